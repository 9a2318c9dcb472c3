"""In-process ingest cost: CPU per batch to validate and store the simulator's node-seconds (8 GPUs, 8 ranks, host,
ports, probes), one transaction per batch (the path before the group commit) against groups of N (``store_group``).

No HTTP, no threads: this isolates what the server spends per batch behind the door, which issue 11 budgets at
0.5 ms per node-second all in. Prints microseconds of CPU (``time.process_time``) per batch for each mode, split
into parse + validate and store, and the ratio.

    python benchmarks/ingest_inproc.py                          # embedded SQLite in a temporary directory
    python benchmarks/ingest_inproc.py --backend pg --nodes 128 # PostgreSQL (CLUSTERDX_BENCH_DATABASE_URL)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PG_URL = os.environ.get("CLUSTERDX_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/cdx_bench_inproc")


def _setup(backend: str, redis_url: str | None = None) -> None:
    """Django on ``backend``, migrated; the live state in Redis at ``redis_url`` (as the production stack keeps it),
    else in memory: this measures the database path."""
    os.environ.setdefault("CLUSTERDX_DATA_DIR", tempfile.mkdtemp(prefix="cdx-inproc-"))
    os.environ.pop("REDIS_URL", None)
    if redis_url:
        os.environ["REDIS_URL"] = redis_url
        os.environ.setdefault("CLUSTERDX_REDIS_PREFIX", f"stages{os.getpid()}")
    if backend == "pg":
        import psycopg

        base, name = PG_URL.rsplit("/", 1)
        with psycopg.connect(base + "/postgres", autocommit=True) as conn:
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
                conn.execute(f'CREATE DATABASE "{name}"')
        os.environ["DATABASE_URL"] = PG_URL
    else:
        os.environ.pop("DATABASE_URL", None)
    os.environ["DJANGO_SETTINGS_MODULE"] = "dashboard.settings"
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def _bodies(nodes: int, seconds: int, prefix: str) -> list[list[bytes]]:
    """One list of JSON bodies per simulated second (one body per node), stamped just before now."""
    from collectors.sim.model import SimCluster
    from collectors.sim.scenario import parse

    start = time.time() - seconds - 2
    sim = SimCluster(parse({"cluster": {"nodes": nodes, "gpus_per_node": 8, "seed": 3}}), start, agent_prefix=prefix)
    encode = _encoder()
    return [[json.dumps(encode(b), separators=(",", ":")).encode() for b in sim.tick(start + t)]
            for t in range(1, seconds + 1)]


KEEP_RECORDS = True  # as the server's ingest parses (--dicts: every record a dict, as before 2026-12-03)
WIRE = 1  # --wire 2: the GPU samples, steps, probes and beats as column blocks (clusterdx.blocks)


def _encoder() -> Any:
    from clusterdx import blocks

    return blocks.encode_batch if WIRE == 2 else (lambda b: b)


def _validate(body: bytes) -> tuple[dict[str, Any], str]:
    from clusterdx import wire
    from dashboard.ingest import blocks

    # What the server runs: the compiled decoder (the reference path only words the errors of refused batches).
    batch = blocks.parse(body) if WIRE == 2 else wire.parse_batch(body, keep_records=KEEP_RECORDS)
    return batch, hashlib.sha256(body).hexdigest()


def _checkpoint(clock: Any = time.process_time) -> float:
    """CPU seconds of copying what is still in SQLite's write-ahead log into the database: work a writer defers (a
    larger ``wal_autocheckpoint``, a checkpoint of its own thread) is counted, not left to after the measurement."""
    from django.db import connection

    if connection.vendor != "sqlite":
        return 0.0
    t0 = clock()
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return clock() - t0


def run(mode: str, nodes: int, seconds: int, group: int) -> dict[str, float]:
    from dashboard.ingest.writer import clear_caches, store_batch, store_group
    from dashboard.telemetry.models import Cluster

    cluster = Cluster.objects.create(name=f"inproc-{mode}-{time.time_ns()}")
    clear_caches()
    seconds_of = _bodies(nodes, seconds + 1, prefix=f"{mode}{time.time_ns()}")
    for body in seconds_of[0]:  # the first second creates the inventory (nodes, GPUs, runs): not measured
        store_batch(cluster, *_validate(body))
    validate_s = store_s = 0.0
    count = 0
    for bodies in seconds_of[1:]:
        t0 = time.process_time()
        jobs = [(cluster, *_validate(b)) for b in bodies]
        t1 = time.process_time()
        if mode == "per-batch":
            for j in jobs:
                store_batch(*j)
        else:
            for i in range(0, len(jobs), group):
                outcomes = store_group(jobs[i:i + group])
                assert all(getattr(o, "status", None) == "accepted" for o in outcomes), outcomes
        store_s += time.process_time() - t1
        validate_s += t1 - t0
        count += len(bodies)
    store_s += _checkpoint()
    return {"validate_us": validate_s / count * 1e6, "store_us": store_s / count * 1e6,
            "total_us": (validate_s + store_s) / count * 1e6, "batches": count}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["sqlite", "pg"], default="sqlite")
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--group", type=int, default=64, help="batches per commit in the group mode")
    ap.add_argument("--dicts", action="store_true", help="parse every record into a dict (the path before the "
                    "server kept the GPU samples, steps and probes as the decoder's records)")
    ap.add_argument("--wire", type=int, choices=(1, 2), default=1, help="the wire version of the bodies")
    ap.add_argument("--server-gc", action="store_true", help="tune the garbage collector as the server does at its "
                    "first batch (gc.freeze, a young collection every 50,000 allocations)")
    args = ap.parse_args()
    global KEEP_RECORDS, WIRE
    KEEP_RECORDS, WIRE = not args.dicts, args.wire
    _setup(args.backend)
    from django.db import connection

    if args.server_gc:
        from dashboard.ingest import asgi

        asgi._tune_gc()

    print(f"backend {connection.vendor}, {args.nodes} nodes x 8 GPUs x {args.seconds} s, group of {args.group}, "
          f"wire version {args.wire}")
    results = {mode: run(mode, args.nodes, args.seconds, args.group) for mode in ("per-batch", "group")}
    for mode, r in results.items():
        print(f"{mode:>9}: {r['batches']:.0f} batches, CPU per batch (= per node-second): parse+validate "
              f"{r['validate_us']:.0f} us, store {r['store_us']:.0f} us, total {r['total_us']:.0f} us")
    before, after = results["per-batch"], results["group"]
    print(f"store ratio group/per-batch {after['store_us'] / before['store_us']:.3f}; "
          f"total {after['total_us'] / before['total_us']:.3f}; budget 500 us per node-second all in "
          f"(HTTP, gzip and the live update come on top)")


if __name__ == "__main__":
    main()
