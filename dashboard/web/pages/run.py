"""The run page and a rank's page, and the JSON API they read.

- ``/runs/<id>/``: findings of this run, KPIs (step, tokens/s, MFU, goodput), the whole run's step split with zoom
  (downsampled on the server), loss / grad norm / MFU / goodput, rank x step heatmaps, the settings with drift, the
  NCCL panel, and the explain view of a clicked step (every layer of ``/api/v1/runs/<id>/steps/<step>/explain``).
- ``/runs/<id>/ranks/<rank>/``: that rank's split over the whole run, its node and GPU, its beat, findings and
  settings.

Live: the run websocket (``/ws/live/?run=<id>``); its snapshot carries per-step aggregates, never ranks x steps.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required
from django.db.models import Q
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import path, reverse

from dashboard.diagnosis.efficiency import run_figures
from dashboard.diagnosis.live import finding_row
from dashboard.diagnosis.models import Finding
from dashboard.live.state import get_state
from dashboard.telemetry.models import Rank, Run
from dashboard.web.access import BadRequest, api, int_param, run_or_404
from dashboard.web.links import node_url, run_url
from dashboard.web.pages import run_series as series
from dashboard.web.pages.run_openapi import OPENAPI  # the API's documents: long, not logic
from dashboard.web.pages.run_settings import nccl_panel, rank_links, run_settings

PER_RANK_MAX = 64  # per-rank bars (and per-rank rows in the live snapshot) only up to this many ranks
DEFAULT_POINTS = 600
MAX_POINTS = 3000


def _step_range(request: HttpRequest, run: Run, rank: int | None = None) -> tuple[int, int] | None:
    bounds = series.step_bounds(run, rank)
    if bounds is None:
        return None
    big = 2**62
    lo = int_param(request, "from_step", bounds[0], 0, big) if request.GET.get("from_step") else None
    hi = int_param(request, "to_step", bounds[1], 0, big) if request.GET.get("to_step") else None
    if lo is not None and hi is not None and hi < lo:
        raise BadRequest("to_step must not be below from_step")
    return series.clamp(bounds, lo, hi)


def _apis(run: Run) -> dict[str, str]:
    return {"steps": reverse("api-run-steps", args=[run.id]), "heatmap": reverse("api-run-heatmap", args=[run.id]),
            "settings": reverse("api-run-settings", args=[run.id]), "nccl": reverse("api-run-nccl", args=[run.id]),
            # the explain URL of step N is this prefix + N + "/explain" (the diagnosis app serves it)
            "explain_prefix": reverse("explain-step", args=[run.id, 0]).rsplit("/0/", 1)[0] + "/"}


@login_required
def run_detail(request: HttpRequest, run_id: int) -> HttpResponse:
    run = run_or_404(request.user, run_id)
    ranks = list(Rank.objects.filter(run=run).order_by("rank").values("rank", "node__hostname", "gpu_index"))
    hosts = sorted({r["node__hostname"] for r in ranks if r["node__hostname"]})
    cluster = run.cluster.name
    data = {"run": run.id, "name": run.name, "ws": f"/ws/live/?run={run.id}", "api": _apis(run),
            "world_size": run.world_size, "n_ranks": len(ranks), "per_rank_max": PER_RANK_MAX,
            "hosts": {h: node_url(cluster, h) for h in hosts},
            # rank -> its links, for the per-rank bars: only while they are drawn (a 16,384-rank run does not need
            # a directory in the page; its heatmap rows carry their own links)
            "ranks": {r["rank"]: rank_links(run, r["rank"], r["node__hostname"], r["gpu_index"])
                      for r in ranks} if len(ranks) <= PER_RANK_MAX else {}}
    return render(request, "web/run.html", {"run": run, "cluster": run.cluster, "page_data": data,
                                            "n_ranks": len(ranks), "n_nodes": len(hosts)})


@login_required
def rank_detail(request: HttpRequest, run_id: int, rank: int) -> HttpResponse:
    run = run_or_404(request.user, run_id)
    info = _rank_or_404(run, rank)
    data = {"run": run.id, "rank": rank, "ws": f"/ws/live/?run={run.id}",
            "api": {"rank": reverse("api-run-rank", args=[run.id, rank]),
                    "steps": reverse("api-run-steps", args=[run.id])}}
    return render(request, "web/rank.html", {"run": run, "cluster": run.cluster, "rank": info, "page_data": data,
                                             "run_url": run_url(run.id)})


def _rank_or_404(run: Run, rank: int) -> dict[str, Any]:
    r = Rank.objects.filter(run=run, rank=rank).values("rank", "node__hostname", "local_rank", "gpu_index",
                                                        "meta", "updated_at").first()
    if r is None:
        if series.step_bounds(run, rank) is None:
            raise Http404("no such rank")
        r = {"rank": rank, "node__hostname": None, "local_rank": None, "gpu_index": None, "meta": {},
             "updated_at": None}
    return {**rank_links(run, rank, r["node__hostname"], r["gpu_index"]), "local_rank": r["local_rank"],
            "meta": r["meta"] or {}, "meta_updated_at": r["updated_at"].timestamp() if r["updated_at"] else None}


# -- the JSON API ------------------------------------------------------------------------------------------------

@api
def steps_api(request: HttpRequest, run_id: int) -> dict[str, Any]:
    run = run_or_404(request.user, run_id)
    rank = int_param(request, "rank", -1, 0, 1_000_000) if request.GET.get("rank") else None
    points = int_param(request, "points", DEFAULT_POINTS, 10, MAX_POINTS)
    rng = _step_range(request, run, rank)
    bounds = series.step_bounds(run, rank)
    if rng is None or bounds is None:
        return {"run": run.id, "rank": rank, "first_step": None, "last_step": None, "bucket_steps": 1, "step": [],
                "efficiency": None, "run_efficiency": None, "loss_spikes": []}
    body = series.step_series(run, rng[0], rng[1], points, rank)
    body |= {"first_step": bounds[0], "last_step": bounds[1],
             "efficiency": series.current_efficiency(run) if rank is None else None,
             # goodput and MFU over the whole run, as the diagnosis pass stored them (None until its first pass)
             "run_efficiency": run_figures(run) if rank is None else None,
             "loss_spikes": series.loss_spikes(run, rng[0], rng[1]) if rank is None else []}
    return body


@api
def heatmap_api(request: HttpRequest, run_id: int) -> dict[str, Any]:
    run = run_or_404(request.user, run_id)
    metric = request.GET.get("metric") or "compute_s"
    if metric not in series.HEATMAP_METRICS:
        raise BadRequest(f"metric must be one of {', '.join(series.HEATMAP_METRICS)}")
    cols = int_param(request, "points", series.MAX_HEATMAP_COLS, 10, series.MAX_HEATMAP_COLS)
    rng = _step_range(request, run)
    if rng is None:
        return {"run": run.id, "metric": metric, "steps": [], "rows": [], "nodes": [], "z": [], "bucket_steps": 1}
    return series.heatmap(run, metric, rng[0], rng[1], cols)


@api
def settings_api(request: HttpRequest, run_id: int) -> dict[str, Any]:
    return run_settings(run_or_404(request.user, run_id))


@api
def nccl_api(request: HttpRequest, run_id: int) -> dict[str, Any]:
    return nccl_panel(run_or_404(request.user, run_id))


@api
def rank_api(request: HttpRequest, run_id: int, rank: int) -> dict[str, Any]:
    run = run_or_404(request.user, run_id)
    info = _rank_or_404(run, rank)
    beat = next((b for b in get_state().beats(run.cluster_id) if b.get("run") == run.name and b.get("rank") == rank),
                None)
    q = Q(run=run, rank=rank)
    if info["host"]:
        q |= Q(node__hostname=info["host"], subject_type="node")
        if info["gpu"] is not None:
            q |= Q(node__hostname=info["host"], subject_type="gpu", gpu_index=info["gpu"])
    findings = (Finding.objects.filter(cluster_id=run.cluster_id).filter(q)
                .select_related("cluster", "node", "peer_node").order_by("-updated_at")[:50])
    return {"run": run.id, "run_name": run.name, "run_url": run_url(run.id), **info, "beat": beat,
            "bounds": series.step_bounds(run, rank), "findings": [
                {**finding_row(f), "resolved_at": f.resolved_at.timestamp() if f.resolved_at else None}
                for f in findings]}


urlpatterns: list[Any] = [
    path("runs/<int:run_id>/", run_detail, name="run"),
    path("runs/<int:run_id>/ranks/<int:rank>/", rank_detail, name="rank"),
    path("api/v1/runs/<int:run_id>/steps", steps_api, name="api-run-steps"),
    path("api/v1/runs/<int:run_id>/heatmap", heatmap_api, name="api-run-heatmap"),
    path("api/v1/runs/<int:run_id>/settings", settings_api, name="api-run-settings"),
    path("api/v1/runs/<int:run_id>/nccl", nccl_api, name="api-run-nccl"),
    path("api/v1/runs/<int:run_id>/ranks/<int:rank>", rank_api, name="api-run-rank"),
]
__all__ = ["OPENAPI", "urlpatterns"]
