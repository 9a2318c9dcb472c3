"""One attempt at one delivery: claim the row, send, store the answer, say when to try again.

The claim is a conditional UPDATE on (id, attempts, status), so of two copies of the same task only one sends;
the loser only reports when the row next needs someone. A claim older than the lease belonged to a worker that
died mid-request (its task comes back through acks_late): the same attempt number may take it over.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Q
from django.utils import timezone

from dashboard import metrics
from dashboard.alerts import alert as alerts
from dashboard.alerts import base, conf, http
from dashboard.alerts.models import Delivery

log = logging.getLogger(__name__)
S = Delivery.Status


@dataclass(frozen=True)
class Next:
    """What the task should do afterwards: run attempt ``attempt`` at ``at``, or nothing (``at`` None)."""

    attempt: int
    at: datetime | None = None


_rng = random.Random()


def backoff_s(attempt: int, rng: random.Random = _rng) -> float:
    """Exponential, capped, with jitter (50-100% of the step) so a receiver's outage does not end in a stampede."""
    base_s, cap = float(conf.get("ALERTS_BACKOFF_BASE_S")), float(conf.get("ALERTS_BACKOFF_MAX_S"))
    return min(cap, base_s * 2 ** (attempt - 1)) * rng.uniform(0.5, 1.0)


def claim(delivery_id: int, attempt: int) -> int | None:
    """The attempt number this caller now owns, or None when the row is not this caller's to send."""
    now = timezone.now()
    fresh = Delivery.objects.filter(id=delivery_id, attempts=attempt - 1, status__in=(S.PENDING, S.RETRYING),
                                    next_attempt_at__lte=now)
    if fresh.update(status=S.SENDING, attempts=attempt, claimed_at=now) == 1:
        return attempt
    stale = Delivery.objects.filter(id=delivery_id, attempts=attempt, status=S.SENDING,
                                    claimed_at__lt=now - timedelta(seconds=conf.claim_lease_s()))
    if stale.update(attempts=attempt + 1, claimed_at=now) == 1:
        log.warning("alerts: delivery %s: attempt %s was lost with its worker; taking it over", delivery_id, attempt)
        return attempt + 1
    return None


def when_free(delivery_id: int, attempt: int) -> Next:
    """After a lost claim: come back when the row may need this attempt again, or never."""
    row = Delivery.objects.filter(id=delivery_id).values("status", "attempts", "next_attempt_at", "claimed_at").first()
    if row is None:
        return Next(attempt)
    if row["status"] in (S.PENDING, S.RETRYING) and row["attempts"] == attempt - 1:
        return Next(attempt, row["next_attempt_at"])  # came early (a duplicate, or a resolve waiting its turn)
    if row["status"] == S.SENDING and row["attempts"] == attempt:  # someone is sending: check its lease later
        return Next(attempt, row["claimed_at"] + timedelta(seconds=conf.claim_lease_s() + 0.5))
    return Next(attempt)  # finished, or a later attempt is someone else's


def attempt(delivery_id: int, number: int) -> Next:
    """Run attempt ``number`` of the delivery if it is due and still this caller's."""
    if _wait_for_trigger(delivery_id):
        return when_free(delivery_id, number)
    owned = claim(delivery_id, number)
    if owned is None:
        return when_free(delivery_id, number)
    delivery = Delivery.objects.select_related("endpoint__cluster", "finding", "resolves").get(id=delivery_id)
    why_not = _why_not_send(delivery)
    if why_not:
        _finish(delivery_id, owned, status=S.SUPPRESSED, last_error=why_not)
        return Next(owned)
    try:
        result = base.for_endpoint(delivery.endpoint).notify(alerts.build(delivery))
    except Exception as exc:  # a bug in rendering is stored on the row, never a crash loop
        log.exception("alerts: delivery %s could not be built", delivery_id)
        result = http.HttpResult(None, f"internal error: {type(exc).__name__}: {exc}", False, None, 0.0)
    return record(delivery, owned, result)


