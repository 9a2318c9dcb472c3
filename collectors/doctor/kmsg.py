"""Kernel log text (dmesg, journalctl, /dev/kmsg) as the doctor sees it: one event per ``NVRM: Xid`` line."""

from __future__ import annotations

import re
from typing import Any

from collectors.doctor.report import Finding
from collectors.xid import describe_xid, normalize_pci, parse_kmsg_line

MAX_EVENTS = 5000
_GPU_HEAD_RE = re.compile(r"NVRM: The NVIDIA GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)\s*$")
# A pasted Xid whose PCI id was redacted ("PCI:0000:xx:00", "PCI:<redacted>"): the code and the message still count.
_REDACTED_XID_RE = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<pci>[^)]{0,40})\): (?P<code>\d{1,5}),?\s*(?P<rest>.{0,400})")


class XidFacts:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.off_bus: set[str] = set()  # "GPU at ... has fallen off the bus" lines: evidence, not Xid events
        self.total = 0
        self._pending: str | None = None  # the PCI id of a multi-line "The NVIDIA GPU ..." message

    def feed(self, line: str) -> bool:
        if "NVRM" not in line:
            return False
        # Newer drivers split the message over lines: "NVRM: The NVIDIA GPU 0000:b3:00.0" / "NVRM: (PCI ID: ...)
        # installed in this system has" / "NVRM: fallen off the bus and is not responding to commands."
        m = _GPU_HEAD_RE.search(line)
        if m:
            self._pending = normalize_pci(m.group(1)) or m.group(1)
            return True
        if "fallen off the bus" in line and self._pending and "NVRM: Xid" not in line and "GPU at" not in line:
            self.off_bus.add(self._pending)
            self._pending = None
            return True
        ev = parse_kmsg_line(line)
        if ev is None:
            m = _REDACTED_XID_RE.search(line)
            if m:
                self._redacted(m)
            return True  # an NVRM line we understand enough to know it is the driver talking
        if "NVRM: Xid" not in ev["message"]:
            self.off_bus.add(ev["pci_bus_id"])
            return True
        self.total += 1
        if len(self.events) < MAX_EVENTS:
            data = ev["data"]
            self.events.append({
                "xid": ev["code"], "pci": ev["pci_bus_id"], "pid": _int(data.get("pid")),
                "process": data.get("process"), "message": data.get("detail", ""),
                "meaning": data["meaning"], "action": data["action"],
            })
        return True

    def _redacted(self, m: re.Match[str]) -> None:
        code = int(m["code"])
        info = describe_xid(code)
        self.total += 1
        if len(self.events) < MAX_EVENTS:
            self.events.append({"xid": code, "pci": m["pci"].strip() or "unknown", "pid": None, "process": None,
                                "message": m["rest"].strip(), "meaning": info.meaning, "action": info.action})

    def to_dict(self) -> dict[str, Any]:
        return {"events": self.events}

    def findings(self) -> list[Finding]:
        if not self.events:
            if self.off_bus:
                info = describe_xid(79)
                return [Finding(95, f"GPU {', '.join(sorted(self.off_bus))} fell off the bus", info.action)]
            return []
        rank = {"critical": 3, "error": 2, "warning": 1, "info": 0}
        worst = max(self.events, key=lambda e: (rank[describe_xid(e["xid"]).severity], -self.events.index(e)))
        info = describe_xid(worst["xid"])
        gpus = sorted({e["pci"] for e in self.events if e["xid"] == worst["xid"]})
        score = {"critical": 95, "error": 80, "warning": 50, "info": 30}[info.severity]
        codes = sorted({e["xid"] for e in self.events})
        also = f" (Xids seen: {', '.join(map(str, codes))})" if len(codes) > 1 else ""
        evidence = tuple(f"Xid {e['xid']} on {e['pci']}: {e['message'][:160]}" for e in self.events[:5])
        return [Finding(score, f"Xid {worst['xid']} on GPU {', '.join(gpus)}: {info.meaning}{also}",
                        _action(worst, info.action), evidence)]


def _action(event: dict[str, Any], default: str) -> str:
    if event["xid"] != 154:
        return default
    msg = event["message"]
    if "Reboot" in msg:
        return "The driver asks for a node reboot: drain the node and reboot it."
    if "Reset" in msg:
        return "The driver asks for a GPU reset: stop the GPU's processes and reset it (nvidia-smi -r)."
    return default


def _int(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None
