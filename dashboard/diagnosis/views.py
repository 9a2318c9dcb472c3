"""The diagnosis API: findings, and "why was step N slow?". Session auth; an outsider gets 404, never a hint that
a cluster or run exists."""

from __future__ import annotations

from datetime import UTC, datetime
from functools import wraps
from typing import Any

from django.db.models import Q
from django.http import Http404, HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

from dashboard.diagnosis.detectors import KINDS
from dashboard.diagnosis.explain import explain_step
from dashboard.diagnosis.live import finding_row
from dashboard.diagnosis.models import SEVERITIES, Finding
from dashboard.telemetry.models import Node, Run
from dashboard.web.access import BadRequest, api_error, epoch_param, visible_clusters

MAX_LIMIT = 1000


def _api_login_required(view: Any) -> Any:
    @wraps(view)
    def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> JsonResponse:
        if not request.user.is_authenticated:
            return api_error(401, "unauthenticated", "log in first (session cookie)")
        return view(request, *args, **kwargs)

    return wrapped


def _visible_run(user: Any, run_id: int) -> Run | None:
    run = Run.objects.select_related("cluster").filter(id=run_id).first()
    return run if run is not None and run.cluster.visible_to(user) else None


def _id(text: str) -> int | None:
    """``text`` as a database id, or None: ``str.isdigit`` also accepts "²" (which ``int`` refuses) and 5,000-digit
    strings (over Python's conversion limit); 18 digits are below every id column's maximum."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


def _epoch(request: HttpRequest, name: str) -> datetime | None:
    value = epoch_param(request, name)
    return None if value is None else datetime.fromtimestamp(value, UTC)


def _int(q: Any, name: str, default: int, lo: int, hi: int | None = None) -> int:
    raw = q.get(name)
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be an integer, got {raw[:40]!r}") from None
    if value < lo:
        raise BadRequest(f"{name} must be at least {lo}")
    return min(value, hi) if hi is not None else value


def _filtered(request: HttpRequest) -> Any:
    """The findings the query asks for, of the clusters the user is a member of. Raises BadRequest (400) or Http404."""
    q = request.GET
    visible = visible_clusters(request.user)
    qs = Finding.objects.filter(cluster__in=visible)
    if q.get("cluster"):
        name = q["cluster"]
        match = Q(name=name) | (Q(id=_id(name)) if _id(name) is not None else Q(pk__in=[]))
        cluster = visible.filter(match).first()
        if cluster is None:
            raise Http404("no such cluster")
        qs = qs.filter(cluster=cluster)
    if q.get("run"):
        run_id = _id(q["run"])
        if run_id is None:
            raise BadRequest(f"run must be a run id (an integer), got {q['run'][:40]!r}")
        run = _visible_run(request.user, run_id)
        if run is None:
            raise Http404("no such run")
        # A run's findings: its own, and those of the nodes its ranks run on (a dead node, a failing GPU).
        qs = qs.filter(Q(run=run) | Q(node__ranks__run=run)).distinct()
    for name, allowed in (("state", Finding.State.values), ("kind", list(KINDS)), ("severity", SEVERITIES)):
        values = [v for v in q.getlist(name) if v]
        bad = [v for v in values if v not in allowed]
        if bad:
            raise BadRequest(f"{name} must be one of {', '.join(allowed)}, got {bad[0][:40]!r}")
        if values:
            qs = qs.filter(**{f"{name}__in": values})
    if q.get("node"):
        host = q["node"]
        nodes = Node.objects.filter(cluster__in=visible, hostname=host)
        if not nodes.exists():
            raise BadRequest(f"no node named {host[:80]!r} in your clusters")
        # A node's findings: about it, its GPUs and ranks, and the links it is an end of.
        qs = qs.filter(Q(node__in=nodes) | Q(peer_node__in=nodes))
    since, until = _epoch(request, "since"), _epoch(request, "until")
    if since and until and until <= since:
        raise BadRequest("until must be after since")
    if since:  # still changing at or after ``since``: updated then, or open
        qs = qs.filter(Q(updated_at__gte=since) | Q(state=Finding.State.OPEN))
    if until:  # already there by ``until``
        qs = qs.filter(opened_at__lte=until)
    return qs


@require_GET
@_api_login_required
def findings(request: HttpRequest) -> JsonResponse:
    """Newest first, paged with ``offset`` and ``limit``: ``X-Total-Count`` says how many match, and a
    ``Link: <...>; rel="next"`` header points at the next page while there is one (the body stays a plain list)."""
    try:
        qs = _filtered(request)
        limit = _int(request.GET, "limit", 100, 1, MAX_LIMIT)
        offset = _int(request.GET, "offset", 0, 0)
    except BadRequest as exc:
        return api_error(400, "bad_request", str(exc))
    except Http404 as exc:
        return api_error(404, "not_found", str(exc))
    total = qs.count()
    page = qs.select_related("cluster", "node", "peer_node").order_by("-updated_at", "-id")[offset:offset + limit]
    from dashboard.diagnosis.silences import mark

    rows = mark([{**finding_row(f), "cluster": f.cluster.name, "resolved_at": f.resolved_at.timestamp() if
                  f.resolved_at else None, "evidence": f.evidence} for f in page])
    response = JsonResponse({"findings": rows})
    response["X-Total-Count"] = str(total)
    if offset + limit < total:
        params = request.GET.copy()
        params["offset"], params["limit"] = str(offset + limit), str(limit)
        response["Link"] = f'<{request.path}?{params.urlencode()}>; rel="next"'
    return response


@require_GET
@_api_login_required
def explain(request: HttpRequest, run_id: int, step: int) -> JsonResponse:
    run = _visible_run(request.user, run_id)
    if run is None:
        return api_error(404, "not_found", "no such run")
    body = explain_step(run, step)
    if body is None:
        return api_error(404, "not_found", f"run {run_id} has no step {step}")
    from dashboard.web.links import gpu_url, node_url, rank_url

    # Every rank, node and GPU the explanation names links to its page, at any run size.
    for row in body["ranks"]:
        row["url"] = rank_url(run.id, row["rank"])
        if row.get("host"):
            row["node_url"] = node_url(run.cluster.name, row["host"])
            if row.get("gpu") is not None:
                row["gpu_url"] = gpu_url(run.cluster.name, row["host"], row["gpu"])
    return JsonResponse(body)
