"""What a columnar node-second would cost the server to decode, check and store, against today's records.

Today a node-second is ~35 JSON records (8 GPU samples of 37 fields, 8 training steps, ~9 probes, 8 rank beats, a
host and a port sample), and the server makes a Python object of every value: msgspec decodes them into the wire's
records, the writer builds ~27 rows and SQLite binds each cell. That is the floor the profiles keep finding
(docs/scaling.md): cutting the parser (Arrow's JSON reader) or one post's GPUs into a block buys nothing, because
the cost is per value, per post.

The alternative measured here is wire version 2 (``clusterdx.blocks``, the agent's encoder): the GPU, step, probe
and beat numbers of a post as base64 float64 matrices (one per kind, a row per record; null is NaN) beside the few
strings and JSON values they carry, and the host and port samples as today's records. The server decodes each
post's envelope with msgspec and its blocks with ``dashboard.ingest.blocks`` (the server's own decoder), then
checks a whole group of posts at once: one matrix per kind for the group, column by column against the wire's own
ranges (``clusterdx.wire``: bounds, integers, which fields may be null) and stored as one zlib-compressed row per post and
kind, under the same two indexes as today's series tables; host and port rows as today. The idempotency ledger
row and the body's SHA-256 are kept, as the server does.

Both paths take the same simulator batches (gzip-compressed bodies), ``--fill`` seconds stored before ``--seconds``
are timed, in groups of ``--group`` posts: today's through the server's own ``wire.parse_batch`` and
``writer.store_group`` on a migrated SQLite database, the columnar one with raw sqlite3. Prints CPU per
node-second of each and the ratio, and reads the columnar rows back to check they hold exactly the numbers sent.
HTTP, the live publisher and the diagnosis pass are not in either number (the ingest benchmark measures those).

    python benchmarks/columnar.py                     # 512 nodes, 20 s filled, 10 s timed
    python benchmarks/columnar.py --nodes 2048 --fill 10 --seconds 5
"""

from __future__ import annotations

import argparse
import base64
import gc
import gzip
import hashlib
import json
import os
import resource
import sqlite3
import sys
import tempfile
import time
import typing
import zlib
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Before anything of dashboard is imported (importing it reads the settings): today's side stores into a fresh
# database of its own, never into the server's.
os.environ["CLUSTERDX_DATA_DIR"] = tempfile.mkdtemp(prefix="cdx-columnar-")
os.environ["DJANGO_SETTINGS_MODULE"] = "dashboard.settings"

from clusterdx import blocks, wire  # noqa: E402
from clusterdx.wire_compiled import struct  # noqa: E402
from dashboard.ingest import blocks as server_blocks  # noqa: E402

COLS = {kind: blocks.LAYOUTS[kind].numbers for kind in blocks.BLOCKED}
# The post's envelope: the blocks as JSON values, for the server's own block decoder (dashboard.ingest.blocks).
ColumnarBatch = msgspec.defstruct("ColumnarBatch", [
    ("v", typing.Literal[2]), ("agent_id", str), ("seq", int), ("host", str), ("sent_at", float),
    ("topology", struct(wire.Topology) | None, None), ("hosts", list[struct(wire.HostSample)], []),
    ("ports", list[struct(wire.PortSample)], []), ("events", list[struct(wire.Event)], []),
    ("runs", list[struct(wire.RunMeta)], []), ("gpus", dict[str, Any]), ("steps", dict[str, Any]),
    ("probes", dict[str, Any]), ("beats", dict[str, Any])], kw_only=True, forbid_unknown_fields=True)
_decode = msgspec.json.Decoder(ColumnarBatch).decode
_encode = msgspec.json.Encoder().encode
FRAMES = {"gpus": "gpuframe", "steps": "stepframe", "probes": "probeframe"}  # beats go to the live state only
HOST, PORT = wire.field_names(wire.HostSample), wire.field_names(wire.PortSample)


