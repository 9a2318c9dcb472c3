"""A process that claims a CPU as a web worker does (tests/server/test_affinity.py): prints the CPU it claimed and
the CPUs a child it spawns runs on, then holds the claim until its stdin closes.

    python tests/server/affinity_claimer.py MODE QUOTA|none CONTAINER(0|1) [release|claim]

The child releases (as the diagnosis pass's process does) and prints the CPUs it then runs on, or claims a CPU of its
own (as the ingest writer's does) and prints that CPU (-1: none).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dashboard import affinity


def child(q: multiprocessing.Queue, how: str) -> None:  # type: ignore[type-arg]
    if how == "claim":  # the CPU it claimed (-1: none), when its threads are on that CPU
        cpu = affinity.claim("test child", mode="on")
        q.put([cpu if cpu is not None and os.sched_getaffinity(0) == {cpu} else -1])
        return
    affinity.release()
    q.put(sorted(os.sched_getaffinity(0)))


if __name__ == "__main__":
    mode, quota, container = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    how = sys.argv[4] if len(sys.argv) > 4 else "release"
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # running before the claim: moved too
    cpu = affinity.claim("test", mode=mode, quota=None if quota == "none" else float(quota), container=container)
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # started after it: inherits it
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q, how))
    p.start()
    print(cpu, ",".join(map(str, q.get(timeout=60))), flush=True)
    p.join()
    sys.stdin.read()
