"""How the test programs that run gloo ranks end: the process leaves without the interpreter's finalization.

A Python callback on a gloo future (torch's own Python comm hooks, the hooks' timed hook and collective tracer) is
released on gloo's worker thread, which takes the GIL to do it. If that thread was descheduled until the main thread
had begun finalizing, CPython before 3.14 ends it with ``pthread_exit`` as it takes the GIL; unwinding through gloo's
C++ frames is ``std::terminate`` and the rank aborts ("terminate called without an active exception") after it did
everything right. CI's loaded cores did that once to a rank of ``tests/hooks/ddp_worker.py`` after its last step.
docs/training-hooks.md says who meets it and what to do; the test programs do the same: exit here, nothing left
to run, once their results are written and the Monitor is closed."""

from __future__ import annotations

import os
import sys


def exit_without_finalizing(code: int = 0) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
