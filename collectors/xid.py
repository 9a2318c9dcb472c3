"""NVIDIA Xid codes: what each means, what to do about it, and how bad it is; plus the kernel-log line parser.

One table serves the agent (live ``/dev/kmsg`` lines become wire events), the log doctor (pasted ``dmesg``) and the
server (a stored Xid code rendered with its meaning). Facts come from NVIDIA's Xid catalogue and the driver's
``nverror.h`` names; the *action* column is phrased for the person on call, not copied.

Standard library only: the agent imports this on GPU nodes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

Severity = Literal["info", "warning", "error", "critical"]


@dataclass(frozen=True, slots=True)
class XidInfo:
    code: int
    name: str  # the driver's mnemonic, e.g. ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS
    meaning: str
    action: str
    severity: Severity
    cls: str  # "app", "memory", "bus", "nvlink", "thermal", "driver", "hardware"
    known: bool = True


# Actions, shared so that two codes with the same remedy say it the same way.
_RESTART_APP = "Restart the application; if it recurs with the same code on other GPUs it is a bug in the program."
_RESET_GPU = "Drain the GPU, stop its processes and reset it (nvidia-smi -r -i <gpu>); reboot the node if reset fails."
_DRAIN_NODE = "Drain the node now, then reboot it; if it comes back, check PCIe seating, power and cooling, then RMA."
_NVLINK = ("Reset the GPU (or the node with its NVSwitches); repeated NVLink errors on the same link mean a bad "
           "link, cable or baseboard: run the fabric diagnostics and RMA.")
_ECC_RESET = "Reset the GPU at the next safe point so the pending row remap or page retirement takes effect."

# code: (mnemonic, meaning, action, severity, class)
_TABLE: dict[int, tuple[str, str, str, Severity, str]] = {
    8: ("ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT", "GPU stopped processing (channel idle timeout)",
        _RESTART_APP, "error", "app"),
    13: ("ROBUST_CHANNEL_GR_EXCEPTION", "Graphics engine exception: usually an illegal address or instruction in "
         "a kernel (out-of-range access); rarely a hardware fault", _RESTART_APP + " Run it under compute-sanitizer.",
         "error", "app"),
    31: ("ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "GPU memory page fault (MMU fault): a kernel touched an address "
         "it does not own; usually a program bug, occasionally a driver or hardware fault",
         _RESTART_APP + " Run it under compute-sanitizer.", "error", "app"),
    32: ("ROBUST_CHANNEL_PBDMA_ERROR", "Invalid or corrupted push buffer stream: often PCIe errors between the CPU "
         "and the GPU", "Check PCIe AER errors and replay counters for this GPU; reset it, drain the node if it "
         "recurs.", "error", "bus"),
    38: ("ROBUST_CHANNEL_DRIVER_FIRMWARE_ERROR", "Driver firmware error", _RESET_GPU, "error", "driver"),
    43: ("ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "GPU stopped processing: a user program faulted and its channel "
         "was torn down (usually follows Xid 13 or 31)", "Nothing for the GPU; fix or restart the application.",
         "warning", "app"),
    44: ("ROBUST_CHANNEL_GR_FAULT_DURING_CTXSW", "Graphics engine fault during a context switch", _RESET_GPU,
         "error", "driver"),
    45: ("ROBUST_CHANNEL_PREEMPTIVE_REMOVAL", "Preemptive cleanup: the driver killed a channel after an earlier "
         "error or because the process was killed", "Look for the Xid that came before it; on its own it is the "
         "trace of a process being stopped.", "info", "app"),
    46: ("ROBUST_CHANNEL_GPU_TIMEOUT_ERROR", "GPU stopped processing (timeout)", _RESET_GPU, "error", "driver"),
    48: ("ROBUST_CHANNEL_ECC_DBE", "Double-bit (uncorrectable) ECC error in GPU memory",
         "Stop the GPU's jobs and reset it; if it recurs or the page cannot be retired, RMA the GPU.",
         "critical", "memory"),
    54: ("ROBUST_CHANNEL_AUX_POWER_ERROR", "Auxiliary power is not connected to the GPU",
         "Check the GPU's power cables.", "critical", "hardware"),
    56: ("ROBUST_CHANNEL_DISPLAY_CHANNEL_EXCEPTION", "Display engine error", "Usually harmless on compute nodes.",
         "info", "driver"),
    57: ("ROBUST_CHANNEL_FB_LINK_TRAINING_FAILURE", "Error programming video memory interface",
         _DRAIN_NODE, "critical", "memory"),
    61: ("PMU_BREAKPOINT", "Internal micro-controller breakpoint or warning (PMU)", _RESET_GPU,
         "error", "driver"),
    62: ("PMU_HALT_ERROR", "Internal micro-controller halt (PMU or GSP firmware stopped)", _RESET_GPU,
         "critical", "driver"),
    63: ("INFOROM_PAGE_RETIREMENT_EVENT", "ECC page retirement or row-remapping event recorded: a memory row was "
         "marked to be remapped or a page retired", _ECC_RESET, "warning", "memory"),
    64: ("INFOROM_PAGE_RETIREMENT_FAILURE", "ECC page retirement or row-remapping recording failure",
         "Reset the GPU; if the remap keeps failing the GPU has run out of spare rows: RMA it.", "error",
         "memory"),
    68: ("ROBUST_CHANNEL_NVDEC0_ERROR", "Video decoder exception", _RESTART_APP, "warning", "app"),
    69: ("ROBUST_CHANNEL_GR_CLASS_ERROR", "Graphics engine class error", _RESTART_APP, "error", "app"),
    74: ("NVLINK_ERROR", "NVLink error: a link between GPUs (or to an NVSwitch) reported a fatal error or went down",
         _NVLINK, "critical", "nvlink"),
    79: ("ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "The GPU has fallen off the bus: the host can no longer reach "
         "it over PCIe (power, thermal, PCIe or board failure)", _DRAIN_NODE, "critical", "bus"),
    92: ("EXCESSIVE_SBE_INTERRUPTS", "High single-bit ECC error rate", "Watch the GPU's ECC counters; reset it at "
         "the next safe point and RMA it if the rate stays high.", "warning", "memory"),
    93: ("INFOROM_ERASE_LIMIT_EXCEEDED", "InfoROM erase limit exceeded", "Contact the vendor: the GPU's InfoROM is "
         "worn out.", "warning", "hardware"),
    94: ("ROBUST_CHANNEL_CONTAINED_ERROR", "Contained uncorrectable ECC error: only the process that used the bad "
         "memory was stopped", "Restart the application; reset the GPU at the next safe point so the row remap "
         "takes effect.", "error", "memory"),
    95: ("ROBUST_CHANNEL_UNCONTAINED_ERROR", "Uncontained uncorrectable ECC error: every process on the GPU may be "
         "affected", "Stop all work on the GPU and reset it (row remap); if errors persist, RMA it.",
         "critical", "memory"),
    109: ("ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", "Context switch timeout: a kernel could not be preempted in time "
          "(a hung kernel or a driver/firmware fault)", _RESTART_APP + " Reset the GPU if it repeats.",
          "error", "app"),
    110: ("SEC_FAULT_ERROR", "Security fault error", _RESET_GPU, "critical", "hardware"),
    119: ("GSP_RPC_TIMEOUT", "GSP RPC timeout: the GPU System Processor firmware stopped answering the driver",
          _RESET_GPU + " If it repeats, update the driver or disable GSP firmware.", "critical", "driver"),
    120: ("GSP_ERROR", "GSP error: the GPU System Processor firmware reported a fault", _RESET_GPU,
          "critical", "driver"),
    121: ("C2C_ERROR", "Chip-to-chip (C2C) link error (Grace Hopper / Blackwell superchips)", _DRAIN_NODE,
          "critical", "bus"),
    122: ("SPI_PMU_RPC_READ_FAIL", "SPI PMU RPC read failure", _RESET_GPU, "error", "driver"),
    123: ("SPI_PMU_RPC_WRITE_FAIL", "SPI PMU RPC write failure", _RESET_GPU, "error", "driver"),
    124: ("SPI_PMU_RPC_ERASE_FAIL", "SPI PMU RPC erase failure", _RESET_GPU, "error", "driver"),
    125: ("INFOROM_FS_ERROR", "InfoROM file system error", _RESET_GPU, "error", "hardware"),
    136: ("ALI_TRAINING_FAIL", "NVLink training failure (ALI)", _NVLINK, "error", "nvlink"),
    137: ("NVLINK_FLA_PRIV_ERR", "NVLink fabric address (FLA) privilege error: a remote access was refused, "
          "usually a program or fabric-manager setup problem", _RESTART_APP + " Check the fabric manager.",
          "error", "nvlink"),
    140: ("UNRECOVERABLE_ECC_ERROR_ESCAPE", "Unrecovered ECC error escaped to the application",
          "Stop the GPU's jobs and reset it; RMA if it recurs.", "critical", "memory"),
    143: ("GPU_INIT_ERROR", "GPU initialisation failure", _DRAIN_NODE, "critical", "hardware"),
    144: ("NVLINK_SAW_ERROR", "NVLink SAW (switch-access window) error", _NVLINK, "critical", "nvlink"),
    145: ("NVLINK_RLW_ERROR", "NVLink RLW (receive link) error", _NVLINK, "critical", "nvlink"),
    146: ("NVLINK_TLW_ERROR", "NVLink TLW (transmit link) error", _NVLINK, "critical", "nvlink"),
    147: ("NVLINK_TREX_ERROR", "NVLink TREX error", _NVLINK, "critical", "nvlink"),
    148: ("NVLINK_NVLPW_CTRL_ERROR", "NVLink NVLPW control error", _NVLINK, "critical", "nvlink"),
    149: ("NVLINK_NETIR_ERROR", "NVLink NETIR (network interface) error", _NVLINK, "critical", "nvlink"),
    150: ("NVLINK_MSE_ERROR", "NVLink MSE (management) error", _NVLINK, "critical", "nvlink"),
    151: ("ROBUST_CHANNEL_KEY_ROTATION_ERROR", "Confidential-computing key rotation error", _RESET_GPU,
          "error", "driver"),
    154: ("GPU_RECOVERY_ACTION_CHANGED", "GPU recovery action changed: the driver says what the GPU now needs "
          "(none, a GPU reset, a node reboot, or drain and reset)", "Do what the message asks: 'GPU Reset "
          "Required' -> reset the GPU; 'Node Reboot Required' -> drain and reboot the node; 'Drain P2P' -> stop "
          "peer-to-peer jobs and reset.", "critical", "driver"),
}

# NVIDIA's catalogue temperature codes are not Xids; thermal problems reach us through NVML throttle reasons.


def describe_xid(code: int) -> XidInfo:
    """What an Xid code means. Unknown or odd codes get a generic entry rather than an exception."""
    try:
        code = int(code)
    except (TypeError, ValueError):
        code = -1
    row = _TABLE.get(code)
    if row is None:
        return XidInfo(code, "UNKNOWN", f"Xid {code} (not in clusterdx's table)",
                       "Look the code up in NVIDIA's Xid catalogue; reset the GPU if it keeps repeating.",
                       "warning", "driver", known=False)
    name, meaning, action, severity, cls = row
    return XidInfo(code, name, meaning, action, severity, cls)


def known_codes() -> tuple[int, ...]:
    return tuple(sorted(_TABLE))


# ---------------------------------------------------------------------------------------------------------------
# Kernel log lines.

# "NVRM: Xid (PCI:0000:3b:00): 79, pid=123, name=python, GPU has fallen off the bus."; old drivers omit "PCI:".
_XID_RE = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)\):"
                     r"\s*(?P<code>\d{1,6})\b,?\s?(?P<rest>.*)")
# "NVRM: GPU at PCI:0000:2b:00: ... has fallen off the bus." / "NVRM: GPU 0000:2b:00.0: GPU has fallen off the bus."
_OFF_BUS_RE = re.compile(r"NVRM: GPU (?:at )?(?:PCI:)?(?P<pci>[0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}"
                         r"(?:\.[0-7])?):? .*has fallen off the bus")
_PID_RE = re.compile(r"^pid=['\"]?(?P<pid><unknown>|\d+)['\"]?,\s*")
_NAME_RE = re.compile(r"^name=(?P<name>'[^']*'|\"[^\"]*\"|<unknown>|[^,]*),\s*")
_MAX_MESSAGE = 2000


def normalize_pci(bus_id: str) -> str:
    """One spelling for a PCI address: lower case, 4-digit domain, with function ("0000:3b:00.0").

    The kernel prints "0000:3b:00" and NVML "00000000:3B:00.0"; comparing the normalised forms pairs them up."""
    text = bus_id.strip().lower()
    if text.startswith("pci:"):
        text = text[4:]
    parts = text.split(":")
    if len(parts) == 2:
        parts.insert(0, "0000")
    if len(parts) != 3:
        return text
    domain = parts[0][-4:].rjust(4, "0")
    devfn = parts[2] if "." in parts[2] else parts[2] + ".0"
    return f"{domain}:{parts[1]}:{devfn}"


def _split_pid_name(rest: str) -> tuple[str | None, str | None, str]:
    pid = name = None
    m = _PID_RE.match(rest)
    if m:
        pid = None if m["pid"] == "<unknown>" else m["pid"]
        rest = rest[m.end():]
    m = _NAME_RE.match(rest)
    if m:
        value = m["name"].strip("'\"")
        name = None if value in ("<unknown>", "") else value
        rest = rest[m.end():]
    return pid, name, rest


def parse_kmsg_line(line: str) -> dict[str, Any] | None:
    """A kernel Xid (or "fallen off the bus") line as a wire ``Event`` dict without ``ts``; ``None`` otherwise.

    Works on ``dmesg``, ``dmesg -T``, syslog/journalctl and raw ``/dev/kmsg`` ("6,1234,5678,-;NVRM: ...") lines,
    since it only looks from the ``NVRM:`` marker on. ``data`` carries ``meaning`` and ``action`` always, ``pid``
    and ``process`` only when the line names them."""
    at = line.find("NVRM: ")
    if at < 0:
        return None
    text = line[at:].rstrip("\r\n")
    m = _XID_RE.match(text)
    if m:
        code = int(m["code"])
        pid, name, rest = _split_pid_name(m["rest"])
        return _event(code, m["pci"], text, pid, name, rest.strip())
    m = _OFF_BUS_RE.match(text)
    if m:
        return _event(79, m["pci"], text, None, None, "GPU has fallen off the bus")
    return None


def _event(code: int, pci: str, text: str, pid: str | None, name: str | None, detail: str) -> dict[str, Any]:
    info = describe_xid(code)
    data = {"meaning": info.meaning, "action": info.action}
    if pid is not None:
        data["pid"] = pid
    if name is not None:
        data["process"] = name[:256]
    if detail:
        data["detail"] = detail[:1000]
    return {
        "kind": "xid",
        "code": code,
        "pci_bus_id": normalize_pci(pci),
        "severity": info.severity,
        "message": text[:_MAX_MESSAGE],
        "data": data,
    }
