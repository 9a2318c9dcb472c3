"""InfiniBand tool output: ibstat, ibv_devinfo (-v), perfquery (-x), ibqueryerrors and sysfs counter dumps
(``grep . /sys/class/infiniband/*/ports/*/{state,phys_state,rate,link_layer,counters/*,hw_counters/*}``).

Every tool spells the same port facts differently; they are normalised to one record per (device, port):
state "Active"/"Down"/"Init"/"Armed", phys_state "LinkUp"/"Polling"/"Disabled"..., rate in Gb/s, and the non-zero
error counters under the names the tool printed.
"""

from __future__ import annotations

import re
from typing import Any

from collectors.doctor.report import Finding

_MAX_PORTS = 4096
_ERROR_WORDS = ("err", "discard", "downed", "recovery", "dropped", "timeout", "out_of_sequence", "out_of_buffer",
                "overrun", "integrity", "retries", "Error", "Discard", "Downed", "Recovery", "Dropped", "Overrun",
                "Integrity")
_PHYS = {"LINK_UP": "LinkUp", "POLLING": "Polling", "DISABLED": "Disabled", "SLEEP": "Sleep",
         "LINK_ERROR_RECOVERY": "LinkErrorRecovery", "PORT_CONFIGURATION_TRAINING": "PortConfigurationTraining",
         "PHY_TEST": "PhyTest"}

# No pattern here may rescan a run from each of its characters (quadratic on a 4 KB line of spaces, dots or digits):
# keys and values are split with str methods, and unanchored searches start only at the beginning of a run.
_CA_RE = re.compile(r"^CA '(?P<dev>[^']+)'")
_HCA_RE = re.compile(r"^hca_id:\s*(?P<dev>\S+)")
_PORT_RE = re.compile(r"^\s*(?:Port (?P<a>\d+):|port:\s*(?P<b>\d+))\s*$")
_KEY_RE = re.compile(r"[A-Za-z][\w ]*")
_PERF_HEAD_RE = re.compile(r"^# Port (?:extended )?counters: Lid (?P<lid>\d+) port (?P<port>\d+)")
# "k:....v": the value may not start with a dot (else "\.+" and "\S+" split a run of dots every possible way).
_PERF_RE = re.compile(r"^(?P<k>\w+):\.+(?P<v>[^\s.]\S*|\.)\s*$")
_QERR_HEAD_RE = re.compile(r"^Errors for (?:0x[0-9a-fA-F]+ )?\"(?P<dev>[^\"]*)\"")
# "port ALL" (ibqueryerrors -c, a switch's or node's ports summed) is kept as port 0.
_QERR_PORT_RE = re.compile(r"GUID (?P<guid>0x[0-9a-fA-F]+) port (?P<port>\d+|ALL):(?P<rest>.*)")
# rdma-core's ibqueryerrors adds a human-readable copy: "[PortXmitDiscards == 2846 (2.779K)]".
_QERR_CTR_RE = re.compile(r"\[(?P<k>\w+) == (?P<v>\d+)(?: \([^)\]]{0,32}\))?\]")
_SYSFS_RE = re.compile(r"(?:/sys/class/infiniband/)?(?P<dev>[\w.-]{1,64})/ports/(?P<port>\d+)/"
                       r"(?:(?:hw_)?counters/)?(?P<k>\w+)\s*:(?P<v>.*)")
_SPEED_RE = re.compile(r"(?<![\d.])([\d.]+)\s*Gbps")
_WIDTH_RE = re.compile(r"(?<!\d)(\d+)X")
_CODE_RE = re.compile(r"\(\d+\)$")


def _kv(line: str) -> tuple[str, str] | None:
    """("Key", "value") for "  Key : value", the key a letter then word characters and spaces; else None."""
    key, sep, value = line.partition(":")
    key = key.strip()
    if not sep or not _KEY_RE.fullmatch(key):
        return None
    return key, value.strip()


def _strip_code(text: str) -> str:
    """"Active (4)" -> "Active"."""
    text = text.strip()
    m = _CODE_RE.search(text) if text.endswith(")") else None
    return text[: m.start()].rstrip() if m else text


