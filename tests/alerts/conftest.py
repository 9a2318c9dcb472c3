"""Alert tests on the embedded default: tasks eager, nothing enqueued, deliveries made by ``send_due`` in the test's
own thread; a real HTTP receiver on 127.0.0.1 (so private destinations are allowed here, explicitly)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.alerts.alerts_support import Receiver

FAST = {
    "ALERTS_ALLOW_PRIVATE": True,
    "ALERTS_GROUP_WAIT_S": 0.0,
    "ALERTS_BACKOFF_BASE_S": 0.01,
    "ALERTS_BACKOFF_MAX_S": 0.05,
    "ALERTS_HTTP_TIMEOUT_S": 2.0,
    "ALERTS_MAX_ATTEMPTS": 5,
}


@pytest.fixture(autouse=True)
def alerts_settings(settings: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    from dashboard.celery import app

    settings.CLUSTERDX = {**settings.CLUSTERDX, **FAST}
    monkeypatch.setitem(app.conf, "task_always_eager", True)
    return settings.CLUSTERDX


@pytest.fixture
def cluster(db: None) -> Any:
    from dashboard.telemetry.models import Cluster

    return Cluster.objects.create(name="prod-a")


@pytest.fixture
def nodes(cluster: Any) -> list[Any]:
    from dashboard.telemetry.models import Node

    return [Node.objects.create(cluster=cluster, hostname=f"node-{i:03d}") for i in range(4)]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()


@pytest.fixture
def endpoint_for(cluster: Any) -> Callable[..., Any]:
    """An endpoint of ``kind`` pointing at ``receiver`` (which learns the signing secret)."""
    from dashboard.alerts import endpoints

    def make(receiver: Receiver, kind: str = "webhook", **options: Any) -> Any:
        secret = "R" * 32 if kind == "pagerduty" else ""
        endpoint, shown = endpoints.create(cluster, name=f"{kind}-test", kind=kind, url=receiver.url,
                                           secret=options.pop("secret", secret), **options)
        if kind == "webhook":
            receiver.secret = shown
        return endpoint

    return make

