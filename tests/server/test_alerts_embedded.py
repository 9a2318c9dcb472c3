"""The embedded default end to end: the server's own scheduler (no Celery worker, no Redis) sends a finding's
alert to a real receiver within a couple of seconds."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from dashboard.alerts import endpoints
from dashboard.alerts.models import Delivery
from tests.alerts.alerts_support import Receiver, make_finding, signal
from tests.server.conftest import AsgiServer


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()


def test_the_embedded_server_sends_alerts_on_its_own(asgi_server: AsgiServer, receiver: Receiver,
                                                     settings: Any) -> None:
    if settings.REDIS_URL:
        pytest.skip("embedded default only: with REDIS_URL the Celery worker sends alerts (test_alerts_worker)")
    from dashboard.telemetry.models import Cluster

    settings.CLUSTERDX = {**settings.CLUSTERDX, "ALERTS_ALLOW_PRIVATE": True, "ALERTS_GROUP_WAIT_S": 0.2}
    cluster = Cluster.objects.create(name="prod-a")
    _, receiver.secret = endpoints.create(cluster, name="oncall", kind="webhook", url=receiver.url)
    signal(make_finding(cluster, subject="node-005"), "opened")
    got = receiver.wait_for(1, timeout=10)
    assert len(got) == 1 and got[0].verified is True
    assert got[0].json()["data"]["findings"][0]["subject"] == "node-005"
    deadline = time.monotonic() + 5  # the answer is recorded just after the receiver sent it
    while Delivery.objects.get().status != Delivery.Status.DELIVERED and time.monotonic() < deadline:
        time.sleep(0.05)
    assert Delivery.objects.get().status == Delivery.Status.DELIVERED
