"""Every read of training-step samples (one row per rank and step) that a page, an API, the live snapshot, the
evidence, the goodput record or "why was step N slow" makes.

As :mod:`dashboard.storage.gpu_samples` is for GPUs: the one module outside the writer, the step rollup
(:mod:`dashboard.storage.steps`), retention and the diagnosis pass's held window that knows a step sample is a row
of :class:`~dashboard.telemetry.models.StepSample`. Callers get plain values (epoch seconds, floats, tuples, numpy
arrays), never querysets, so the storage can change here (docs/scaling.md: a post's step numbers kept as one frame)
without a page noticing. Per-step aggregates over ranks are asked for by name (:data:`AGGREGATES`), not as ORM
expressions, for the same reason.

Reads of one rank go through :func:`~dashboard.telemetry.models.of_rank` (the (run, rank group, step) index); a
read bounded by time is bounded by steps too where the caller knows them, or SQLite prefers the (run, ts) index.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

import numpy as np
from django.db import connection
from django.db.models import Avg, Count, Max, Min, QuerySet, Sum

from dashboard.telemetry.models import StepSample, of_rank

# Per-step aggregates over a step's ranks, by the name callers ask for them: "end" is when its last rank finished.
AGGREGATES: dict[str, Any] = {
    "end": Max("ts"), "n": Count("id"), "tokens": Sum("tokens"), "step_time_s": Avg("step_time_s"),
    "step_time_max_s": Max("step_time_s"), "data_wait_s": Avg("data_wait_s"), "compute_s": Avg("compute_s"),
    "comm_s": Avg("comm_s"),
}
BUCKET_METRICS = ("compute_s", "data_wait_s", "comm_arrive_s", "step_time_s")  # :func:`bucket_means`' columns


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def _of(run_id: int, rank: int | None) -> QuerySet[Any]:
    qs = StepSample.objects.filter(run_id=run_id)
    return qs if rank is None else of_rank(qs, rank)


def _epochs(row: dict[str, Any]) -> dict[str, Any]:
    for k in ("ts", "end"):
        if isinstance(row.get(k), datetime):
            row[k] = row[k].timestamp()
    return row


def bounds(run_id: int, rank: int | None = None) -> tuple[int, int] | None:
    """The run's (or one rank's) first and last step kept; None before its first."""
    b = _of(run_id, rank).aggregate(lo=Min("step"), hi=Max("step"))
    return None if b["lo"] is None else (int(b["lo"]), int(b["hi"]))


def first_ts(run_id: int) -> float | None:
    """When the run's oldest kept step sample was taken."""
    t = StepSample.objects.filter(run_id=run_id).aggregate(t=Min("ts"))["t"]
    return None if t is None else t.timestamp()


def ranks_at(run_id: int, step: int) -> set[int]:
    """The ranks that reported ``step``."""
    return set(StepSample.objects.filter(run_id=run_id, step=step).values_list("rank", flat=True))


def runs_with_rank(run_ids: Iterable[int], rank: int) -> set[int]:
    """Which of ``run_ids`` have a step sample of ``rank``."""
    ids = list(run_ids)
    if not ids:
        return set()
    return set(of_rank(StepSample.objects.filter(run_id__in=ids), rank).values_list("run_id", flat=True).distinct())


