"""What the GIL costs the embedded server's group writer: GPU rows stored by a writer thread while another thread of the
same process runs Python (in the server, the event loop reading, inflating and decoding the next posts).

Python's sqlite3 releases the GIL around every ``sqlite3_step``, so an ``executemany`` of N rows hands it back N
times. A thread that wants it back while another thread is running Python waits until that thread drops it: at a
blocking call, or when the switch interval (``sys.getswitchinterval()``, 5 ms) forces it. Against a thread that never
blocks, that is one row per 5 ms. ``dashboard.ingest.writer`` therefore puts ``SQLITE_ROWS_PER_STATEMENT`` rows in
each INSERT on SQLite, and the rows past the last whole statement in statements of 2**k rows
(:func:`dashboard.ingest.statements.statement_sizes`, which this benchmark uses): a few hand-backs per commit.

For each layout (one row per statement, then ``--rows`` rows per statement), the writer stores the migrated GPU
samples table's rows (one node's second is 8 rows; commits of ``--commit`` rows) for ``--seconds``, alone and then
beside a thread that runs Python without blocking, and prints rows a second, the writer thread's CPU per row and the
ratios.

    python benchmarks/sqlite_convoy.py
    python benchmarks/sqlite_convoy.py --rows 64 --commit 2048 --seconds 5
"""

from __future__ import annotations

import argparse
import random
import shutil
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import cache
from itertools import chain
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from sqlite_index import TABLES, schema, second  # noqa: E402

from dashboard.ingest.statements import statement_sizes  # noqa: E402


def busy(stop: threading.Event) -> None:
    """Python that never blocks: the worst case for a thread waiting for the GIL."""
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def store(db: sqlite3.Connection, sql: Callable[[int], str], rows: list[list[object]], per: int, commit: int,
          seconds: float) -> tuple[float, float]:
    """Rows a second and the writer thread's CPU µs per row, committing ``commit`` rows at a time for ``seconds``."""
    n, t0, c0 = 0, time.perf_counter(), time.thread_time()
    while time.perf_counter() - t0 < seconds:
        for start in range(0, len(rows), commit):
            part = rows[start:start + commit]
            db.execute("BEGIN")
            at = 0
            for size in statement_sizes(len(part), per):  # the group writer's layout
                db.execute(sql(size), list(chain.from_iterable(part[at:at + size])))
                at += size
            db.execute("COMMIT")
            n += len(part)
    return n / (time.perf_counter() - t0), (time.thread_time() - c0) / n * 1e6


def measure(args: argparse.Namespace, per: int, beside_busy: bool) -> tuple[float, float]:
    table = TABLES["gpus"]
    create, indexes = schema(table)
    folder = Path(tempfile.mkdtemp(prefix="cdx-convoy-"))
    try:
        db = sqlite3.connect(folder / "db.sqlite3", isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # as the server's settings
        for sql in [create, *indexes]:
            db.execute(sql)
        cols = [r[1] for r in db.execute(f'PRAGMA table_info("{table}")') if r[1] != "id"]
        one_row = f"({', '.join('?' * len(cols))})"
        head = f'INSERT INTO "{table}" ({", ".join(cols)}) VALUES '
        rows = second(cols, args.nodes, 0, random.Random(7))
        stop = threading.Event()
        spinner = threading.Thread(target=busy, args=(stop,))
        if beside_busy:
            spinner.start()
        out: list[tuple[float, float]] = []
        writer = threading.Thread(target=lambda: out.append(store(
            db, cache(lambda n: head + ", ".join([one_row] * n)), rows, per, args.commit, args.seconds)))
        writer.start()
        writer.join()
        stop.set()
        if beside_busy:
            spinner.join()
        db.close()
        return out[0]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=512, help="rows per statement of the second layout (the writer's)")
    p.add_argument("--nodes", type=int, default=256, help="nodes x 8 GPU rows stored over and over")
    p.add_argument("--commit", type=int, default=1592, help="rows per commit (199 nodes' GPUs: a group is rarely "
                   "a multiple of the rows per statement)")
    p.add_argument("--seconds", type=float, default=4.0, help="per measurement")
    args = p.parse_args()
    print(f"GPU sample rows, commits of {args.commit}, {args.seconds:g} s each, switch interval "
          f"{sys.getswitchinterval() * 1e3:g} ms (SQLite {sqlite3.sqlite_version})", flush=True)
    results = {}
    for per in (1, args.rows):
        for beside_busy in (False, True):
            rate, cpu = results[per, beside_busy] = measure(args, per, beside_busy)
            print(f"  {per:3d} row(s) per statement, {'beside a busy thread' if beside_busy else 'alone':21s} "
                  f"{rate:9,.0f} rows/s  writer CPU {cpu:6.1f} us/row", flush=True)
    for beside_busy in (False, True):
        old, new = results[1, beside_busy], results[args.rows, beside_busy]
        print(f"  {'beside a busy thread' if beside_busy else 'alone'}: {args.rows} rows per statement / 1: "
              f"rows/s x{new[0] / old[0]:.2f}, CPU per row x{new[1] / old[1]:.2f}")


if __name__ == "__main__":
    main()
