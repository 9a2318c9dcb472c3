"""What the agent reads from each GPU, as a table of readers grouped by how often the value can change.

A reader maps one NVML call (or a few spellings of it, newest first) to one or more ``GpuSample`` fields. It
returns ``(values, reasons)``: on failure every field it owns is ``None`` and carries the reason. Static values are
read once, slow ones (aggregate ECC, row remapping, NVLink counters, power limit) every few seconds, fast ones
every interval: this keeps an 8-GPU node at a few dozen NVML calls per second.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from collectors.gpu.nvml import NOT_SUPPORTED, Call, Nvml

Values = dict[str, Any]
Reasons = dict[str, str]
Reader = Callable[[Nvml, Any], tuple[Values, Reasons]]

# NVML constants, spelled out so this table reads without pynvml installed (values from nvml.h).
TEMPERATURE_GPU = 0
CLOCK_SM, CLOCK_MEM = 1, 2
CORRECTED, UNCORRECTED = 0, 1
VOLATILE, AGGREGATE = 0, 1
RETIRED_SBE_CAUSE, RETIRED_DBE_CAUSE = 0, 1
MEMORY_V2 = 0x02000028
NVLINK_REPLAY, NVLINK_RECOVERY, NVLINK_CRC_FLIT, NVLINK_CRC_DATA = 0, 1, 2, 3
NVLINK_MAX_LINKS = 18  # Hopper and Blackwell; pynvml's own constant is used when it has one

# Clock event ("throttle") reason bits, decoded to the names the dashboard and the diagnosis use.
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)


def decode_throttle(mask: int) -> list[str]:
    names = [name for bit, name in THROTTLE_REASONS if mask & bit]
    known = sum(bit for bit, _ in THROTTLE_REASONS)
    rest = mask & ~known
    names += [f"bit_0x{1 << i:x}" for i in range(64) if rest >> i & 1]
    return names


@dataclass(frozen=True)
class Simple:
    """A reader for one call whose result converts to ``fields`` in order."""

    fields: tuple[str, ...]
    calls: tuple[Call, ...]
    convert: Callable[[Any], tuple[Any, ...]]

    def __call__(self, nvml: Nvml, handle: Any) -> tuple[Values, Reasons]:
        value, reason = nvml.first(self.calls, handle)
        if reason is not None:
            return dict.fromkeys(self.fields), dict.fromkeys(self.fields, reason)
        return dict(zip(self.fields, self.convert(value), strict=True)), {}


def one(field: str, fn: str, *args: Any, scale: float | None = None) -> Simple:
    if scale is None:
        return Simple((field,), (Call(fn, args),), lambda v: (v,))
    return Simple((field,), (Call(fn, args),), lambda v: (v * scale,))


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _pci(info: Any) -> tuple[str]:
    bus_id = _text(info.busId)
    try:
        from collectors.xid import normalize_pci
    except ImportError:  # the Xid table ships with the agent; tolerate a partial install anyway
        return (bus_id.lower(),)
    # One spelling with the kernel log ("0000:3b:00.0"), so Xid lines and samples pair up on the server.
    return (normalize_pci(bus_id),)


STATIC: tuple[Reader, ...] = (
    Simple(("name",), (Call("nvmlDeviceGetName"),), lambda v: (_text(v)[:96],)),
    Simple(("uuid",), (Call("nvmlDeviceGetUUID"),), lambda v: (_text(v)[:96],)),
    Simple(("pci_bus_id",), (Call("nvmlDeviceGetPciInfo_v3"),), _pci),
    one("sm_clock_max_mhz", "nvmlDeviceGetMaxClockInfo", CLOCK_SM),
    one("mem_clock_max_mhz", "nvmlDeviceGetMaxClockInfo", CLOCK_MEM),
    one("pcie_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration"),
    one("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth"),
)

FAST: tuple[Reader, ...] = (
    Simple(("util_gpu_pct", "util_mem_pct"), (Call("nvmlDeviceGetUtilizationRates"),),
           lambda u: (float(u.gpu), float(u.memory))),
    # v2 reports "used" without the driver's reservation, as nvidia-smi does; old drivers only have v1.
    Simple(("mem_used_bytes", "mem_total_bytes"),
           (Call("nvmlDeviceGetMemoryInfo", (MEMORY_V2,), "nvmlDeviceGetMemoryInfo_v2"),
            Call("nvmlDeviceGetMemoryInfo")),
           lambda m: (m.used, m.total)),
    one("temp_c", "nvmlDeviceGetTemperature", TEMPERATURE_GPU),
    one("power_w", "nvmlDeviceGetPowerUsage", scale=0.001),
    one("sm_clock_mhz", "nvmlDeviceGetClockInfo", CLOCK_SM),
    one("mem_clock_mhz", "nvmlDeviceGetClockInfo", CLOCK_MEM),
    Simple(("throttle_reasons",),
           (Call("nvmlDeviceGetCurrentClocksEventReasons"), Call("nvmlDeviceGetCurrentClocksThrottleReasons")),
           lambda mask: (decode_throttle(mask),)),
    one("ecc_sbe_volatile", "nvmlDeviceGetTotalEccErrors", CORRECTED, VOLATILE),
    one("ecc_dbe_volatile", "nvmlDeviceGetTotalEccErrors", UNCORRECTED, VOLATILE),
    one("pcie_replay_total", "nvmlDeviceGetPcieReplayCounter"),
    one("pcie_gen", "nvmlDeviceGetCurrPcieLinkGeneration"),
    one("pcie_width", "nvmlDeviceGetCurrPcieLinkWidth"),
)

SLOW: tuple[Reader, ...] = (
    one("power_limit_w", "nvmlDeviceGetEnforcedPowerLimit", scale=0.001),
    one("ecc_sbe_aggregate", "nvmlDeviceGetTotalEccErrors", CORRECTED, AGGREGATE),
    one("ecc_dbe_aggregate", "nvmlDeviceGetTotalEccErrors", UNCORRECTED, AGGREGATE),
)

REMAP_FIELDS = ("remap_correctable", "remap_uncorrectable", "remap_pending", "remap_failure")
RETIRED_FIELDS = ("retired_pages_sbe", "retired_pages_dbe", "retired_pages_pending")
NVLINK_FIELDS = ("nvlink_links_up", "nvlink_links_total", "nvlink_crc_errors_total",
                 "nvlink_replay_errors_total", "nvlink_recovery_errors_total")

read_remap = Simple(REMAP_FIELDS, (Call("nvmlDeviceGetRemappedRows"),),
                    lambda r: (r[0], r[1], bool(r[2]), bool(r[3])))


def read_retired(nvml: Nvml, handle: Any) -> tuple[Values, Reasons]:
    values: Values = {}
    reasons: Reasons = {}
    for field, cause in (("retired_pages_sbe", RETIRED_SBE_CAUSE), ("retired_pages_dbe", RETIRED_DBE_CAUSE)):
        pages, reason = nvml.call("nvmlDeviceGetRetiredPages", handle, cause)
        values[field] = None if pages is None else len(pages)
        if reason:
            reasons[field] = reason
    pending, reason = nvml.call("nvmlDeviceGetRetiredPagesPendingStatus", handle)
    values["retired_pages_pending"] = None if pending is None else bool(pending)
    if reason:
        reasons["retired_pages_pending"] = reason
    return values, reasons


def memory_error_reader(nvml: Nvml, handle: Any) -> tuple[Reader, Reasons]:
    """Row remapping (Ampere and later) or page retirement (older), whichever this GPU supports.

    Returns the reader to use from now on and the fixed reasons for the other family's fields."""
    _, remap_reason = read_remap(nvml, handle)
    if not remap_reason:
        return read_remap, dict.fromkeys(RETIRED_FIELDS, "superseded by row remapping on this GPU")
    _, retired_reason = read_retired(nvml, handle)
    if not retired_reason:
        reason = next(iter(remap_reason.values()))
        return read_retired, dict.fromkeys(REMAP_FIELDS, reason)
    return (lambda _n, _h: ({}, {})), {**remap_reason, **retired_reason}


