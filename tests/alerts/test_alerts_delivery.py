"""Sending one delivery against a real receiver: retries and their limits, Retry-After, permanent answers, claims."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from django.utils import timezone

from dashboard.alerts import delivery as attempts
from dashboard.alerts import endpoints
from dashboard.alerts.models import Delivery
from dashboard.alerts.tasks import send_due
from tests.alerts.alerts_support import Receiver, Reply, drain, make_finding, signal

S = Delivery.Status


def opened(cluster: Any, node: Any) -> Delivery:
    signal(make_finding(cluster, node=node, gpu_index=0), "opened")
    return Delivery.objects.get(event="opened", group=None)


def test_it_retries_5xx_then_delivers_exactly_once(cluster: Any, nodes: list[Any], receiver: Receiver,
                                                  endpoint_for: Any) -> None:
    receiver.script = [Reply(500), Reply(503)]
    endpoint_for(receiver)
    row = opened(cluster, nodes[0])
    drain()
    row.refresh_from_db()
    assert [r.answered for r in receiver.requests] == [500, 503, 200]
    assert (row.status, row.attempts, row.response_code, row.last_error) == (S.DELIVERED, 3, 200, "")
    assert len({r.headers["webhook-id"] for r in receiver.requests}) == 1  # receivers deduplicate on it
    assert all(r.verified for r in receiver.requests)


def test_it_honours_retry_after_on_429(cluster: Any, nodes: list[Any], receiver: Receiver, endpoint_for: Any) -> None:
    receiver.script = [Reply(429, retry_after="1")]
    endpoint_for(receiver)
    row = opened(cluster, nodes[0])
    send_due()
    row.refresh_from_db()
    assert (row.status, row.response_code) == (S.RETRYING, 429)
    wait = (row.next_attempt_at - timezone.now()).total_seconds()
    assert 0.8 < wait <= 1.0, wait  # the receiver's delay, not the (tiny) backoff
    send_due()
    assert len(receiver.requests) == 1  # not due yet
    time.sleep(wait + 0.05)
    send_due()
    row.refresh_from_db()
    assert [r.answered for r in receiver.requests] == [429, 200] and row.status == S.DELIVERED
    assert receiver.requests[1].at - receiver.requests[0].at >= 0.95


def test_it_stops_at_a_404(cluster: Any, nodes: list[Any], receiver: Receiver, endpoint_for: Any) -> None:
    receiver.script = [Reply(404)]
    endpoint_for(receiver)
    row = opened(cluster, nodes[0])
    drain()
    send_due()
    row.refresh_from_db()
    assert len(receiver.requests) == 1
    assert (row.status, row.attempts, row.response_code) == (S.FAILED, 1, 404)
    assert row.last_error == "HTTP 404 Not Found"


def test_it_retries_408_but_not_410_or_400(cluster: Any, nodes: list[Any], receiver: Receiver,
                                          endpoint_for: Any) -> None:
    receiver.script = [Reply(408), Reply(410)]
    endpoint_for(receiver)
    row = opened(cluster, nodes[0])
    drain()
    row.refresh_from_db()
    assert [r.answered for r in receiver.requests] == [408, 410]
    assert (row.status, row.attempts, row.response_code) == (S.FAILED, 2, 410)


def test_it_gives_up_after_max_attempts(cluster: Any, nodes: list[Any], receiver: Receiver, endpoint_for: Any,
                                        alerts_settings: dict[str, Any]) -> None:
    alerts_settings["ALERTS_MAX_ATTEMPTS"] = 3
    receiver.script = [Reply(502)] * 10
    endpoint_for(receiver)
    row = opened(cluster, nodes[0])
    drain()
    row.refresh_from_db()
    assert len(receiver.requests) == 3
    assert (row.status, row.attempts) == (S.FAILED, 3)
    assert row.last_error == "HTTP 502 Bad Gateway (gave up after 3 attempts)"


def test_it_retries_a_timeout(cluster: Any, nodes: list[Any], receiver: Receiver, endpoint_for: Any,
                              alerts_settings: dict[str, Any]) -> None:
    alerts_settings["ALERTS_HTTP_TIMEOUT_S"] = 0.3
    receiver.script = [Reply(hang_s=3)]
    endpoint_for(receiver)
    row = opened(cluster, nodes[0])
    drain()
    row.refresh_from_db()
    assert len(receiver.requests) == 2 and receiver.requests[1].answered == 200
    assert (row.status, row.attempts) == (S.DELIVERED, 2)


def test_it_retries_a_refused_connection(cluster: Any, nodes: list[Any], receiver: Receiver,
                                         endpoint_for: Any) -> None:
    endpoint = endpoint_for(receiver)
    receiver.stop()  # nobody listens on that port any more
    row = opened(cluster, nodes[0])
    send_due()
    row.refresh_from_db()
    assert (row.status, row.response_code, row.attempts) == (S.RETRYING, None, 1)
    assert row.last_error.startswith("ConnectError")
    assert endpoint.url not in row.last_error


def test_it_never_retries_a_test_send(cluster: Any, receiver: Receiver, endpoint_for: Any) -> None:
    receiver.script = [Reply(500)]
    row = endpoints.send_test(endpoint_for(receiver))
    drain()
    assert len(receiver.requests) == 1
    assert (row.status, row.attempts, row.max_attempts) == (S.FAILED, 1, 1)
    assert row.last_error == "HTTP 500 Internal Server Error (test sends are not retried)"
    assert receiver.requests[0].json()["type"] == "finding.test"


def test_a_task_run_twice_sends_once(cluster: Any, nodes: list[Any], receiver: Receiver, endpoint_for: Any) -> None:
    endpoint_for(receiver)
    row = opened(cluster, nodes[0])
    first = attempts.attempt(row.id, 1)
    second = attempts.attempt(row.id, 1)
    assert len(receiver.requests) == 1
    assert first.at is None and second.at is None  # neither copy asks to run again
    row.refresh_from_db()
    assert (row.status, row.attempts) == (S.DELIVERED, 1)


def test_it_takes_over_the_claim_of_a_dead_worker_after_the_lease(cluster: Any, nodes: list[Any],
                                                                  receiver: Receiver, endpoint_for: Any) -> None:
    endpoint_for(receiver)
    row = opened(cluster, nodes[0])
    assert attempts.claim(row.id, 1) == 1  # a worker claims it ... and dies before sending
    assert attempts.attempt(row.id, 1).at is not None  # its redelivered task: the lease still runs, come back
    assert receiver.requests == []
    lease = timedelta(seconds=attempts.conf.claim_lease_s() + 1)
    Delivery.objects.filter(id=row.id).update(claimed_at=timezone.now() - lease)
    attempts.attempt(row.id, 1)
    row.refresh_from_db()
    assert len(receiver.requests) == 1
    assert (row.status, row.attempts) == (S.DELIVERED, 2)  # the lost attempt counts


def test_a_late_result_of_an_expired_claim_does_not_overwrite_a_newer_one(cluster: Any, nodes: list[Any],
                                                                           receiver: Receiver,
                                                                           endpoint_for: Any) -> None:
    endpoint_for(receiver)
    row = opened(cluster, nodes[0])
    attempts.claim(row.id, 1)
    lease = timedelta(seconds=attempts.conf.claim_lease_s() + 1)
    Delivery.objects.filter(id=row.id).update(claimed_at=timezone.now() - lease)
    attempts.attempt(row.id, 1)  # takes over as attempt 2 and delivers
    from dashboard.alerts.http import HttpResult

    attempts.record(Delivery.objects.select_related("endpoint").get(id=row.id), 1,
                    HttpResult(500, "HTTP 500", True, None, 1.0))  # the slow first worker finally answers
    row.refresh_from_db()
    assert (row.status, row.attempts) == (S.DELIVERED, 2)


def test_backoff_is_exponential_capped_and_jittered(alerts_settings: dict[str, Any]) -> None:
    import random

    alerts_settings.update(ALERTS_BACKOFF_BASE_S=2.0, ALERTS_BACKOFF_MAX_S=600.0)
    rng = random.Random(1)
    for attempt, step in [(1, 2.0), (2, 4.0), (5, 32.0), (12, 600.0)]:
        delays = [attempts.backoff_s(attempt, rng) for _ in range(200)]
        assert step * 0.5 <= min(delays) and max(delays) <= step
        assert max(delays) - min(delays) > step * 0.3  # jittered, not one fixed value
