"""The overview's runs table: each run's state, step rate, MFU and money at risk since its last checkpoint.

MFU and the cost at risk are the diagnosis' own figures (:func:`efficiency_figures` and the checkpoint detector's
arithmetic), computed over a small :class:`Window` holding only the runs' last few steps, so the overview and a
finding never disagree. A fixed number of queries whatever the number of runs, nodes or ranks.

Run state, in this order:

- **crashed**: an open ``rank_down`` finding on the run says a rank crashed, or a rank's hooks said "crashed" after
  the run's last step;
- **stalled**: an open ``hang`` or ``rank_down`` finding on the run (or a ``node_down`` that names it stalled);
- **finished**: its ranks' hooks said "finished" after the last step;
- **stalled**: no step for longer than the hang detector's limit, max(hang_steps x median step, hang_min_s);
- **finished**: no step for an hour (``ACTIVE_RUN_S``; the hang detector stops looking at it too), nothing open;
- **running**: otherwise.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

import numpy as np
from django.conf import settings
from django.db.models import Count, F, Max

from dashboard.diagnosis.detectors.base import Thresholds
from dashboard.diagnosis.detectors.steps import (
    _checkpoint_detection,
    _checkpoints,
    efficiency_figures,
    run_steps,
)
from dashboard.diagnosis.detectors.window import (
    GPU_NUM,
    GPU_OBJ,
    PORT_NUM,
    PORT_OBJ,
    PROBE_NUM,
    SPANS,
    RunInfo,
    Table,
    Window,
)
from dashboard.diagnosis.loader import ACTIVE_RUN_S
from dashboard.diagnosis.models import Finding
from dashboard.storage import step_samples
from dashboard.telemetry.models import Cluster, Event, Rank, Run
from dashboard.web.links import run_url

RUNS_LISTED = 20
# Steps read per stepping run: efficiency_figures looks at up to 17; a few are enough for a rate and MFU, and they
# cost ranks x steps rows (5,120 at 1,024 ranks, 81,920 at 16,384). Only the columns those figures read.
OVERVIEW_STEPS = 5
STEP_COLS = ("rank", "step", "ts", "step_time_s", "tokens")


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def _steps_table(runs: list[Run | None]) -> Table:
    """The last OVERVIEW_STEPS steps of every run given (None: not read), in one query, as the diagnosis' step table
    (run = list index)."""
    stepping = [(i, r) for i, r in enumerate(runs) if r is not None and r.last_step is not None]
    if not stepping:
        return Table.from_rows(("run", *STEP_COLS), (), [])
    mat = step_samples.recent_matrix([(r.id, r.last_step - OVERVIEW_STEPS) for _, r in stepping], STEP_COLS)
    index = {r.id: float(i) for i, r in stepping}
    cols = {c: mat[i + 1] for i, c in enumerate(STEP_COLS)}
    run_col = np.array([index[int(v)] for v in mat[0]]) if mat.shape[1] else np.empty(0)
    return Table({"run": run_col, **cols})


def _infos(runs: list[Run], now: float) -> list[RunInfo]:
    missing = [r.id for r in runs if not r.world_size]
    counts = dict(Rank.objects.filter(run_id__in=missing).values("run_id").annotate(n=Count("id"))
                  .values_list("run_id", "n")) if missing else {}
    infos = [RunInfo(r.name, r.world_size or counts.get(r.id) or None, dict(r.meta or {}), {}, r.last_step,
                     r.last_step_at.timestamp() if r.last_step_at else None, id=r.id) for r in runs]
    by_id = {i.id: i for i in infos}
    ckpts = (Event.objects.filter(kind="checkpoint", run__in=runs, step__isnull=False,
                                  ts__gte=_dt(now - SPANS["checkpoints"]))
             .values("run_id", "step").annotate(last=Max("ts")).order_by("run_id", "step"))
    for c in ckpts:
        by_id[c["run_id"]].checkpoints.append((c["last"].timestamp(), c["step"]))
    return infos


def _window(now: float, infos: list[RunInfo], steps: Table) -> Window:
    def empty(num: tuple[str, ...], obj: tuple[str, ...] = ()) -> Table:
        return Table.from_rows(num, obj, [])

    return Window(now=now, nodes=[], steps=steps, gpus=empty(GPU_NUM, GPU_OBJ), ports=empty(PORT_NUM, PORT_OBJ),
                  probes=empty(PROBE_NUM), events=[], hosts={}, runs=infos, last_heard={})


def _hook_states(runs: list[Run]) -> dict[int, set[str]]:
    """run id -> the terminal states ("finished", "crashed") its ranks' hooks reported since its last step."""
    since = {r.id: r.last_step_at for r in runs if r.last_step_at is not None}
    if not since:
        return {}
    out: dict[int, set[str]] = {}
    qs = (Event.objects.filter(kind="hook", run_id__in=list(since), ts__gte=min(since.values()))
          .order_by("-ts").values_list("run_id", "ts", "data")[:5000])
    for run_id, ts, data in qs:
        state = (data or {}).get("state") if isinstance(data, dict) else None
        if state in ("finished", "crashed") and ts >= since[run_id]:
            out.setdefault(run_id, set()).add(state)
    return out