def _why_not_send(delivery: Delivery) -> str:
    if not delivery.endpoint.enabled and delivery.event != "test":
        return "endpoint disabled before sending"
    trigger = delivery.resolves
    if trigger is not None and trigger.status in (S.FAILED, S.SUPPRESSED):
        return f"delivery {trigger.id}, which this would resolve, was not delivered ({trigger.status})"
    return ""


def record(delivery: Delivery, number: int, result: http.HttpResult) -> Next:
    error = redact(result.error, delivery)
    common = {"response_code": result.status, "duration_ms": round(result.duration_ms, 2), "last_error": error}
    metrics.ALERT_DELIVERIES.labels("delivered" if result.delivered else "retryable" if result.retryable
                                    else "failed").inc()
    if result.delivered:
        _finish(delivery.id, number, status=S.DELIVERED, **common)
        return Next(number)
    if result.retryable and number < delivery.max_attempts:
        delay = result.retry_after_s if result.retry_after_s is not None else backoff_s(number)
        at = timezone.now() + timedelta(seconds=delay)
        _owned(delivery.id, number).update(status=S.RETRYING, next_attempt_at=at, **common)
        log.info("alerts: delivery %s attempt %s: %s; retrying in %.1f s", delivery.id, number, error, delay)
        return Next(number + 1, at)
    if result.retryable:
        why = "test sends are not retried" if delivery.event == "test" else f"gave up after {number} attempts"
        common["last_error"] = f"{error} ({why})"
    _finish(delivery.id, number, status=S.FAILED, **common)
    log.warning("alerts: delivery %s failed: %s", delivery.id, common["last_error"])
    return Next(number)


def _owned(delivery_id: int, number: int) -> object:
    # Only the claim's owner writes the outcome: a worker that outlived its lease must not overwrite a newer one.
    return Delivery.objects.filter(id=delivery_id, attempts=number, status=S.SENDING)


def _finish(delivery_id: int, number: int, **fields: object) -> None:
    _owned(delivery_id, number).update(finished_at=timezone.now(), **fields)  # type: ignore[attr-defined]


def _wait_for_trigger(delivery_id: int) -> bool:
    """A resolve must not overtake its trigger (PagerDuty would keep an incident open): postpone it meanwhile."""
    row = Delivery.objects.filter(id=delivery_id, status=S.PENDING, resolves__status__in=Delivery.ACTIVE)
    busy = row.values_list("resolves__next_attempt_at", "resolves__claimed_at").first()
    if busy is None:
        return False
    later = max([t for t in busy if t] + [timezone.now()]) + timedelta(seconds=1)
    row.update(next_attempt_at=later)
    return True


def redact(text: str, delivery: Delivery) -> str:
    """Errors are shown to users and logged: strip the endpoint's URL path (Slack's secret) and secret from them."""
    endpoint = delivery.endpoint
    for secret in (endpoint.secret, endpoint.url):
        if secret and secret in text:
            text = text.replace(secret, "[redacted]")
    return text


def due(now: datetime | None = None, limit: int = 100, grace_s: float = 0.0) -> list[tuple[int, int]]:
    """(delivery id, attempt) for rows overdue by ``grace_s``: pending ones and claims whose worker is gone."""
    now = now or timezone.now()
    lease_end = now - timedelta(seconds=conf.claim_lease_s() + grace_s)
    rows = (Delivery.objects.filter(Q(status__in=(S.PENDING, S.RETRYING), next_attempt_at__lte=now -
                                      timedelta(seconds=grace_s)) | Q(status=S.SENDING, claimed_at__lt=lease_end))
            .order_by("next_attempt_at").values_list("id", "status", "attempts")[:limit])
    return [(pk, attempts if status == S.SENDING else attempts + 1) for pk, status, attempts in rows]
