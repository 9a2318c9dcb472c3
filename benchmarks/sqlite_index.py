"""What an index's key order costs SQLite's ingest: rows inserted into a time-series table that already holds minutes
of a large cluster, under the migrated indexes against the key order they replaced.

A B-tree index appends each new row at the end of its key's range. Keyed by GPU, a 2,048-node cluster has 16,384
ranges, so once each holds a leaf page of its own (past a minute or two) every row of a commit dirties its own page,
and in WAL mode each dirtied page is written out whole at the commit. Keyed by node, a node's eight GPUs share a leaf.
The step samples had the same shape twice: (run, rank, step), 16,384 ranges at 2,048 nodes x 8 ranks, and the node
column's own index; migration telemetry 0014 keys ranks in groups of eight, (run, rank / 8, step), and drops the other.

``--table gpus`` builds the GPU samples table (migration 0013: (node, gpu_index, ts) -> (node, ts)), ``--table steps``
the step samples (0014), from the migrated schema; fills ``--fill`` seconds of ``--nodes`` x 8 GPUs or ranks (one
transaction a second), then times ``--seconds`` more in commits of ``--commit`` rows, the group writer's way, and
prints CPU and wall per row, commit percentiles and the ratio.

    python benchmarks/sqlite_index.py                          # GPU rows, 2,048 nodes, 120 s filled, 10 s timed
    python benchmarks/sqlite_index.py --table steps            # step rows, the same
    python benchmarks/sqlite_index.py --nodes 512 --fill 600
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TABLES = {"gpus": "telemetry_gpusample", "steps": "telemetry_stepsample"}
# Per table: label -> (migrated indexes left out, by their columns; indexes added): the old layout, then the new.
LAYOUTS: dict[str, dict[str, tuple[list[str], list[str]]]] = {
    "gpus": {"by GPU (node, gpu_index, ts)": (['("node_id", "ts")'], ['("node_id", "gpu_index", "ts")']),
             "by node (node, ts)": ([], [])},
    "steps": {"(run, rank, step) + (node)": (["/ 8"], ['("run_id", "rank", "step")', '("node_id")']),
              "(run, rank / 8, step)": ([], [])},
}


@cache
def schema(table: str) -> tuple[str, list[str]]:
    """The table's CREATE TABLE and CREATE INDEX statements, as the migrations make them (in a temporary database,
    removed once they are read; once per process: Django is set up for that database)."""
    os.environ["CLUSTERDX_DATA_DIR"] = tempfile.mkdtemp(prefix="cdx-idx-")
    os.environ.pop("DATABASE_URL", None)
    os.environ["DJANGO_SETTINGS_MODULE"] = "dashboard.settings"
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    # The row tables as they were before frames replaced them (telemetry 0018 drops them): this benchmark is the
    # measurement behind their index choices (docs/scaling-storage.md), kept runnable.
    call_command("migrate", "telemetry", "0016_frames_backfill", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute("SELECT type, sql FROM sqlite_master WHERE tbl_name = %s AND sql IS NOT NULL", [table])
        rows = cursor.fetchall()
    connection.close()
    shutil.rmtree(os.environ["CLUSTERDX_DATA_DIR"], ignore_errors=True)  # only its statements were wanted
    return next(sql for kind, sql in rows if kind == "table"), [sql for kind, sql in rows if kind == "index"]


def stamp(t: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(1_780_000_000 + t)) + ".000000"  # as Django stores it


NULLS = {"phases", "metrics", "groups", "throttle_reasons", "xid_errors"}


def second(cols: list[str], nodes: int, t: int, rng: random.Random) -> list[list[object]]:
    """One second of the cluster: 8 rows a node (its GPUs, or its ranks at step ``t``)."""
    fixed: dict[str, object] = {"cluster_id": 1, "run_id": 1, "ts": stamp(t), "step": t}
    rows = []
    for node in range(nodes):
        for k in range(8):
            fixed.update(node_id=node + 1, gpu_index=k, rank=node * 8 + k)
            rows.append([fixed[c] if c in fixed else None if c in NULLS else rng.random() * 100 for c in cols])
    return rows


def measure(label: str, layout: tuple[list[str], list[str]], table: str, ddl: tuple[str, list[str]],
            args: argparse.Namespace) -> dict[str, float]:
    path = Path(tempfile.mkdtemp(prefix="cdx-idx-")) / "db.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")  # what the server's settings set
    left_out, added = layout
    db.execute(ddl[0])
    for sql in ddl[1]:
        if not any(cols in sql for cols in left_out):
            db.execute(sql)
    for i, columns in enumerate(added):
        db.execute(f'CREATE INDEX "old_{i}" ON "{table}" {columns}')
    cols = [r[1] for r in db.execute(f'PRAGMA table_info("{table}")') if r[1] != "id"]
    insert = f'INSERT INTO "{table}" ({", ".join(cols)}) VALUES ({", ".join("?" * len(cols))})'
    rng = random.Random(7)
    template = second(cols, args.nodes, 0, rng)
    ts_at, step_at = cols.index("ts"), cols.index("step") if "step" in cols else None
    print(f"==> {label}: filling {args.fill} s of {args.nodes} nodes x 8", flush=True)
    for t in range(args.fill):
        ts = stamp(t)
        for row in template:
            row[ts_at] = ts
            if step_at is not None:
                row[step_at] = t
        db.execute("BEGIN")
        db.executemany(insert, template)
        db.execute("COMMIT")
        if (t + 1) % 30 == 0:
            print(f"    {t + 1} s filled", flush=True)
    timed = [second(cols, args.nodes, args.fill + t, rng) for t in range(args.seconds)]
    commits: list[float] = []
    cpu0, wall0, n = time.process_time(), time.perf_counter(), 0
    for rows in timed:
        for i in range(0, len(rows), args.commit):
            part = rows[i:i + args.commit]
            t0 = time.perf_counter()
            db.execute("BEGIN")
            db.executemany(insert, part)
            db.execute("COMMIT")
            commits.append(time.perf_counter() - t0)
            n += len(part)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    db.close()
    size = sum(f.stat().st_size for f in path.parent.iterdir())
    for f in path.parent.iterdir():
        f.unlink()
    path.parent.rmdir()
    commits.sort()
    return {"cpu_us": cpu / n * 1e6, "wall_us": wall / n * 1e6, "p50_ms": statistics.median(commits) * 1e3,
            "p99_ms": commits[int(len(commits) * 0.99)] * 1e3, "mb": size / 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", choices=sorted(TABLES), default="gpus")
    p.add_argument("--nodes", type=int, default=2048)
    p.add_argument("--fill", type=int, default=120, help="seconds of data already in the table")
    p.add_argument("--seconds", type=int, default=10, help="seconds of data timed")
    p.add_argument("--commit", type=int, default=1024, help="rows per commit while timed")
    args = p.parse_args()
    table = TABLES[args.table]
    ddl = schema(table)
    results = {label: measure(label, layout, table, ddl, args) for label, layout in LAYOUTS[args.table].items()}
    print(f"\n{table}: {args.nodes} nodes x 8, {args.fill} s in the table, {args.seconds} s timed in commits of "
          f"{args.commit} rows (SQLite {sqlite3.sqlite_version}, WAL, synchronous=NORMAL)")
    for label, r in results.items():
        print(f"  {label:30s} CPU {r['cpu_us']:5.1f} us/row  wall {r['wall_us']:5.1f} us/row  commit p50 "
              f"{r['p50_ms']:5.1f} ms p99 {r['p99_ms']:5.1f} ms  file {r['mb']:,.0f} MB")
    old, new = results.values()
    print(f"  new / old: CPU {new['cpu_us'] / old['cpu_us']:.2f}, wall {new['wall_us'] / old['wall_us']:.2f}")


if __name__ == "__main__":
    main()