class Columnar:
    def __init__(self, path: str) -> None:
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=wal")
        self.db.execute("PRAGMA synchronous=normal")  # the embedded server's settings (dashboard.storage.sqlite)
        for table in FRAMES.values():
            self.db.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, cluster_id INT, node_id INT, ts REAL, "
                            "n INT, num BLOB, obj TEXT)")
            self.db.execute(f"CREATE INDEX {table}_c ON {table} (cluster_id, ts)")
            self.db.execute(f"CREATE INDEX {table}_n ON {table} (node_id, ts)")
        for table, cols in (("host", HOST), ("port", PORT)):
            self.db.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, cluster_id, node_id, {', '.join(cols)})")
            self.db.execute(f"CREATE INDEX {table}_n ON {table} (node_id, ts)")
        self.db.execute("CREATE TABLE batch (id INTEGER PRIMARY KEY, cluster_id, agent_id, seq, host, received_at, "
                        "sent_at, digest, UNIQUE (cluster_id, agent_id, seq))")
        self.nodes: dict[str, int] = {}

    def store(self, posts: list[bytes]) -> None:
        bodies = [zlib.decompress(p, 31) for p in posts]
        batches = [_decode(b) for b in bodies]
        digests = [hashlib.sha256(b).hexdigest() for b in bodies]
        decoded = {kind: [server_blocks.decode_block(kind, getattr(b, kind), fast=True) for b in batches] for kind in COLS}
        # The whole group's numbers checked at once, per kind (a refusal would send the group post by post).
        server_blocks.check([blk for kind_blocks in decoded.values() for blk in kind_blocks])
        raw = {kind: [blk.mat.tobytes() for blk in decoded[kind]] for kind in FRAMES}
        ids = [self.nodes.setdefault(b.host, len(self.nodes) + 1) for b in batches]
        now = time.time()
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        db.executemany("INSERT INTO batch (cluster_id, agent_id, seq, host, received_at, sent_at, digest) "
                       "VALUES (1, ?, ?, ?, ?, ?, ?)",
                       [(b.agent_id, b.seq, b.host, now, b.sent_at, d) for b, d in zip(batches, digests, strict=True)])
        for kind, table in FRAMES.items():
            at = [c.name for c in COLS[kind]].index("ts")
            width = len(COLS[kind])
            db.executemany(f"INSERT INTO {table} (cluster_id, node_id, ts, n, num, obj) VALUES (1, ?, ?, ?, ?, ?)",
                           [(i, float(np.frombuffer(r, dtype=np.float64, count=1, offset=8 * at)[0]),
                             len(r) // 8 // width, zlib.compress(r, 1), _encode(blk.cols))
                            for i, r, blk in zip(ids, raw[kind], decoded[kind], strict=True) if r])
        for table, cols, get in (("host", HOST, lambda b: b.hosts), ("port", PORT, lambda b: b.ports)):
            db.executemany(f"INSERT INTO {table} (cluster_id, node_id, {', '.join(cols)}) "
                           f"VALUES (1, ?, {', '.join('?' * len(cols))})",
                           [(i, *[_encode(v) if isinstance(v, (list, dict, msgspec.Struct)) else v
                                  for v in msgspec.structs.astuple(r)])
                            for i, b in zip(ids, batches, strict=True) for r in get(b)])
        db.execute("COMMIT")

    def read_back(self, kind: str) -> np.ndarray:
        rows = self.db.execute(f"SELECT num FROM {FRAMES[kind]} ORDER BY id").fetchall()
        return np.frombuffer(b"".join(zlib.decompress(r[0]) for r in rows), dtype=np.float64) \
            .reshape(-1, len(COLS[kind]))


def simulate(nodes: int, seconds: int) -> list[list[dict[str, Any]]]:
    from collectors.sim.model import SimCluster
    from collectors.sim.scenario import parse

    start = time.time() - seconds - 60
    sim = SimCluster(parse({"cluster": {"nodes": nodes, "gpus_per_node": 8, "seed": 3}}), start)
    seq: dict[str, int] = {}
    out = []
    for t in range(seconds):
        tick = []
        for b in sim.tick(start + t):
            seq[b["host"]] = seq.get(b["host"], 0) + 1
            tick.append({**b, "seq": seq[b["host"]]})
        out.append(tick)
    return out


def _gz(obj: Any) -> bytes:
    return gzip.compress(json.dumps(obj, separators=(",", ":")).encode(), 1)


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_today(plan: list[list[bytes]], fill: int, group: int) -> float:
    """CPU per node-second of the server's own decode and group commit (a fresh migrated SQLite database)."""
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from dashboard.ingest.writer import store_group
    from dashboard.telemetry.models import Cluster

    cluster = Cluster.objects.create(name="bench-columnar")
    used, n = 0.0, 0
    for t, posts in enumerate(plan):
        for i in range(0, len(posts), group):
            a = cpu()
            jobs = []
            for p in posts[i:i + group]:
                body = zlib.decompress(p, 31)
                batch = wire.parse_batch(body, keep_records=True)
                jobs.append((cluster, batch, hashlib.sha256(body).hexdigest()))  # as views.check_body
            outcomes = store_group(jobs)
            if t >= fill:
                used += cpu() - a
                n += len(jobs)
            bad = [o for o in outcomes if isinstance(o, Exception)]
            if bad:
                raise RuntimeError(f"today's writer refused a batch: {bad[0]!r}")
        if (t + 1) % 10 == 0:
            print(f"    today: {t + 1} of {len(plan)} s stored", flush=True)
    return used / n


def run_columnar(plan: list[list[bytes]], fill: int, group: int, sent: dict[str, list[np.ndarray]]) -> tuple[float, bool]:
    store = Columnar(os.path.join(tempfile.mkdtemp(prefix="cdx-columnar-"), "columnar.sqlite3"))
    used, n = 0.0, 0
    for t, posts in enumerate(plan):
        for i in range(0, len(posts), group):
            a = cpu()
            store.store(posts[i:i + group])
            if t >= fill:
                used += cpu() - a
                n += len(posts[i:i + group])
    same = all(np.array_equal(store.read_back(k), np.concatenate(sent[k]), equal_nan=True) for k in FRAMES)
    return used / n, same


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=512)
    p.add_argument("--fill", type=int, default=20, help="seconds stored before the timed ones")
    p.add_argument("--seconds", type=int, default=10, help="seconds timed")
    p.add_argument("--group", type=int, default=256, help="posts per transaction (a group commit)")
    args = p.parse_args()
    print(f"==> simulating {args.nodes} nodes x 8 GPUs for {args.fill + args.seconds} s", flush=True)
    batches = simulate(args.nodes, args.fill + args.seconds)
    today = [[_gz(b) for b in tick] for tick in batches]
    columnar, sent = [], {k: [] for k in FRAMES}
    for tick in batches:
        bodies = []
        for b in tick:
            body = blocks.encode_batch(b)
            bodies.append(_gz(body))
            for k in FRAMES:
                sent[k].append(np.frombuffer(base64.b64decode(body[k]["num"]), dtype=np.float64)
                               .reshape(-1, len(COLS[k])))
        columnar.append(bodies)
    per = {k: sum(len(b[k]) for b in batches[-1]) / len(batches[-1]) for k in ("gpus", "steps", "probes", "beats")}
    print(f"    a node-second: {per['gpus']:.0f} GPUs, {per['steps']:.0f} steps, {per['probes']:.0f} probes, "
          f"{per['beats']:.0f} beats; gzip mean {np.mean([len(x) for x in today[-1]]):.0f} B today, "
          f"{np.mean([len(x) for x in columnar[-1]]):.0f} B columnar", flush=True)
    # The server's collector settings for both (dashboard.ingest.asgi._tune_gc: a fifth of its CPU at 256 nodes).
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)
    print("==> columnar: decode, check and store", flush=True)
    col, same = run_columnar(columnar, args.fill, args.group, sent)
    print("==> today: wire.parse_batch and writer.store_group", flush=True)
    now = run_today(today, args.fill, args.group)
    print(f"today:    {now * 1e6:7.0f} us of CPU per node-second (decode, checks, group commit)")
    print(f"columnar: {col * 1e6:7.0f} us of CPU per node-second ({col / now:.2f} of today's); "
          f"the same values read back: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
