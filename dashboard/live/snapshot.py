"""What a browser gets when it connects: the recent past, in the same row layouts as the deltas."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from dashboard.live.events import STEP_AGG_ROW, STEP_ROW
from dashboard.live.state import get_state
from dashboard.storage import step_samples
from dashboard.telemetry.models import Rank, Run

# Per-rank rows go into a snapshot only for runs this small (the run page draws per-rank bars up to here) and only
# for the last PER_RANK_STEPS steps; beyond, the snapshot is per-step aggregates, so its size does not grow with ranks.
PER_RANK_MAX = 64
PER_RANK_STEPS = 20
# Rank-step rows read to build the aggregates: a 16,384-rank run gets its last ~60 steps, a 1,024-rank run 300.
AGG_ROW_BUDGET = 1_000_000


def _n_ranks(run: Run) -> int:
    return run.world_size or Rank.objects.filter(run=run).count()


def run_info(run: Run) -> dict[str, Any]:
    """The run and its recent steps aggregated over ranks (layout STEP_AGG_ROW): what the run page's KPIs, live
    charts and step list start from. A few hundred rows whatever the world size."""
    ranks = _n_ranks(run)
    return {"id": run.id, "name": run.name, "cluster": run.cluster_id, "world_size": run.world_size,
            "last_step": run.last_step, "meta": run.meta, "ranks": ranks,
            "recent": {"columns": STEP_AGG_ROW, "rows": step_aggregates(run, ranks)}}


def step_aggregates(run: Run, ranks: int, steps: int | None = None) -> list[list[Any]]:
    steps = steps or settings.CLUSTERDX["LIVE_SNAPSHOT_STEPS"]
    steps = max(10, min(steps, AGG_ROW_BUDGET // max(ranks, 1)))
    if run.last_step is None:
        return []
    rows = step_samples.per_step(run.id, ("end", "n", "step_time_s", "step_time_max_s", "data_wait_s", "compute_s",
                                          "comm_s", "tokens"), after_step=run.last_step - steps)
    return [[r["step"], round(r["end"], 3), r["n"], *(_r(r[k]) for k in ("step_time_s", "step_time_max_s",
                                                                         "data_wait_s", "compute_s", "comm_s")),
             r["tokens"]] for r in rows]


def _r(v: float | None) -> float | None:
    return None if v is None else round(float(v), 6)


def recent_steps(run: Run, steps: int = PER_RANK_STEPS) -> list[list[Any]]:
    """Per-rank rows (STEP_ROW) of the last ``steps`` steps, for runs of at most PER_RANK_MAX ranks; none for bigger
    runs (at 1,024 ranks x 300 steps these were 8-14 MB of the first frame; the aggregates in run_info replace
    them)."""
    if run.last_step is None or _n_ranks(run) > PER_RANK_MAX:
        return []
    return step_samples.rank_rows(run.id, run.last_step - steps, tuple(STEP_ROW[3:]))


def recent_events(cluster_id: int, run_id: int | None = None, host: str | None = None,
                  limit: int = 50) -> list[dict[str, Any]]:
    """The newest warnings and errors, from the database, in the live event row layout (newest last, as deltas
    arrive)."""
    from dashboard.live.publish import SEVERE
    from dashboard.telemetry.models import Event

    qs = Event.objects.filter(cluster_id=cluster_id, severity__in=SEVERE)
    if host is not None:
        qs = qs.filter(node__hostname=host)
    rows = qs.order_by("-ts", "-id").values("ts", "node__hostname", "kind", "severity", "code", "gpu_index", "message")
    out = [{"ts": r["ts"].timestamp(), "host": r["node__hostname"], "kind": r["kind"], "severity": r["severity"],
            "code": r["code"], "gpu_index": r["gpu_index"], "message": r["message"][:500]} for r in rows[:limit]]
    return out[::-1]


def latest_gpus(cluster_id: int) -> list[list[Any]]:
    return sorted(get_state().gpus(cluster_id), key=lambda r: (r[0], r[1]))


def open_findings(cluster_id: int, run_id: int | None) -> list[dict[str, Any]]:
    """Open findings for the page, when the diagnosis app is installed."""
    from django.apps import apps

    if not apps.is_installed("dashboard.diagnosis"):
        return []
    from dashboard.diagnosis.live import findings_for

    return findings_for(cluster_id, run_id)
