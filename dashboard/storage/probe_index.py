"""The inbound probe index: which probe frames hold probes *to* a host, per minute (telemetry.ProbeInbound).

A probe frame is kept by its sender (dashboard.storage.frames), so "the probes node-17 was sent" would otherwise be a
search of every frame of the cluster in the range for its name: at 2,048 nodes an hour is millions of frames. Rows
per probe keyed by peer were the dearest thing ingest wrote (a leaf of the peer index dirtied per probe), so ingest
writes nothing for it; this pass builds it from the frames' ``peers`` column, a few seconds behind:

* It reads the frames written since its last pass by id (the primary key: no other index), and on PostgreSQL a
  margin below (``ID_MARGIN``): a transaction there may commit after higher ids were read, and its frames are in the
  margin next time (SQLite's ids commit in order). A late frame (an agent replaying its spool) is just a new id:
  its old minute's row gets it.
* Each (cluster, peer, minute) row holds the ascending ids of its frames; a pass merges what it read into the
  rows it touches (a union: reading a frame twice changes nothing).

Readers ask :func:`frames_to` for the frames of a host's range: the listed ones, and the id past which frames are
not indexed yet, to search by name (the last seconds: a range of the primary key).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import lz4.block
import numpy as np
from django.db import connection, transaction
from django.db.models import Max

from dashboard.telemetry.models import ProbeFrame, ProbeInbound, ProbeIndexState
from dashboard.turns import yield_to_urgent

MINUTE = 60
ID_MARGIN = 20_000  # frame ids below the last pass's newest read again (at 2,048 nodes, ~20 s of frames)
CHUNK = 50_000  # frames read per statement
WRITE = 2_000  # index rows written per statement
TURN = 2_000  # frames read, or index rows merged, between two yields to a diagnosis pass (dashboard.turns)
LOCK_KEY = 0x636478_5049  # "cdx" "PI": one pass at a time across workers (PostgreSQL advisory lock)


def pack(ids: np.ndarray) -> bytes:
    """Ascending ids as LZ4 over their differences: neighbouring frames have near ids, a few bytes each."""
    return lz4.block.compress(np.diff(ids, prepend=0).astype("<i8").tobytes(), store_size=True)


def unpack(data: bytes | memoryview) -> np.ndarray:
    return np.cumsum(np.frombuffer(lz4.block.decompress(data), dtype="<i8"))


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


@contextmanager
def _exclusive() -> Iterator[None]:
    if connection.vendor != "postgresql":  # the embedded scheduler runs one job at a time
        yield
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_lock(%s)", [LOCK_KEY])
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [LOCK_KEY])


# (database) -> (the seen id this process's last pass left, the ids it indexed within the margin below it)
_indexed: dict[tuple[str, str], tuple[int, np.ndarray]] = {}
LATE = 1_000  # margin ids read by id per statement


def update() -> int:
    """One pass: every frame written since the last (and :func:`margin` ids below) into the index. Returns the
    index rows written.

    The margin's frames this process indexed in its last pass are not read again: only the margin's ids are, and
    the rows of the ids among them it has not indexed (those that committed late). Reading the whole margin every
    pass was ~70 % of this pass's work at 2,048 nodes (20,000 frames again for ~7,700 new ones every 15 s), in a
    worker whose every CPU second a diagnosis pass shares. Another process's pass, or a reset index, moves the seen
    id past what this process knows, and the whole margin is read again (merging is a union: twice is harmless)."""
    with _exclusive():
        state, _ = ProbeIndexState.objects.get_or_create(pk=1)
        top = ProbeFrame.objects.aggregate(m=Max("id"))["m"]
        if top is None:
            return 0
        written = 0
        start = max(0, state.seen_id - margin())
        db = (connection.alias, str(connection.settings_dict["NAME"]))
        last = _indexed.get(db)
        read: list[np.ndarray] = []
        if last is not None and last[0] == state.seen_id and start < state.seen_id:
            in_margin = _ids(start, state.seen_id)
            late = np.setdiff1d(in_margin, last[1])
            for i in range(0, len(late), LATE):
                found, ids = _read_ids(late[i:i + LATE])
                written += _merge(found)
                read.append(ids)
            read.append(last[1][last[1] > start])
            start = state.seen_id
        while start < top:
            end = min(start + CHUNK, top)
            found, ids = _read(start, end)
            written += _merge(found)
            read.append(ids)
            start = end
        seen = max(state.seen_id, top)
        ProbeIndexState.objects.filter(pk=1, seen_id__lt=top).update(seen_id=top)
        done = np.concatenate(read) if read else np.empty(0, dtype=np.int64)
        _indexed[db] = (seen, np.unique(done[done > seen - margin()]))
        return written


Key = tuple[int, str, int]  # (cluster id, peer, minute number)


def _minute_sql() -> str:
    """A frame's minute number, exactly (SQLite's julianday() is off by microseconds: its text's whole seconds)."""
    if connection.vendor == "postgresql":
        return f"floor(extract(epoch from ts) / {MINUTE})::bigint"
    return f"CAST(strftime('%%s', substr(ts, 1, 19)) AS INTEGER) / {MINUTE}"  # %%: Django's cursor makes %s a parameter


