"""Every read of training-step samples that a page, an API, the live snapshot, the evidence, the goodput record or
"why was step N slow" makes, from the step frames (:class:`~dashboard.telemetry.models.StepFrame`,
:mod:`dashboard.storage.frames`): a post's steps of one run, one group of ``RANK_GROUP`` ranks, one bucket of
``STEP_BUCKET`` step numbers and one 10 s window, as one packed matrix.

The one module outside the writer, the step rollup (:mod:`dashboard.storage.steps`, which aggregates through this
one), retention and the diagnosis pass's held window that knows how steps are stored. Callers get plain values (epoch
seconds, floats, ints, tuples, numpy arrays), never querysets or frames. Per-step aggregates over ranks are asked for
by name (:data:`AGGREGATES`) and computed here in numpy with SQL's meaning: a mean or a sum over the non-null values,
None where there are none; a count of samples.

Every read selects whole frames by indexed columns, then filters their samples (:class:`Sel`): steps ``lo..hi`` are in
the frames with ``lo <= step_hi <= step_bucket_end(hi)`` along (run, step_hi); one rank's in those of its
``rank_group`` too, along (run, rank_group, step_hi); samples taken in [t0, t1] in those with
``window_start(t0) <= ts <= t1`` along (run, ts). Aggregations decode a few thousand frames at a time, each chunk
whole step buckets, and sum a step's samples in (rank, time) order, so a step reads the same whatever range it was
read in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
from django.db import connection
from django.db.models import Min, Q, QuerySet

from dashboard.storage import frames as fr
from dashboard.telemetry.models import Node, StepFrame
from dashboard.turns import yield_to_urgent

K = fr.STEPS
# The wire's whole numbers (clusterdx.wire.Step): read back as ints, as their row columns were.
INTS = frozenset({"rank", "step", "tokens", "samples", "mem_allocated_bytes", "mem_reserved_bytes", "mem_total_bytes"})
# Per-step aggregates over a step's ranks, by the name callers ask for: (field, statistic). "end" is when its last
# rank finished, "n" how many rank samples it has.
AGGREGATES: dict[str, tuple[str, str]] = {
    "end": ("ts", "max"), "n": ("ts", "count"), "tokens": ("tokens", "sum"), "step_time_s": ("step_time_s", "mean"),
    "step_time_max_s": ("step_time_s", "max"), "data_wait_s": ("data_wait_s", "mean"),
    "compute_s": ("compute_s", "mean"), "comm_s": ("comm_s", "mean"),
}
BUCKET_METRICS = ("compute_s", "data_wait_s", "comm_arrive_s", "step_time_s")  # :func:`bucket_means`' columns
CHUNK = 4_000  # frames an aggregation decodes at a time: a day of a 1,024-rank run is never one matrix
RANK_SPAN_MAX = 64 * fr.STEP_BUCKET  # steps one round of a rank's search reads at most (see :func:`_rank_ends`)
Of = Callable[[fr.Rows], np.ndarray]  # a column (or columns) computed from decoded samples
_BIG = float(np.nextafter(2.0**63, 0))  # the largest float64 an int64 holds (a counter at the wire's 2**63 - 1)


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


# -- selecting frames and samples -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sel:
    """A run's samples of steps ``lo..hi``, of ``steps`` only, of one ``rank``, taken in [t0, t1] (t0 excluded when
    ``open_t0``): each bound optional."""

    run_id: int
    lo: int | None = None
    hi: int | None = None
    rank: int | None = None
    t0: float | None = None
    t1: float | None = None
    open_t0: bool = False
    steps: tuple[int, ...] | None = None

    def frames(self) -> QuerySet[StepFrame]:
        """Every frame that can hold such a sample, by indexed columns."""
        qs = StepFrame.objects.filter(run_id=self.run_id)
        if self.rank is not None:
            qs = qs.filter(rank_group=self.rank // fr.RANK_GROUP)
        if self.lo is not None:
            qs = qs.filter(step_hi__gte=self.lo)
        if self.hi is not None:
            qs = qs.filter(step_hi__lte=fr.step_bucket_end(self.hi), step_lo__lte=self.hi)
        if self.steps is not None:
            qs = qs.filter(_buckets_q(self.steps))
        if self.rank is not None and (self.lo is not None or self.steps is not None):
            # Bounded along (run, rank_group, step_hi) already. Bounded by time as well, SQLite takes (run, ts),
            # every rank group's frames of the range: for one rank of a 1,024-rank run, 128 times the frames.
            return qs
        if self.t0 is not None:
            qs = qs.filter(ts__gte=_dt(fr.window_start(self.t0)))
        if self.t1 is not None:
            qs = qs.filter(ts__lte=_dt(self.t1))
        return qs

    def keep(self, rows: fr.Rows) -> fr.Rows:
        """Of a chunk of decoded frames, the samples selected."""
        step, ts = rows["step"], rows["ts"]
        keep = np.ones(len(rows), dtype=bool)
        if self.lo is not None:
            keep &= step >= self.lo
        if self.hi is not None:
            keep &= step <= self.hi
        if self.rank is not None:
            keep &= rows["rank"] == self.rank
        if self.steps is not None:
            keep &= np.isin(step, np.asarray(self.steps, dtype=float))
        if self.t0 is not None:
            keep &= ts > self.t0 if self.open_t0 else ts >= self.t0
        if self.t1 is not None:
            keep &= ts <= self.t1
        return rows if keep.all() else rows.where(keep)

    def read(self, cols: Sequence[str] = (), objects: Sequence[str] = ()) -> fr.Rows:
        """The samples selected, in no set order."""
        frames = self.frames().values_list(*cols, "n", "layout", "data").iterator(chunk_size=CHUNK)
        return self.keep(fr.decode(K, frames, cols, objects))

    def chunks(self, cols: Sequence[str] = (), objects: Sequence[str] = ()) -> Iterator[fr.Rows]:
        """The samples selected, a few thousand frames at a time in step order, a step bucket never split between two
        chunks (so neither is a step)."""
        batch: list[tuple[Any, ...]] = []
        qs = self.frames().order_by("step_hi").values_list("step_hi", *cols, "n", "layout", "data")
        for frame in qs.iterator(chunk_size=CHUNK):
            if len(batch) >= CHUNK and fr.step_bucket_start(frame[0]) != fr.step_bucket_start(batch[-1][0]):
                yield self.keep(fr.decode(K, [f[1:] for f in batch], cols, objects))
                batch = []
            batch.append(frame)
        if batch:
            yield self.keep(fr.decode(K, [f[1:] for f in batch], cols, objects))


def _buckets_q(steps: Iterable[int]) -> Q:
    """The frames of the step buckets ``steps`` fall in: one ``step_hi`` range per run of consecutive buckets."""
    starts = sorted({fr.step_bucket_start(s) for s in steps})
    q = Q(pk__in=[])
    run = 0
    for i, b in enumerate(starts):
        if i + 1 == len(starts) or starts[i + 1] != b + fr.STEP_BUCKET:
            q |= Q(step_hi__gte=starts[run], step_hi__lte=b + fr.STEP_BUCKET - 1)
            run = i + 1
    return q


# -- values as callers get them ---------------------------------------------------------------------------------------


def py(values: np.ndarray, whole: bool = False) -> list[Any]:
    """A float column as Python values: None for NaN, ints where ``whole``."""
    nan = np.isnan(values)
    out = (np.clip(np.where(nan, 0.0, values), -_BIG, _BIG).astype(np.int64) if whole else values).tolist()
    for i in np.flatnonzero(nan).tolist():
        out[i] = None
    return out


def _columns(rows: fr.Rows, fields: Sequence[str]) -> list[list[Any]]:
    """Each of ``fields`` (numeric, object, ``node_id`` or ``node__hostname``) of ``rows`` as a list of values."""
    hosts: dict[Any, str | None] = {}
    if "node__hostname" in fields:
        ids = {n for n in rows["node_id"].tolist() if n is not None}
        hosts = dict(Node.objects.filter(id__in=ids).values_list("id", "hostname"))  # one lookup, the few nodes
    out = []
    for f in fields:
        if f == "node__hostname":
            out.append([hosts.get(n) for n in rows["node_id"].tolist()])
        elif f == "node_id":
            out.append(rows["node_id"].tolist())
        elif f in K.objects:
            out.append(rows.objs[f])
        else:
            out.append(py(rows[f], f in INTS))
    return out


def _wants(fields: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(frame columns, object fields) that reading ``fields`` needs."""
    cols = ("node_id",) if {"node_id", "node__hostname"} & set(fields) else ()
    return cols, tuple(f for f in fields if f in K.objects)


