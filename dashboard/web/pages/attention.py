"""Acknowledge a finding, silence a subject: the forms on the pages and the JSON API for scripts.

Both need the member role in the finding's cluster (a viewer gets 403, an outsider 404, as everywhere). The page
forms are plain CSRF-protected POSTs that return to the page they came from; the JSON API takes the same session
(with its CSRF header) and answers errors as ``{"error", "detail"}``. The rules live in
:mod:`dashboard.diagnosis.silences`; this module only checks who may and turns input into calls.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import render
from django.urls import path
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from dashboard.diagnosis import silences
from dashboard.diagnosis.models import Silence
from dashboard.telemetry.models import Cluster
from dashboard.web.access import api_error, cluster_or_404, finding_or_404, has_role, require_role

RECENT = 50  # ended silences listed with ?state=all
DURATIONS = [(60, "1 hour"), (240, "4 hours"), (720, "12 hours"), (1440, "1 day"), (4320, "3 days"),
             (10080, "7 days")]


def can_act(user: Any, cluster: Cluster) -> bool:
    """Whether the pages show this user the acknowledge and silence buttons."""
    return has_role(user, cluster, "member")


def forms_context(user: Any, cluster: Cluster) -> dict[str, Any]:
    """What a page's template needs to draw the forms: whether to, and the duration choices."""
    return {"can_act": can_act(user, cluster), "durations": DURATIONS}


def silences_of(cluster: Cluster, *, ended: bool = False) -> list[dict[str, Any]]:
    now = timezone.now()
    qs = Silence.objects.filter(cluster=cluster)
    qs = qs.filter(ends_at__lte=now).order_by("-ends_at")[:RECENT] if ended else \
        qs.filter(starts_at__lte=now, ends_at__gt=now).order_by("ends_at")
    return [silences.silence_info(s) for s in qs]


# -- JSON API ---------------------------------------------------------------------------------------------------------
def _json_api(view: Callable[..., tuple[int, dict[str, Any]]]) -> Callable[..., HttpResponse]:
    """Session auth; 401 / 403 / 404 / 400 as JSON with the reason, never a 500 for bad input."""

    @wraps(view)
    def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not request.user.is_authenticated:
            return api_error(401, "unauthenticated", "log in first (session cookie)")
        try:
            status, body = view(request, *args, **kwargs)
        except Http404 as exc:
            return api_error(404, "not_found", str(exc) or "not found")
        except PermissionDenied as exc:
            return api_error(403, "forbidden", str(exc))
        except silences.Refused as exc:
            return api_error(400, "bad_request", str(exc))
        return JsonResponse(body, status=status)

    return wrapped


