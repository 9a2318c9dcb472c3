"""What an index's key order costs SQLite's ingest: GPU rows inserted into a table that already holds minutes of a
large cluster, with the samples indexed by (node, gpu_index, ts) against (node, ts).

A B-tree index appends each new row at the end of its key's range. Keyed by GPU, a 2,048-node cluster has 16,384
ranges, so once each holds a leaf page of its own (past a minute or two) every row of a commit dirties its own page,
and in WAL mode each dirtied page is written out whole at the commit. Keyed by node, a node's eight GPUs share a leaf.
This builds the GPU samples table from the migrated schema (the current (cluster, ts) index and either key order),
fills it with ``--fill`` seconds of ``--nodes`` x 8 GPUs (one transaction a second), then times ``--seconds`` more
in commits of ``--commit`` rows, the group writer's way, and prints CPU and wall per row, commit percentiles and the
ratio.

    python benchmarks/sqlite_index.py                          # 2,048 nodes, 120 s filled, 10 s timed
    python benchmarks/sqlite_index.py --nodes 512 --fill 600
"""

from __future__ import annotations

import argparse
import os
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TABLE = "telemetry_gpusample"
LAYOUTS = {"by GPU (node, gpu_index, ts)": ("node_id", "gpu_index", "ts"), "by node (node, ts)": ("node_id", "ts")}


def schema() -> tuple[str, str]:
    """The GPU samples table's CREATE TABLE and its (cluster, ts) index, as the migrations make them."""
    os.environ["CLUSTERDX_DATA_DIR"] = tempfile.mkdtemp(prefix="cdx-idx-")
    os.environ.pop("DATABASE_URL", None)
    os.environ["DJANGO_SETTINGS_MODULE"] = "dashboard.settings"
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", "telemetry", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute("SELECT type, sql FROM sqlite_master WHERE tbl_name = %s AND sql IS NOT NULL", [TABLE])
        rows = cursor.fetchall()
    table = next(sql for kind, sql in rows if kind == "table")
    by_time = next(sql for kind, sql in rows if kind == "index" and '("cluster_id", "ts")' in sql)
    return table, by_time


def stamp(t: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(1_780_000_000 + t)) + ".000000"  # as Django stores it


def second(cols: list[str], nodes: int, t: int, rng: random.Random) -> list[list[object]]:
    fixed: dict[str, object] = {"cluster_id": 1, "ts": stamp(t)}
    rows = []
    for node in range(nodes):
        for gpu in range(8):
            fixed.update(node_id=node + 1, gpu_index=gpu)
            rows.append([fixed[c] if c in fixed else rng.random() * 100 for c in cols])
    return rows


def measure(label: str, key: tuple[str, ...], ddl: tuple[str, str], args: argparse.Namespace) -> dict[str, float]:
    path = Path(tempfile.mkdtemp(prefix="cdx-idx-")) / "db.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")  # what the server's settings set
    db.execute(ddl[0])
    db.execute(ddl[1])
    columns = ", ".join(f'"{c}"' for c in key)
    db.execute(f'CREATE INDEX "by_key" ON "{TABLE}" ({columns})')
    cols = [r[1] for r in db.execute(f'PRAGMA table_info("{TABLE}")') if r[1] != "id"]
    insert = f'INSERT INTO "{TABLE}" ({", ".join(cols)}) VALUES ({", ".join("?" * len(cols))})'
    rng = random.Random(7)
    template = second(cols, args.nodes, 0, rng)
    ts_at = cols.index("ts")
    print(f"==> {label}: filling {args.fill} s of {args.nodes} nodes x 8 GPUs", flush=True)
    for t in range(args.fill):
        ts = stamp(t)
        for row in template:
            row[ts_at] = ts
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
    p.add_argument("--nodes", type=int, default=2048)
    p.add_argument("--fill", type=int, default=120, help="seconds of data already in the table")
    p.add_argument("--seconds", type=int, default=10, help="seconds of data timed")
    p.add_argument("--commit", type=int, default=1024, help="rows per commit while timed")
    args = p.parse_args()
    ddl = schema()
    results = {label: measure(label, key, ddl, args) for label, key in LAYOUTS.items()}
    print(f"\n{args.nodes} nodes x 8 GPUs, {args.fill} s in the table, {args.seconds} s timed in commits of "
          f"{args.commit} rows (SQLite {sqlite3.sqlite_version}, WAL, synchronous=NORMAL)")
    for label, r in results.items():
        print(f"  {label:30s} CPU {r['cpu_us']:5.1f} us/row  wall {r['wall_us']:5.1f} us/row  commit p50 "
              f"{r['p50_ms']:5.1f} ms p99 {r['p99_ms']:5.1f} ms  file {r['mb']:,.0f} MB")
    old, new = results.values()
    print(f"  by node / by GPU: CPU {new['cpu_us'] / old['cpu_us']:.2f}, wall {new['wall_us'] / old['wall_us']:.2f}")


if __name__ == "__main__":
    main()
