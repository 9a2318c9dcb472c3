"""Xid events from NVML's event API, polled without waiting once per interval.

NVML queues Xid ("critical error") events per event set; ``nvmlEventSetWait`` with a 0 ms timeout returns one
queued event or times out at once, so polling costs one call per interval when nothing happened. Each event is
decoded by the shared Xid table (:mod:`collectors.xid`) into meaning, action and severity.
"""

from __future__ import annotations

import logging
from typing import Any

from collectors.gpu.nvml import Nvml, handle_key

log = logging.getLogger("clusterdx.agent.gpu")

XID_EVENT_TYPE = 0x8  # nvmlEventTypeXidCriticalError
MAX_EVENTS_PER_POLL = 256  # a GPU in an Xid storm must not stall the interval


class XidEvents:
    def __init__(self, nvml: Nvml, gpus: dict[int, tuple[int, str | None]]) -> None:
        """``gpus`` maps a handle's address to (GPU index, PCI bus id)."""
        self._nvml = nvml
        self._gpus = gpus
        self._set: Any = None
        self.registered: list[int] = []

    def start(self, handles: list[Any]) -> str | None:
        """Register every GPU that supports Xid events; the reason when none does."""
        event_set, reason = self._nvml.call("nvmlEventSetCreate")
        if reason is not None:
            return f"no NVML event set ({reason})"
        self._set = event_set
        for index, handle in enumerate(handles):
            supported, reason = self._nvml.call("nvmlDeviceGetSupportedEventTypes", handle)
            if reason is None and supported & XID_EVENT_TYPE:
                _, reason = self._nvml.call("nvmlDeviceRegisterEvents", handle, XID_EVENT_TYPE, event_set)
            if reason is None and supported & XID_EVENT_TYPE:
                self.registered.append(index)
        if not self.registered:
            self.close()
            return "no GPU delivers Xid events through NVML"
        return None

    def poll(self, now: float) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._set is None:
            return events
        lib = self._nvml.lib
        for _ in range(MAX_EVENTS_PER_POLL):
            try:
                data = lib.nvmlEventSetWait(self._set, 0)
            except lib.NVMLError as exc:
                if exc.value != lib.NVML_ERROR_TIMEOUT:
                    log.warning("NVML event wait failed (%s); Xid events are off from now on", exc)
                    self.close()
                break
            if data.eventType & XID_EVENT_TYPE:
                events.append(self._event(now, data))
        return events

    def _event(self, now: float, data: Any) -> dict[str, Any]:
        index, pci = self._gpus.get(handle_key(data.device), (None, None))
        code = int(data.eventData)
        meaning, action, severity, name = describe(code)
        where = f"GPU {index}" if index is not None else "a GPU"
        event: dict[str, Any] = {
            "ts": now, "kind": "xid", "code": code, "severity": severity,
            "message": f"Xid {code} on {where}{f' ({pci})' if pci else ''}: {meaning}"[:8192],
            "data": {"meaning": meaning[:1024], "action": action[:1024], "name": name, "source": "nvml"},
        }
        if index is not None:
            event["gpu_index"] = index
        if pci:
            event["pci_bus_id"] = pci
        return event

    def close(self) -> None:
        if self._set is not None:
            self._nvml.call("nvmlEventSetFree", self._set)
            self._set = None


def describe(code: int) -> tuple[str, str, str, str]:
    """(meaning, action, severity, mnemonic) from the shared Xid table; a plain fallback if it is missing."""
    try:
        from collectors.xid import describe_xid
    except ImportError:
        return f"Xid {code}", "Look the code up in NVIDIA's Xid catalogue.", "error", "UNKNOWN"
    info = describe_xid(code)
    return info.meaning, info.action, info.severity, info.name
