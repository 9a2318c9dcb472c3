"""A cluster's settings (``/clusters/<name>/settings/``): members and their roles, ingest tokens, webhooks, the
interconnect, and the audit log.

Every member reads it (the page shows the role one holds); only an owner sees the forms, and every change is a
CSRF-protected POST that checks the owner role itself (:func:`dashboard.web.access.require_role`): 404 for an
outsider, 403 for a viewer or member. A refused change re-renders the page with the reason and a 400.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth import get_user_model
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import path
from django.views.decorators.http import require_POST

from clusterdx.topology import TopologyError
from dashboard.accounts import members
from dashboard.telemetry import audit, interconnect, placement, tokens
from dashboard.telemetry.models import Cluster, IngestToken, Membership, Node, Role
from dashboard.web.access import cluster_or_404, require_role, role_of

AUDIT_PAGE = 50


def _context(request: HttpRequest, cluster: Cluster) -> dict[str, Any]:
    role = role_of(request.user, cluster)
    found = interconnect.detected(cluster)
    log = Paginator(cluster.audit.order_by("-at", "-id"), AUDIT_PAGE).get_page(request.GET.get("page"))
    return {
        "cluster": cluster, "role": role, "is_owner": role == Role.OWNER, "roles": Role.values,
        "memberships": Membership.objects.filter(cluster=cluster).select_related("user").order_by("user__username"),
        "tokens": IngestToken.objects.filter(cluster=cluster).order_by("revoked_at", "-created_at"),
        "scopes": tokens.SCOPES, "endpoints": cluster.alert_endpoints.order_by("name", "id"),
        "interconnects": [(k, "auto: use the detected one" if k == "auto" else interconnect.LABELS[k])
                          for k in members.INTERCONNECTS],
        "detected": found, "detected_label": interconnect.LABELS.get(found.kind or "", "nothing yet"),
        "audit": log, "placed_by_file": Node.objects.filter(cluster=cluster, placed_by="file").count(),
    }


@login_required
def settings_page(request: HttpRequest, name: str) -> HttpResponse:
    cluster = cluster_or_404(request.user, name)
    return render(request, "web/settings.html", _context(request, cluster))


@login_required
@require_POST
def settings_action(request: HttpRequest, name: str, action: str) -> HttpResponse:
    cluster = cluster_or_404(request.user, name)
    require_role(request.user, cluster, Role.OWNER)
    handler = ACTIONS.get(action)
    if handler is None:
        raise Http404("no such action")
    try:
        answer = handler(request, cluster)
    except members.Refused as exc:
        messages.error(request, str(exc))
        return render(request, "web/settings.html", _context(request, cluster), status=400)
    return answer or redirect("cluster-settings", name=cluster.name)


def _user(request: HttpRequest) -> Any:
    username = request.POST.get("username", "").strip()
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        raise members.Refused(f"no user named {username[:150]!r} (clusterdx user add NAME creates one)")
    return user


def _member_set(request: HttpRequest, cluster: Cluster) -> None:
    user = _user(request)
    done = members.set_role(cluster, user, request.POST.get("role", ""), actor=request.user)
    messages.info(request, f"{user.username}: {done} as {request.POST['role']}")


def _member_remove(request: HttpRequest, cluster: Cluster) -> HttpResponse | None:
    user = _user(request)
    if not members.remove(cluster, user, actor=request.user):
        raise members.Refused(f"{user.username} is not a member of {cluster.name}")
    messages.info(request, f"{user.username} removed from {cluster.name}")
    # An owner who left no longer sees the cluster: its settings page would be a 404.
    return None if role_of(request.user, cluster) else redirect("home")


def _token_create(request: HttpRequest, cluster: Cluster) -> HttpResponse:
    scope = request.POST.get("scope", "")
    hosts = request.POST.get("hosts", "").replace(",", " ").split()
    try:
        row, secret = tokens.create_token(cluster, request.POST.get("name", "").strip()[:64], scope=scope, hosts=hosts)
    except ValueError as exc:
        raise members.Refused(str(exc)) from None
    audit.record(request.user, "token.create", cluster=cluster, target=row.prefix, scope=row.scope, hosts=row.hosts)
    # Rendered, not redirected: the secret is in this one response and stored in no session or cookie.
    return render(request, "web/settings.html", {**_context(request, cluster), "created": row, "secret": secret})


def _token_revoke(request: HttpRequest, cluster: Cluster) -> None:
    prefix = request.POST.get("prefix", "")
    if not IngestToken.objects.filter(cluster=cluster, prefix=prefix, revoked_at=None).exists():
        raise members.Refused(f"no active token {prefix[:20]!r} in {cluster.name}")
    tokens.revoke(prefix)
    audit.record(request.user, "token.revoke", cluster=cluster, target=prefix)
    messages.info(request, f"token {prefix} revoked")


def _interconnect(request: HttpRequest, cluster: Cluster) -> None:
    if members.set_interconnect(cluster, request.POST.get("interconnect", ""), actor=request.user):
        messages.info(request, f"interconnect: {cluster.interconnect_label()}")


def _topology(request: HttpRequest, cluster: Cluster) -> None:
    upload = request.FILES.get("file")
    if upload is None:
        raise members.Refused("choose a topology file (CSV host,rack,switch,spine, JSON, or Slurm's topology.conf)")
    if upload.size is not None and upload.size > placement.MAX_BYTES:
        raise members.Refused(f"{upload.name}: {upload.size} bytes, at most {placement.MAX_BYTES}")
    try:
        done = placement.upload(cluster, upload.read(), upload.name or "upload", actor=request.user)
    except TopologyError as exc:
        raise members.Refused(f"{upload.name}: {exc}") from None
    messages.info(request, done.summary(cluster))


ACTIONS = {"member-set": _member_set, "member-remove": _member_remove, "token-create": _token_create,
           "token-revoke": _token_revoke, "interconnect": _interconnect, "topology": _topology}

urlpatterns = [
    path("clusters/<slug:name>/settings/", settings_page, name="cluster-settings"),
    path("clusters/<slug:name>/settings/<str:action>/", settings_action, name="cluster-settings-action"),
]
