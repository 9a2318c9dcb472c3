"""Step rollups: one row per (run, step), aggregated over the run's ranks, for the run page's whole-run history.

The run page draws a run's history as min / mean / max per bucket of steps over every rank. From the step frames that
is every (rank, step) sample of the range decoded and grouped: fine for minutes of a run, not for a day of a 1,024-rank
run (88 million samples). A rollup pass (with the GPU and host rollups, :func:`dashboard.storage.rollup.roll_up`)
writes each *settled* step's aggregates once; the page reads those rows for the settled steps and groups raw samples
only for the live tail (:func:`per_step`). Both come from the same aggregation (:func:`_raw`, over the frames through
:mod:`dashboard.storage.step_samples`), so a rolled-up step reads exactly as its raw samples did.

Settled: ``SETTLE_STEPS`` behind the run's newest step, or every step once the run has not stepped for
``SETTLE_S`` (it ended, or it hangs). Rank samples that arrive for a step already rolled up (an agent replaying what it
spooled through an outage) are found by id: every StepFrame above the last pass's newest id, less a margin for ids
that commit out of order on PostgreSQL, whose ``step_lo`` is at or below its run's rolled-up step is decoded, and the
rolled-up steps among its samples are rolled up again, whole, from raw.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
from django.conf import settings
from django.db import connection

from dashboard.storage import frames as fr
from dashboard.storage import step_samples
from dashboard.storage.models import STEP_SPLIT, RollupState, StepRollup, StepRollupState
from dashboard.storage.step_samples import Sel, py
from dashboard.telemetry.models import Run, StepFrame

SETTLE_STEPS = 50  # a step this far behind the newest one has every rank's sample (ranks are never 50 steps apart)
SETTLE_S = 300.0  # a run that has not stepped for this long is settled to its last step
# StepFrame ids below the last pass's newest still checked: those of transactions still open when it read (PostgreSQL
# commits ids out of order). A post makes about one frame (a node's eight ranks), a group commit at most a few hundred:
# this covers a dozen groups in flight, as 20,000 StepSample ids did (eight or more rows a post). Each pass rolls again
# the rolled-up steps these frames hold, so the margin is not free either.
ID_MARGIN = 5_000
STEPS_PER_STATEMENT = 2_000  # a backfill of a long run is many bounded reads, never one giant one

# aggregate name -> StepRollup column
COLUMNS = {"n": "n", "ts": "ts", "tokens": "tokens", "loss": "loss", "grad_norm": "grad_norm",
           **{f"{f}__{s}": f"{f}_{s}" for f in STEP_SPLIT for s in ("sum", "n", "min", "max")}}
# The columns a step's samples are grouped over: the frame's numbers, then the training loop's own (from metrics).
VALUES = ("ts", "tokens", *STEP_SPLIT)
METRICS = ("loss", "grad_norm")


def _values(rows: fr.Rows) -> np.ndarray:
    """Each sample's VALUES and METRICS (NaN where it has none) as a matrix."""
    nums = rows.mat[:, [fr.STEPS.col(c) for c in VALUES]]
    metrics = np.full((len(rows), len(METRICS)), np.nan)
    for i, m in enumerate(rows.objs["metrics"]):
        if m:  # a JSON object from the training loop: only its numbers count, as SQL's cast of them did
            metrics[i] = [v if isinstance(v, int | float) and not isinstance(v, bool) else np.nan
                          for v in (m.get(k) for k in METRICS)]
    return np.hstack([nums, metrics])


def _raw(run_id: int, lo: int, hi: int, rank: int | None = None, steps: list[int] | None = None
         ) -> list[dict[str, Any]]:
    """Steps ``lo..hi`` grouped from raw samples (only ``steps`` of them when given; one ``rank``'s when given), one
    dict per step in step order: "step", "n" (samples), "ts" (the newest, a datetime), "tokens" (summed), "loss" and
    "grad_norm" (means), and per STEP_SPLIT field its sum, count, min and max; SQL's nulls where a field has no value."""
    sel = Sel(run_id, lo, hi, rank, steps=None if steps is None else tuple(steps))
    width = len(VALUES) + len(METRICS)
    s = step_samples.per_key(sel, lambda r: r["step"], _values, width, objects=("metrics",))
    mean, total = s.mean(), s.total()
    at = {c: i for i, c in enumerate((*VALUES, *METRICS))}
    cols: dict[str, list[Any]] = {"step": py(s.keys, True), "n": s.n[:, at["ts"]].tolist(),
                                  "ts": [datetime.fromtimestamp(t, UTC) for t in s.max[:, at["ts"]].tolist()],
                                  "tokens": py(total[:, at["tokens"]], True)}
    cols |= {k: py(mean[:, at[k]]) for k in METRICS}
    for f in STEP_SPLIT:
        i = at[f]
        cols |= {f"{f}__sum": py(total[:, i]), f"{f}__n": s.n[:, i].tolist(), f"{f}__min": py(s.min[:, i]),
                 f"{f}__max": py(s.max[:, i])}
    return [dict(zip(cols, row, strict=True)) for row in zip(*cols.values(), strict=True)]


