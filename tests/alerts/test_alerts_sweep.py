"""The sweeps: embedded, due deliveries go out from a background thread; in production, only rows whose message
was lost (overdue by the grace) or whose worker died (claim lease over) are handed to the queue again."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from dashboard.alerts import conf, tasks
from dashboard.alerts import delivery as attempts
from dashboard.alerts.models import Delivery
from tests.alerts.alerts_support import Receiver, make_finding, signal

S = Delivery.Status


@pytest.mark.django_db(transaction=True)  # the sweeping thread has its own connection: rows must be committed
def test_the_embedded_sweep_sends_from_a_background_thread(cluster: Any, nodes: list[Any], receiver: Receiver,
                                                           endpoint_for: Any) -> None:
    endpoint_for(receiver)
    signal(make_finding(cluster, node=nodes[0], gpu_index=0), "opened")
    tasks.sweep()
    tasks.sweep()  # a second tick while the first thread may still run: at most one sweeping thread
    assert len(receiver.wait_for(1, timeout=10)) == 1
    with tasks._sweeping:  # the thread has let go: it has finished
        pass
    assert Delivery.objects.get().status == S.DELIVERED and len(receiver.requests) == 1


def test_production_sweep_picks_only_lost_messages_and_dead_claims(cluster: Any, nodes: list[Any],
                                                                    receiver: Receiver, endpoint_for: Any) -> None:
    endpoint_for(receiver)
    for node in nodes[:3]:
        signal(make_finding(cluster, node=node, gpu_index=0), "opened")
    fresh, lost, dead = Delivery.objects.order_by("id")
    now = timezone.now()
    Delivery.objects.filter(id=lost.id).update(next_attempt_at=now - timedelta(seconds=120), attempts=2,
                                               status=S.RETRYING)
    assert attempts.claim(dead.id, 1) == 1
    Delivery.objects.filter(id=dead.id).update(claimed_at=now - timedelta(seconds=conf.claim_lease_s() + 90))
    assert sorted(attempts.due(grace_s=60)) == [(lost.id, 3), (dead.id, 1)]
    assert sorted(attempts.due()) == [(fresh.id, 1), (lost.id, 3), (dead.id, 1)]  # embedded: no grace
