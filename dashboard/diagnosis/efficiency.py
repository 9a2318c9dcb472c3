"""MFU per step and goodput per run, stored by each diagnosis pass (the math: :mod:`.detectors.goodput`).

Each pass folds the steps that ended since the run's last folded step (and at least ``SETTLE_S`` ago, so a step's
ranks have arrived) into the run's :class:`RunEfficiency`, and writes one :class:`StepEfficiency` row per executed
step. A catching-up pass folds at most ``CHUNK_S`` of a run's history, so its cost never grows with the run's age.
"""

from __future__ import annotations

import logging
import math
from dataclasses import fields
from datetime import UTC, datetime
from typing import Any

from django.db import transaction

from dashboard.diagnosis.detectors.goodput import Goodput, fold
from dashboard.diagnosis.models import RunEfficiency, StepEfficiency
from dashboard.storage import step_samples
from dashboard.telemetry.models import Event, Rank, Run
from dashboard.turns import yield_to_urgent

log = logging.getLogger(__name__)
SETTLE_S = 2.0
CHUNK_S = 3600.0
ACTIVE_RUN_S = 3600.0
_STATE = {f.name for f in fields(Goodput)} - {"done"}


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def record(cluster_id: int, now: float) -> int:
    """Fold every active run of the cluster; returns the steps folded. Never raises into the pass."""
    n = 0
    for run in Run.objects.filter(cluster_id=cluster_id, last_step_at__gte=_dt(now - ACTIVE_RUN_S)):
        yield_to_urgent()  # a pass in this process goes first (dashboard.turns)
        try:
            n += record_run(run, now)
        except Exception:  # the figures wait for the next pass; the findings must not
            log.exception("efficiency of run %s", run.name)
    return n


def _state(eff: RunEfficiency) -> Goodput:
    return Goodput(**{k: v for k, v in (eff.figures or {}).items() if k in _STATE})


def record_run(run: Run, now: float) -> int:
    eff = RunEfficiency.objects.filter(run=run).first() or RunEfficiency(run=run)
    g = _state(eff)
    since = g.last_end
    if since is None:
        first = step_samples.first_ts(run.id)
        if first is None:
            return 0
        since = first - 1e-3
    until = min(now - SETTLE_S, since + CHUNK_S)
    rows = step_samples.per_step(run.id, ("end", "step_time_s", "tokens", "n"), since=since, until=until, by="end")
    if not rows:
        return 0
    lo = min(r["step"] for r in rows)
    g.done = {s: (ts.timestamp(), st) for s, ts, st in StepEfficiency.objects.filter(run=run, step__gte=lo)
              .values_list("step", "ts", "step_time_s")}
    ckpts = set(Event.objects.filter(run=run, kind="checkpoint", step__gte=lo - 1).values_list("step", flat=True))
    if (run.meta or {}).get("last_checkpoint_step") is not None:
        ckpts.add(int(run.meta["last_checkpoint_step"]))
    folded = set(fold(g, [(r["step"], r["end"], r["step_time_s"]) for r in rows], ckpts))
    meta = run.meta or {}
    gpus = run.world_size or Rank.objects.filter(run=run).count() or None
    # A step a later row of the same chunk undid (a restart below it) lost its work: it is no productive step.
    new = [r for r in rows if r["step"] in folded and r["step"] in g.done]
    # step_time_s keeps the productive part (capped at the stall line), as a replay of the step loses it
    steps = [StepEfficiency(run=run, step=r["step"], ts=_dt(r["end"]), step_time_s=g.done[r["step"]][1], tokens=r["tokens"],
                            mfu=_mfu(r["tokens"], r["step_time_s"], meta, gpus)) for r in new]
    eff.tokens += sum(r["tokens"] or 0 for r in new)
    eff.step_seconds += sum(r["step_time_s"] for r in new)
    eff.tokens_per_s = eff.tokens / eff.step_seconds if eff.step_seconds > 0 else None
    eff.mfu = _mfu(eff.tokens, eff.step_seconds, meta, gpus)
    eff.goodput = g.goodput
    eff.figures = {k: v for k, v in g.figures().items()}
    with transaction.atomic():
        StepEfficiency.objects.filter(run=run, step__in=[s.step for s in steps]).delete()  # a replay replaces
        StepEfficiency.objects.bulk_create(steps)
        eff.save()
    return len(steps)


def _mfu(tokens: float | None, seconds: float, meta: dict[str, Any], gpus: int | None) -> float | None:
    fpt, peak = meta.get("flops_per_token"), meta.get("peak_flops")
    if not tokens or not seconds or not fpt or not peak or not gpus:
        return None
    v = tokens * fpt / (peak * gpus * seconds)
    return round(v, 6) if math.isfinite(v) else None


def run_figures(run: Run) -> dict[str, Any] | None:
    """What the run page and the API show: goodput with its accounting, the run-wide MFU and tokens/s."""
    eff = RunEfficiency.objects.filter(run=run).first()
    if eff is None:
        return None
    f = eff.figures or {}
    return {"goodput": _r(eff.goodput), "mfu": _r(eff.mfu), "tokens_per_s": _r(eff.tokens_per_s, 1),
            "wall_s": _r(f.get("wall_s"), 1), "productive_s": _r(f.get("productive_s"), 1),
            "lost_s": {k: _r(f.get(f"{k}_s"), 1) for k in ("stall", "checkpoint", "restart", "replayed")},
            "restarts": f.get("restarts", 0), "through_step": f.get("last_step"),
            "updated_at": eff.updated_at.timestamp()}


def _r(v: Any, d: int = 4) -> float | None:
    return None if v is None or not math.isfinite(float(v)) else round(float(v), d)