def _read(after: int, through: int) -> tuple[dict[Key, list[int]], np.ndarray]:
    """(cluster, peer, minute) -> the ids of the frames with ids in (after, through] holding probes to the peer; and
    the ids read."""
    return _frames("id > %s AND id <= %s", [after, through])


def _read_ids(ids: np.ndarray) -> tuple[dict[Key, list[int]], np.ndarray]:
    """:func:`_read` of the frames with these ids."""
    return _frames(f"id IN ({', '.join(['%s'] * len(ids))})", [int(i) for i in ids])


def _ids(after: int, through: int) -> np.ndarray:
    """The ids of the frames in (after, through], ascending."""
    table = connection.ops.quote_name(ProbeFrame._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT id FROM {table} WHERE id > %s AND id <= %s", [after, through])
        return np.sort(np.fromiter((r[0] for r in cursor.fetchall()), dtype=np.int64))


def _frames(where: str, params: list[Any]) -> tuple[dict[Key, list[int]], np.ndarray]:
    out: dict[Key, list[int]] = defaultdict(list)
    ids: list[int] = []
    table = connection.ops.quote_name(ProbeFrame._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT id, cluster_id, {_minute_sql()}, peers FROM {table} WHERE {where}", params)
        for k, (frame_id, cluster_id, minute, peers) in enumerate(cursor.fetchall()):
            if not k % TURN:
                yield_to_urgent()
            ids.append(frame_id)
            for peer in peers.split():
                out[(cluster_id, peer, minute)].append(frame_id)
    return out, np.asarray(ids, dtype=np.int64)


def margin() -> int:
    """Ids below the newest seen that may still commit: SQLite has one writer, its ids commit in order."""
    return ID_MARGIN if connection.vendor == "postgresql" else 0


def _merge(found: dict[Key, list[int]]) -> int:
    """Union ``found`` into its rows, one transaction (a reader sees a minute's old ids or the merged ones)."""
    if not found:
        return 0
    by_minute: dict[tuple[int, int], list[str]] = defaultdict(list)
    for cluster_id, peer, minute in found:
        by_minute[(cluster_id, minute)].append(peer)
    with transaction.atomic():
        have: dict[Key, np.ndarray] = {}
        for (cluster_id, minute), peers in by_minute.items():
            for i in range(0, len(peers), 1000):
                for peer, data in ProbeInbound.objects.filter(cluster_id=cluster_id, ts=_dt(minute * MINUTE),
                                                              peer__in=peers[i:i + 1000]).values_list("peer", "frames"):
                    have[(cluster_id, peer, minute)] = unpack(data)
        rows: list[tuple[Any, ...]] = []
        adapt = connection.ops.adapt_datetimefield_value
        for k, (key, ids) in enumerate(found.items()):
            if not k % TURN:
                yield_to_urgent()  # inside the transaction: it writes nothing yet, and readers see the old rows
            merged = np.union1d(np.asarray(ids, dtype=np.int64), have.get(key, np.empty(0, dtype=np.int64)))
            if key in have and len(merged) == len(have[key]):
                continue  # nothing new (a margin read again)
            cluster_id, peer, minute = key
            rows.append((cluster_id, peer, adapt(_dt(minute * MINUTE)), len(merged), pack(merged)))
        for i in range(0, len(rows), WRITE):
            yield_to_urgent()
            _upsert(rows[i:i + WRITE])
    return len(rows)


def _upsert(rows: list[tuple[Any, ...]]) -> None:
    """(cluster id, peer, minute as the database takes it, n, frames) rows in one INSERT ... ON CONFLICT UPDATE. The
    ORM's bulk_create prepared every field of every row in Python: two thirds of this pass at 2,048 nodes (every
    peer's row of the minute, 2,048-4,096 a pass)."""
    q = connection.ops.quote_name
    sql = (f"INSERT INTO {q(ProbeInbound._meta.db_table)} (cluster_id, peer, ts, n, frames) VALUES "
           f"{', '.join(['(%s, %s, %s, %s, %s)'] * len(rows))} "
           "ON CONFLICT (cluster_id, peer, ts) DO UPDATE SET n = excluded.n, frames = excluded.frames")
    with connection.cursor() as cursor:
        cursor.execute(sql, [v for row in rows for v in row])


def frames_to(cluster_id: int, host: str, t0: float, t1: float) -> tuple[np.ndarray, int]:
    """(the ids of the indexed frames that hold probes to ``host`` taken in the minutes of [t0, t1], the id past which
    frames may not be indexed yet): a reader takes the listed frames, and those past that id by their ``peers``."""
    state = ProbeIndexState.objects.values_list("seen_id", flat=True).first() or 0
    first = _dt(math.floor(t0 / MINUTE) * MINUTE)
    parts = [unpack(data) for data in ProbeInbound.objects.filter(
        cluster_id=cluster_id, peer=host, ts__gte=first, ts__lte=_dt(t1)).values_list("frames", flat=True)]
    ids = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    return ids, max(0, state - margin())
