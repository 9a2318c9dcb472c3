"""The doctor's answer: facts, a verdict (cause and fix) and how much of the input it could not read."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Finding:
    """One candidate explanation. The highest ``score`` becomes the verdict; ties keep the first found."""

    score: int  # 100 = the job certainly died of this; 10 = worth a look
    cause: str
    fix: str
    evidence: tuple[str, ...] = ()


HEALTHY = Finding(0, "Nothing in this text points at a failure", "If the job still misbehaves, collect the log "
                  "with NCCL_DEBUG=INFO (and NCCL_DEBUG_SUBSYS=INIT,NET) from every rank, plus dmesg from each node.")


@dataclass
class Report:
    kind: str
    facts: dict[str, Any]
    finding: Finding = HEALTHY
    unparsed_lines: int = 0
    lines: int = 0
    others: list[Finding] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        cause, fix = self.finding.cause, self.finding.fix
        return f"{cause[:1].upper()}{cause[1:]}. Next: {fix}"

    def to_dict(self) -> dict[str, Any]:
        """Exactly the issue's JSON: kind, facts, verdict, unparsed_lines."""
        return {"kind": self.kind, "facts": self.facts, "verdict": self.verdict, "unparsed_lines": self.unparsed_lines}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False)

    def render_text(self) -> str:
        out = [f"kind: {self.kind}  ({self.lines} lines read, {self.unparsed_lines} not understood)", "", "facts:"]
        out += [f"  {line}" for line in _render_facts(self.facts)]
        cause = self.finding.cause
        out += ["", f"verdict: {cause[:1].upper()}{cause[1:]}.", f"next:    {self.finding.fix}"]
        if self.finding.evidence:
            out += ["", "evidence:"] + [f"  {e}" for e in self.finding.evidence[:5]]
        if self.others:
            out += ["", "also seen:"] + [f"  - {f.cause}" for f in self.others[:4]]
        return "\n".join(out) + "\n"


def _render_facts(facts: dict[str, Any], indent: str = "") -> list[str]:
    lines: list[str] = []
    for key, value in facts.items():
        if isinstance(value, dict) and value:
            lines.append(f"{indent}{key}:")
            lines += _render_facts(value, indent + "  ")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            lines.append(f"{indent}{key}: {len(value)}")
            for item in value[:50]:
                lines.append(f"{indent}  - " + ", ".join(f"{k}={_short(v)}" for k, v in item.items() if v not in
                                                         (None, [], {})))
            if len(value) > 50:
                lines.append(f"{indent}  ... {len(value) - 50} more")
        elif isinstance(value, list):
            shown = value[:20]
            if key == "warnings":
                lines.append(f"{indent}{key}: {len(value)}")
                lines += [f"{indent}  {_short(v, 200)}" for v in shown]
            else:
                more = f" (+{len(value) - 20} more)" if len(value) > 20 else ""
                lines.append(f"{indent}{key}: {', '.join(map(str, shown)) or '-'}{more}")
        else:
            lines.append(f"{indent}{key}: {'-' if value is None or value == {} else value}")
    return lines


def _short(value: Any, limit: int = 80) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