def _tuples(sel: Sel, fields: Sequence[str], order: Sequence[str] = ()) -> list[tuple[Any, ...]]:
    """``fields`` of the samples of ``sel`` as tuples, sorted by ``order`` (fields, first the most significant)."""
    rows = sel.read(*_wants(fields))
    if order:
        rows = rows.where(np.lexsort([rows[f] for f in reversed(order)]))
    return list(zip(*_columns(rows, fields), strict=True)) if fields else [()] * len(rows)


# -- grouped statistics -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stats:
    """Per distinct key (sorted): each value column's sum and count of its non-null values, its min and max (NaN
    where it has none)."""

    keys: np.ndarray
    sum: np.ndarray
    n: np.ndarray
    min: np.ndarray
    max: np.ndarray

    def mean(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.n > 0, self.sum / np.maximum(self.n, 1), np.nan)

    def total(self) -> np.ndarray:
        """SQL's SUM: NaN (null) where no value was summed."""
        return np.where(self.n > 0, self.sum, np.nan)


def stats(keys: np.ndarray, values: np.ndarray) -> Stats:
    """``values`` (a row per sample, a column per field) grouped by ``keys``; a key's rows summed in their order."""
    order = np.argsort(keys, kind="stable")
    k, v = keys[order], values[order]
    if not len(k):
        empty = np.empty((0, values.shape[1]))
        return Stats(k, empty, empty.astype(np.int64), empty, empty)
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    have = ~np.isnan(v)
    return Stats(k[starts], np.add.reduceat(np.where(have, v, 0.0), starts),
                 np.add.reduceat(have.astype(np.int64), starts), np.fmin.reduceat(v, starts),
                 np.fmax.reduceat(v, starts))