# field -> (NVML field ids of the totals over all links, per-link error counters to sum otherwise)
NVLINK_ERRORS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "nvlink_crc_errors_total": ((38, 45), (NVLINK_CRC_FLIT, NVLINK_CRC_DATA)),  # NVML_FI_DEV_NVLINK_CRC_*_TOTAL
    "nvlink_replay_errors_total": ((52,), (NVLINK_REPLAY,)),  # NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL
    "nvlink_recovery_errors_total": ((59,), (NVLINK_RECOVERY,)),  # NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL
}
NVLINK_TOTAL_FIELDS = sorted({i for ids, _ in NVLINK_ERRORS.values() for i in ids})
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")  # by nvmlValueType_t


def _field_value(v: Any) -> int:
    member = _VALUE_MEMBERS[v.valueType] if v.valueType < len(_VALUE_MEMBERS) else "ullVal"
    return max(0, int(getattr(v.value, member)))


class NvLinks:
    """NVLink state and error counters summed over the links this GPU has (found once, at start)."""

    def __init__(self, nvml: Nvml, handle: Any) -> None:
        self.links: list[int] = []
        self.reason = NOT_SUPPORTED
        self.use_fields = True
        # Links are numbered from 0; the first one that does not answer is past the last this GPU has.
        for link in range(getattr(nvml.lib, "NVML_NVLINK_MAX_LINKS", NVLINK_MAX_LINKS)):
            _, reason = nvml.call("nvmlDeviceGetNvLinkState", handle, link)
            if reason is not None:
                if link == 0:
                    self.reason = reason
                break
            self.links.append(link)

    def __call__(self, nvml: Nvml, handle: Any) -> tuple[Values, Reasons]:
        if not self.links:
            return dict.fromkeys(NVLINK_FIELDS), dict.fromkeys(NVLINK_FIELDS, self.reason or NOT_SUPPORTED)
        values: Values = {"nvlink_links_total": len(self.links)}
        reasons: Reasons = {}
        up = [nvml.call("nvmlDeviceGetNvLinkState", handle, link) for link in self.links]
        values["nvlink_links_up"] = sum(1 for v, r in up if r is None and v)
        totals = self._field_totals(nvml, handle)
        for field, (field_ids, counters) in NVLINK_ERRORS.items():
            if all(i in totals for i in field_ids):
                values[field] = sum(totals[i] for i in field_ids)
                continue
            values[field], reason = self._sum(nvml, handle, counters)
            if reason:
                reasons[field] = reason
        return values, reasons

    def _field_totals(self, nvml: Nvml, handle: Any) -> dict[int, int]:
        """Totals over all links in one call (what Hopper and later answer; per-link counters are deprecated)."""
        if not self.use_fields:
            return {}
        got, reason = nvml.call("nvmlDeviceGetFieldValues", handle, NVLINK_TOTAL_FIELDS)
        if reason is not None:
            self.use_fields = False  # an older driver: the per-link counters from now on
            return {}
        return {int(v.fieldId): _field_value(v) for v in got if v.nvmlReturn == 0}

    def _sum(self, nvml: Nvml, handle: Any, counters: tuple[int, ...]) -> tuple[int | None, str | None]:
        total = 0
        for link in self.links:
            for counter in counters:
                value, reason = nvml.call("nvmlDeviceGetNvLinkErrorCounter", handle, link, counter)
                if reason is not None:
                    return None, reason
                total += value
        return total, None
