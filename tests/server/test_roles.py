"""Roles per cluster on every mutating endpoint: an outsider gets 404, a role below the one needed 403, and neither
changes anything; the lowest role allowed does. Viewers read every page, API and the websocket; outsiders nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from dashboard.alerts import endpoints
from dashboard.alerts.models import Delivery, Endpoint
from dashboard.telemetry.models import AuditEntry, Cluster, IngestToken, Membership, Run
from tests.server.conftest import AsgiServer, World, make_batch, post, session_cookie

ROLES = ("outsider", "viewer", "member", "owner")


@pytest.fixture
def people(world: World, django_user_model: Any) -> dict[str, Any]:
    viewer = django_user_model.objects.create_user("victor")
    world.cluster.members.add(viewer, through_defaults={"role": "viewer"})
    django_user_model.objects.create_user("carol")
    return {"outsider": world.outsider, "viewer": viewer, "member": world.teammate, "owner": world.owner}


def _state() -> tuple[Any, ...]:
    """Everything a mutation here may change, to compare before and after."""
    return (sorted(Membership.objects.values_list("cluster__name", "user__username", "role")),
            sorted(Endpoint.objects.values_list("name", "enabled")), Delivery.objects.count(),
            sorted(IngestToken.objects.values_list("prefix", "revoked_at")),
            sorted(Cluster.objects.values_list("name", "interconnect")), AuditEntry.objects.count())


def _endpoint(world: World) -> int:
    return endpoints.create(world.cluster, name="oncall", kind="webhook", url="http://127.0.0.1:9/hook")[0].id


def _token(world: World) -> str:
    return IngestToken.objects.get(cluster=world.cluster).prefix


# (path, form, lowest role that may do it). Paths and forms are built per test: "{ep}" an endpoint of prod-a.
MUTATIONS: list[tuple[str, Callable[[World], dict[str, str]], str]] = [
    ("/clusters/prod-a/alerts/", lambda w: {"name": "pager", "kind": "webhook", "url": "https://hooks.example.com/x",
                                            "min_severity": "error", "max_per_hour": "5"}, "owner"),
    ("/clusters/prod-a/alerts/{ep}/test/", lambda w: {}, "member"),
    ("/clusters/prod-a/alerts/{ep}/disable/", lambda w: {}, "owner"),
    ("/clusters/prod-a/alerts/{ep}/delete/", lambda w: {}, "owner"),
    ("/clusters/prod-a/settings/member-set/", lambda w: {"username": "carol", "role": "viewer"}, "owner"),
    ("/clusters/prod-a/settings/member-remove/", lambda w: {"username": "bob"}, "owner"),
    ("/clusters/prod-a/settings/token-create/", lambda w: {"name": "jobs", "scope": "hook"}, "owner"),
    ("/clusters/prod-a/settings/token-revoke/", lambda w: {"prefix": _token(w)}, "owner"),
    ("/clusters/prod-a/settings/interconnect/", lambda w: {"interconnect": "eth"}, "owner"),
]


@pytest.mark.parametrize(("path", "form", "lowest"), MUTATIONS, ids=[m[0].split("prod-a/")[1] for m in MUTATIONS])
def test_each_change_needs_its_role(world: World, people: dict[str, Any], client: Client, path: str,
                                    form: Callable[[World], dict[str, str]], lowest: str) -> None:
    url = path.format(ep=_endpoint(world))
    for role in ROLES:
        before = _state()
        client.force_login(people[role])
        answer = client.post(url, form(world))
        if ROLES.index(role) < ROLES.index(lowest):
            assert answer.status_code == (404 if role == "outsider" else 403), (role, answer.status_code)
            assert _state() == before, f"a {role} changed something"
        else:
            assert answer.status_code in (200, 302), (role, answer.status_code, answer.content[:300])
            assert _state() != before, f"the {role}'s change did nothing"
            return


READS = ["/clusters/prod-a/", "/clusters/prod-a/settings/", "/clusters/prod-a/alerts/",
         "/clusters/prod-a/alerts/deliveries/", "/clusters/prod-a/findings/", "/clusters/prod-a/links/",
         "/clusters/prod-a/nodes/node-000/", "/runs/{run}/", "/api/v1/clusters/prod-a/overview",
         "/api/v1/clusters/prod-a/events", "/api/v1/runs/{run}/settings", "/api/v1/runs/{run}/nccl",
         "/api/v1/clusters/prod-a/nodes/node-000"]


def test_a_viewer_reads_every_page_and_an_outsider_none(world: World, people: dict[str, Any], client: Client) -> None:
    assert post(client, make_batch(), world.token).status_code == 200
    run = Run.objects.get(name="run-1").id
    for role, expected in (("viewer", 200), ("outsider", 404)):
        client.force_login(people[role])
        for path in READS:
            assert client.get(path.format(run=run)).status_code == expected, (role, path)
    client.force_login(people["viewer"])
    page = client.get("/clusters/prod-a/settings/").content.decode()
    assert "Read-only" in page and "member-remove" not in page and "token-create" not in page
    alerts = client.get("/clusters/prod-a/alerts/").content.decode()
    assert "Add an endpoint" not in alerts


def test_the_websocket_admits_every_role_and_no_outsider(asgi_server: AsgiServer, world: World, client: Client,
                                                        people: dict[str, Any]) -> None:
    from websockets.exceptions import InvalidStatus

    from tests.server.test_live import recv_json, ws_connect

    for role in ("viewer", "member", "owner"):
        with ws_connect(asgi_server, f"/ws/live/?cluster={world.cluster.id}", session_cookie(client, people[role])) as ws:
            assert recv_json(ws)["type"] == "snapshot", role
    with pytest.raises(InvalidStatus) as refused:
        ws_connect(asgi_server, f"/ws/live/?cluster={world.cluster.id}", session_cookie(client, people["outsider"]))
    assert refused.value.response.status_code == 403
