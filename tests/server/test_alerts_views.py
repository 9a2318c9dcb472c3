"""Alert pages: members manage their cluster's endpoints and see its delivery log; nobody else learns they exist."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client

from dashboard.alerts import endpoints
from dashboard.alerts.models import Delivery, Endpoint
from tests.alerts.alerts_support import Receiver, drain, make_finding, signal
from tests.server.conftest import World


@pytest.fixture(autouse=True)
def _embedded_alerts(settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from dashboard.celery import app

    settings.CLUSTERDX = {**settings.CLUSTERDX, "ALERTS_ALLOW_PRIVATE": True, "ALERTS_GROUP_WAIT_S": 0.0}
    # Runs before `world` creates its users: a fast hasher saves about a second per test.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    monkeypatch.setitem(app.conf, "task_always_eager", True)  # deliveries are made by the test, never enqueued


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()


def login(client: Client, user: Any) -> Client:
    client.force_login(user)
    return client


def add_webhook(world: World, url: str) -> Endpoint:
    return endpoints.create(world.cluster, name="oncall", kind="webhook", url=url)[0]


def test_it_adds_an_endpoint_and_shows_the_secret_once(world: World, client: Client, receiver: Receiver) -> None:
    login(client, world.owner)
    page = client.post("/clusters/prod-a/alerts/", {"name": "oncall", "kind": "webhook", "url": receiver.url,
                                                    "min_severity": "error", "kinds": "failing_gpu", "max_per_hour": 5})
    endpoint = Endpoint.objects.get()
    assert page.status_code == 200 and endpoint.secret in page.content.decode()
    assert (endpoint.cluster, endpoint.created_by, endpoint.kinds, endpoint.max_per_hour) == (
        world.cluster, world.owner, ["failing_gpu"], 5)
    listing = client.get("/clusters/prod-a/alerts/").content.decode()
    assert "oncall" in listing and endpoint.secret not in listing


def test_a_bad_endpoint_is_refused_with_the_reason(world: World, client: Client) -> None:
    login(client, world.owner)
    page = client.post("/clusters/prod-a/alerts/", {"name": "pd", "kind": "pagerduty", "secret": "nope",
                                                    "min_severity": "error", "max_per_hour": 5})
    assert page.status_code == 200 and not Endpoint.objects.exists()
    assert "the secret must be the 32-character routing (integration) key" in page.content.decode()


def test_slack_urls_are_masked_on_the_page(world: World, client: Client) -> None:
    endpoints.create(world.cluster, name="chat", kind="slack", url="https://hooks.slack.com/services/T/B/topsecret")
    page = login(client, world.teammate).get("/clusters/prod-a/alerts/").content.decode()
    assert "topsecret" not in page and "https://hooks.slack.com/…" in page


def test_a_teammate_sends_a_test_and_sees_the_log(world: World, client: Client, receiver: Receiver) -> None:
    endpoint = add_webhook(world, receiver.url)
    receiver.secret = endpoint.secret
    login(client, world.teammate)
    page = client.post(f"/clusters/prod-a/alerts/{endpoint.id}/test/", follow=True)
    assert "Test to oncall: delivered HTTP 200" in page.content.decode()
    assert receiver.requests[0].verified is True
    signal(make_finding(world.cluster, subject="node-007"), "opened")
    drain()
    log = client.get("/clusters/prod-a/alerts/deliveries/").content.decode()
    assert log.count('class="status-delivered"') == 2 and "node-007" in log


def test_enable_disable_and_delete(world: World, client: Client, receiver: Receiver) -> None:
    endpoint = add_webhook(world, receiver.url)
    login(client, world.owner)
    client.post(f"/clusters/prod-a/alerts/{endpoint.id}/disable/")
    assert not Endpoint.objects.get().enabled
    client.post(f"/clusters/prod-a/alerts/{endpoint.id}/enable/")
    assert Endpoint.objects.get().enabled
    client.post(f"/clusters/prod-a/alerts/{endpoint.id}/delete/")
    assert not Endpoint.objects.exists()


def test_an_outsider_sees_and_changes_nothing(world: World, client: Client, receiver: Receiver) -> None:
    endpoint = add_webhook(world, receiver.url)
    login(client, world.outsider)
    assert client.get("/clusters/prod-a/alerts/").status_code == 404
    assert client.get("/clusters/prod-a/alerts/deliveries/").status_code == 404
    for action in ("test", "disable", "delete"):
        assert client.post(f"/clusters/prod-a/alerts/{endpoint.id}/{action}/").status_code == 404
        # Their own cluster's path with our endpoint's id: still nothing.
        assert client.post(f"/clusters/prod-b/alerts/{endpoint.id}/{action}/").status_code == 404
    assert client.post("/clusters/prod-a/alerts/", {"name": "x", "kind": "webhook", "url": receiver.url,
                                                    "min_severity": "info", "max_per_hour": 1}).status_code == 404
    assert receiver.requests == [] and list(Endpoint.objects.values_list("enabled", flat=True)) == [True]


def test_anonymous_users_are_sent_to_the_login_page(world: World, client: Client) -> None:
    for path in ("/clusters/prod-a/alerts/", "/clusters/prod-a/alerts/deliveries/"):
        page = client.get(path)
        assert page.status_code == 302 and page["Location"].startswith("/login/")


def test_changes_need_the_csrf_token(world: World, receiver: Receiver) -> None:
    endpoint = add_webhook(world, receiver.url)
    strict = login(Client(enforce_csrf_checks=True), world.owner)
    assert strict.post(f"/clusters/prod-a/alerts/{endpoint.id}/delete/").status_code == 403
    assert strict.post("/clusters/prod-a/alerts/", {"name": "x", "kind": "webhook"}).status_code == 403
    assert strict.get(f"/clusters/prod-a/alerts/{endpoint.id}/delete/").status_code == 405
    assert Endpoint.objects.count() == 1 and not Delivery.objects.exists()
