"""What storing a node's GPUs of one second as one row would save SQLite's ingest and the diagnosis pass's read.

Today a node-second is eight GPU rows of 37 columns (``telemetry_gpusample``, one row per GPU, two indexes). The
alternative measured here is one row per node-second: the eight GPUs' numeric fields as one float64 matrix in a BLOB
(the pass reads it with ``np.frombuffer``: no Python object per cell) and their two JSON fields as one JSON list.
Both layouts start from the same batches as the server decodes them (``wire.parse_batch(keep_records=True)``, the
simulator's 8 GPUs a node) and build their rows with the writer's own helpers (sample time as SQLite's datetime
text, JSON cells); today's rows are read back with the diagnosis loader's ``_cells``. Each layout fills ``--fill``
seconds of ``--nodes`` nodes, then times ``--seconds`` more in commits of ``--commit`` node-seconds, then reads the
newest ``--delta`` seconds back as a pass's delta.

Prints CPU per node-second of building the rows and inserting them, CPU of the delta read, the file size per
GPU-second, and the ratios. This measures the storage layout only: the pages, rollups and detectors that read GPU
rows would all have to read the packed form (docs/scaling.md says what that change takes).

    python benchmarks/gpu_layout.py                    # 2,048 nodes, 60 s filled, 10 s timed, 5 s read back
    python benchmarks/gpu_layout.py --nodes 512 --fill 120
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clusterdx import wire  # noqa: E402

# The writer's and the loader's helpers need Django's settings (no database is opened: the layouts are raw SQLite).
os.environ.setdefault("CLUSTERDX_DATA_DIR", tempfile.mkdtemp(prefix="cdx-layout-settings-"))
os.environ["DJANGO_SETTINGS_MODULE"] = "dashboard.settings"
import django  # noqa: E402

django.setup()
from dashboard.diagnosis.loader import _cells  # noqa: E402
from dashboard.ingest.writer import _dt, _json_text, _sqlite_datetime  # noqa: E402

JSON = ("throttle_reasons", "unavailable")
NUM = tuple(f for f in wire.field_names(wire.GpuSample)
            if f not in ("index", "ts", "uuid", "name", "pci_bus_id", *JSON))


def batches(nodes: int, seconds: int) -> list[list[dict[str, Any]]]:
    """The simulator's node-seconds, as the server's ingest decodes them (GPU samples kept as msgspec records)."""
    from collectors.sim.model import SimCluster
    from collectors.sim.scenario import parse

    start = time.time() - seconds - 2
    sim = SimCluster(parse({"cluster": {"nodes": nodes, "gpus_per_node": 8, "seed": 3}}), start)
    out = []
    for t in range(seconds):
        out.append([wire.parse_batch(msgspec.json.encode(b), keep_records=True) for b in sim.tick(start + t + 1)])
        if (t + 1) % 20 == 0:
            print(f"    {t + 1}/{seconds} s of batches built", flush=True)
    return out


def _stamp(ts: float) -> str:
    return _sqlite_datetime(_dt(ts))


def _stamped(stamps: dict[float, str], ts: float) -> str:
    """The sample time's column text, once per distinct time (the writer converts each sample time once, too)."""
    text = stamps.get(ts)
    if text is None:
        text = stamps[ts] = _stamp(ts)
    return text


