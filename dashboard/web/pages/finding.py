"""The finding page (where every alert lands) and the findings list of a cluster.

The finding page answers "what is wrong, how sure, what to do" on top, then draws the evidence its detector decided
on (:mod:`dashboard.web.evidence`: the series, the window, the threshold), the numbers, the earlier findings on the
same subject and the alert deliveries it caused. Its API, ``/api/v1/findings/{id}``, is the page's first data.
The list page reads ``/api/v1/findings`` (dashboard.diagnosis.views) with the filters of its GET form.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import path, reverse

from dashboard.diagnosis import silences
from dashboard.diagnosis.detectors import KINDS
from dashboard.diagnosis.live import finding_row
from dashboard.diagnosis.models import SEVERITIES, Finding
from dashboard.telemetry.models import Node, Run
from dashboard.web import evidence
from dashboard.web.access import api, cluster_or_404, finding_or_404
from dashboard.web.links import cluster_url, finding_url, findings_url, node_url, run_url
from dashboard.web.pages.attention import forms_context, silences_of

EARLIER = 50
DELIVERIES = 100


def _ts(value: Any) -> float | None:
    return value.timestamp() if value is not None else None


def finding_info(f: Finding) -> dict[str, Any]:
    row = finding_row(f)
    row.update({
        "cluster": f.cluster.name, "cluster_url": cluster_url(f.cluster.name), "findings_url": findings_url(f.cluster.name),
        "resolved_at": _ts(f.resolved_at), "last_seen_at": _ts(f.last_seen_at), "evidence": f.evidence,
        "node_url": node_url(f.cluster.name, f.node.hostname) if f.node_id else None,
        "peer_node": f.peer_node.hostname if f.peer_node_id else None,
        "run_name": f.run.name if f.run_id else None, "run_url": run_url(f.run_id) if f.run_id else None,
    })
    return silences.mark([row])[0]


def silence_choices(f: Finding) -> list[dict[str, str]]:
    """What the finding page offers to silence, narrowest first: its GPU or link, its node, its run, its kind."""
    host = f.node.hostname if f.node_id else None
    out = []
    if host and f.gpu_index is not None:
        out.append(("gpu", f"{host}/gpu{f.gpu_index}", f"GPU {host}/gpu{f.gpu_index}"))
    if f.subject_type == "link" and "~" in f.subject:
        out.append(("link", f.subject, f"link {f.subject}"))
    if host:
        out.append(("node", host, f"node {host} (maintenance: its GPUs, ranks and links)"))
    if f.run_id:
        out.append(("run", str(f.run_id), f"run {f.run.name}"))
    out.append(("kind", f.kind, f"every {f.kind} finding on {f.cluster.name}"))
    return [{"scope": scope, "target": target, "label": label} for scope, target, label in out]


def covering_silences(f: Finding) -> list[dict[str, Any]]:
    """The active silences that hold back alerts about this finding (each can be ended from the page)."""
    row = {**silences.facts(f), "cluster_id": f.cluster_id}
    return [s for s in silences_of(f.cluster) if silences.covers(s["scope"], s["target"], row)]


def earlier(f: Finding) -> list[dict[str, Any]]:
    """Other findings on the same subject (any kind), newest first: a node that fails every week shows it here."""
    qs = (Finding.objects.filter(cluster_id=f.cluster_id, subject=f.subject).exclude(id=f.id)
          .order_by("-opened_at", "-id")[:EARLIER])
    return [{"id": e.id, "kind": e.kind, "title": e.title, "severity": e.severity, "state": e.state,
             "opened_at": _ts(e.opened_at), "resolved_at": _ts(e.resolved_at), "url": finding_url(e.id)} for e in qs]


def deliveries(f: Finding) -> list[dict[str, Any]]:
    """The alert deliveries this finding caused, on every endpoint: sent, failed, folded into a group, suppressed."""
    from dashboard.alerts.models import Delivery

    qs = Delivery.objects.filter(finding=f).select_related("endpoint").order_by("-created_at", "-id")[:DELIVERIES]
    cluster = f.cluster.name
    return [{"id": d.id, "endpoint": d.endpoint.name, "endpoint_kind": d.endpoint.kind,
             "endpoint_url": reverse("alerts", args=[cluster]), "event": d.event, "severity": d.severity,
             "status": d.status, "attempts": d.attempts, "max_attempts": d.max_attempts,
             "last_error": d.last_error[:500], "response_code": d.response_code, "duration_ms": d.duration_ms,
             "group": d.group_id, "created_at": _ts(d.created_at), "next_attempt_at": _ts(d.next_attempt_at),
             "finished_at": _ts(d.finished_at), "log_url": reverse("alerts-deliveries", args=[cluster])} for d in qs]


def detail(f: Finding) -> dict[str, Any]:
    # The page needs only the cluster's findings from the stream: narrowed to no node ("-"), it is spared every
    # GPU's deltas and events (a 2,048-node snapshot is megabytes of them).
    return {"finding": finding_info(f), "chart": evidence.chart(f), "earlier": earlier(f),
            "deliveries": deliveries(f), "ws": f"/ws/live/?cluster={f.cluster_id}&only=findings",
            "silences": covering_silences(f), "silence_choices": silence_choices(f)}


@login_required
def finding_detail(request: HttpRequest, finding_id: int) -> HttpResponse:
    f = finding_or_404(request.user, finding_id)
    return render(request, "web/finding.html", {"finding": f, "cluster": f.cluster, "data": detail(f),
                                                **forms_context(request.user, f.cluster)})


@api
def finding_api(request: HttpRequest, finding_id: int) -> dict[str, Any]:
    return detail(finding_or_404(request.user, finding_id))


@login_required
def finding_list(request: HttpRequest, name: str) -> HttpResponse:
    cluster = cluster_or_404(request.user, name)
    runs = list(Run.objects.filter(cluster=cluster).order_by("-id").values("id", "name")[:200])
    hosts = list(Node.objects.filter(cluster=cluster).order_by("hostname").values_list("hostname", flat=True)[:5000])
    data = {"cluster": cluster.name, "cluster_id": cluster.id, "api": "/api/v1/findings",
            "ws": f"/ws/live/?cluster={cluster.id}&only=findings"}
    return render(request, "web/findings.html", {"cluster": cluster, "runs": runs, "hosts": hosts, "kinds": KINDS,
                                                  "severities": SEVERITIES, "states": Finding.State.values,
                                                  "data": data, "silences": silences_of(cluster),
                                                  "scopes": silences.SCOPES, **forms_context(request.user, cluster)})


urlpatterns: list[Any] = [
    path("findings/<int:finding_id>/", finding_detail, name="finding"),
    path("clusters/<slug:name>/findings/", finding_list, name="findings"),
    path("api/v1/findings/<int:finding_id>", finding_api, name="api-finding"),
]

_ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_PANEL = {
    "type": "object", "required": ["id", "title", "x", "series", "thresholds", "direction"],
    "properties": {
        "id": {"type": "string"}, "title": {"type": "string"}, "y_title": {"type": "string"},
        "x": {"enum": ["time", "step", "category"], "description": "time: epoch seconds; step: training step"},
        "type": {"enum": ["line", "bar"]},
        "direction": {"enum": ["above", "below"], "description": "which side of the threshold is bad"},
        "series": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "role": {"enum": ["subject", "baseline", "context"]},
            "x": {"type": "array"}, "y": {"type": "array", "items": {"type": ["number", "null"]}}}}},
        "thresholds": {"type": "array", "description": "the first one is the detector's deciding line",
                       "items": {"type": "object", "properties": {
                           "name": {"type": "string"}, "x": {"type": "array"}, "y": {"type": "array"},
                           "value": {"type": "number", "description": "present when the threshold is constant"}}}},
        "window": {"type": ["array", "null"], "description": "the detector's window, in the panel's x units"},
        "markers": {"type": "array", "items": {"type": "object"}, "description": "Xid events, checkpoints..."},
        "breach": {"type": ["object", "null"], "description": "the subject's worst point vs the threshold: x, y, "
                   "threshold, over"},
    },
}
OPENAPI: dict[str, Any] = {
    "/api/v1/findings/{finding_id}": {"get": {
        "operationId": "getFinding",
        "summary": "One finding: the answer, its evidence as charts with the detector's threshold, earlier findings "
                   "on the same subject, and the alert deliveries it caused",
        "security": [{"session": []}],
        "parameters": [{"name": "finding_id", "in": "path", "required": True, "schema": {"type": "integer"}}],
        "responses": {
            "200": {"description": "The finding", "content": {"application/json": {"schema": {
                "type": "object", "required": ["finding", "chart", "earlier", "deliveries"],
                "properties": {
                    "finding": {"type": "object", "description": "kind, subject, subject_url, severity, state, "
                                "opened_at, updated_at, resolved_at, confidence, action, headline, evidence, url"},
                    "chart": {"type": "object", "required": ["kind", "range", "panels", "numbers"], "properties": {
                        "kind": {"type": "string"}, "range": {"type": "array", "items": {"type": "number"}},
                        "window": {"type": ["array", "null"], "items": {"type": "number"}},
                        "panels": {"type": "array", "items": _PANEL},
                        "numbers": {"type": "array", "items": {"type": "object"}},
                        "thresholds": {"type": "object", "description": "threshold name -> value used"}}},
                    "earlier": {"type": "array", "items": {"type": "object", "description":
                                "id, kind, title, severity, state, opened_at, resolved_at, url"}},
                    "deliveries": {"type": "array", "items": {"type": "object", "description":
                                   "endpoint, endpoint_kind, event, status, attempts, max_attempts, last_error, "
                                   "response_code, created_at, finished_at, next_attempt_at, group"}},
                    "ws": {"type": "string", "description": "the live stream that carries this finding's changes"},
                }}}}},
            "401": {"description": "Not logged in", **_ERROR},
            "404": {"description": "No such finding (or not yours)", **_ERROR},
        }}},
}