def merge(parts: list[Stats], width: int) -> Stats:
    """Several chunks' statistics as one (chunks of whole steps share no key: then it only joins them)."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return stats(np.empty(0), np.empty((0, width)))
    keys = np.concatenate([p.keys for p in parts])
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]]) if len(k) else np.empty(0, dtype=np.int64)
    if not len(k):
        return parts[0]

    def join(name: str, how: np.ufunc) -> np.ndarray:
        return how.reduceat(np.concatenate([getattr(p, name) for p in parts])[order], starts)

    return Stats(k[starts], join("sum", np.add), join("n", np.add), join("min", np.fmin), join("max", np.fmax))


def per_key(sel: Sel, key: Of, values: Of, width: int, objects: Sequence[str] = ()) -> Stats:
    """:func:`stats` of the samples of ``sel``, chunk by chunk: ``key(rows)`` each sample's key, ``values(rows)`` its
    ``width`` value columns. A step's samples are summed by rank, then time."""
    parts = []
    for rows in sel.chunks(objects=objects):
        yield_to_urgent()  # a worker's background aggregation (the efficiency figures) lets a pass go first
        order = np.lexsort((rows["ts"], rows["rank"], rows["step"]))
        parts.append(stats(key(rows)[order], values(rows)[order]))
    return merge(parts, width)


# -- the reads --------------------------------------------------------------------------------------------------------


def bounds(run_id: int, rank: int | None = None) -> tuple[int, int] | None:
    """The run's (or one rank's) first and last step kept; None before its first. The run's from the frames' step
    columns alone: the first step is the least ``step_lo`` among the frames of the lowest ``step_hi``'s bucket."""
    if rank is not None:
        first, last = _rank_ends([run_id], rank, last=False), _rank_ends([run_id], rank, last=True)
        return (first[run_id], last[run_id]) if run_id in last else None
    frames = StepFrame.objects.filter(run_id=run_id)
    hi = frames.order_by("-step_hi").values_list("step_hi", flat=True).first()
    low = frames.order_by("step_hi").values_list("step_hi", flat=True).first()
    if hi is None or low is None:
        return None
    lo = frames.filter(step_hi__lte=fr.step_bucket_end(low)).aggregate(lo=Min("step_lo"))["lo"]
    return int(lo), int(hi)


def first_ts(run_id: int) -> float | None:
    """When the run's oldest kept step sample was taken: its oldest frame's ``ts``, which is its oldest sample's."""
    t = StepFrame.objects.filter(run_id=run_id).order_by("ts").values_list("ts", flat=True).first()
    return None if t is None else t.timestamp()


def ranks_at(run_id: int, step: int) -> set[int]:
    """The ranks that reported ``step``."""
    return {int(r) for r in np.unique(Sel(run_id, step, step).read()["rank"]).tolist()}


def runs_with_rank(run_ids: Iterable[int], rank: int) -> set[int]:
    """Which of ``run_ids`` have a step sample of ``rank``."""
    return set(_rank_ends(list(run_ids), rank, last=True))


