"""Storage cost per tier: bytes per GPU per day of raw GPU frames, of raw host rows and of the 10 s and 1 min rollups,
on each backend, and what a retention needs on disk at 2,048 nodes x 8 GPUs.

    python benchmarks/storage.py                      # SQLite and PostgreSQL, 4 nodes x 8 GPUs, 2 simulated hours
    python benchmarks/storage.py --nodes 8 --hours 4  # more data, the same ratios
    python benchmarks/storage.py --backends sqlite --post-s 1

Each backend runs in a child process on a fresh database (SQLite: a temporary data directory; PostgreSQL: a scratch
database on ``--pg-url``'s server, dropped afterwards). The simulator's GPU and host samples (the values agents send,
so the fields that are null on a real GPU are null here too) are stored for ``--hours`` at 1 Hz: the GPU samples as
the ingest writer frames them (:mod:`dashboard.storage.frames`: a frame per node, post of ``--post-s`` seconds and
10 s window), the host samples as rows. The rollup pass runs once over them, and the tables' real sizes are read:
PostgreSQL ``pg_total_relation_size`` summed over each table's partitions (heap, TOAST and every index), SQLite
``dbstat`` pages of the table and its indexes (a frame's packed data included).

Then the cost of the rollup pass in steady state: a pass over every node's last 5 min plus margins (what the 5 min
schedule does, the newest windows not rolled up yet), ``--repeat`` times; printed as CPU time (on PostgreSQL the
database's backend process, via psutil, and this process, where the GPU frames are decoded and grouped in numpy;
SQLite runs in this process) and wall time, per raw sample, per node-pass, and as cores at 2,048 nodes x 8 GPUs at
1 Hz. ``--explain`` adds the pass's EXPLAIN ANALYZE (PostgreSQL).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GPUS_PER_NODE = 8
SCALE_NODES = 2048
TABLES = {  # label -> (table, per GPU (True) or per node)
    "raw GPU frames (1 Hz)": ("telemetry_gpuframe", True),
    "GPU rollups 10 s": ("storage_gpu_10s", True),
    "GPU rollups 1 min": ("storage_gpu_1m", True),
    "raw host samples (1 Hz)": ("telemetry_hostsample", False),
    "host rollups 10 s": ("storage_host_10s", False),
    "host rollups 1 min": ("storage_host_1m", False),
}


def _size(cursor: Any, vendor: str, table: str) -> int:
    if vendor == "postgresql":
        cursor.execute("SELECT coalesce(sum(pg_total_relation_size(relid)), 0) FROM pg_partition_tree(%s)", [table])
        return int(cursor.fetchone()[0])
    cursor.execute("SELECT coalesce(sum(pgsize), 0) FROM dbstat WHERE name IN "
                   "(SELECT name FROM sqlite_master WHERE tbl_name = %s)", [table])
    return int(cursor.fetchone()[0])


def child(nodes: int, hours: float, repeat: int, explain: bool, post_s: int) -> dict[str, Any]:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection
    from django.db.models import Sum

    from dashboard.storage.models import ROLLUPS
    from dashboard.storage.rollup import roll_up
    from dashboard.telemetry.models import Cluster, GpuFrame, HostSample

    call_command("migrate", verbosity=0)
    cluster = Cluster.objects.create(name=f"bench-storage-{int(time.time())}")
    seconds = int(hours * 3600)
    start = time.time() - seconds - 60
    a = time.perf_counter()
    ids, gpus = _feed(cluster, nodes, start, seconds, post_s)
    fed = time.perf_counter() - a
    a = time.perf_counter()
    roll_up()
    rolled = time.perf_counter() - a
    vendor = connection.vendor
    with connection.cursor() as cursor:  # before the steady passes below: their updates leave dead rows behind
        if vendor == "postgresql":
            cursor.execute("CHECKPOINT")
        sizes = {label: _size(cursor, vendor, table) for label, (table, _) in TABLES.items()}
    # A steady-state pass: every node's last 5 min (the schedule) + 30 s margin + 30 s slack, minute-aligned.
    from dashboard.storage.rollup import _roll, floor_to

    end = datetime.fromtimestamp(start + seconds + 1, UTC)
    lo = floor_to(end - timedelta(seconds=360), 60)
    node_ids = sorted(ids)
    steady_rows = (GpuFrame.objects.filter(ts__gte=lo).aggregate(n=Sum("n"))["n"] or 0) + \
        HostSample.objects.filter(ts__gte=lo).count()
    rollups = [t for _, _, tiers in ROLLUPS.values() for t in tiers.values()]

    def forget_new() -> None:
        # What a real pass finds: the windows of the last 5 min not rolled up yet (the one open at the previous pass
        # partly), and the minute or two before them, margins, already rolled up and unchanged.
        for model in rollups:
            model._default_manager.filter(ts__gte=floor_to(end - timedelta(seconds=300), 10)).delete()

    steady = _steady(lambda: _roll(node_ids, lo, end, None), repeat, forget_new)
    plans = _explain(lambda: _roll(node_ids, lo, end, None), forget_new) if explain else []
    counts = {"gpus": gpus, "nodes": len(ids), "gpu_rows": GpuFrame.objects.aggregate(n=Sum("n"))["n"],
              "gpu_frames": GpuFrame.objects.count(), "host_rows": HostSample.objects.count()}
    return {"vendor": vendor, "sizes": sizes, "counts": counts, "hours": seconds / 3600, "feed_s": fed,
            "rollup_s": rolled, "steady": steady, "steady_rows": steady_rows, "plans": plans, "post_s": post_s}


def _feed(cluster: Any, nodes: int, start: float, seconds: int, post_s: int) -> tuple[set[int], int]:
    """The simulator's samples of ``seconds`` at 1 Hz: GPU samples as frames of ``post_s`` s posts (as the ingest
    writer frames a post), host samples as rows. Returns the node ids and the number of GPUs."""
    from benchmarks.diagnosis import scenario_for
    from collectors.sim.model import SimCluster
    from dashboard.storage import frames as fr
    from dashboard.telemetry.models import GpuFrame, HostSample, Node

    sim = SimCluster(scenario_for(None, nodes, GPUS_PER_NODE, 1)[0], start)
    host_cols = {f.name for f in HostSample._meta.fields} - {"id", "cluster", "node", "ts"}
    ids: dict[str, Node] = {}
    gpus: set[tuple[str, int]] = set()
    posts: dict[str, list[dict[str, Any]]] = {}
    frames: list[GpuFrame] = []
    host_rows: list[HostSample] = []
    for i in range(1, seconds + 1):
        for b in sim.tick(start + i):
            node = ids.get(b["host"]) or ids.setdefault(b["host"], Node.objects.create(cluster=cluster, hostname=b["host"]))
            posts.setdefault(b["host"], []).extend(b.get("gpus", []))
            gpus.update((b["host"], g["index"]) for g in b.get("gpus", []))
            for h in b.get("hosts", []):
                host_rows.append(HostSample(cluster=cluster, node=node, ts=datetime.fromtimestamp(h["ts"], UTC),
                                            **{k: v for k, v in h.items() if k in host_cols}))
        if i % post_s and i != seconds:
            continue
        for host, recs in posts.items():
            mat = fr.matrix(fr.GPUS, [tuple(r.get(c) for c in fr.GPUS.numbers) for r in recs])
            objs = fr.objects(fr.GPUS, {f: [r.get(f) for r in recs] for f in fr.GPUS.objects})
            frames += [GpuFrame(cluster=cluster, node=ids[host], ts=datetime.fromtimestamp(f.ts, UTC), n=f.n,
                                layout=fr.GPUS.layout, data=f.data) for f in fr.build(fr.GPUS, mat, objs)]
        posts = {}
        if len(host_rows) >= 2_000 or i == seconds:
            GpuFrame.objects.bulk_create(frames, batch_size=2000)
            HostSample.objects.bulk_create(host_rows, batch_size=2000)
            frames, host_rows = [], []
    return {n.id for n in ids.values()}, len(gpus)


def _explain(run: Any, reset: Any) -> list[str]:
    """EXPLAIN ANALYZE of each SQL statement of a steady pass (PostgreSQL; rolled back, they write): where the time
    goes in the host rollup (the GPU windows are grouped in numpy, outside the database)."""
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    if connection.vendor != "postgresql":
        return []
    with CaptureQueriesContext(connection) as ctx:
        run()
    plans = []
    reset()
    for q in ctx.captured_queries:
        if not q["sql"].startswith("WITH"):
            continue
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN (ANALYZE, TIMING ON, COSTS OFF) {q['sql']}")
            plans.append("\n".join(r[0] for r in cursor.fetchall()))
            transaction.set_rollback(True)
    return plans


def _steady(run: Any, repeat: int, reset: Any) -> dict[str, float]:
    """The steady-state pass ``repeat`` times (``reset`` before each, untimed); the least of each of wall time and
    CPU time (the machine is shared: the least is the one least disturbed). On PostgreSQL the database's CPU is the
    server backend process of this connection (psutil), where the host rollup's SQL and the GPU windows' upserts run,
    and the client's is this process, where the GPU frames are decoded and grouped; on SQLite both are this process,
    the library being in it."""
    from django.db import connection

    proc = None
    if connection.vendor == "postgresql":
        import psutil

        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            proc = psutil.Process(cursor.fetchone()[0])

    def cpu() -> float:
        if proc is None:
            return time.process_time()
        t = proc.cpu_times()
        return float(t.user + t.system)

    walls, cpus, clients = [], [], []
    for _ in range(repeat):
        reset()
        w, c, k = time.perf_counter(), cpu(), time.process_time()
        run()
        walls.append(time.perf_counter() - w)
        cpus.append(cpu() - c)
        clients.append(time.process_time() - k)
    both = [d + k for d, k in zip(cpus, clients, strict=True)] if proc else cpus
    return {"wall_s": min(walls), "db_cpu_s": min(cpus), "client_cpu_s": min(clients) if proc else 0.0,
            "cpu_s": min(both)}


def run_backend(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    tmp = tempfile.mkdtemp(prefix="cdx-bench-storage-")
    env["CLUSTERDX_DATA_DIR"] = tmp
    db = None
    if backend == "postgresql":
        import psycopg

        db = f"cdx_bench_storage_{os.getpid()}"
        with psycopg.connect(args.pg_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{db}"')
        env["DATABASE_URL"] = args.pg_url.rsplit("/", 1)[0] + "/" + db
    try:
        out = subprocess.run([sys.executable, __file__, "--child", "--nodes", str(args.nodes), "--hours", str(args.hours),
                              "--repeat", str(args.repeat), "--post-s", str(args.post_s),
                              *(["--explain"] if args.explain else [])],
                             env=env, check=True, capture_output=True, text=True)
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))
    except subprocess.CalledProcessError as exc:
        sys.stderr.write(exc.stderr)
        raise
    finally:
        if db is not None:
            import psycopg

            with psycopg.connect(args.pg_url, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n < 2**40 else f"{n / 2**40:,.2f} TiB"


def report(res: dict[str, Any], raw_hours: list[float], days_10s: list[float], days_1m: float) -> None:
    c, days = res["counts"], res["hours"] / 24
    print(f"\n{res['vendor']}: {c['nodes']} nodes, {c['gpus']} GPUs, {res['hours']:.1f} h at 1 Hz "
          f"({c['gpu_rows']:,} GPU samples in {c['gpu_frames']:,} frames of {res['post_s']} s posts, "
          f"{c['host_rows']:,} host rows); fed in {res['feed_s']:.0f} s, "
          f"rollup pass {res['rollup_s']:.1f} s = {res['rollup_s'] / (c['nodes'] * res['hours']) * 1000:.0f} ms per "
          f"node-hour")
    # A steady pass covers each node's last 5 min plus margins (6 min of raw samples); at scale it runs once per 5 min
    # per node, so its cost per node times the nodes over 300 s is the share of a core it keeps busy.
    s, rows = res["steady"], res["steady_rows"]
    gpus_per_node = c["gpus"] / c["nodes"]
    scale_rows = SCALE_NODES * (GPUS_PER_NODE + 1) / (gpus_per_node + 1)  # the pass's rows scale with GPUs + host
    print(f"  steady-state pass (5 min schedule, {rows:,} raw samples, both tiers, GPU and host): wall "
          f"{s['wall_s'] * 1000:.0f} ms, CPU {s['cpu_s'] * 1000:.0f} ms"
          + (f" (database {s['db_cpu_s'] * 1000:.0f} ms + client {s['client_cpu_s'] * 1000:.0f} ms)"
             if s["client_cpu_s"] else ""))
    for what, sec in (("CPU", s["cpu_s"]), ("wall", s["wall_s"])):
        print(f"    {what:>4}: {sec / rows * 1e6:6.2f} us per raw sample, {sec / c['nodes'] * 1000:6.1f} ms per node-pass; "
              f"at {SCALE_NODES:,} nodes x {GPUS_PER_NODE} GPUs at 1 Hz: {sec / c['nodes'] * scale_rows / 300:.2f} cores")
    for plan in res.get("plans", []):
        print("  " + plan.replace("\n", "\n  "))
    per_day: dict[str, float] = {}
    print(f"  {'tier':<26} {'bytes/GPU/day' :>14} {'bytes/row':>10}   (host tiers: per node; raw: per sample)")
    for label, (_, per_gpu) in TABLES.items():
        unit = c["gpus"] if per_gpu else c["nodes"]
        per_day[label] = res["sizes"][label] / unit / days
        rows = c["gpu_rows"] if label.startswith("raw GPU") else c["host_rows"] if label.startswith("raw host") else None
        width = 10 if "10 s" in label else 60 if "1 min" in label else 1
        rows = rows or (unit * res["hours"] * 3600 / width)
        print(f"  {label:<26} {per_day[label]:>14,.0f} {res['sizes'][label] / rows:>10,.0f}")
    gpus, nodes = SCALE_NODES * GPUS_PER_NODE, SCALE_NODES

    def fleet(prefix: str) -> float:  # bytes per day at scale of the tables whose label starts with prefix
        return sum(per_day[k] * (gpus if TABLES[k][1] else nodes) for k in per_day if k.lower().startswith(prefix))

    for d10 in days_10s:
        roll = (fleet("gpu rollups 10") + fleet("host rollups 10")) * d10 + \
            (fleet("gpu rollups 1 ") + fleet("host rollups 1 ")) * days_1m
        for hours in raw_hours:
            raw = fleet("raw") * hours / 24
            # PostgreSQL drops whole days: up to one more day of raw samples is on disk just before a drop.
            extra = (f" (up to {gib(fleet('raw') * (hours + 24) / 24 + roll)} with day partitions)"
                     if res["vendor"] == "postgresql" else "")
            print(f"  at {SCALE_NODES:,} nodes x {GPUS_PER_NODE} GPUs: raw {hours:g} h {gib(raw)} + 10 s {d10:g} d + "
                  f"1 min {days_1m:g} d {gib(roll)} = {gib(raw + roll)}{extra}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--hours", type=float, default=2.0)
    p.add_argument("--backends", nargs="*", default=["sqlite", "postgresql"], choices=["sqlite", "postgresql"])
    p.add_argument("--pg-url", default=os.environ.get("CLUSTERDX_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    p.add_argument("--raw-hours", type=float, nargs="*", default=[6.0, 72.0])
    p.add_argument("--rollup-10s-days", type=float, nargs="*", default=[7.0, 30.0])  # the default first
    p.add_argument("--rollup-1m-days", type=float, default=30.0)
    p.add_argument("--repeat", type=int, default=5, help="steady-state passes measured (the least is printed)")
    p.add_argument("--post-s", type=int, default=2, help="seconds of GPU samples per post, so per frame (2: the send "
                   "interval at 2,048 nodes)")
    p.add_argument("--explain", action="store_true", help="print EXPLAIN ANALYZE of a steady pass (PostgreSQL)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.nodes, args.hours, args.repeat, args.explain, args.post_s)))
        return 0
    results = [run_backend(b, args) for b in args.backends]
    if args.json:
        print(json.dumps(results, indent=1))
    for res in results:
        report(res, args.raw_hours, args.rollup_10s_days, args.rollup_1m_days)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
