"""Every link into a heading of the README or docs/ names a heading that exists (a heading renamed with its date,
as "Where it stands" was, broke four links that no page test reads)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens dropped, spaces made hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"^#+\s+(.*)", line)
        if m:
            s = _slug(m.group(1))
            n = seen.get(s, 0)
            out.add(s if n == 0 else f"{s}-{n}")  # a repeated heading's anchor gets -1, -2, ...
            seen[s] = n + 1
    return out


def test_every_link_to_a_heading_finds_it() -> None:
    anchors = {p.resolve(): _anchors(p) for p in FILES}
    broken = []
    for path in FILES:
        for m in re.finditer(r"\]\(([^)\s#]*)#([^)\s]+)\)", path.read_text()):
            target = (path.parent / m.group(1)).resolve() if m.group(1) else path.resolve()
            if target in anchors and m.group(2) not in anchors[target]:
                broken.append(f"{path.relative_to(ROOT)}: {m.group(1)}#{m.group(2)}")
    assert not broken, broken
    assert sum(len(a) for a in anchors.values()) > 100  # the headings were found at all
