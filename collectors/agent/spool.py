"""The on-disk spool: every batch is written here before it is sent and deleted once the server has it.

One SQLite file holds the unsent batches (already gzip-compressed, so a replay costs no CPU to re-encode), the
next sequence number and the drop counts not yet reported. Writing before sending is what makes ``kill -9`` lose
at most the interval being measured: a batch is either in the spool or acknowledged by the server.

The bound (batches and bytes) drops the *oldest* batches first, counts them, and the count rides in the next
batch's ``dropped`` as ``spool_overflow``, so the server knows about the gap. A batch the disk refuses (full) is
counted the same way, as ``disk_full``, by the next batch that fits. The counter lives in the same
transaction as the batch that reports it: a crash can neither lose nor double the report.

Sequence numbers survive an OS crash, not only ``kill -9``: the transaction that numbers a batch is committed with
``synchronous=FULL`` (the WAL is fsynced), so no batch can be sent before its number is on disk, and a crash can
never hand that number to a new batch, which the server would take for a duplicate of the old one and the agent
would delete. Deleting an acknowledged batch stays ``NORMAL`` (no fsync): if a crash undoes a delete, the batch is
sent again and the server recognises it by its content digest as a duplicate; draining a backlog of a day's
batches after an outage would otherwise cost one fsync each. Should a number be reused anyway (a spool restored
from a backup or a VM snapshot), the server answers 409 ``seq_reused`` and :meth:`Spool.renumber` moves the batch
past every number the lost counter can have reached.

When the server asks for fewer posts than the agent samples (``send_interval_s``), each interval's records are
*staged* (:meth:`Spool.stage`, one row, no number yet) and the staged rows are *sealed* into numbered batches once per
send interval (:meth:`Spool.seal`, one transaction). A staged row survives ``kill -9`` like a batch does; it is only
not fsynced, as it carries no number a crash could hand out twice. Once sealed, a batch is immutable: it is resent
byte for byte until acknowledged.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import json
import logging
import os
import resource
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clusterdx import blocks, wire

log = logging.getLogger(__name__)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS batch (seq INTEGER PRIMARY KEY, body BLOB NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS staged (id INTEGER PRIMARY KEY, lists TEXT NOT NULL);
"""
Lists = dict[str, list[dict[str, Any]]]
MAX_DROP_KEYS = 16  # the wire's bound on Batch.dropped
# How far a renumbered batch jumps past the reused seq: farther than any counter can have advanced before it was
# rolled back (2**32 batches is 136 years at 1 Hz), while 2**63 leaves room for two billion such jumps.
RENUMBER_SKIP = 2**32
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_ROOM_BYTES = 1 << 20  # less free room than this when a write fails: the disk is full


@dataclass(frozen=True)
class Spooled:
    seq: int
    body: bytes  # gzip-compressed JSON