class Rows:
    """Today's layout: one row per GPU and second."""

    name = "a row per GPU (today)"
    ddl = [f"CREATE TABLE g (id INTEGER PRIMARY KEY AUTOINCREMENT, cluster_id INTEGER, node_id INTEGER, "
           f"gpu_index INTEGER, ts TEXT, {', '.join(f'{c} REAL' for c in NUM)}, {', '.join(f'{c} TEXT' for c in JSON)})",
           "CREATE INDEX g_cluster_ts ON g (cluster_id, ts)", "CREATE INDEX g_node_ts ON g (node_id, ts)"]
    cols = ["cluster_id", "node_id", "gpu_index", "ts", *NUM, *JSON]
    get = wire.Fields("index", "ts", *NUM, *JSON)

    def rows(self, node: int, batch: dict[str, Any], stamps: dict[float, str]) -> list[list[Any]]:
        gpus = batch["gpus"]
        out = [[1, node, *r] for r in map(self.get.of(gpus), gpus)]
        for row in out:
            row[3] = _stamped(stamps, row[3])
            row[-2], row[-1] = _json_text(row[-2]), _json_text(row[-1])
        return out

    def read(self, db: sqlite3.Connection, since: str) -> np.ndarray:
        sel = ", ".join(["id", "node_id", "gpu_index", "(julianday(ts) - 2440587.5) * 86400.0", *NUM, *JSON])
        rows = db.execute(f"SELECT {sel} FROM g WHERE cluster_id = 1 AND ts >= ?", [since]).fetchall()
        return _cells(rows, 4 + len(NUM) + len(JSON))[:, :4 + len(NUM)].astype(float)


class Packed:
    """One row per node and second: the GPUs' numbers as a float64 matrix (GPU index first), JSON as one list;
    ``level`` > 0: the matrix zlib-compressed (a node's GPUs repeat their limits, clocks and zero counters, which
    SQLite's own record format stores in a byte or none, and a raw float64 matrix in eight)."""

    ddl = ["CREATE TABLE g (id INTEGER PRIMARY KEY AUTOINCREMENT, cluster_id INTEGER, node_id INTEGER, "
           "ts TEXT, gpus INTEGER, values_f64 BLOB, json TEXT)",
           "CREATE INDEX g_cluster_ts ON g (cluster_id, ts)", "CREATE INDEX g_node_ts ON g (node_id, ts)"]
    cols = ["cluster_id", "node_id", "ts", "gpus", "values_f64", "json"]
    get = wire.Fields("index", *NUM)
    get_json = wire.Fields(*JSON)

    def __init__(self, level: int = 0) -> None:
        self.level = level
        self.name = f"a row per node, zlib {level}" if level else "a row per node (packed)"

    def rows(self, node: int, batch: dict[str, Any], stamps: dict[float, str]) -> list[list[Any]]:
        gpus = batch["gpus"]
        if not gpus:
            return []
        ts = gpus[0].ts  # a node's GPUs share their sample time (the agent reads them in one pass;
        # where they did not, the values read back would differ and the comparison at the end says so)
        mat = np.array(list(map(self.get.of(gpus), gpus)), dtype=object).astype(float)  # None -> NaN
        extra = list(map(self.get_json.of(gpus), gpus))
        blob = zlib.compress(mat.tobytes(), self.level) if self.level else mat.tobytes()
        return [[1, node, _stamped(stamps, ts), len(gpus), blob,
                 _json_text(extra)]]

    def read(self, db: sqlite3.Connection, since: str) -> np.ndarray:
        rows = db.execute("SELECT id, node_id, (julianday(ts) - 2440587.5) * 86400.0, gpus, values_f64, json FROM g "
                          "WHERE cluster_id = 1 AND ts >= ?", [since]).fetchall()
        if not rows:
            return np.empty((0, 4 + len(NUM)))
        ids, nodes, times, counts, blobs, _ = zip(*rows, strict=True)
        if self.level:
            blobs = tuple(map(zlib.decompress, blobs))
        vals = np.frombuffer(b"".join(blobs), dtype=np.float64).reshape(-1, 1 + len(NUM))
        per = np.asarray(counts)
        head = np.column_stack([np.repeat(ids, per), np.repeat(nodes, per), vals[:, 0], np.repeat(times, per)])
        return np.hstack([head, vals[:, 1:]])  # the same columns as Rows.read: id, node, gpu, ts, numbers


