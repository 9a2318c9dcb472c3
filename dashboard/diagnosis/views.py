"""The diagnosis API: findings, and "why was step N slow?". Session auth; an outsider gets 404, never a hint that
a cluster or run exists."""

from __future__ import annotations

from functools import wraps
from typing import Any

from django.db.models import Q
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

from dashboard.diagnosis.detectors import KINDS
from dashboard.diagnosis.explain import explain_step
from dashboard.diagnosis.live import finding_row
from dashboard.diagnosis.models import Finding
from dashboard.telemetry.models import Cluster, Run

MAX_LIMIT = 1000


def _error(status: int, code: str, detail: str) -> JsonResponse:
    return JsonResponse({"error": code, "detail": detail}, status=status)


def _api_login_required(view: Any) -> Any:
    @wraps(view)
    def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> JsonResponse:
        if not request.user.is_authenticated:
            return _error(401, "unauthenticated", "log in first (session cookie)")
        return view(request, *args, **kwargs)

    return wrapped


def _visible(user: Any) -> Any:
    if user.is_superuser:
        return Cluster.objects.all()
    return Cluster.objects.filter(members=user)


def _visible_run(user: Any, run_id: int) -> Run | None:
    run = Run.objects.select_related("cluster").filter(id=run_id).first()
    return run if run is not None and run.cluster.visible_to(user) else None


@require_GET
@_api_login_required
def findings(request: HttpRequest) -> JsonResponse:
    q = request.GET
    qs = Finding.objects.filter(cluster__in=_visible(request.user))
    if q.get("cluster"):
        name = q["cluster"]
        match = Q(name=name) | (Q(id=int(name)) if name.isdigit() else Q(pk__in=[]))
        cluster = _visible(request.user).filter(match).first()
        if cluster is None:
            return _error(404, "not_found", "no such cluster")
        qs = qs.filter(cluster=cluster)
    if q.get("run"):
        run = _visible_run(request.user, int(q["run"])) if q["run"].isdigit() else None
        if run is None:
            return _error(404, "not_found", "no such run")
        # A run's findings: its own, and those of the nodes its ranks run on (a dead node, a failing GPU).
        qs = qs.filter(Q(run=run) | Q(node__ranks__run=run)).distinct()
    if q.get("state"):
        if q["state"] not in Finding.State.values:
            return _error(400, "bad_request", f"state must be one of {', '.join(Finding.State.values)}")
        qs = qs.filter(state=q["state"])
    if q.get("kind"):
        if q["kind"] not in KINDS:
            return _error(400, "bad_request", f"kind must be one of {', '.join(KINDS)}")
        qs = qs.filter(kind=q["kind"])
    try:
        limit = min(MAX_LIMIT, max(1, int(q.get("limit", 100))))
    except ValueError:
        return _error(400, "bad_request", "limit must be an integer")
    rows = [{**finding_row(f), "cluster": f.cluster.name, "resolved_at": f.resolved_at.timestamp() if f.resolved_at
             else None, "evidence": f.evidence}
            for f in qs.select_related("cluster").order_by("-updated_at", "-id")[:limit]]
    return JsonResponse({"findings": rows})


@require_GET
@_api_login_required
def explain(request: HttpRequest, run_id: int, step: int) -> JsonResponse:
    run = _visible_run(request.user, run_id)
    if run is None:
        return _error(404, "not_found", "no such run")
    body = explain_step(run, step)
    if body is None:
        return _error(404, "not_found", f"run {run_id} has no step {step}")
    return JsonResponse(body)