def _rank_ends(run_ids: list[int], rank: int, last: bool) -> dict[int, int]:
    """Per run of ``run_ids`` with a sample of ``rank``, its last (or first) step. A rank's frames are its group's:
    they are read from that end of each run along (run, rank_group, step_hi), a span of whole step buckets per round
    (one bucket, then doubling up to RANK_SPAN_MAX steps), until the rank is found: the first span holds it unless it
    stopped (or started) reporting before its group did. Two queries a round for all the runs. A rank its group never
    had (rank 5 of a 4-rank run) is known absent only once the group's whole history is read: ~7 us a frame (a
    100,000-step run 0.7 s on SQLite), where the row index answered it with one probe."""
    group = rank // fr.RANK_GROUP
    found: dict[int, int] = {}
    past = dict.fromkeys(run_ids, 2**63 - 1 if last else -(2**63))  # the step_hi bound still to read beyond
    span = fr.STEP_BUCKET
    while past:
        edge = _group_edges(past, group, last)
        if not edge:
            break
        ranges = {r: ((fr.step_bucket_end(e) - span + 1, e) if last else (e, fr.step_bucket_start(e) + span - 1))
                  for r, e in edge.items()}
        q = Q(pk__in=[])
        for r, (a, b) in ranges.items():
            q |= Q(run_id=r, step_hi__gte=a, step_hi__lte=b)
        frames = StepFrame.objects.filter(q, rank_group=group).values_list("run_id", "n", "layout", "data")
        rows = fr.decode(K, frames, ("run_id",))
        mine = rows.where(rows["rank"] == rank)
        for r, steps in _by_run(mine).items():
            found[r] = int(steps.max() if last else steps.min())
        # A span is whole buckets and a frame's steps lie in its step_hi's bucket: what is found is the rank's end.
        past = {r: (a - 1 if last else b + 1) for r, (a, b) in ranges.items() if r not in found}
        span = min(2 * span, RANK_SPAN_MAX)
    return found


def _group_edges(past: dict[int, int], group: int, last: bool) -> dict[int, int]:
    """Per run, the highest ``step_hi`` of ``group``'s frames at or below its bound (the lowest at or above, when not
    ``last``); runs with none left are absent. One query of an index probe per run."""
    table = connection.ops.quote_name(StepFrame._meta.db_table)
    op, way = ("<=", "DESC") if last else (">=", "ASC")
    one = (f"(SELECT step_hi FROM {table} WHERE run_id = %s AND rank_group = %s AND step_hi {op} %s "
           f"ORDER BY step_hi {way} LIMIT 1)")
    runs = list(past)
    with connection.cursor() as cur:
        cur.execute("SELECT " + ", ".join([one] * len(runs)), [v for r in runs for v in (r, group, past[r])])
        got = cur.fetchone()
    return {r: int(e) for r, e in zip(runs, got, strict=True) if e is not None}


def _by_run(rows: fr.Rows) -> dict[int, np.ndarray]:
    run = rows["run_id"].astype(np.int64)
    return {int(r): rows["step"][run == r] for r in np.unique(run).tolist()}


