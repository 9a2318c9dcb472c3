"""The CPU of each stage of a post's way through the server, in one process, as the ingest benchmark's posts arrive
(``benchmarks/ingest.py``'s plan: a post every 4 s per node, wire version 2, gzip): checking the body (gunzip, decode,
validate, hash), storing groups of 8 (``store_group``), publishing them to the live layer (``publish_batches``).

``--contend`` adds what a web worker's other threads do to these: a thread that keeps the GIL busy (encoding JSON)
beside the measured one, as the event loop, the group writer and the publisher are beside each other. ``--pin`` holds
the process to one CPU first, as ``CLUSTERDX_PIN_CPU`` does (dashboard/affinity.py). The times are the measured
thread's own CPU (``time.thread_time``), so the contending thread's work is not in them, only what it costs this one.

    python benchmarks/ingest_stages.py                       # alone
    python benchmarks/ingest_stages.py --contend             # a busy thread beside it, on any CPU
    python benchmarks/ingest_stages.py --contend --pin       # the same two threads on one CPU
    python benchmarks/ingest_stages.py --profile store       # and where one stage's time goes (cProfile)
    python benchmarks/ingest_stages.py --backend pg          # PostgreSQL, the live state in Redis (the production
                                                             # stack's web worker; CLUSTERDX_BENCH_DATABASE_URL,
                                                             # CLUSTERDX_TEST_REDIS_URL)
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _busy(stop: threading.Event) -> None:
    doc = {"gpus": [[f"node-{i:04d}", i % 8, 1.5 * i, 40.0, 300.5] for i in range(64)]}
    while not stop.is_set():
        json.dumps(doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=512)
    ap.add_argument("--seconds", type=int, default=12)
    ap.add_argument("--backend", choices=["embedded", "pg"], default="embedded")
    ap.add_argument("--group", type=int, default=8, help="posts per commit (the 2,048-node run averages 7)")
    ap.add_argument("--contend", action="store_true", help="a thread that keeps the GIL busy beside the measured one")
    ap.add_argument("--pin", action="store_true", help="the whole process on one CPU")
    ap.add_argument("--profile", choices=["check", "store", "publish"],
                    help="print where that stage's time goes (cProfile, its functions by own time); the stages' "
                         "times then include the profiler's")
    args = ap.parse_args()
    if args.pin:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before any thread starts: all inherit it
    import ingest as bench
    from ingest_inproc import _checkpoint, _setup

    if args.backend == "pg":
        _setup("pg", bench.REDIS_URL)
    else:
        _setup("sqlite")  # the embedded default in a temporary data directory, migrated

    from dashboard.ingest import asgi
    from dashboard.ingest import writer as w
    from dashboard.ingest.views import Checked, Poster, check_body
    from dashboard.live.publish import publish_batches
    from dashboard.telemetry.models import Cluster

    print(f"==> building {args.nodes} nodes x {args.seconds} s of posts", flush=True)
    plan = bench.build(args.nodes, 8, args.seconds, 4, f"stages{os.getpid()}", time.time() - args.seconds - 5)
    cluster = Cluster.objects.create(name=f"stages-{os.getpid()}")
    poster = Poster(cluster.id, cluster.name, "cluster", "")
    asgi._tune_gc()
    published: list[Any] = []
    w.published_to = published.append  # handed over here, published below on this thread (timed apart)

    def checked(body: bytes) -> Checked:
        c = check_body(poster, body, True, 64 << 20)
        assert isinstance(c, Checked), c
        return c

    for posts in plan.by_second[:4]:  # each node's first post makes its inventory (nodes, GPUs, ranks): not timed
        for p in posts:
            c = checked(p.body)
            w.store_batch(cluster, c.batch, c.digest)
    published.clear()
    rest = [p for posts in plan.by_second[4:] for p in posts]
    stop = threading.Event()
    if args.contend:
        threading.Thread(target=_busy, args=(stop,), daemon=True).start()
    spent = {"check": 0.0, "store": 0.0, "publish": 0.0}
    clock = time.thread_time
    profiler = cProfile.Profile()

    def stage(name: str) -> contextlib.AbstractContextManager[Any]:
        return profiler if name == args.profile else contextlib.nullcontext()

    for i in range(0, len(rest), args.group):
        t0 = clock()
        with stage("check"):
            group = [checked(p.body) for p in rest[i:i + args.group]]
        t1 = clock()
        with stage("store"):
            w.store_group([(cluster, c.batch, c.digest) for c in group])
        t2 = clock()
        with stage("publish"):
            for items in published:
                publish_batches(items)
        published.clear()
        t3 = clock()
        spent["check"] += t1 - t0
        spent["store"] += t2 - t1
        spent["publish"] += t3 - t2
    spent["store"] += _checkpoint(clock)  # what the commits left in SQLite's log, copied now: counted, not deferred
    stop.set()
    node_s = sum(p.seconds for p in rest)
    print(f"{args.backend}: {len(rest)} posts, {node_s} node-seconds, groups of {args.group}; contend={args.contend} "
          f"pin={args.pin}")
    for stage, s in spent.items():
        print(f"  {stage:8} {s / len(rest) * 1e6:6.0f} us a post  {s / node_s * 1e3:.3f} ms a node-second")
    total = sum(spent.values())
    print(f"  {'total':8} {total / len(rest) * 1e6:6.0f} us a post  {total / node_s * 1e3:.3f} ms a node-second")
    if args.profile:
        print(f"\n==> where {args.profile}'s time goes (cProfile: the 25 functions with the most own time)")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