def at_step(run_id: int, step: int, fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every rank's sample of one step, by rank; ``ts`` in epoch seconds. ``node__hostname`` is the rank's node."""
    rows = StepSample.objects.filter(run_id=run_id, step=step).order_by("rank").values(*fields)
    return [_epochs(r) for r in rows]


def before(run_id: int, step: int, steps: int, fields: tuple[str, ...]) -> list[tuple[Any, ...]]:
    """``fields`` of every rank's samples of the ``steps`` steps before ``step``, in no set order."""
    return list(StepSample.objects.filter(run_id=run_id, step__gte=step - steps, step__lt=step).values_list(*fields))


def cells(run_id: int, lo: int, hi: int, fields: tuple[str, ...], rank: int | None = None) -> list[tuple[Any, ...]]:
    """``(rank, step, *fields)`` of every sample of steps ``lo..hi`` (of one rank when given), in no set order."""
    return list(_of(run_id, rank).filter(step__gte=lo, step__lte=hi).values_list("rank", "step", *fields))


def rank_progress(run_id: int, rank: int, t0: float, t1: float, lo: int, hi: int) -> list[tuple[int, float]]:
    """(step, when) of one rank's samples taken in [t0, t1] within steps ``lo..hi``, by step."""
    qs = _of(run_id, rank).filter(ts__gte=_dt(t0), ts__lte=_dt(t1), step__gte=lo, step__lte=hi)
    return [(int(s), ts.timestamp()) for s, ts in qs.order_by("step").values_list("step", "ts")]


def step_ends(run_id: int, t0: float, t1: float, newest: int) -> list[tuple[int, float]]:
    """(step, when its last rank finished) of the run's steps with a sample in [t0, t1]: the newest ``newest`` of
    them, oldest first."""
    rows = (StepSample.objects.filter(run_id=run_id, ts__gte=_dt(t0), ts__lte=_dt(t1)).values("step")
            .annotate(last=Max("ts")).order_by("-step")[:newest])
    return sorted((int(r["step"]), r["last"].timestamp()) for r in rows)


def per_step(run_id: int, aggregates: tuple[str, ...], *, after_step: int | None = None,
             since: float | None = None, until: float | None = None, by: str = "step") -> list[dict[str, Any]]:
    """One dict per step, ``{"step": ..., name: aggregate over its ranks ...}`` for each of ``aggregates``
    (:data:`AGGREGATES`; "end" in epoch seconds), of the steps after ``after_step`` and/or of the samples taken in
    (since, until]; ordered by ``by`` ("step" or "end")."""
    qs = StepSample.objects.filter(run_id=run_id)
    if after_step is not None:
        qs = qs.filter(step__gt=after_step)
    if since is not None:
        qs = qs.filter(ts__gt=_dt(since))
    if until is not None:
        qs = qs.filter(ts__lte=_dt(until))
    # Annotated under other names: an aggregate may not be named as the column it aggregates.
    rows = qs.values("step").annotate(**{f"agg_{a}": AGGREGATES[a] for a in aggregates}).order_by(
        "step" if by == "step" else "agg_end")
    return [_epochs({"step": r["step"], **{a: r[f"agg_{a}"] for a in aggregates}}) for r in rows]


def rank_rows(run_id: int, after_step: int, fields: tuple[str, ...]) -> list[list[Any]]:
    """``[step, rank, ts, *fields]`` of every sample after ``after_step``, by step then rank; ts in epoch seconds."""
    qs = StepSample.objects.filter(run_id=run_id, step__gt=after_step).order_by("step", "rank")
    return [[s, r, ts.timestamp(), *rest] for s, r, ts, *rest in qs.values_list("step", "rank", "ts", *fields)]


def bucket_means(run_id: int, metric: str, lo: int, hi: int, width: int) -> np.ndarray:
    """``[rank, bucket, mean]`` rows: the mean of ``metric`` per rank per bucket of ``width`` steps from ``lo``
    (bucket k holds steps lo + k*width ...), for steps ``lo..hi``. Grouped by the database and returned as one float
    array: 1,024 ranks x 600 buckets are 614,400 cells, and per-row converters were seconds of a heatmap."""
    if metric not in BUCKET_METRICS:  # a column name in the SQL below: only the known ones
        raise ValueError(metric)
    with connection.cursor() as cur:
        cur.execute(f"SELECT rank, (step - %s) / %s AS b, AVG({metric}) "
                    f"FROM {connection.ops.quote_name(StepSample._meta.db_table)} "
                    "WHERE run_id = %s AND step >= %s AND step <= %s GROUP BY rank, b",
                    [lo, width, run_id, lo, hi])
        return np.array(cur.fetchall(), dtype=float).reshape(-1, 3)


def recent_matrix(runs: list[tuple[int, int]], fields: tuple[str, ...]) -> np.ndarray:
    """For each (run id, after step) of ``runs``, the samples after that step, as one float matrix with a row per
    column (``run_id``, then ``fields``; ``ts`` in epoch seconds) and a column per sample: one query, through the
    diagnosis pass's own column reader."""
    from dashboard.diagnosis.loader import _epoch, _read

    where = " OR ".join("(run_id = %s AND step > %s)" for _ in runs)
    params: list[Any] = [v for pair in runs for v in pair]
    mat, _ = _read(StepSample, ["run_id", *(_epoch() if c == "ts" else c for c in fields)], [], where, params)
    return mat
