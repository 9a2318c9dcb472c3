"""In a worker process, the diagnosis pass goes first.

``clusterdx worker`` runs its tasks in threads of one process (the pass's held window lives there), and its threads
take turns at one GIL. The probe index and the efficiency figures are CPU-bound at 2,048 nodes (0.4-1.4 s each,
every 10-15 s), and a pass that ran beside one got half the interpreter: on the kept 2,048-node cluster, a pass of
0.53 s of CPU took 0.66 s alone and 1.31 s beside one busy thread, with a 5 ms or a 50 ms switch interval alike
(``sys.setswitchinterval`` decides how often the threads swap, not how they share). Under ingest, the passes that
met one of those tasks took ~1.5 s where the others took ~1.1 s.

A pass is what someone waits on (a fault named within seconds); those tasks run every 10-15 s and nobody waits on
their second. So a pass marks itself :func:`urgent`, and the background tasks call :func:`yield_to_urgent` between
chunks of their work (each chunk tens of milliseconds): while a pass runs in this process they wait, at most
``MAX_YIELD_S`` at a time (a pass stuck on the database must not stall them for good). The embedded default's pass
runs in a process of its own (:mod:`dashboard.diagnosis.offload`) and never marks itself here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from dashboard import metrics

MAX_YIELD_S = 10.0

_lock = threading.Lock()
_urgent = 0  # urgent tasks running in this process
_clear = threading.Event()  # set while none runs
_clear.set()


@contextmanager
def urgent() -> Iterator[None]:
    """While this runs, the background tasks of this process wait at their next :func:`yield_to_urgent`."""
    global _urgent
    with _lock:
        _urgent += 1
        _clear.clear()
    try:
        yield
    finally:
        with _lock:
            _urgent -= 1
            if not _urgent:
                _clear.set()


def yield_to_urgent() -> float:
    """A background task between two chunks of its work: wait while an urgent task runs in this process (at most
    MAX_YIELD_S). Returns the seconds waited (also counted in /metrics)."""
    if _clear.is_set():
        return 0.0
    t0 = time.monotonic()
    _clear.wait(MAX_YIELD_S)
    waited = time.monotonic() - t0
    metrics.BACKGROUND_YIELD_SECONDS.inc(waited)
    return waited
