"""Why the gloo test programs end with tests/gloo_exit.py (docs/training-hooks.md, DDP): a gloo thread that takes the
GIL to release a Python callback after the interpreter began to finalize aborts a rank that finished cleanly, and
ending without the finalization does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hooks_support import free_port, gloo_env

WORKER = Path(__file__).with_name("late_release_worker.py")


def ranks(how: str) -> list[tuple[int, str]]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), how], env=gloo_env(rank, 2, port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    try:
        return [(p.wait(60), p.communicate()[0]) for p in procs]
    finally:
        for p in procs:
            p.kill()


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="CPython 3.14 leaves such a thread waiting: no abort")
def test_a_gloo_thread_releasing_a_callback_during_finalization_aborts_the_rank() -> None:
    for code, out in ranks("finalize"):
        assert "trained" in out
        assert code == -6 and "terminate called without an active exception" in out, (code, out)


def test_ending_without_finalizing_exits_cleanly() -> None:
    for code, out in ranks("exit"):
        assert (code, out.strip()) == (0, "trained"), out