def _state(text: str) -> str:
    text = _strip_code(text)
    text = re.sub(r"^\d+:\s*", "", text)
    text = text.removeprefix("PORT_")
    return text.capitalize() if text.isupper() else text


def _phys(text: str) -> str:
    text = _strip_code(text)
    text = re.sub(r"^\d+:\s*", "", text)
    return _PHYS.get(text, text)


def _is_error(name: str) -> bool:
    return any(w in name for w in _ERROR_WORDS) and "Select" not in name


class IbFacts:
    def __init__(self) -> None:
        self.ports: dict[tuple[str, int], dict[str, Any]] = {}
        self._dev: str | None = None
        self._port: dict[str, Any] | None = None
        self._speed: dict[int, tuple[float | None, int | None]] = {}

    def _get(self, dev: str, port: int) -> dict[str, Any] | None:
        key = (dev, port)
        rec = self.ports.get(key)
        if rec is None and len(self.ports) < _MAX_PORTS:
            rec = {"device": dev, "port": port, "state": None, "phys_state": None, "rate_gbps": None,
                   "link_layer": None, "error_counters": {}}
            self.ports[key] = rec
        return rec

    def feed(self, line: str) -> bool:
        if not line.strip():
            return False
        # First handler that claims the line wins; the order goes from the most to the least specific shape.
        return any(h(line) for h in (self._tool_head, self._sysfs, self._perf, self._qerr, self._port_head, self._kv))

    def _tool_head(self, line: str) -> bool:
        m = _CA_RE.match(line) or _HCA_RE.match(line)
        if m:
            self._dev, self._port = m["dev"], None
            return True
        return False

    def _port_head(self, line: str) -> bool:
        m = _PORT_RE.match(line)
        if not m or self._dev is None:
            return False
        self._port = self._get(self._dev, int(m["a"] or m["b"]))
        return True

    def _kv(self, line: str) -> bool:
        kv = _kv(line)
        if kv is None or self._port is None:
            return kv is not None and self._dev is not None
        key, value, port = kv[0].lower(), kv[1], self._port
        if key == "state":
            port["state"] = _state(value)
        elif key in ("physical state", "phys_state"):
            port["phys_state"] = _phys(value)
        elif key == "rate":
            port["rate_gbps"] = _float(value)
        elif key == "link layer" or key == "link_layer":
            port["link_layer"] = value
        elif key in ("active_width", "active_speed"):
            self._devinfo_rate(port, key, value)
        return True

    def _devinfo_rate(self, port: dict[str, Any], key: str, value: str) -> None:
        speed, width = self._speed.get(id(port), (None, None))
        if key == "active_speed":
            m = _SPEED_RE.search(value)
            speed = float(m.group(1)) if m else None
        else:
            m = _WIDTH_RE.search(value)
            width = int(m.group(1)) if m else None
        self._speed[id(port)] = (speed, width)
        if speed is not None and width is not None:
            port["rate_gbps"] = speed * width

    def _perf(self, line: str) -> bool:
        m = _PERF_HEAD_RE.match(line)
        if m:
            dev = self._dev or f"lid {m['lid']}"
            self._port = self._get(dev, int(m["port"]))
            return True
        m = _PERF_RE.match(line)
        if not m:
            return False
        if self._port is not None and _is_error(m["k"]):
            _count(self._port, m["k"], m["v"])
        return True

    def _qerr(self, line: str) -> bool:
        m = _QERR_HEAD_RE.match(line)
        if m:
            self._dev = m["dev"] or "unnamed"
            return True
        m = _QERR_PORT_RE.search(line) if "GUID" in line else None
        if not m:
            return False
        dev = self._dev or m["guid"]
        port = self._get(dev, 0 if m["port"] == "ALL" else int(m["port"]))
        for c in _QERR_CTR_RE.finditer(m["rest"]):
            if port is not None:
                _count(port, c["k"], c["v"])
        return True

    def _sysfs(self, line: str) -> bool:
        m = _SYSFS_RE.search(line) if "/ports/" in line else None
        if not m:
            return False
        port = self._get(m["dev"], int(m["port"]))
        if port is None:
            return True
        key, value = m["k"], m["v"].strip()
        if key == "state":
            port["state"] = _state(value)
        elif key == "phys_state":
            port["phys_state"] = _phys(value)
        elif key == "rate":
            port["rate_gbps"] = _float(value)
        elif key == "link_layer":
            port["link_layer"] = value
        elif _is_error(key):
            _count(port, key, value)
        return True

    def to_dict(self) -> dict[str, Any]:
        return {"ports": list(self.ports.values())}

    def findings(self) -> list[Finding]:
        out: list[Finding] = []
        ports = list(self.ports.values())
        rates = [p["rate_gbps"] for p in ports if p["rate_gbps"]]
        best = max(rates) if rates else None
        for p in ports:
            out += _port_findings(p, best)
        return out


