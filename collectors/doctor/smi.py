"""``nvidia-smi -q`` (text, any ``-d`` subset) and ``nvidia-smi -q -x`` (XML) into per-GPU health facts.

The text form is an indented tree ("Key : Value" leaves, bare section titles); we rebuild the tree per GPU and read
the sections we need, so both the old ECC schema (Single Bit / Double Bit x Device Memory, Register File, ...) and the
new one (SRAM/DRAM Correctable/Uncorrectable) come out as the driver printed them.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Any

from collectors.doctor.report import Finding

_GPU_RE = re.compile(r"^GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$")
_MAX_GPUS = 1024
_MAX_XML_LINES = 500_000
# nvidia-smi nests 4-5 levels; anything deeper is junk, and reading it recursively would raise RecursionError.
_MAX_DEPTH = 32
# XML reason tags -> the names the text form prints, so both forms give the same list.
_REASON_NAMES = {
    "gpu_idle": "Idle", "applications_clocks_setting": "Applications Clocks Setting", "sw_power_cap": "SW Power Cap",
    "hw_slowdown": "HW Slowdown", "hw_thermal_slowdown": "HW Thermal Slowdown",
    "hw_power_brake_slowdown": "HW Power Brake Slowdown", "sync_boost": "Sync Boost",
    "sw_thermal_slowdown": "SW Thermal Slowdown", "display_clocks_setting": "Display Clock Setting",
}


def _value(text: str) -> Any:
    text = text.strip()
    return int(text) if text.isdecimal() else text  # isdigit() admits "²", which int() refuses


class SmiFacts:
    def __init__(self) -> None:
        self.gpus: list[dict[str, Any]] = []
        self._stack: list[tuple[int, dict[str, Any]]] = []
        self._xml: ET.XMLPullParser | None = None
        self._xml_lines = 0
        self._xml_broken = False
        self._xml_depth = 0
        self._open_gpu: ET.Element | None = None  # a <gpu> cut off by a truncated paste

    # -- feeding ----------------------------------------------------------------------------------------------
    def feed(self, line: str) -> bool:
        if self._xml is not None or line.lstrip().startswith(("<?xml", "<nvidia_smi_log", "<!DOCTYPE nvidia")):
            return self._feed_xml(line)
        return self._feed_text(line)

    def _feed_text(self, line: str) -> bool:
        m = _GPU_RE.match(line.strip()) if line.startswith("GPU ") else None
        if m:
            tree: dict[str, Any] = {}
            if len(self.gpus) < _MAX_GPUS:
                self.gpus.append({"_tree": tree, "_bus": m.group(1)})
            self._stack = [(-1, tree)]
            return True
        if not line.strip():
            return False
        if not self._stack:
            if self._header(line) or not line.startswith(" ") or len(self.gpus) >= _MAX_GPUS:
                return self._header(line)
            # A paste that starts inside a GPU block (the header was cut off): read it as one unnamed GPU.
            tree = {}
            self.gpus.append({"_tree": tree, "_bus": None})
            self._stack = [(-1, tree)]
        indent = len(line) - len(line.lstrip(" "))
        while len(self._stack) > 1 and self._stack[-1][0] >= indent:
            self._stack.pop()
        node = self._stack[-1][1]
        body = line.strip()
        key, sep, val = body.partition(" : ")
        if not sep and body.endswith(" :"):
            key, sep, val = body[:-2], ":", ""
        if sep:
            node.setdefault(key.strip(), _value(val))
        elif len(self._stack) <= _MAX_DEPTH:
            child: dict[str, Any] = {}
            node.setdefault(body, child)
            self._stack.append((indent, child))
        return True

    @staticmethod
    def _header(line: str) -> bool:
        return "NVSMI LOG" in line or line.startswith(("Timestamp", "Driver Version", "CUDA Version", "Attached GPUs"))

    def _feed_xml(self, line: str) -> bool:
        if self._xml_broken or self._xml_lines > _MAX_XML_LINES:
            return False
        if "<!ENTITY" in line:  # nvidia-smi never declares entities; refuse entity expansion outright
            self._xml_broken = True
            return False
        if self._xml is None:
            self._xml = ET.XMLPullParser(events=("start", "end"))
        self._xml_lines += 1
        if line.lstrip().startswith("<!DOCTYPE"):
            return True
        try:
            self._xml.feed(line + "\n")
            for event, elem in self._xml.read_events():
                self._xml_depth += 1 if event == "start" else -1
                if self._xml_depth > _MAX_DEPTH:
                    self._xml_broken = True
                    return False
                if elem.tag == "gpu" and event == "start":
                    self._open_gpu = elem
                elif elem.tag == "gpu":
                    self._open_gpu = None
                    if len(self.gpus) < _MAX_GPUS:
                        self.gpus.append({"_xml": _xml_gpu(elem)})
                    elem.clear()
        except ET.ParseError:
            self._xml_broken = True  # a truncated paste: keep the GPUs read so far
            return False
        return True

    # -- facts ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        gpus = [g["_xml"] if "_xml" in g else _text_gpu(g["_bus"], g["_tree"]) for g in self.gpus]
        if self._open_gpu is not None and len(gpus) < _MAX_GPUS:
            gpus.append(_xml_gpu(self._open_gpu))
        return {"gpus": gpus}

    def findings(self) -> list[Finding]:
        out: list[Finding] = []
        for gpu in self.to_dict()["gpus"]:
            out += _gpu_findings(gpu)
        return out


# -- text form -----------------------------------------------------------------------------------------------------
def _section(tree: dict[str, Any], *names: str) -> Any:
    for name in names:
        if name in tree:
            return tree[name]
    return None


def _text_gpu(bus: str, tree: dict[str, Any]) -> dict[str, Any]:
    ecc_mode = _section(tree, "Ecc Mode", "ECC Mode")
    errors = _section(tree, "ECC Errors") or {}
    reasons = _section(tree, "Clocks Throttle Reasons", "Clocks Event Reasons")
    if reasons is None and isinstance(tree.get("Performance"), dict):
        reasons = _section(tree["Performance"], "Clocks Throttle Reasons", "Clocks Event Reasons")
    pci = tree.get("PCI") if isinstance(tree.get("PCI"), dict) else {}
    return {
        "bus_id": pci.get("Bus Id", bus) if isinstance(pci, dict) else bus,
        "name": tree.get("Product Name"),
        "ecc_mode": ecc_mode.get("Current") if isinstance(ecc_mode, dict) else ecc_mode,
        "ecc": {"volatile": _dict_or_none(errors, "Volatile"), "aggregate": _dict_or_none(errors, "Aggregate")}
        if isinstance(errors, dict) else None,
        "retired_pages": _dict_or_none(tree, "Retired Pages"),
        "remapped_rows": _dict_or_none(tree, "Remapped Rows"),
        "throttle_reasons_active": _active(reasons) if isinstance(reasons, dict) else [],
    }


def _dict_or_none(tree: dict[str, Any], key: str) -> dict[str, Any] | None:
    value = tree.get(key)
    return value if isinstance(value, dict) else None


def _active(reasons: dict[str, Any]) -> list[str]:
    out = []
    for name, value in reasons.items():
        if isinstance(value, dict):
            out += _active(value)
        elif value == "Active":
            out.append(name)
    return out


# -- XML form ------------------------------------------------------------------------------------------------------
def _xml_tree(elem: ET.Element, depth: int = 0) -> Any:
    children = list(elem)
    if not children:
        return _value(elem.text or "")
    if depth >= _MAX_DEPTH:
        return {}
    return {child.tag: _xml_tree(child, depth + 1) for child in children}


def _xml_gpu(elem: ET.Element) -> dict[str, Any]:
    tree = _xml_tree(elem)
    tree = tree if isinstance(tree, dict) else {}
    ecc_mode = tree.get("ecc_mode")
    errors = tree.get("ecc_errors")
    reasons = tree.get("clocks_throttle_reasons") or tree.get("clocks_event_reasons")
    active = []
    if isinstance(reasons, dict):
        for tag, value in reasons.items():
            if value == "Active":
                short = re.sub(r"^clocks_(?:throttle|event)_reason_", "", tag)
                active.append(_REASON_NAMES.get(short, short))
    return {
        "bus_id": elem.get("id"),
        "name": tree.get("product_name"),
        "ecc_mode": ecc_mode.get("current_ecc") if isinstance(ecc_mode, dict) else ecc_mode,
        "ecc": {"volatile": _dict_or_none(errors, "volatile"), "aggregate": _dict_or_none(errors, "aggregate")}
        if isinstance(errors, dict) else None,
        "retired_pages": _dict_or_none(tree, "retired_pages"),
        "remapped_rows": _dict_or_none(tree, "remapped_rows"),
        "throttle_reasons_active": active,
    }


# -- verdicts ------------------------------------------------------------------------------------------------------
def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}".lower()
        if isinstance(value, dict):
            out.update(_flat(value, name + "/"))
        else:
            out[name] = value
    return out


def _uncorrectable(ecc: dict[str, Any] | None) -> int:
    """Uncorrectable errors in one ECC block: new schema '*Uncorrectable*' rows, old schema 'Double Bit/Total'."""
    total = 0
    for key, value in _flat(ecc).items():
        if isinstance(value, int) and (("uncorrectable" in key and "/" not in key)
                                       or key in ("double bit/total", "double_bit/total")):
            total += value
    return total


def _yes(value: Any) -> bool:
    return str(value).strip().lower() == "yes"


def _gpu_findings(gpu: dict[str, Any]) -> list[Finding]:
    out: list[Finding] = []
    bus, name = gpu["bus_id"], gpu.get("name") or "GPU"
    rows = _flat(gpu.get("remapped_rows"))
    pending = any(_yes(v) for k, v in rows.items() if k.endswith("pending") or k.endswith("remapped_row_pending"))
    failure = any(_yes(v) for k, v in rows.items() if "failure" in k)
    unc_rows = next((v for k, v in rows.items() if isinstance(v, int) and k in ("uncorrectable error",
                                                                                 "remapped_row_unc")), 0)
    ecc = gpu.get("ecc") or {}
    vol_unc = _uncorrectable(ecc.get("volatile"))
    if failure:
        out.append(Finding(95, f"{name} {bus}: row remapping failed - the GPU has run out of spare memory rows",
                           "take the GPU out of service and RMA it"))
    if pending and (unc_rows or vol_unc):
        out.append(Finding(92, f"{name} {bus}: uncorrectable ECC error with a row remap pending",
                           "drain the GPU and reset it (nvidia-smi -r -i <gpu>, or reboot) so the remap takes "
                           "effect; RMA if it keeps happening"))
    elif pending:
        out.append(Finding(70, f"{name} {bus}: a memory row remap is pending", "reset the GPU at the next safe point"))
    retired = _flat(gpu.get("retired_pages"))
    if any(_yes(v) for k, v in retired.items() if "pending" in k):
        out.append(Finding(85, f"{name} {bus}: a page retirement is pending after ECC errors",
                           "reset the GPU or reboot the node so the page is retired; RMA if the count keeps growing"))
    if vol_unc and not pending:
        out.append(Finding(85, f"{name} {bus}: {vol_unc} uncorrectable ECC errors since the last reset",
                           "drain the GPU and reset it; check Xid 48/63/64/94/95 in dmesg; RMA if it recurs"))
    active = gpu.get("throttle_reasons_active") or []
    brake = "HW Power Brake Slowdown" in active
    if brake:
        # An external signal, not the GPU's own temperature: the board's power-brake pin is asserted by the chassis
        # (a failed or missing PSU, lost redundancy, the BMC capping power). HW Slowdown is its parent flag.
        out.append(Finding(75, f"{name} {bus or '(bus id not in the excerpt)'}: HW Power Brake Slowdown is active - "
                           "the chassis is asserting the GPU's power-brake signal and clocks drop by half or more",
                           "check the node's power supplies and their redundancy (ipmitool sdr / sel list, the BMC's "
                           "power capping policy); every GPU behind the same PSU slows together"))
    hot = [r for r in active if ("Thermal" in r or "HW" in r) and r != "HW Power Brake Slowdown"
           and not (brake and r == "HW Slowdown")]
    if hot:
        out.append(Finding(60, f"{name} {bus}: clocks held down by {', '.join(hot)}",
                           "check cooling (fans, inlet temperature, airflow blockers) and the PSU/power brake "
                           "signal; this GPU will be a straggler until fixed"))
    if gpu.get("ecc_mode") == "Disabled":
        out.append(Finding(20, f"{name} {bus}: ECC is disabled", "enable it (nvidia-smi -e 1, then reset) unless "
                           "this was deliberate: memory errors go undetected without it"))
    return out
