"""How long a second writer waits for SQLite while the group writer holds it back to back, with SQLite's busy handler
alone against the embedded backend's fair in-process lock (dashboard.storage.sqlite).

Two threads of one process write one SQLite file (WAL), as the embedded server's group writer and its other thread
(findings, alerts, rollups, retention) do: the writer holds each transaction ``--writer-ms`` and begins the next at
once; the other holds ``--other-ms`` and pauses ``--pause-ms`` between its transactions. Prints each thread's
transactions and its wait to begin (mean, p50, p99, max) for both ways, over ``--seconds`` each.

    python benchmarks/sqlite_turns.py
    python benchmarks/sqlite_turns.py --writer-ms 100 --other-ms 20
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dashboard.storage.sqlite.base import FairLock  # (imports without Django settings)


def run(path: Path, fair: bool, args: argparse.Namespace) -> dict[str, list[float]]:
    lock = FairLock()
    stop = time.monotonic() + args.seconds
    waits: dict[str, list[float]] = {"writer": [], "other": []}

    def work(name: str, hold: float, pause: float) -> None:
        db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            if fair:
                lock.acquire(30)
            db.execute("BEGIN IMMEDIATE")
            waits[name].append(time.perf_counter() - t0)
            db.execute("INSERT INTO t VALUES (?)", [name])
            time.sleep(hold)  # the transaction's work (the writer's rows; the other's findings)
            db.execute("COMMIT")
            if fair:
                lock.release()
            time.sleep(pause)
        db.close()

    threads = [threading.Thread(target=work, args=("writer", args.writer_ms / 1e3, 0.0)),
               threading.Thread(target=work, args=("other", args.other_ms / 1e3, args.pause_ms / 1e3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return waits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--writer-ms", type=float, default=30.0, help="the group writer's transaction")
    p.add_argument("--other-ms", type=float, default=10.0, help="the other thread's transaction")
    p.add_argument("--pause-ms", type=float, default=40.0, help="the other thread's pause between transactions")
    args = p.parse_args()
    path = Path(tempfile.mkdtemp(prefix="cdx-turns-")) / "db.sqlite3"
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE t (who TEXT)")
    db.commit()
    db.close()
    print(f"writer holds {args.writer_ms:g} ms back to back; the other holds {args.other_ms:g} ms every "
          f"{args.other_ms + args.pause_ms:g} ms; {args.seconds:g} s each way")
    for label, fair in (("SQLite's busy handler", False), ("fair in-process lock", True)):
        waits = run(path, fair, args)
        for name, w in waits.items():
            w.sort()
            print(f"  {label:22s} {name:6s} {len(w):5d} transactions  wait mean {statistics.mean(w) * 1e3:7.1f} ms"
                  f"  p50 {w[len(w) // 2] * 1e3:7.1f}  p99 {w[int(len(w) * 0.99)] * 1e3:7.1f}  max {w[-1] * 1e3:7.1f}")
    for f in path.parent.iterdir():
        f.unlink()
    path.parent.rmdir()


if __name__ == "__main__":
    main()