def _count(port: dict[str, Any], name: str, value: str) -> None:
    try:
        n = int(value, 0)
    except ValueError:
        return
    if n:
        port["error_counters"][name] = n
    # A counter pinned at its width's maximum stopped counting: the true number is higher (reset it to see the rate).
    if n in (0xFFFFFFFF, 0xFFFF) and name not in port.setdefault("saturated", []):
        port["saturated"].append(name)


def _float(text: str) -> float | None:
    m = re.match(r"\s*([\d.]+)", text)
    try:
        return float(m.group(1)) if m else None
    except ValueError:
        return None


_PHYSICAL = ("symbol", "Symbol", "LinkErrorRecovery", "link_error_recovery", "LinkDowned", "link_downed",
             "LocalLinkIntegrity", "local_link_integrity")


def _port_findings(p: dict[str, Any], best: float | None) -> list[Finding]:
    name = f"{p['device']} port {p['port']}"
    out: list[Finding] = []
    if p["state"] and p["state"] != "Active":
        phys = f" (physical state {p['phys_state']})" if p["phys_state"] else ""
        hint = "the cable is unplugged or the far end is down" if p["phys_state"] == "Polling" else \
            "no subnet manager has configured it" if p["state"] == "Init" else "the link is not usable"
        out.append(Finding(85, f"{name} is {p['state']}{phys}: {hint}",
                           "reseat or replace the cable/transceiver, check the switch port; for Init check that "
                           "the subnet manager (opensm/UFM) is running; NCCL will use another HCA or sockets"))
    if best and p["rate_gbps"] and p["rate_gbps"] < best and p["state"] in (None, "Active"):
        out.append(Finding(60, f"{name} runs at {p['rate_gbps']:g} Gb/s while others run at {best:g} Gb/s: "
                           "a degraded link (lanes down or a lower speed negotiated)",
                           "reseat or replace the cable or transceiver; check the switch port's speed settings"))
    errs = p["error_counters"]
    physical = {k: v for k, v in errs.items() if any(s in k for s in _PHYSICAL)}
    if physical:
        out.append(Finding(70, f"{name} has physical-layer errors ({_fmt(physical)}): a marginal cable, "
                           "transceiver or port", "replace the cable/transceiver (run the fabric's cable "
                           "diagnostics first); these cause NCCL completion errors 12 under load"))
    elif errs:
        out.append(Finding(45, f"{name} has error counters set ({_fmt(errs)})", "watch whether they grow under "
                           "load (perfquery -x twice, a minute apart); discards alone mean congestion"))
    if p.get("saturated"):
        out.append(Finding(40, f"{name}: {', '.join(p['saturated'])} saturated at the counter's maximum (32-bit "
                           "4294967295 or 16-bit 65535): the real count is higher and the rate unknown",
                           "reset the counters (perfquery -R, or ibqueryerrors --clear-errors) and read them again "
                           "after a minute of load; use the 64-bit extended counters (perfquery -x) where the HCA "
                           "has them"))
    return out


def _fmt(counters: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in list(counters.items())[:6])