def per_step(run_id: int, lo: int, hi: int, rank: int | None = None) -> list[dict[str, Any]]:
    """Steps ``lo..hi`` of a run, one dict per step (the names of :data:`COLUMNS`, and "step"), in step order:
    rolled-up steps from their rows, the rest grouped from raw. ``rank``: one rank's, always raw (its rank group's
    frames, one index range)."""
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
    """One pass over every run: its newly settled steps, and the steps late samples arrived for. Returns the rollup
    rows written."""
    state, _ = RollupState.objects.get_or_create(pk=1)
    newest = StepFrame.objects.order_by("-id").values_list("id", flat=True).first()
    late = _late(state.step_seen_id - ID_MARGIN) if state.step_seen_id is not None and newest is not None else {}
    held = dict(StepRollupState.objects.values_list("run_id", "rolled_to"))
    purged = now - timedelta(hours=settings.CLUSTERDX["RETENTION_HOURS"])  # raw steps older than this are gone
    written = 0
    for run_id, last_step, last_at in Run.objects.filter(last_step__isnull=False).values_list(
            "id", "last_step", "last_step_at"):
        quiet = last_at is None or (now - last_at) > timedelta(seconds=SETTLE_S)
        settled = last_step if quiet else last_step - SETTLE_STEPS
        written += _again(run_id, sorted(late.get(run_id, ())), purged)
        rolled = held.get(run_id)
        start = (rolled + 1) if rolled is not None else _first_step(run_id)
        if start is None or settled < start:
            continue
        step = start
        while step <= settled:
            # Bounded by steps, and by the steps a run actually has (a run's first step need not be 0).
            hi = min(settled, step + STEPS_PER_STATEMENT - 1)
            written += _write(run_id, _raw(run_id, step, hi))
            step = hi + 1
        StepRollupState.objects.update_or_create(run_id=run_id, defaults={"rolled_to": settled})
    if newest is not None:
        RollupState.objects.filter(pk=1).update(step_seen_id=newest)
    return written


def _late(after_id: int) -> dict[int, set[int]]:
    """Per run, its rolled-up steps that frames above ``after_id`` hold samples of. One range scan of the primary
    key, each frame checked against its run's state in SQL: of minutes of a large cluster's frames only those
    reaching back to a rolled-up step (a few at most: the rest are the live tail) are read and decoded."""
    q = connection.ops.quote_name
    with connection.cursor() as cur:
        cur.execute(f"SELECT f.run_id, r.rolled_to, f.n, f.layout, f.data FROM {q(StepFrame._meta.db_table)} f "
                    f"JOIN {q(StepRollupState._meta.db_table)} r ON r.run_id = f.run_id "
                    "WHERE f.id > %s AND f.step_lo <= r.rolled_to", [after_id])
        rows = fr.decode(fr.STEPS, cur.fetchall(), ("run_id", "rolled_to"))
    rows = rows.where(rows["step"] <= rows["rolled_to"])
    late: dict[int, set[int]] = defaultdict(set)
    for run_id, step in np.unique(np.stack([rows["run_id"], rows["step"]], axis=1), axis=0).tolist():
        late[int(run_id)].add(int(step))
    return late


def _again(run_id: int, steps: list[int], purged: datetime) -> int:
    """Roll ``steps`` (rolled up before, sorted) again, whole, from raw."""
    written = 0
    for i in range(0, len(steps), STEPS_PER_STATEMENT):
        part = steps[i:i + STEPS_PER_STATEMENT]
        # A step whose raw frames retention has purged keeps its rollup: rolled again from what raw still holds
        # (the late samples alone) it would lose the rest.
        have = dict(StepRollup.objects.filter(run_id=run_id, step__in=part).values_list("step", "ts"))
        part = [s for s in part if s not in have or have[s] >= purged]
        if part:
            written += _write(run_id, _raw(run_id, part[0], part[-1], steps=part))
    return written


def _first_step(run_id: int) -> int | None:
    b = step_samples.bounds(run_id)
    return None if b is None else b[0]


def _write(run_id: int, rows: list[dict[str, Any]]) -> int:
    if not rows:
        return 0
    objs = [StepRollup(run_id=run_id, step=r["step"], **{col: r[name] for name, col in COLUMNS.items()})
            for r in rows]
    StepRollup.objects.bulk_create(objs, update_conflicts=True, unique_fields=["run", "step"],
                                   update_fields=list(COLUMNS.values()))
    return len(objs)
