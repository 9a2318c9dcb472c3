"""Rows a pass process keeps from one diagnosis pass to the next, so a pass reads only what ingest wrote since.

At 2,048 nodes the window holds ~340,000 GPU rows, ~310,000 step rows and ~260,000 probe rows; turning them into
Python tuples and floats was most of a 5-15 s pass. The pass runs every few seconds and its window moves by that
much, so a series here keeps its rows (numeric matrix, decoded object columns) and asks the database only for rows
with a higher id than the highest it holds, then drops what fell out of the window. The window a pass sees is the
same set of rows a full read would return.

Why ids and not timestamps: agents replay spooled batches after an outage, with old sample times. Ids follow the
order rows were written in, whatever their ``ts``:

* SQLite has one writer at a time and ids grow (``AUTOINCREMENT``) in commit order: once a pass has seen id N, every
  row that commits later has an id above N. ``id > N`` is exact.
* PostgreSQL takes ids from a sequence when a row is inserted, and concurrent transactions (several web workers,
  each with its group commit) commit in another order: a row below N may commit after the pass saw N. Each gap in
  the ids a pass holds (below its highest) is kept as a "hole" for ``HOLE_TTL_S`` and read again by every pass
  until it fills or expires; a transaction open longer than that is the only thing missed. Most holes are other
  clusters' rows (ids are global) and never fill: past ``MAX_HOLES`` neighbours are merged, and rows read twice
  through a merged hole are dropped by id.

Every delta read also asks for the held highest row itself (``id = top``, whatever its ``ts``): when that row is
gone (the database was emptied, another test's rows reused its ids) the series is read afresh. A bound that moves
back (``now`` earlier than the last pass's, a run's last step lower) also means a fresh read: rows the series dropped
would belong to the window again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from django.db import connection

HOLE_TTL_S = 60.0  # a PostgreSQL transaction that commits later than this after its rows took their ids is missed
MAX_HOLES = 64
ID_MAX = 2**62
MAX_SERIES = 256  # per process; a series not read for a while is the first to go
IDLE_S = 600.0  # a series not read for this long (an ended run's steps) is dropped

# (condition, its params, whether this is a fresh read) -> (ids, numeric matrix, object columns)
Reader = Callable[[str, list[Any], bool], tuple[np.ndarray, np.ndarray, list[np.ndarray]]]


@dataclass
class Series:
    """One series' held rows: ``mat`` (numeric columns, one row per column, as the loader reads them) with ``ids``
    and the object columns ``objs``; every row has ``mat[at] >= bound`` (``> bound`` when ``strict``).

    The rows live in buffers with room to grow, ``[lo, hi)`` in use: a pass appends its delta after ``hi`` and drops
    the rows that left the window by moving ``lo`` (they arrive about in time order, so the oldest are first), so it
    copies only its delta, not the whole window (~70 MB of GPU rows at 2,048 nodes)."""

    at: int
    strict: bool
    bound: float = -np.inf
    top: int = -1  # highest id held, -1: nothing read yet
    holes: list[tuple[int, int, float]] = field(default_factory=list)  # (lo, hi, since): ids lo..hi unseen
    used: float = 0.0
    lo: int = 0
    hi: int = 0
    _ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    _mat: np.ndarray | None = None
    _objs: list[np.ndarray] = field(default_factory=list)

    @property
    def ids(self) -> np.ndarray:
        return _frozen(self._ids[self.lo:self.hi])

    @property
    def mat(self) -> np.ndarray:
        return _frozen(self._mat[:, self.lo:self.hi]) if self._mat is not None else np.empty((0, 0))

    @property
    def objs(self) -> list[np.ndarray]:
        return [_frozen(o[self.lo:self.hi]) for o in self._objs]

    def delta(self, bound_sql: str, bound_params: list[Any]) -> tuple[str, list[Any]]:
        """The SQL condition for the rows this series lacks: those in the window (``bound_sql``) above the top or
        in a hole, and the top row itself (the proof that the held rows are still the database's)."""
        if self.top < 0:
            return bound_sql, bound_params
        # A closed range, not ``id >= top``: without statistics (a new day's partition, autovacuum off) PostgreSQL
        # guesses a third of the table for an open one and scans it all; a closed one it guesses small.
        parts, params = ["id BETWEEN %s AND %s"], [self.top, ID_MAX]
        for lo, hi, _ in self.holes:
            parts.append("id BETWEEN %s AND %s")
            params += [lo, hi]
        return f"({' OR '.join(parts)}) AND ({bound_sql} OR id = %s)", [*params, *bound_params, self.top]

    def merge(self, ids: np.ndarray, mat: np.ndarray, objs: list[np.ndarray], bound: float) -> bool:
        """Add a delta read's rows and drop those out of the window; False when the held rows are stale (the held
        top row was not read back: read the series afresh)."""
        if self.top >= 0 and not (ids == self.top).any():
            return False
        seen = ids  # every id read counts for the top and the holes, whether its rows are in the window or not
        new = ids != self.top  # held, or out of the window by now
        if self.holes and self.top >= 0:
            # A merged hole reads rows held already, all below the old top: only those ids are looked up, and only
            # among the held ids from the lowest of them on (holes are recent, so a short tail of the window).
            below = np.flatnonzero(ids < self.top)
            if len(below):
                held_ids = self.ids
                held_ids = held_ids[held_ids >= ids[below].min()]
                new[below[np.isin(ids[below], held_ids)]] = False
        # Rows before the bound: a frame is read whole (dashboard.storage.frames), and may hold older samples.
        new &= mat[self.at] > bound if self.strict else mat[self.at] >= bound
        if not new.all():
            ids, mat, objs = ids[new], _columns(mat, new), [o[new] for o in objs]
        if self._mat is None:
            self._mat, self._objs = np.empty((mat.shape[0], 0)), [np.empty(0, dtype=object) for _ in objs]
        before = self.top
        self._drop_older(bound)
        if len(ids):
            if self.hi + len(ids) > self._ids.shape[0]:
                if self.hi - self.lo + len(ids) <= self._ids.shape[0] * 3 // 4:
                    self._shift()  # room enough at the front, where the rows that left were
                else:
                    self._move(None, len(ids))
            self._ids[self.hi:self.hi + len(ids)] = ids
            _copy(self._mat, self.hi, mat)
            for buf, col in zip(self._objs, objs, strict=True):
                buf[self.hi:self.hi + len(ids)] = col
            self.hi += len(ids)
        if len(seen):
            self.top = max(self.top, int(seen.max()))
        self.bound = bound
        if connection.vendor == "postgresql":
            self._holes(before, seen)
        return True

    def _drop_older(self, bound: float) -> None:
        """Drop the held rows that left the window. Rows are held in the order they were written, and a post holds
        its node's last few seconds (4 s at 2,048 nodes): the rows that leave are mixed with rows that stay, over
        the front of the buffer only, up to the last row that leaves. That band is compacted in place, kept rows in
        their order, and ``lo`` moves past it; the rows behind it are not touched. Copying the whole window into
        new buffers at every pass instead (~80 MB at 2,048 nodes) was a fifth of the pass process's CPU."""
        held = self._mat[self.at, self.lo:self.hi]
        leave = held <= bound if self.strict else held < bound
        out = np.flatnonzero(leave)
        if not len(out):
            return
        end = int(out[-1]) + 1  # the band: rows [lo, lo + end) hold every row that leaves
        stay = self.lo + np.flatnonzero(~leave[:end])
        start = self.lo + end - len(stay)
        if len(stay):  # gathered first (a copy), then written over the band's tail: the order is kept
            self._ids[start:self.lo + end] = self._ids[stay]
            self._mat[:, start:self.lo + end] = self._mat[:, stay]
            for buf in self._objs:
                buf[start:self.lo + end] = buf[stay]
        for buf in self._objs:  # the objects of the rows left behind are not kept alive by the buffer
            buf[self.lo:start] = None
        self.lo = start

    def _shift(self) -> None:
        """Move the held rows to the buffers' start, in place: the window's rows leave at the front as new ones
        come at the back, and new buffers (twice the window, ~200 MB of GPU rows at 2,048 nodes) every few passes
        cost more than the copy, in fresh pages. Chunks no longer than the gap never overlap what they copy over,
        so numpy needs no temporary copy of the window either."""
        n, gap = self.hi - self.lo, self.lo
        for a in range(0, n, gap):
            b = min(n, a + gap)
            self._ids[a:b] = self._ids[gap + a:gap + b]
            self._mat[:, a:b] = self._mat[:, gap + a:gap + b]
            for buf in self._objs:
                buf[a:b] = buf[gap + a:gap + b]
        for buf in self._objs:
            buf[n:self.hi] = None
        self.lo, self.hi = 0, n

    def _move(self, keep: np.ndarray | None, room: int) -> None:
        """Copy the held rows (those in ``keep``, all when None) to new buffers with room for ``room`` more and as
        much again."""
        ids = self._ids[self.lo:self.hi] if keep is None else self._ids[self.lo:self.hi][keep]
        cap = 2 * (len(ids) + room) + 1024
        n = len(ids)
        # Only the held rows are written: the room after them stays untouched memory until rows fill it (copying
        # np.empty's room in as well faulted in and wrote ~100 MB of pages for nothing at each growth).
        self._ids = np.empty(cap, dtype=np.int64)
        self._ids[:n] = ids
        mat = self._mat[:, self.lo:self.hi] if keep is None else self._mat[:, self.lo:self.hi][:, keep]
        self._mat = np.empty((mat.shape[0], cap))
        self._mat[:, :n] = mat
        objs = []
        for o in self._objs:
            buf = np.empty(cap, dtype=object)
            buf[:n] = o[self.lo:self.hi] if keep is None else o[self.lo:self.hi][keep]
            objs.append(buf)
        self._objs = objs
        self.lo, self.hi = 0, n

    def _holes(self, before: int, ids: np.ndarray) -> None:
        now = time.monotonic()
        seen = np.sort(ids)
        holes = []
        for lo, hi, since in self.holes:  # what is still missing of the old holes
            if now - since > HOLE_TTL_S:
                continue
            edges = np.r_[lo - 1, seen[(seen >= lo) & (seen <= hi)], hi + 1]
            holes += [(int(edges[i]) + 1, int(edges[i + 1]) - 1, since) for i in np.nonzero(np.diff(edges) > 1)[0]]
        if before >= 0:  # gaps in the ids above the old top (a first read's gaps are older than any transaction)
            above = np.r_[before, seen[seen > before]]
            cut = np.nonzero(np.diff(above) > 1)[0]
            holes += [(int(above[i]) + 1, int(above[i + 1]) - 1, now) for i in cut]
        holes.sort()
        while len(holes) > MAX_HOLES:  # merge neighbours pairwise (rows read twice are dropped by id)
            holes = [(a[0], b[1], min(a[2], b[2])) for a, b in zip(holes[::2], holes[1::2], strict=False)] + \
                ([holes[-1]] if len(holes) % 2 else [])
        self.holes = holes


COPY_ROWS = 8192  # rows a step when a delta is copied into the held buffers (see _copy)


def _columns(mat: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``mat[:, keep]``, in ``mat``'s own layout: a delta read a row per sample (a transposed view) is selected by
    whole samples (contiguous rows) instead of field by field."""
    return mat.T[keep].T if mat.flags.f_contiguous and not mat.flags.c_contiguous else mat[:, keep]


def _copy(buf: np.ndarray, at: int, mat: np.ndarray) -> None:
    """``buf[:, at:at + n] = mat`` in steps of COPY_ROWS columns. A delta read a row per sample is transposed here;
    transposed whole, each field's stride through ~50 MB of samples missed the cache at every value, and took 1.5
    times as long as these steps, whose samples fit in the cache (200,000 GPU samples: 25 ms against 16)."""
    n = mat.shape[1]
    for a in range(0, n, COPY_ROWS):
        b = min(n, a + COPY_ROWS)
        buf[:, at + a:at + b] = mat[:, a:b]


def _frozen(a: np.ndarray) -> np.ndarray:
    """A read-only view: the detectors get the held rows, and one writing into them must fail loudly."""
    v = a.view()
    v.flags.writeable = False
    return v


_series: dict[Hashable, Series] = {}
_scopes: dict[Hashable, Any] = {}


def scope(cluster_id: int, identity: Any) -> None:
    """Forget cluster ``cluster_id``'s series when ``identity`` (its creation time) is not the last pass's: another
    cluster under the same id (SQLite gives a rolled-back row's id again, as between two tests). Series keys are
    (name, cluster id, ...)."""
    db = (connection.alias, connection.settings_dict["NAME"])
    if _scopes.get((*db, cluster_id), identity) != identity:
        for key in [k for k in _series if k[:2] == db and k[2][1] == cluster_id]:
            del _series[key]
    _scopes[(*db, cluster_id)] = identity


def series(key: tuple[Any, ...], at: int, bound: float, strict: bool = False) -> Series:
    """The held series ``key`` (a new, empty one when there is none, or when ``bound`` moved back)."""
    key = (connection.alias, connection.settings_dict["NAME"], key)
    now = time.monotonic()
    got = _series.get(key)
    if got is None or bound < got.bound:
        for k in [k for k, s in _series.items() if now - s.used > IDLE_S]:
            del _series[k]
        if len(_series) >= MAX_SERIES:
            del _series[min(_series, key=lambda k: _series[k].used)]
        got = _series[key] = Series(at, strict)
    got.used = now
    return got


def read(key: tuple[Any, ...], at: int, bound: float, bound_sql: str, bound_params: list[Any], fetch: Reader,
         strict: bool = False) -> Series:
    """The series ``key`` brought up to date. Its rows are those with ``mat[at] >= bound`` (``>`` when ``strict``),
    which ``bound_sql`` says in SQL; ``fetch(condition, params, fresh)`` reads the rows matching ``condition`` (one
    query) and returns (ids, numeric matrix, object columns). A delta read (not ``fresh``) should keep the planner
    off the (cluster, ts) index (``cluster_id + 0 = %s``): it must take the few rows above the top from the primary
    key, and a partition whose statistics are older than its rows (a new day's) made PostgreSQL pick the other one
    and filter the whole window (174 ms at 2,048 nodes, against 0.2 ms)."""
    s = series(key, at, bound, strict)
    if not s.merge(*fetch(*s.delta(bound_sql, bound_params), s.top < 0), bound):
        forget(key)
        s = series(key, at, bound, strict)
        s.merge(*fetch(bound_sql, bound_params, True), bound)
    return s


def forget(key: tuple[Any, ...] | None = None) -> None:
    """Drop one held series (``key``) or all of them."""
    if key is None:
        _series.clear()
    else:
        _series.pop((connection.alias, connection.settings_dict["NAME"], key), None)