def _body(request: HttpRequest) -> dict[str, Any]:
    try:
        body = json.loads(request.body or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise silences.Refused(f"the body must be a JSON object: {exc}") from None
    if not isinstance(body, dict):
        raise silences.Refused("the body must be a JSON object")
    return body


def _ack_state(f: Any) -> dict[str, Any]:
    return {"id": f.id, "state": f.state, "acked_by": f.acked_by_name or None,
            "acked_at": f.acked_at.timestamp() if f.acked_at else None}


@_json_api
def ack_api(request: HttpRequest, finding_id: int) -> tuple[int, dict[str, Any]]:
    """POST acknowledges, DELETE takes it back."""
    if request.method not in ("POST", "DELETE"):
        return 405, {"error": "method_not_allowed", "detail": "POST acknowledges, DELETE takes the acknowledgement back"}
    f = finding_or_404(request.user, finding_id)
    require_role(request.user, f.cluster, "member")
    if request.method == "POST" and f.state != "open":
        raise silences.Refused("only an open finding can be acknowledged (this one has resolved)")
    changed = silences.acknowledge(f, request.user, on=request.method == "POST")
    return 200, {"finding": _ack_state(f), "changed": changed}


@_json_api
def silences_api(request: HttpRequest, name: str) -> tuple[int, dict[str, Any]]:
    """GET lists the active silences (``?state=ended``: the last ones that ended); POST creates one."""
    cluster = cluster_or_404(request.user, name)
    if request.method == "GET":
        ended = request.GET.get("state", "active")
        if ended not in ("active", "ended"):
            raise silences.Refused(f"state must be active or ended, got {ended[:40]!r}")
        return 200, {"silences": silences_of(cluster, ended=ended == "ended")}
    if request.method != "POST":
        return 405, {"error": "method_not_allowed", "detail": "GET lists, POST creates"}
    require_role(request.user, cluster, "member")
    body = _body(request)
    s = silences.create_silence(cluster, request.user, str(body.get("scope", "")), str(body.get("target", "")),
                                body.get("minutes"), str(body.get("reason", "")))  # type: ignore[arg-type]
    return 201, {"silence": silences.silence_info(s)}


def _silence_or_404(user: Any, silence_id: int) -> Silence:
    s = Silence.objects.select_related("cluster").filter(id=silence_id).first()
    if s is None or not s.cluster.visible_to(user):
        raise Http404("no such silence")
    return s


@_json_api
def end_api(request: HttpRequest, silence_id: int) -> tuple[int, dict[str, Any]]:
    if request.method != "POST":
        return 405, {"error": "method_not_allowed", "detail": "POST ends the silence now"}
    s = _silence_or_404(request.user, silence_id)
    require_role(request.user, s.cluster, "member")
    changed = silences.end_silence(s, request.user)
    return 200, {"silence": silences.silence_info(s), "changed": changed}


# -- page forms -------------------------------------------------------------------------------------------------------
def _next(request: HttpRequest, fallback: str) -> str:
    """The page the form came from (``next``), if it is on this site: never a redirect elsewhere."""
    nxt = request.POST.get("next", "")
    ok = url_has_allowed_host_and_scheme(nxt, allowed_hosts={request.get_host()}, require_https=request.is_secure())
    return nxt if nxt and ok else fallback


def _back(request: HttpRequest, fallback: str) -> HttpResponseRedirect:
    return HttpResponseRedirect(_next(request, fallback))


def _refused(request: HttpRequest, exc: Exception, back: str) -> HttpResponse:
    return render(request, "web/refused.html", {"reason": str(exc), "back": back}, status=400)


@require_POST
@login_required
def ack_form(request: HttpRequest, finding_id: int) -> HttpResponse:
    f = finding_or_404(request.user, finding_id)
    require_role(request.user, f.cluster, "member")
    silences.acknowledge(f, request.user, on=request.POST.get("ack", "1") != "0")
    return _back(request, f"/findings/{f.id}/")


@require_POST
@login_required
def silence_form(request: HttpRequest, name: str) -> HttpResponse:
    cluster = cluster_or_404(request.user, name)
    require_role(request.user, cluster, "member")
    back = _next(request, f"/clusters/{cluster.name}/findings/")
    # The finding page offers its subjects as one choice, "<scope>:<target>"; other forms send the two apart.
    scope, _, target = request.POST.get("what", "").partition(":")
    if not request.POST.get("what"):
        scope, target = request.POST.get("scope", ""), request.POST.get("target", "")
    try:
        minutes = float(request.POST.get("minutes", ""))
    except ValueError:
        return _refused(request, silences.Refused("choose how long the silence lasts"), back)
    try:
        silences.create_silence(cluster, request.user, scope, target, minutes, request.POST.get("reason", ""))
    except silences.Refused as exc:
        return _refused(request, exc, back)
    return HttpResponseRedirect(back)


@require_POST
@login_required
def end_form(request: HttpRequest, silence_id: int) -> HttpResponse:
    s = _silence_or_404(request.user, silence_id)
    require_role(request.user, s.cluster, "member")
    silences.end_silence(s, request.user)
    return _back(request, f"/clusters/{s.cluster.name}/findings/")


urlpatterns: list[Any] = [
    path("findings/<int:finding_id>/ack", ack_form, name="finding-ack"),
    path("clusters/<slug:name>/silences/", silence_form, name="silence-create"),
    path("silences/<int:silence_id>/end", end_form, name="silence-end"),
    path("api/v1/findings/<int:finding_id>/ack", ack_api, name="api-finding-ack"),
    path("api/v1/clusters/<slug:name>/silences", silences_api, name="api-silences"),
    path("api/v1/silences/<int:silence_id>/end", end_api, name="api-silence-end"),
]

_ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_WHO = {"401": {"description": "Not logged in", **_ERROR},
        "403": {"description": "Your role in the cluster is below member (viewer), or no CSRF token", **_ERROR},
        "404": {"description": "No such finding, cluster or silence (or not yours)", **_ERROR}}
_SILENCE = {"type": "object", "properties": {
    "id": {"type": "integer"}, "scope": {"enum": silences.SCOPES}, "target": {"type": "string"},
    "reason": {"type": "string"}, "by": {"type": "string"}, "starts_at": {"type": "number"},
    "ends_at": {"type": "number"}, "ended_by": {"type": ["string", "null"]}}}
_ACK = {"200": {"description": "The finding's acknowledgement now; changed is false when it already was",
                "content": {"application/json": {"schema": {"type": "object", "properties": {
                    "finding": {"type": "object", "description": "id, state, acked_by, acked_at"},
                    "changed": {"type": "boolean"}}}}}},
        "400": {"description": "The finding has resolved", **_ERROR}, **_WHO}
_FID = [{"name": "finding_id", "in": "path", "required": True, "schema": {"type": "integer"}}]
OPENAPI: dict[str, Any] = {
    "/api/v1/findings/{finding_id}/ack": {
        "post": {"operationId": "ackFinding", "summary": "Acknowledge an open finding: no more alerts about it "
                 "until it resolves (member role; session with X-CSRFToken)", "security": [{"session": []}],
                 "parameters": _FID, "responses": _ACK},
        "delete": {"operationId": "unackFinding", "summary": "Take an acknowledgement back (member role)",
                   "security": [{"session": []}], "parameters": _FID, "responses": _ACK},
    },
    "/api/v1/clusters/{name}/silences": {
        "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
        "get": {"operationId": "listSilences", "summary": "The cluster's active silences (state=ended: the last "
                "ones that ended)", "security": [{"session": []}],
                "parameters": [{"name": "state", "in": "query", "required": False,
                                "schema": {"enum": ["active", "ended"]}}],
                "responses": {"200": {"description": "Silences", "content": {"application/json": {"schema": {
                    "type": "object", "properties": {"silences": {"type": "array", "items": _SILENCE}}}}}},
                    "400": {"description": "A bad state", **_ERROR}, **_WHO}},
        "post": {"operationId": "createSilence", "summary": "Silence a node, GPU, link, run or finding kind for a "
                 "time: its findings open and show, but send no alert until it ends (member role)",
                 "security": [{"session": []}],
                 "requestBody": {"required": True, "content": {"application/json": {"schema": {
                     "type": "object", "required": ["scope", "target", "minutes", "reason"], "properties": {
                         "scope": {"enum": silences.SCOPES},
                         "target": {"type": "string", "description": "node: host; gpu: host/gpuN; link: host~host; "
                                    "run: run id or name; kind: a finding kind"},
                         "minutes": {"type": "number", "minimum": 1, "maximum": 43200},
                         "reason": {"type": "string", "maxLength": 500}}}}}},
                 "responses": {"201": {"description": "The silence", "content": {"application/json": {"schema": {
                     "type": "object", "properties": {"silence": _SILENCE}}}}},
                     "400": {"description": "A bad scope, target, duration or reason (the reason in detail)",
                             **_ERROR}, **_WHO}},
    },
    "/api/v1/silences/{silence_id}/end": {"post": {
        "operationId": "endSilence", "summary": "End a silence now; alerts held back for findings still open go out "
        "(member role)", "security": [{"session": []}],
        "parameters": [{"name": "silence_id", "in": "path", "required": True, "schema": {"type": "integer"}}],
        "responses": {"200": {"description": "The silence; changed is false when it had already ended",
                              "content": {"application/json": {"schema": {"type": "object", "properties": {
                                  "silence": _SILENCE, "changed": {"type": "boolean"}}}}}}, **_WHO}}},
}