def at_step(run_id: int, step: int, fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every rank's sample of one step, by rank; ``ts`` in epoch seconds. ``node__hostname`` is the rank's node."""
    return [dict(zip(fields, t, strict=True)) for t in _tuples(Sel(run_id, step, step), fields, ("rank",))]


def before(run_id: int, step: int, steps: int, fields: tuple[str, ...]) -> list[tuple[Any, ...]]:
    """``fields`` of every rank's samples of the ``steps`` steps before ``step``, in no set order."""
    return _tuples(Sel(run_id, step - steps, step - 1), fields)


def cells(run_id: int, lo: int, hi: int, fields: tuple[str, ...], rank: int | None = None) -> list[tuple[Any, ...]]:
    """``(rank, step, *fields)`` of every sample of steps ``lo..hi`` (of one rank when given), in no set order."""
    return _tuples(Sel(run_id, lo, hi, rank), ("rank", "step", *fields))


def rank_progress(run_id: int, rank: int, t0: float, t1: float, lo: int, hi: int) -> list[tuple[int, float]]:
    """(step, when) of one rank's samples taken in [t0, t1] within steps ``lo..hi``, by step."""
    return _tuples(Sel(run_id, lo, hi, rank, t0, t1), ("step", "ts"), ("step",))


def step_ends(run_id: int, t0: float, t1: float, newest: int) -> list[tuple[int, float]]:
    """(step, when its last rank finished) of the run's steps with a sample in [t0, t1]: the newest ``newest`` of
    them, oldest first (the finish of the samples in the range)."""
    s = per_key(Sel(run_id, t0=t0, t1=t1), lambda r: r["step"], lambda r: r["ts"][:, None], 1)
    keep = slice(max(0, len(s.keys) - newest), None)
    return list(zip(py(s.keys[keep], True), s.max[keep, 0].tolist(), strict=True))


def per_step(run_id: int, aggregates: tuple[str, ...], *, after_step: int | None = None,
             since: float | None = None, until: float | None = None, by: str = "step") -> list[dict[str, Any]]:
    """One dict per step, ``{"step": ..., name: aggregate over its ranks ...}`` for each of ``aggregates``
    (:data:`AGGREGATES`; "end" in epoch seconds), of the steps after ``after_step`` and/or of the samples taken in
    (since, until]; ordered by ``by`` ("step" or "end")."""
    fields = sorted({AGGREGATES[a][0] for a in aggregates} | {"ts"})
    at = {f: i for i, f in enumerate(fields)}
    sel = Sel(run_id, None if after_step is None else after_step + 1, t0=since, t1=until, open_t0=True)
    s = per_key(sel, lambda r: r["step"], lambda r: r.mat[:, [K.col(f) for f in fields]], len(fields))
    got = {"step": py(s.keys, True)}
    for a in aggregates:
        field, how = AGGREGATES[a]
        i = at[field]
        if how == "count":
            got[a] = s.n[:, i].tolist()
        else:
            values = {"max": s.max, "mean": s.mean(), "sum": s.total()}[how][:, i]
            got[a] = py(values, how == "sum" and field in INTS)
    order = range(len(s.keys)) if by == "step" else np.argsort(s.max[:, at["ts"]], kind="stable").tolist()
    return [{name: col[j] for name, col in got.items()} for j in order]


def rank_rows(run_id: int, after_step: int, fields: tuple[str, ...]) -> list[list[Any]]:
    """``[step, rank, ts, *fields]`` of every sample after ``after_step``, by step then rank; ts in epoch seconds."""
    return [list(t) for t in _tuples(Sel(run_id, after_step + 1), ("step", "rank", "ts", *fields), ("step", "rank"))]


def bucket_means(run_id: int, metric: str, lo: int, hi: int, width: int) -> np.ndarray:
    """``[rank, bucket, mean]`` rows: the mean of ``metric`` per rank per bucket of ``width`` steps from ``lo``
    (bucket k holds steps lo + k*width ...), for steps ``lo..hi``; NaN for a rank's bucket without a value. One float
    array, by rank then bucket: 1,024 ranks x 600 buckets are 614,400 cells."""
    if metric not in BUCKET_METRICS:
        raise ValueError(metric)
    nb = (hi - lo) // width + 1
    col = K.col(metric)
    s = per_key(Sel(run_id, lo, hi), lambda r: r["rank"] * nb + (r["step"] - lo) // width,
                lambda r: r.mat[:, [col]], 1)
    return np.stack([s.keys // nb, s.keys % nb, s.mean()[:, 0]], axis=1).reshape(-1, 3)


def recent_matrix(runs: list[tuple[int, int]], fields: tuple[str, ...]) -> np.ndarray:
    """For each (run id, after step) of ``runs``, the samples after that step, as one float matrix with a row per
    column (``run_id``, then ``fields``, numeric; ``ts`` in epoch seconds; NaN for null) and a column per sample: one
    query, every run's frames past its step along (run, step_hi)."""
    if not runs:
        return np.empty((1 + len(fields), 0))
    after: dict[int, int] = {}
    for run_id, step in runs:
        after[run_id] = min(step, after.get(run_id, step))
    q = Q(pk__in=[])
    for run_id, step in after.items():
        q |= Q(run_id=run_id, step_hi__gt=step)
    rows = fr.decode(K, StepFrame.objects.filter(q).values_list("run_id", "n", "layout", "data")
                     .iterator(chunk_size=CHUNK), ("run_id",))
    ids, afters = np.array(list(after.items()), dtype=float).reshape(-1, 2).T
    order = np.argsort(ids, kind="stable")
    run = rows["run_id"].astype(float)
    at = order[np.clip(np.searchsorted(ids[order], run), 0, max(len(ids) - 1, 0))]
    rows = rows.where(rows["step"] > afters[at])
    return np.vstack([rows["run_id"].astype(float), *(rows[f] for f in fields)]).reshape(1 + len(fields), -1)
