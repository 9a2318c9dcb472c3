"""What a browser gets when it connects: the recent past, in the same row layouts as the deltas."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from dashboard.live.events import STEP_ROW
from dashboard.live.state import get_state
from dashboard.telemetry.models import Run, StepSample


def run_info(run: Run) -> dict[str, Any]:
    return {"id": run.id, "name": run.name, "cluster": run.cluster_id, "world_size": run.world_size,
            "last_step": run.last_step, "meta": run.meta}


def recent_steps(run: Run, steps: int | None = None) -> list[list[Any]]:
    steps = steps or settings.CLUSTERDX["LIVE_SNAPSHOT_STEPS"]
    if run.last_step is None:
        return []
    qs = StepSample.objects.filter(run=run, step__gt=run.last_step - steps).order_by("step", "rank")
    rows = []
    for s in qs.values_list("step", "rank", "ts", *STEP_ROW[3:]):
        rows.append([s[0], s[1], s[2].timestamp(), *s[3:]])
    return rows


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