def _open_about(cluster: Cluster, runs: list[Run]) -> dict[str, set[str]]:
    """run name -> "crashed" / "stalled" from the open findings that stop it."""
    names = {r.id: r.name for r in runs}
    out: dict[str, set[str]] = {}
    qs = Finding.objects.filter(cluster=cluster, state=Finding.State.OPEN, kind__in=["hang", "rank_down", "node_down"])
    for run_id, kind, evidence in qs.values_list("run_id", "kind", "evidence")[:500]:
        evidence = evidence or {}
        if kind == "node_down":
            for name in evidence.get("stalled_runs") or []:
                out.setdefault(name, set()).add("stalled")
            continue
        name = names.get(run_id)
        if name is None:
            continue
        crashed = kind == "rank_down" and (evidence.get("metrics") or {}).get("state") == "crashed"
        out.setdefault(name, set()).add("crashed" if crashed else "stalled")
    return out


def run_state(info: RunInfo, now: float, median_step_s: float | None, hooks: set[str], open_: set[str],
              t: Thresholds) -> str:
    """The rule in the module docstring."""
    if "crashed" in open_ or "crashed" in hooks:
        return "crashed"
    if "stalled" in open_:
        return "stalled"
    if "finished" in hooks:
        return "finished"
    if info.last_step_ts is None:
        return "finished"
    idle = now - info.last_step_ts
    if idle > ACTIVE_RUN_S:
        return "finished"
    limit = max(t.hang_steps * median_step_s, t.hang_min_s) if median_step_s else t.hang_min_s * t.hang_steps
    return "stalled" if idle > limit else "running"


def _step_rate(w: Window, ri: int) -> float | None:
    """Steps per second over the recent window: steps advanced / time between the newest rank of the first and last
    steps read."""
    rs = run_steps(w, ri, (), OVERVIEW_STEPS)
    if rs is None or len(rs.steps) < 2:
        return None
    with np.errstate(all="ignore"):
        newest = np.nanmax(rs.m["ts"], axis=0)
    span = float(newest[-1] - newest[0])
    return round(float(rs.steps[-1] - rs.steps[0]) / span, 3) if span > 0 else None


def _at_risk(w: Window, info: RunInfo, state: str, created: float, t: Thresholds) -> dict[str, Any] | None:
    """Money at risk since the last checkpoint (since the start when none was seen), as the checkpoint detector
    prices it. A crashed run counts until its last step; a finished one risks nothing."""
    if state == "finished" or info.last_step is None or info.last_step_ts is None:
        return None
    ckpts = _checkpoints(info)
    last_ts, last_step = ckpts[-1] if ckpts else (created, 0)
    at = w if state != "crashed" else dataclasses.replace(w, now=max(info.last_step_ts, last_ts))
    m = _checkpoint_detection(at, info, last_ts, last_step, None, t).evidence["metrics"]
    return {"usd": m["usd_at_risk"], "gpu_hours": m["gpu_hours_at_risk"], "steps_since": m["steps_since"],
            "last_checkpoint_step": last_step if ckpts else None, "since": "checkpoint" if ckpts else "start"}


def runs_overview(cluster: Cluster, now: float) -> dict[str, Any]:
    runs = list(Run.objects.filter(cluster=cluster)
                .order_by(F("last_step_at").desc(nulls_last=True), "-id")[:RUNS_LISTED])
    total = Run.objects.filter(cluster=cluster).count() if len(runs) == RUNS_LISTED else len(runs)
    t = Thresholds(gpu_hour_usd=float(settings.CLUSTERDX["GPU_HOUR_PRICE_USD"]))
    infos = _infos(runs, now)
    recent = [r if r.last_step_at and now - r.last_step_at.timestamp() <= ACTIVE_RUN_S else None for r in runs]
    w = _window(now, infos, _steps_table(recent))
    hooks, open_ = _hook_states(runs), _open_about(cluster, runs)
    rows = []
    for ri, (run, info) in enumerate(zip(runs, infos, strict=True)):
        fig = efficiency_figures(w, ri) if recent[ri] is not None else None
        med = (fig or {}).get("median_step_s")
        state = run_state(info, now, med, hooks.get(run.id, set()), open_.get(run.name, set()), t)
        rows.append({
            "id": run.id, "name": run.name, "url": run_url(run.id), "state": state, "last_step": run.last_step,
            "last_step_at": info.last_step_ts, "world_size": info.world_size,
            "step_rate": _step_rate(w, ri) if fig else None, "median_step_s": med,
            "tokens_per_s": (fig or {}).get("tokens_per_s"), "mfu": (fig or {}).get("mfu"),
            "goodput": (fig or {}).get("goodput"),
            "at_risk": _at_risk(w, info, state, run.created_at.timestamp(), t),
        })
    return {"runs": rows, "runs_total": total, "gpu_hour_usd": t.gpu_hour_usd}