class Spool:
    def __init__(self, path: str | Path, *, max_batches: int = 86_400, max_bytes: int = 512 << 20,
                 wire_version: int = 1) -> None:
        self.path = Path(path)
        self.wire_version = wire_version
        self.as_version_1 = 0  # posts of a version 2 spool that went as version 1 (a value no block carries exactly)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        # One connection shared by the sampling loop and the sender thread, serialised by the lock.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL by default: every numbering commit is fsynced (see the module docstring); delete() relaxes it.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._count, self._bytes = self._db.execute("SELECT count(*), coalesce(sum(length(body)), 0) FROM batch")\
            .fetchone()
        self._unstored: dict[str, int] = {}  # batches the disk refused (and their drops), for the next batch stored

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
    def staged(self) -> int:
        """Intervals of records waiting to be sealed into a batch."""
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM staged").fetchone()[0])

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
        """Number the batch, attach the unreported drops plus ``dropped``, store it; returns its seq.

        A batch the spool cannot store (a full disk, an I/O error) is counted as ``disk_full`` or ``spool_error``,
        with the drops it carried, and reported by the next batch stored; the error is raised to the caller."""
        with self._lock:
            count, size = self._count, self._bytes
            try:
                self._db.execute("BEGIN IMMEDIATE")
                seq = self._put(batch, dropped or {})
                self._db.execute("COMMIT")
            except BaseException as exc:
                if self._db.in_transaction:  # SQLite already rolled back after some errors (SQLITE_FULL, IOERR)
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                self._count, self._bytes = count, size
                if isinstance(exc, sqlite3.Error | OSError):
                    # In memory: the disk that refused the batch cannot take the count either. An agent restarted
                    # before the disk frees up loses it (and says so in its log).
                    for reason, n in {self._loss_reason(exc): 1, **(dropped or {})}.items():
                        self._unstored[reason] = self._unstored.get(reason, 0) + n
                raise
            self._unstored = {}
            return seq

    def stage(self, lists: Lists, dropped: dict[str, int] | None = None) -> None:
        """Keep one interval's records until the next :meth:`seal`; its drops are counted for the next batch."""
        with self._lock:
            self._db.execute("PRAGMA synchronous=NORMAL")  # no number is handed out here: see the module docstring
            try:
                with self._db:
                    self._db.execute("INSERT INTO staged (lists) VALUES (?)",
                                     (json.dumps(lists, separators=(",", ":")),))
                    if dropped:
                        self._add_drops(dropped)
            except (sqlite3.Error, OSError) as exc:  # counted as a lost batch would be, for the next batch stored
                for reason, n in {self._loss_reason(exc): 1, **(dropped or {})}.items():
                    self._unstored[reason] = self._unstored.get(reason, 0) + n
                raise
            finally:
                self._db.execute("PRAGMA synchronous=FULL")

    def seal(self, lists: Lists, build: Callable[[Lists], list[dict[str, Any]]],
             dropped: dict[str, int] | None = None) -> list[int]:
        """Number everything staged plus ``lists`` (the interval just measured) as batches; returns their seqs.

        ``build`` turns the merged record lists (staged first, so each list stays in time order) into batch bodies
        within the wire's bounds. One transaction: a crash leaves either the staged rows or the sealed batches, never
        both nor neither. A failure is handled as :meth:`put` handles it; the staged rows then stay for the next try."""
        with self._lock:
            count, size, unstored = self._count, self._bytes, self._unstored
            try:
                self._db.execute("BEGIN IMMEDIATE")
                merged: Lists = {}
                for (raw,) in self._db.execute("SELECT lists FROM staged ORDER BY id").fetchall():
                    _extend(merged, json.loads(raw))
                _extend(merged, lists)
                seqs = []
                for i, body in enumerate(build(merged)):
                    seqs.append(self._put(body, (dropped or {}) if i == 0 else {}))
                    self._unstored = {}  # reported by the first batch only
                self._db.execute("DELETE FROM staged")
                self._db.execute("COMMIT")
            except BaseException as exc:
                if self._db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                self._count, self._bytes, self._unstored = count, size, unstored
                if isinstance(exc, sqlite3.Error | OSError):
                    for reason, n in {self._loss_reason(exc): 1, **(dropped or {})}.items():
                        self._unstored[reason] = self._unstored.get(reason, 0) + n
                raise
            self._unstored = {}
            return seqs

    def _loss_reason(self, exc: BaseException) -> str:
        if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or getattr(exc, "errno", None) in _FULL:
            return "disk_full"
        # SQLite reports a write past the file size limit (EFBIG) as a plain I/O error: look whether there was room.
        try:
            room = os.statvfs(self.path.parent)
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            largest = max((p.stat().st_size for p in (self.path, Path(f"{self.path}-wal")) if p.exists()), default=0)
        except OSError:
            return "spool_error"
        if room.f_bavail * room.f_frsize < _ROOM_BYTES or (limit != resource.RLIM_INFINITY and
                                                           largest + _ROOM_BYTES > limit):
            return "disk_full"
        return "spool_error"

    def _put(self, batch: dict[str, Any], dropped: dict[str, int]) -> int:
        seq = self._next_seq()
        drops = json.loads(self._meta("drops", "{}"))
        for reason, n in [*dropped.items(), *self._unstored.items()]:
            drops[reason] = drops.get(reason, 0) + n
        if drops:
            batch = {**batch, "dropped": _bounded(drops)}
        body = gzip.compress(self._encode({**batch, "seq": seq}), compresslevel=6)
        self._db.execute("INSERT INTO batch (seq, body, created) VALUES (?, ?, ?)", (seq, body, time.time()))
        self._set_meta("next_seq", str(seq + 1))
        self._set_meta("drops", "{}")
        self._count += 1
        self._bytes += len(body)
        self._evict()
        return seq

    def _encode(self, batch: dict[str, Any]) -> bytes:
        """The batch's JSON: as blocks under wire version 2, unless a block cannot carry one of its values exactly
        (or the blocks would not fit in a post), then as version 1, whose checks word what the server refuses."""
        if self.wire_version == 2:
            try:
                text = json.dumps(blocks.encode_batch(batch), separators=(",", ":")).encode()
                if len(text) <= wire.MAX_BATCH_BYTES:
                    return text
                why = f"{len(text)} bytes as blocks"
            except blocks.Unblockable as exc:
                why = str(exc)
            self.as_version_1 += 1
            if self.as_version_1 == 1 or self.as_version_1 % 1000 == 0:
                log.warning("batch %s sent as wire version 1 (%s); %d so far", batch.get("seq"), why[:200],
                            self.as_version_1)
        return json.dumps(batch, separators=(",", ":")).encode()

    def downgrade(self) -> int:
        """Send version 1 from now on, and rewrite every spooled version 2 batch as version 1 under its own seq (the
        server refused them, so it holds none of them): the server this agent reaches predates version 2. Returns
        how many were rewritten."""
        with self._lock:
            self.wire_version = 1
            n = grown = 0
            with self._transaction():
                for seq, old in self._db.execute("SELECT seq, body FROM batch").fetchall():
                    batch = json.loads(gzip.decompress(old))
                    if batch.get("v") != blocks.BLOCK_WIRE_VERSION:
                        continue
                    body = gzip.compress(json.dumps(blocks.decode_batch(batch), separators=(",", ":")).encode(),
                                         compresslevel=6)
                    self._db.execute("UPDATE batch SET body = ? WHERE seq = ?", (body, seq))
                    grown += len(body) - len(old)
                    n += 1
            self._bytes += grown
            return n

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction (the caller holds the lock): committed when the block ends, rolled back if it
        raises."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise

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
        with self._lock:
            # Not synced: a crash that undoes this only causes a resend the server answers as a duplicate.
            self._db.execute("PRAGMA synchronous=NORMAL")
            try:
                with self._db:
                    row = self._db.execute("DELETE FROM batch WHERE seq = ? RETURNING length(body)", (seq,)).fetchone()
            finally:
                self._db.execute("PRAGMA synchronous=FULL")
            if row:
                self._count -= 1
                self._bytes -= row[0]

    def discard(self, seq: int, reason: str) -> None:
        """Delete batch ``seq``, which the server will never accept, and count it as ``reason`` together with the
        drops it carried: those were reported only in a batch the server did not store, so the next batch reports
        them again. One transaction: a crash can neither keep the batch nor lose the count."""
        with self._lock:
            with self._transaction():
                row = self._db.execute("DELETE FROM batch WHERE seq = ? RETURNING body", (seq,)).fetchone()
                if row:
                    more = _carried_drops(row[0])
                    more[reason] = more.get(reason, 0) + 1
                    self._add_drops(more)
            if row:
                self._count -= 1
                self._bytes -= len(row[0])

    def renumber(self, seq: int) -> int | None:
        """Give spooled batch ``seq`` a number the server has never seen, after it answered that ``seq`` is stored
        with other content (409 ``seq_reused``): this spool's counter went back. Returns the new seq (None if the
        batch is gone).

        The new number lies ``RENUMBER_SKIP`` past the reused one, so past every number the lost counter can have
        handed out after it, and the counter continues from there. Batches numbered in the same lost stretch follow
        one after the other (``max`` with the counter) instead of each jumping again."""
        with self._lock, self._transaction():
            return self._renumber(seq)

    def _renumber(self, seq: int) -> int | None:
        row = self._db.execute("SELECT body FROM batch WHERE seq = ?", (seq,)).fetchone()
        if row is None:
            return None
        new = max(self._next_seq(), seq + RENUMBER_SKIP)
        body = gzip.compress(json.dumps({**json.loads(gzip.decompress(row[0])), "seq": new},
                                        separators=(",", ":")).encode(), compresslevel=6)
        self._db.execute("UPDATE batch SET seq = ?, body = ? WHERE seq = ?", (new, body, seq))
        self._set_meta("next_seq", str(new + 1))
        self._bytes += len(body) - len(row[0])
        return new

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _extend(into: Lists, more: Lists) -> None:
    for name, items in more.items():
        into.setdefault(name, []).extend(items)


def _carried_drops(body: bytes) -> dict[str, int]:
    try:
        dropped = json.loads(gzip.decompress(body)).get("dropped") or {}
    except (OSError, EOFError, ValueError, AttributeError):  # a body this spool did not write: nothing to carry
        return {}
    return {k: v for k, v in dropped.items() if isinstance(k, str) and type(v) is int and v > 0}


def _bounded(drops: dict[str, int]) -> dict[str, int]:
    if len(drops) <= MAX_DROP_KEYS:
        return drops
    keep = dict(sorted(drops.items(), key=lambda kv: -kv[1])[: MAX_DROP_KEYS - 1])
    keep["other"] = sum(drops.values()) - sum(keep.values())
    return keep
