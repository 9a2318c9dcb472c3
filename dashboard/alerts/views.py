"""Pages for alert endpoints and the delivery log. Login required; a cluster the user is not a member of is a 404
(as on every page), and every change is a CSRF-protected POST. Every member reads them; a member may also send a test
(the on-call checking the path); adding, enabling, disabling and deleting an endpoint is an owner's, audit-logged."""

from __future__ import annotations

import re
from http import HTTPStatus

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from dashboard.alerts import endpoints
from dashboard.alerts.models import Delivery, Endpoint
from dashboard.diagnosis.models import SEVERITIES
from dashboard.telemetry import audit
from dashboard.telemetry.models import Cluster, Role
from dashboard.web.access import has_role, require_role, visible_clusters

LOG_ROWS = 200
_KNOWN_CODES = {s.value for s in HTTPStatus}
_OLD_EXCERPT = re.compile(r"(?P<status>HTTP \d{3}): .*?(?P<suffix> \((?:gave up after \d+ attempts|test sends are not "
                          r"retried)\))?$", re.DOTALL)


class EndpointForm(forms.Form):
    name = forms.CharField(max_length=64)
    kind = forms.ChoiceField(choices=Endpoint.Kind.choices)
    url = forms.CharField(max_length=500, required=False, help_text="PagerDuty: leave empty for the Events API v2")
    secret = forms.CharField(max_length=200, required=False,
                             help_text="Webhook: empty to generate one. PagerDuty: the routing key.")
    min_severity = forms.ChoiceField(choices=[(s, s) for s in SEVERITIES], initial="warning")
    kinds = forms.CharField(max_length=500, required=False, help_text="Finding kinds, comma-separated; empty: all")
    max_per_hour = forms.IntegerField(min_value=1, max_value=10_000, initial=30)


def _cluster(request: HttpRequest, name: str) -> Cluster:
    return get_object_or_404(visible_clusters(request.user), name=name)


@login_required
@require_http_methods(["GET", "POST"])
def endpoint_list(request: HttpRequest, name: str) -> HttpResponse:
    cluster = _cluster(request, name)
    if request.method == "POST":
        require_role(request.user, cluster, Role.OWNER)
    form = EndpointForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        kinds = [k.strip() for k in data["kinds"].split(",") if k.strip()]
        try:
            endpoint, secret = endpoints.create(cluster, name=data["name"], kind=data["kind"], url=data["url"],
                                                secret=data["secret"], min_severity=data["min_severity"],
                                                kinds=kinds, max_per_hour=data["max_per_hour"], user=request.user)
        except ValueError as exc:
            form.add_error(None, str(exc))
        else:
            audit.record(request.user, "webhook.create", cluster=cluster, target=endpoint.name, kind=endpoint.kind)
            # Rendered, not redirected: the secret is in this one response and stored in no session or cookie.
            return render(request, "alerts/created.html", {"cluster": cluster, "endpoint": endpoint,
                                                           "secret": secret})
    rows = [(e, endpoints.masked_url(e)) for e in cluster.alert_endpoints.order_by("name", "id")]
    return render(request, "alerts/endpoints.html", {"cluster": cluster, "rows": rows, "form": form,
                                                     "is_owner": has_role(request.user, cluster, Role.OWNER),
                                                     "can_test": has_role(request.user, cluster, Role.MEMBER)})


@login_required
@require_POST
def endpoint_action(request: HttpRequest, name: str, pk: int, action: str) -> HttpResponse:
    cluster = _cluster(request, name)
    endpoint = get_object_or_404(Endpoint, pk=pk, cluster=cluster)
    if action not in ("test", "enable", "disable", "delete"):
        raise Http404("no such action")
    require_role(request.user, cluster, Role.MEMBER if action == "test" else Role.OWNER)
    if action == "test":
        row = endpoints.send_test(endpoint)
        level = messages.SUCCESS if row.status == Delivery.Status.DELIVERED else messages.ERROR
        messages.add_message(request, level, f"Test to {endpoint.name}: {row.status} {_outcome(row)}".rstrip())
    elif action in ("enable", "disable"):
        endpoint.enabled = action == "enable"
        endpoint.save(update_fields=["enabled"])
        audit.record(request.user, f"webhook.{action}", cluster=cluster, target=endpoint.name)
        messages.info(request, f"{endpoint.name} {action}d")
    else:
        endpoint.delete()
        audit.record(request.user, "webhook.delete", cluster=cluster, target=endpoint.name)
        messages.info(request, f"{endpoint.name} deleted")
    return redirect("alerts", name=cluster.name)


def _outcome(row: Delivery) -> str:
    """The status code with its standard reason, or our own reason when nothing answered: never the receiver's reply
    (a member could otherwise read an internal service through a test send)."""
    if not row.response_code:
        return f"({row.last_error})" if row.last_error else ""
    phrase = HTTPStatus(row.response_code).phrase if row.response_code in _KNOWN_CODES else ""
    return f"HTTP {row.response_code} {phrase}".rstrip()


@login_required
def delivery_log(request: HttpRequest, name: str) -> HttpResponse:
    cluster = _cluster(request, name)
    rows = (Delivery.objects.filter(endpoint__cluster=cluster).select_related("endpoint", "finding")
            .order_by("-created_at", "-id"))
    endpoint_id = request.GET.get("endpoint", "")
    if endpoint_id.isdigit():
        rows = rows.filter(endpoint_id=int(endpoint_id))
    rows = list(rows[:LOG_ROWS])
    for row in rows:
        row.shown_error = _without_reply(row.last_error)  # type: ignore[attr-defined]
    return render(request, "alerts/deliveries.html", {"cluster": cluster, "rows": rows})


def _without_reply(error: str) -> str:
    """Rows stored before replies were dropped read "HTTP 404: <reply>": show them without it, too."""
    old = _OLD_EXCERPT.match(error)
    return f"{old['status']}{old['suffix'] or ''}" if old else error