def measure(layout: Rows | Packed, data: list[list[dict[str, Any]]],
            args: argparse.Namespace) -> tuple[dict[str, float], np.ndarray]:
    folder = Path(tempfile.mkdtemp(prefix="cdx-layout-"))
    db = sqlite3.connect(folder / "db.sqlite3", isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")  # as the server's settings
    for sql in layout.ddl:
        db.execute(sql)
    insert = f"INSERT INTO g ({', '.join(layout.cols)}) VALUES ({', '.join('?' * len(layout.cols))})"

    def store(second: list[dict[str, Any]]) -> int:
        stamps: dict[float, str] = {}
        rows: list[list[Any]] = []
        for node, batch in enumerate(second):
            rows += layout.rows(node, batch, stamps)
        step = args.commit * (len(rows) // max(1, len(second)))
        for i in range(0, len(rows), max(1, step)):
            db.execute("BEGIN")
            db.executemany(insert, rows[i:i + step])
            db.execute("COMMIT")
        return len(rows)

    print(f"==> {layout.name}: filling {args.fill} s", flush=True)
    for second in data[:args.fill]:
        store(second)
    cpu0, rows = time.process_time(), 0
    for second in data[args.fill:]:
        rows += store(second)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the write-ahead log's copy into the file is the writer's cost
    write = time.process_time() - cpu0
    # The newest ``delta`` simulated seconds, from the earliest sample stamped in the first of them (the simulator's
    # nodes stamp a second a little apart).
    since = _stamp(min(g.ts for b in data[-args.delta] for g in b["gpus"]))
    reads = []
    for _ in range(5):
        t0 = time.process_time()
        got = layout.read(db, since)
        reads.append(time.process_time() - t0)
    db.close()
    size = sum(f.stat().st_size for f in folder.iterdir())
    shutil.rmtree(folder)
    timed = len(data) - args.fill
    return {"write_us": write / (timed * args.nodes) * 1e6, "rows_per_node_s": rows / (timed * args.nodes),
            "read_ms": statistics.median(reads) * 1e3, "read_rows": float(len(got)),
            "bytes_per_gpu_s": size / (len(data) * args.nodes * 8)}, _ordered(got)


def _ordered(got: np.ndarray) -> np.ndarray:
    """A read's samples without their row ids (which differ by layout), in (node, GPU, time) order."""
    return got[np.lexsort((got[:, 3], got[:, 2], got[:, 1]))][:, 1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2048)
    p.add_argument("--fill", type=int, default=60, help="seconds of data already in the table")
    p.add_argument("--seconds", type=int, default=10, help="seconds of data timed")
    p.add_argument("--commit", type=int, default=256, help="node-seconds per commit (the group writer's groups)")
    p.add_argument("--delta", type=int, default=5, help="seconds a pass reads back")
    args = p.parse_args()
    print(f"==> building {args.fill + args.seconds} s of {args.nodes} nodes x 8 GPUs", flush=True)
    data = batches(args.nodes, args.fill + args.seconds)
    results: dict[str, dict[str, float]] = {}
    read: dict[str, np.ndarray] = {}
    layouts: list[Rows | Packed] = [Rows(), Packed(), Packed(level=1)]
    for layout in layouts:
        results[layout.name], read[layout.name] = measure(layout, data, args)
    print(f"\n{args.nodes} nodes x 8 GPUs, {args.seconds} s timed after {args.fill} s, commits of {args.commit} "
          f"node-seconds; pass read of the newest {args.delta} s")
    for name, r in results.items():
        print(f"  {name:>24}: write {r['write_us']:6.1f} us CPU per node-second ({r['rows_per_node_s']:.0f} rows), "
              f"read {r['read_ms']:6.1f} ms CPU for {r['read_rows']:.0f} GPU samples, "
              f"{r['bytes_per_gpu_s']:.0f} bytes per GPU-second")
    old = results[layouts[0].name]
    for layout in layouts[1:]:
        new = results[layout.name]
        same = np.array_equal(read[layouts[0].name], read[layout.name], equal_nan=True)  # every value, in place
        print(f"  {layout.name} / today: write {new['write_us'] / old['write_us']:.2f}, read "
              f"{new['read_ms'] / old['read_ms']:.2f}, size {new['bytes_per_gpu_s'] / old['bytes_per_gpu_s']:.2f}; "
              f"the same values read back: {same}")


if __name__ == "__main__":
    main()
