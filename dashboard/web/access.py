"""Who may see what, in one place, for pages and the JSON API alike.

Every page and API is login-required and scoped to the clusters the user is a member of. An outsider gets 404, never
403: a 403 would tell them the cluster, node, run or finding exists.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.gzip import gzip_page

from dashboard.telemetry.models import ROLE_RANK, Cluster, Membership, Node, Role, Run


def visible_clusters(user: object) -> QuerySet[Cluster]:
    if getattr(user, "is_superuser", False):
        return Cluster.objects.all()
    return Cluster.objects.filter(members=user)


def role_of(user: object, cluster: Cluster) -> str | None:
    """The user's role in ``cluster`` (a superuser is an owner everywhere), or None for an outsider."""
    if not getattr(user, "is_authenticated", False):
        return None
    if getattr(user, "is_superuser", False):
        return Role.OWNER
    return Membership.objects.filter(cluster=cluster, user_id=getattr(user, "pk", None)).values_list("role", flat=True).first()


def has_role(user: object, cluster: Cluster, minimum: str) -> bool:
    """Whether the user holds ``minimum`` or a higher role (viewer < member < owner) in ``cluster``."""
    role = role_of(user, cluster)
    return role is not None and ROLE_RANK[Role(role)] >= ROLE_RANK[Role(minimum)]


def require_role(user: object, cluster: Cluster, minimum: str) -> None:
    """404 for an outsider (the cluster's existence stays secret), 403 for a member whose role is too low."""
    role = role_of(user, cluster)
    if role is None:
        raise Http404("no such cluster")
    if ROLE_RANK[Role(role)] < ROLE_RANK[Role(minimum)]:
        raise PermissionDenied(f"this needs the {minimum} role in {cluster.name}; you are a {role}")


def cluster_or_404(user: object, name: str) -> Cluster:
    cluster = visible_clusters(user).filter(name=name).first()
    if cluster is None:
        raise Http404("no such cluster")
    return cluster


def node_or_404(user: object, cluster_name: str, host: str) -> Node:
    cluster = cluster_or_404(user, cluster_name)
    if "\x00" in host:  # PostgreSQL refuses NUL in a query string (a 500); no host name holds one (wire.Hostname)
        raise Http404("no such node")
    node = Node.objects.filter(cluster=cluster, hostname=host).select_related("cluster").first()
    if node is None:
        raise Http404("no such node")
    return node


def run_or_404(user: object, run_id: int) -> Run:
    run = Run.objects.select_related("cluster").filter(id=run_id).first()
    if run is None or not run.cluster.visible_to(user):
        raise Http404("no such run")
    return run


def finding_or_404(user: object, finding_id: int) -> Any:
    from dashboard.diagnosis.models import Finding

    finding = (Finding.objects.select_related("cluster", "run", "node", "peer_node")
               .filter(id=finding_id, cluster__in=visible_clusters(user)).first())
    if finding is None:
        raise Http404("no such finding")
    return finding


class BadRequest(ValueError):
    """A query parameter the API cannot use; answered 400 with the message."""


def api_error(status: int, code: str, detail: str) -> JsonResponse:
    return JsonResponse({"error": code, "detail": detail}, status=status)


def _json_safe(value: Any) -> Any:
    """NaN and infinities become null: the browser's JSON.parse rejects them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def api(view: Callable[..., dict[str, Any]]) -> Callable[..., HttpResponse]:
    """A read-only JSON API view: GET only, session or personal-token auth (dashboard.accounts.middleware sets
    ``request.user`` from ``Authorization: Bearer``), 401 / 404 / 400 as JSON with the reason.

    The view returns a plain dict; this turns it into the response, so every endpoint answers errors alike."""

    @wraps(view)
    def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if request.method not in ("GET", "HEAD"):
            return api_error(405, "method_not_allowed", "this endpoint is read-only: use GET")
        if not request.user.is_authenticated:
            return api_error(401, "unauthenticated",
                             "log in first (session cookie) or send Authorization: Bearer <personal API token>")
        try:
            body = view(request, *args, **kwargs)
        except Http404 as exc:
            return api_error(404, "not_found", str(exc) or "not found")
        except BadRequest as exc:
            return api_error(400, "bad_request", str(exc))
        try:
            return JsonResponse(body)
        except ValueError:  # a NaN slipped through: clean it rather than answer 500
            return HttpResponse(json.dumps(_json_safe(body)), content_type="application/json")

    # JSON of thousands of nodes compresses ~10x; nothing secret is reflected in these bodies (no BREACH oracle).
    return gzip_page(wrapped)


def epoch_param(request: HttpRequest, name: str) -> float | None:
    """``?name=`` as seconds since 1970, or None when absent. NaN, infinities and far-off times have no datetime: a
    400 with the reason, never a 500."""
    raw = request.GET.get(name)
    if raw in (None, ""):
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1e11:
        raise BadRequest(f"{name} must be seconds since 1970, got {raw[:40]!r}")
    return value


def int_param(request: HttpRequest, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.GET.get(name)
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be an integer, got {raw[:40]!r}") from None
    if not lo <= value <= hi:
        raise BadRequest(f"{name} must be between {lo} and {hi}")
    return value
