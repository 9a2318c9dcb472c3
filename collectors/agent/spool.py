"""The on-disk spool: every batch is written here before it is sent and deleted once the server has it.

One SQLite file holds the unsent batches (already gzip-compressed, so a replay costs no CPU to re-encode), the
next sequence number and the drop counts not yet reported. Writing before sending is what makes ``kill -9`` lose
at most the interval being measured: a batch is either in the spool or acknowledged by the server.

The bound (batches and bytes) drops the *oldest* batches first, counts them, and the count rides in the next
batch's ``dropped`` as ``spool_overflow``, so the server knows about the gap. The counter lives in the same
transaction as the batch that reports it: a crash can neither lose nor double the report.
"""

from __future__ import annotations

import gzip
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS batch (seq INTEGER PRIMARY KEY, body BLOB NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
MAX_DROP_KEYS = 16  # the wire's bound on Batch.dropped


@dataclass(frozen=True)
class Spooled:
    seq: int
    body: bytes  # gzip-compressed JSON


class Spool:
    def __init__(self, path: str | Path, *, max_batches: int = 86_400, max_bytes: int = 512 << 20) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        # One connection shared by the sampling loop and the sender thread, serialised by the lock.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL: a committed batch survives the process being killed; only a power cut may lose the last ones.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._count, self._bytes = self._db.execute("SELECT count(*), coalesce(sum(length(body)), 0) FROM batch")\
            .fetchone()

    # -- meta ----------------------------------------------------------------------------------------------------

    def _meta(self, key: str, default: str) -> str:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def _set_meta(self, key: str, value: str) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def _next_seq(self) -> int:
        row = self._db.execute("SELECT value FROM meta WHERE key = 'next_seq'").fetchone()
        if row:
            return int(row[0])
        # A new spool starts at the current 100-ms tick rather than 0: if a node's spool file is lost (a reimage),
        # the new numbers still lie above every number this agent_id used before, which the server has seen.
        return int(time.time() * 10)

    @property
    def depth(self) -> int:
        return self._count

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def pending_drops(self) -> dict[str, int]:
        with self._lock:
            return json.loads(self._meta("drops", "{}"))

    # -- writing -------------------------------------------------------------------------------------------------

    def note_drop(self, reason: str, n: int = 1) -> None:
        """Count records lost for ``reason``; reported in the next batch put into the spool."""
        with self._lock, self._db:
            self._add_drops({reason: n})

    def _add_drops(self, more: dict[str, int]) -> None:
        drops = json.loads(self._meta("drops", "{}"))
        for reason, n in more.items():
            if reason not in drops and len(drops) >= MAX_DROP_KEYS - 1:
                reason = "other"
            drops[reason] = drops.get(reason, 0) + n
        self._set_meta("drops", json.dumps(drops))

    def put(self, batch: dict[str, Any], dropped: dict[str, int] | None = None) -> int:
        """Number the batch, attach the unreported drops plus ``dropped``, store it; returns its seq."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                seq = self._put(batch, dropped or {})
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return seq

    def _put(self, batch: dict[str, Any], dropped: dict[str, int]) -> int:
        seq = self._next_seq()
        drops = json.loads(self._meta("drops", "{}"))
        for reason, n in dropped.items():
            drops[reason] = drops.get(reason, 0) + n
        if drops:
            batch = {**batch, "dropped": _bounded(drops)}
        body = gzip.compress(json.dumps({**batch, "seq": seq}, separators=(",", ":")).encode(), compresslevel=6)
        self._db.execute("INSERT INTO batch (seq, body, created) VALUES (?, ?, ?)", (seq, body, time.time()))
        self._set_meta("next_seq", str(seq + 1))
        self._set_meta("drops", "{}")
        self._count += 1
        self._bytes += len(body)
        self._evict()
        return seq

    def _evict(self) -> None:
        """Drop the oldest batches beyond the bound; the count is reported in the next batch."""
        evicted = 0
        while self._count > 1 and (self._count > self.max_batches or self._bytes > self.max_bytes):
            seq, size = self._db.execute("SELECT seq, length(body) FROM batch ORDER BY seq LIMIT 1").fetchone()
            self._db.execute("DELETE FROM batch WHERE seq = ?", (seq,))
            self._count -= 1
            self._bytes -= size
            evicted += 1
        if evicted:
            self._add_drops({"spool_overflow": evicted})

    # -- reading -------------------------------------------------------------------------------------------------

    def oldest(self) -> Spooled | None:
        with self._lock:
            row = self._db.execute("SELECT seq, body FROM batch ORDER BY seq LIMIT 1").fetchone()
        return Spooled(row[0], row[1]) if row else None

    def delete(self, seq: int) -> None:
        with self._lock, self._db:
            cur = self._db.execute("DELETE FROM batch WHERE seq = ? RETURNING length(body)", (seq,))
            row = cur.fetchone()
            if row:
                self._count -= 1
                self._bytes -= row[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _bounded(drops: dict[str, int]) -> dict[str, int]:
    if len(drops) <= MAX_DROP_KEYS:
        return drops
    keep = dict(sorted(drops.items(), key=lambda kv: -kv[1])[: MAX_DROP_KEYS - 1])
    keep["other"] = sum(drops.values()) - sum(keep.values())
    return keep
