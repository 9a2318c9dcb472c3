"""The agent's GPU source: one wide ``GpuSample`` per GPU per interval, plus Xid events, all through NVML."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from collectors.agent.source import Collected
from collectors.gpu import readers
from collectors.gpu.nvml import Nvml, handle_key
from collectors.gpu.xid_events import XidEvents

log = logging.getLogger("clusterdx.agent.gpu")


@dataclass
class _Gpu:
    index: int
    handle: Any
    static: dict[str, Any] = field(default_factory=dict)
    slow: dict[str, Any] = field(default_factory=dict)
    # Reasons that hold for the agent's lifetime (static fields, the memory-error family this GPU lacks).
    fixed_reasons: dict[str, str] = field(default_factory=dict)
    slow_reasons: dict[str, str] = field(default_factory=dict)
    slow_readers: tuple[readers.Reader, ...] = ()
    lost: bool = False


class GpuSource:
    name = "gpu"

    def __init__(self, *, slow_interval_s: float = 10.0, xid_events: bool = True) -> None:
        if not 0 < slow_interval_s <= 3600:
            raise ValueError(f"slow_interval_s must be in (0, 3600], got {slow_interval_s}")
        self.slow_interval_s = float(slow_interval_s)
        self.want_xid = bool(xid_events)
        self.nvml = Nvml()
        self.gpus: list[_Gpu] = []
        self.xid: XidEvents | None = None
        self.detail = ""
        self.notes: list[str] = []
        self._next_slow = 0.0

    def start(self) -> str | None:
        reason = self.nvml.start()
        if reason is not None:
            return reason
        count, reason = self.nvml.call("nvmlDeviceGetCount")
        if reason is not None:
            return f"NVML cannot count GPUs: {reason}"
        if not count:
            return "NVML found no GPUs"
        for index in range(count):
            handle, reason = self.nvml.call("nvmlDeviceGetHandleByIndex", index)
            if reason is not None:
                self.notes.append(f"GPU {index} skipped: {reason}")
                continue
            self.gpus.append(self._open(index, handle))
        self._start_xid()
        names = sorted({g.static.get("name") or "?" for g in self.gpus})
        driver, _ = self.nvml.call("nvmlSystemGetDriverVersion")
        self.detail = f"{len(self.gpus)} GPU(s): {', '.join(names)}; driver {readers._text(driver or '?')}"
        return None

    def _open(self, index: int, handle: Any) -> _Gpu:
        gpu = _Gpu(index, handle)
        for read in readers.STATIC:
            values, reasons = read(self.nvml, handle)
            gpu.static.update(values)
            gpu.fixed_reasons.update(reasons)
        memory_errors, family_reasons = readers.memory_error_reader(self.nvml, handle)
        gpu.fixed_reasons.update(family_reasons)
        gpu.slow_readers = (*readers.SLOW, memory_errors, readers.NvLinks(self.nvml, handle))
        return gpu

    def _start_xid(self) -> None:
        if not self.want_xid:
            self.notes.append("Xid events through NVML off (xid_events = false)")
            return
        by_handle = {handle_key(g.handle): (g.index, g.static.get("pci_bus_id")) for g in self.gpus}
        xid = XidEvents(self.nvml, by_handle)
        reason = xid.start([g.handle for g in self.gpus])
        if reason is None:
            self.xid = xid
        else:
            self.notes.append(f"Xid events through NVML off: {reason}; the kmsg source reads them from the kernel")

    def collect(self, now: float, out: Collected) -> None:
        refresh = now >= self._next_slow
        if refresh:
            self._next_slow = now + self.slow_interval_s
        for gpu in self.gpus:
            out.gpus.append(self._sample(gpu, now, refresh, out))
        if self.xid is not None:
            out.events.extend(self.xid.poll(now))

    def _sample(self, gpu: _Gpu, now: float, refresh: bool, out: Collected) -> dict[str, Any]:
        if refresh:
            gpu.slow, gpu.slow_reasons = {}, {}
            for read in gpu.slow_readers:
                values, reasons = read(self.nvml, gpu.handle)
                gpu.slow.update(values)
                gpu.slow_reasons.update(reasons)
        sample: dict[str, Any] = {"ts": now, "index": gpu.index, **gpu.static, **gpu.slow}
        unavailable = {**gpu.fixed_reasons, **gpu.slow_reasons}
        for read in readers.FAST:
            values, reasons = read(self.nvml, gpu.handle)
            sample.update(values)
            unavailable.update(reasons)
        self._note_lost(gpu, now, unavailable, out)
        if unavailable:
            sample["unavailable"] = unavailable
        return sample

    def _note_lost(self, gpu: _Gpu, now: float, unavailable: dict[str, str], out: Collected) -> None:
        """Say once, as an event, that a GPU stopped answering: the samples alone would only show empty cells."""
        lost = unavailable.get("util_gpu_pct", "").startswith("GPU is lost")
        if lost and not gpu.lost:
            log.error("GPU %d (%s) is lost: NVML no longer reaches it", gpu.index, gpu.static.get("pci_bus_id"))
            out.events.append({
                "ts": now, "kind": "agent", "severity": "critical", "gpu_index": gpu.index,
                "message": f"GPU {gpu.index} is lost: NVML no longer reaches it (fell off the bus?)",
                **({"pci_bus_id": gpu.static["pci_bus_id"]} if gpu.static.get("pci_bus_id") else {}),
            })
        gpu.lost = lost

    def close(self) -> None:
        if self.xid is not None:
            self.xid.close()
        self.nvml.shutdown()
