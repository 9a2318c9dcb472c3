"""Step rollups: one row per (run, step), aggregated over the run's ranks, for the run page's whole-run history.

The run page draws a run's history as min / mean / max per bucket of steps over every rank. From raw rows that is a
grouping of every (rank, step) row of the range: fine for minutes of a run, not for a day of a 1,024-rank run (88
million rows). A rollup pass (with the GPU and host rollups, :func:`dashboard.storage.rollup.roll_up`) writes each
*settled* step's aggregates once; the page reads those rows for the settled steps and groups raw rows only for the
live tail (:func:`per_step`). Both come from the same aggregation (:func:`_aggregate`), so a rolled-up step reads
exactly as its raw rows did.

Settled: ``SETTLE_STEPS`` behind the run's newest step, or every step once the run has not stepped for
``SETTLE_S`` (it ended, or it hangs). Rank rows that arrive for a step already rolled up (an agent replaying what it
spooled through an outage) are found by id (every StepSample row above the last pass's newest id, less a margin for
ids that commit out of order on PostgreSQL) and their steps are rolled up again, whole, from raw.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.models import Avg, Count, FloatField, Max, Min, Sum
from django.db.models.fields.json import KT
from django.db.models.functions import Cast

from dashboard.storage.models import STEP_SPLIT, RollupState, StepRollup, StepRollupState
from dashboard.telemetry.models import Run, StepSample, of_rank

SETTLE_STEPS = 50  # a step this far behind the newest one has every rank's row (ranks are never 50 steps apart)
SETTLE_S = 300.0  # a run that has not stepped for this long is settled to its last step
ID_MARGIN = 20_000  # StepSample ids below the last pass's newest still checked: a late commit's (PostgreSQL)
STEPS_PER_STATEMENT = 2_000  # a backfill of a long run is many bounded statements, never one giant one

# annotate() name -> StepRollup column
COLUMNS = {"n": "n", "ts": "ts", "tokens": "tokens", "loss": "loss", "grad_norm": "grad_norm",
           **{f"{f}__{s}": f"{f}_{s}" for f in STEP_SPLIT for s in ("sum", "n", "min", "max")}}


def _aggregate() -> dict[str, Any]:
    aggs: dict[str, Any] = {"n": Count("id"), "ts": Max("ts"), "tokens": Sum("tokens")}
    for f in STEP_SPLIT:
        aggs |= {f"{f}__sum": Sum(f), f"{f}__n": Count(f), f"{f}__min": Min(f), f"{f}__max": Max(f)}
    for key in ("loss", "grad_norm"):  # the training loop's own numbers, from StepSample.metrics
        aggs[key] = Avg(Cast(KT(f"metrics__{key}"), FloatField()))
    return aggs


def _raw(run_id: int, lo: int, hi: int, rank: int | None = None, steps: list[int] | None = None
         ) -> list[dict[str, Any]]:
    """Steps ``lo..hi`` grouped from raw rows (only ``steps`` of them when given; one ``rank``'s when given)."""
    qs = StepSample.objects.filter(run_id=run_id, step__gte=lo, step__lte=hi)
    if rank is not None:
        qs = of_rank(qs, rank)
    if steps is not None:
        qs = qs.filter(step__in=steps)
    return list(qs.values("step").annotate(**_aggregate()).order_by("step"))


def per_step(run_id: int, lo: int, hi: int, rank: int | None = None) -> list[dict[str, Any]]:
    """Steps ``lo..hi`` of a run, one dict per step (the aggregate names of :func:`_aggregate`, and "step"), in
    step order: rolled-up steps from their rows, the rest grouped from raw. ``rank``: one rank's, always raw (an
    index range scan of its own rows)."""
    if rank is not None:
        return _raw(run_id, lo, hi, rank)
    rolled = StepRollupState.objects.filter(run_id=run_id).values_list("rolled_to", flat=True).first()
    out: list[dict[str, Any]] = []
    if rolled is not None and lo <= rolled:
        cols = ["step", *COLUMNS.values()]
        for row in StepRollup.objects.filter(run_id=run_id, step__gte=lo, step__lte=min(hi, rolled)) \
                .order_by("step").values_list(*cols):
            got = dict(zip(cols, row, strict=True))
            out.append({"step": got["step"], **{name: got[col] for name, col in COLUMNS.items()}})
        lo = rolled + 1
    if lo <= hi:
        out += _raw(run_id, lo, hi)
    return out


def roll_up_steps(now: datetime) -> int:
    """One pass over every run: its newly settled steps, and the steps late rows arrived for. Returns the rollup
    rows written."""
    state, _ = RollupState.objects.get_or_create(pk=1)
    newest = StepSample.objects.order_by("-id").values_list("id", flat=True).first()
    late: dict[int, set[int]] = defaultdict(set)
    if state.step_seen_id is not None and newest is not None:
        # The rows written since the last pass for steps already rolled up (a few at most: the rest are the live
        # tail): one range scan of the primary key, each row checked against its run's state in SQL, so minutes
        # of a large cluster's rows never become Python objects.
        q = connection.ops.quote_name
        with connection.cursor() as cur:
            cur.execute(f"SELECT DISTINCT s.run_id, s.step FROM {q(StepSample._meta.db_table)} s "
                        f"JOIN {q(StepRollupState._meta.db_table)} r ON r.run_id = s.run_id "
                        "WHERE s.id > %s AND s.step <= r.rolled_to", [state.step_seen_id - ID_MARGIN])
            for run_id, step in cur.fetchall():
                late[run_id].add(step)
    held = dict(StepRollupState.objects.values_list("run_id", "rolled_to"))
    purged = now - timedelta(hours=settings.CLUSTERDX["RETENTION_HOURS"])  # raw steps older than this are gone
    written = 0
    for run_id, last_step, last_at in Run.objects.filter(last_step__isnull=False).values_list(
            "id", "last_step", "last_step_at"):
        quiet = last_at is None or (now - last_at) > timedelta(seconds=SETTLE_S)
        settled = last_step if quiet else last_step - SETTLE_STEPS
        rolled = held.get(run_id)
        again = sorted(late.get(run_id, ()))  # the query kept only steps at or below the run's rolled_to
        for i in range(0, len(again), STEPS_PER_STATEMENT):
            part = again[i:i + STEPS_PER_STATEMENT]
            # A step whose raw rows retention has purged keeps its rollup: rolled again from what raw still holds
            # (the late rows alone) it would lose the rest.
            have = dict(StepRollup.objects.filter(run_id=run_id, step__in=part).values_list("step", "ts"))
            part = [s for s in part if s not in have or have[s] >= purged]
            if part:
                written += _write(run_id, _raw(run_id, part[0], part[-1], steps=part))
        start = (rolled + 1) if rolled is not None else _first_step(run_id)
        if start is None or settled < start:
            continue
        step = start
        while step <= settled:
            # Bounded by steps, and by the rows a run actually has (a run's first step need not be 0).
            hi = min(settled, step + STEPS_PER_STATEMENT - 1)
            written += _write(run_id, _raw(run_id, step, hi))
            step = hi + 1
        StepRollupState.objects.update_or_create(run_id=run_id, defaults={"rolled_to": settled})
    if newest is not None:
        RollupState.objects.filter(pk=1).update(step_seen_id=newest)
    return written


def _first_step(run_id: int) -> int | None:
    return StepSample.objects.filter(run_id=run_id).order_by("step").values_list("step", flat=True).first()


def _write(run_id: int, rows: list[dict[str, Any]]) -> int:
    if not rows:
        return 0
    objs = [StepRollup(run_id=run_id, step=r["step"], **{col: r[name] for name, col in COLUMNS.items()})
            for r in rows]
    StepRollup.objects.bulk_create(objs, update_conflicts=True, unique_fields=["run", "step"],
                                   update_fields=list(COLUMNS.values()))
    return len(objs)
