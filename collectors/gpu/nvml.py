"""The one way into NVML: lazy initialisation under a lock, and every call turned into ``(value, reason)``.

NVML fails in many ordinary ways (an old driver lacks a function, a consumer GPU has no ECC, a container has no
permission, a GPU fell off the bus). None of them may stop the agent or be reported as a fake ``0``: a failed call
yields ``None`` plus a short reason that ends up in the sample's ``unavailable`` map. A function the library does
not have is logged once, since it will be missing for as long as the driver stays the same.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from typing import Any, NamedTuple

log = logging.getLogger("clusterdx.agent.gpu")

NOT_SUPPORTED = "not supported"


class Call(NamedTuple):
    """One way to ask NVML for something; ``label`` names the C function when it differs from the binding."""

    fn: str
    args: tuple[Any, ...] = ()
    label: str = ""


class Nvml:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lib: Any = None
        self._off: str | None = None
        self._missing_logged: set[str] = set()
        # NVML error codes after which another spelling of the same call is worth trying.
        self._fall_through: frozenset[int] = frozenset()

    def start(self) -> str | None:
        """Initialise NVML once. ``None`` when it answers, else the reason it does not (said once by the caller)."""
        with self._lock:
            if self._lib is None and self._off is None:
                self._off = self._init()
            return self._off

    def _init(self) -> str | None:
        try:
            import pynvml
        except ImportError:
            return "pynvml is not installed (pip install 'clusterdx[agent]')"
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
                return "no NVML library (libnvidia-ml.so.1 not found): no NVIDIA driver on this node"
            return f"NVML did not initialise: {exc}"
        self._lib = pynvml
        self._fall_through = frozenset(
            {pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH}
        )
        return None

    @property
    def lib(self) -> Any:
        """The pynvml module, for its constants; only valid after a successful :meth:`start`."""
        return self._lib

    def call(self, fn: str, *args: Any) -> tuple[Any, str | None]:
        return self.first((Call(fn, args),))

    def first(self, calls: tuple[Call, ...], *lead: Any) -> tuple[Any, str | None]:
        """Try each spelling in turn (newest first) while the library lacks it; ``lead`` goes before each's args."""
        lib = self._lib
        if lib is None:
            return None, self._off or "NVML is not initialised"
        reason = NOT_SUPPORTED
        for call in calls:
            try:
                return getattr(lib, call.fn)(*lead, *call.args), None
            except lib.NVMLError as exc:
                reason = self._reason(call, exc)
                if exc.value not in self._fall_through:
                    return None, reason
            except AttributeError:  # an nvidia-ml-py too old to have the binding at all
                reason = self._missing(call.label or call.fn)
        return None, reason

    def _reason(self, call: Call, exc: Any) -> str:
        lib = self._lib
        code = exc.value
        if code == lib.NVML_ERROR_NOT_SUPPORTED:
            return NOT_SUPPORTED
        if code == lib.NVML_ERROR_FUNCTION_NOT_FOUND:
            return self._missing(call.label or call.fn)
        if code == lib.NVML_ERROR_NO_PERMISSION:
            return "no permission (run the agent as root or give the container the GPU devices)"
        if code == lib.NVML_ERROR_GPU_IS_LOST:
            return "GPU is lost (fell off the bus?)"
        return f"NVML error {code}: {exc}"[:128]

    def _missing(self, name: str) -> str:
        if name not in self._missing_logged:
            self._missing_logged.add(name)
            log.info("NVML has no %s (older driver); what it reports is left empty or read another way", name)
        return f"{name} not in this driver's NVML"[:128]

    def shutdown(self) -> None:
        with self._lock:
            if self._lib is not None:
                with contextlib.suppress(self._lib.NVMLError):
                    self._lib.nvmlShutdown()
                self._lib = None
                self._off = "NVML was shut down"


def handle_key(handle: Any) -> int:
    """A device handle's address, so an event's device can be matched to the GPU it came from."""
    return ctypes.cast(handle, ctypes.c_void_p).value or 0
