"""From finding events to Delivery rows: endpoint filters, grouping, the rate limit and the one resolve.

Decisions for one endpoint are made in one transaction holding that endpoint's row lock, so two detectors
signalling at once cannot both start a group or both slip under the rate limit.

At least once, then deduplicated: ``finding_recorded`` writes an :class:`Outbox` row inside the finding's own
transaction; ``finding_changed`` (after the commit) drains it at once, and the alert sweep drains whatever a crash
left behind. Draining claims the row and writes its deliveries in one transaction, and a delivery is unique per
(endpoint, finding event), so however many times an event is planned, each endpoint gets one delivery.

Acknowledged findings and silenced subjects (:mod:`dashboard.diagnosis.silences`) still get their delivery rows,
suppressed with the reason, so the finding page says why nothing went out. A resolve still goes for an alert that
was sent (it closes the incident the receiver opened); one for an alert held back is suppressed like it. When a
silence ends, :func:`release_silences` sends the alerts it held back for findings still open.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F
from django.dispatch import receiver
from django.utils import timezone

from dashboard.alerts import conf
from dashboard.alerts.models import Delivery, Endpoint, Outbox, severity_rank
from dashboard.diagnosis import silences
from dashboard.diagnosis.models import Finding, Silence
from dashboard.diagnosis.signals import finding_recorded

log = logging.getLogger(__name__)
S = Delivery.Status

# Kinds that one failing node produces together, so a storm of them is one alert.
FAMILIES = {
    "failing_gpu": "gpu", "xid": "gpu", "ecc": "gpu", "gpu_lost": "gpu", "pcie": "gpu", "nvlink": "gpu",
    "thermal": "gpu", "throttling": "gpu", "thermal_throttling": "gpu",
    "slow_link": "network", "flapping_link": "network", "ib_errors": "network",
    # A rank that died or froze is its node in trouble too: one page for the node, not one per rank.
    "node_down": "node", "agent_silent": "node", "rank_down": "node",
}


OUTBOX_MAX_ATTEMPTS = 20  # a row whose planning keeps failing stays, with its error, for someone to look at
OUTBOX_KEEP = timedelta(days=1)  # planned rows are kept this long (what was planned when), then pruned
OUTBOX_PRUNE_EVERY_S = 600.0
_pruned_at = 0.0


@receiver(finding_recorded, dispatch_uid="dashboard.alerts.outbox")
def owe(sender: Any, finding: Finding, event: str, **kwargs: Any) -> None:
    """Inside the finding's transaction: the event's deliveries are owed from the moment the change commits.

    Not guarded: should this insert fail, the finding change rolls back with it, and the next pass retries both."""
    Outbox.objects.create(finding=finding, event=event, severity=finding.severity)


def on_finding_changed(sender: Any, finding: Finding, event: str, **kwargs: Any) -> None:
    """Signal receiver (after the commit). It must never break the detector that sent the signal: failures are
    logged, and what the outbox holds is planned by the next sweep."""
    from dashboard.alerts.tasks import schedule

    try:
        owed_here = list(Outbox.objects.filter(finding_id=finding.id, event=event, planned_at=None)
                         .order_by("id").values_list("id", flat=True))
        # No outbox row: a sender outside the lifecycle (or a sweep got there first); planning again is harmless.
        deliveries = [d for pk in owed_here for d in drain_one(pk)] if owed_here else plan(finding, event)
        for delivery in deliveries:
            # After the commit, should a detector ever signal inside a transaction: a worker must find the row.
            transaction.on_commit(lambda d=delivery: schedule(d))
    except Exception:
        log.exception("alerts: planning deliveries for finding %s (%s) failed", finding.pk, event)


def owed(limit: int = 100) -> list[int]:
    """Outbox rows due for planning, oldest first."""
    return list(Outbox.objects.filter(planned_at=None, attempts__lt=OUTBOX_MAX_ATTEMPTS,
                                      next_attempt_at__lte=timezone.now())
                .order_by("id").values_list("id", flat=True)[:limit])


def drain_one(pk: int) -> list[Delivery]:
    """Plan one outbox row: claimed in the same transaction as the deliveries it writes, so a crash rolls both back
    and a second drainer (the fast path, another worker's sweep) finds it claimed and plans nothing."""
    with transaction.atomic():
        if Outbox.objects.filter(id=pk, planned_at=None).update(planned_at=timezone.now()) != 1:
            return []
        row = Outbox.objects.select_related("finding").get(id=pk)
        finding = row.finding
        finding.severity = row.severity  # the event as it happened, not what the finding has become since
        return plan(finding, row.event)


def drain_outbox(limit: int = 100) -> list[Delivery]:
    """The sweep's part: plan every owed row. A row that fails is pushed back (errors are data), never retried in a
    tight loop. Returns the new pending deliveries, for the caller to schedule."""
    out: list[Delivery] = []
    for pk in owed(limit):
        try:
            out += drain_one(pk)
        except Exception as exc:
            log.exception("alerts: planning outbox row %s failed; pushed back", pk)
            _push_back(pk, exc)
    _prune()
    return out


def _push_back(pk: int, exc: Exception) -> None:
    row = Outbox.objects.filter(id=pk, planned_at=None)
    tries = (row.values_list("attempts", flat=True).first() or 0) + 1
    delay = timedelta(seconds=min(600.0, 2.0 ** tries))
    row.update(attempts=F("attempts") + 1, next_attempt_at=timezone.now() + delay,
               last_error=f"{type(exc).__name__}: {exc}"[:2000])


def _prune() -> None:
    global _pruned_at
    if time.monotonic() - _pruned_at < OUTBOX_PRUNE_EVERY_S:
        return
    _pruned_at = time.monotonic()
    Outbox.objects.filter(planned_at__lt=timezone.now() - OUTBOX_KEEP).delete()


def plan(finding: Finding, event: str, *, after: Silence | None = None) -> list[Delivery]:
    """The deliveries to send for this event, one per interested endpoint (already written, status pending).

    ``after``: the alert a silence held back, now that it has ended (sent to endpoints the finding never reached)."""
    out = []
    held = None if event == "resolved" else silences.held_back(finding)
    for endpoint_id in Endpoint.objects.filter(cluster_id=finding.cluster_id, enabled=True).values_list("id",
                                                                                                          flat=True):
        try:
            with transaction.atomic():
                endpoint = Endpoint.objects.select_for_update().get(id=endpoint_id)
                delivery = plan_resolve(endpoint, finding) if event == "resolved" else \
                    plan_alert(endpoint, finding, event, held, after)
        except IntegrityError:  # the same event signalled twice: the first one's row stands
            delivery = None
        if delivery is not None and delivery.status == S.PENDING:
            out.append(delivery)
    return out


def group_key(finding: Finding, event: str) -> str:
    where = f"node:{finding.node_id}" if finding.node_id else f"subject:{finding.subject}"
    return f"{finding.cluster_id}|{where}|{FAMILIES.get(finding.kind, finding.kind)}|{event}"


def dedup(finding: Finding, event: str) -> str:
    return f"{finding.id}:{event}:{finding.severity}" if event == "escalated" else f"{finding.id}:{event}"


def plan_alert(endpoint: Endpoint, finding: Finding, event: str, held: str | None = None,
               after: Silence | None = None) -> Delivery | None:
    if not endpoint.wants(finding.kind, finding.severity):
        return None
    key = dedup(finding, event) if after is None else f"{finding.id}:{event}:after-silence-{after.id}"
    if Delivery.objects.filter(endpoint=endpoint, dedup=key).exists():
        return None
    if after is not None and _first_alert(endpoint, finding, sent=True) is not None:
        return None  # this endpoint heard of the finding before the silence: nothing was held back from it
    now = timezone.now()
    row = Delivery(endpoint=endpoint, finding=finding, event=event, severity=finding.severity, dedup=key,
                   group_key=group_key(finding, event), max_attempts=conf.get("ALERTS_MAX_ATTEMPTS"))
    if held is not None:  # a row all the same: the finding page shows what was held back, and why
        row.status, row.last_error, row.finished_at = S.SUPPRESSED, held[:2000], now
        row.incident_key = _incident_key(endpoint, finding)
        row.save()
        return row
    leader = _open_group(endpoint, row.group_key, now)
    if leader is not None and (leader.status == S.PENDING or
                               severity_rank(finding.severity) <= severity_rank(leader.severity)):
        return _join(row, leader)
    row.incident_key = _incident_key(endpoint, finding)
    recent = Delivery.objects.filter(endpoint=endpoint, group=None, event__in=("opened", "escalated"),
                                     created_at__gte=now - timedelta(hours=1)).exclude(status=S.SUPPRESSED).count()
    if recent >= endpoint.max_per_hour:
        row.status = S.SUPPRESSED
        row.last_error = f"rate limit: {recent} alerts in the last hour (this endpoint allows {endpoint.max_per_hour})"
        row.finished_at = now
    else:
        row.next_attempt_at = now + timedelta(seconds=float(conf.get("ALERTS_GROUP_WAIT_S")))
    row.save()
    return row


def _open_group(endpoint: Endpoint, key: str, now: Any) -> Delivery | None:
    window = timedelta(seconds=float(conf.get("ALERTS_GROUP_WINDOW_S")))
    return (Delivery.objects.filter(endpoint=endpoint, group=None, group_key=key, created_at__gte=now - window)
            .exclude(status__in=(S.SUPPRESSED, S.FAILED)).order_by("-created_at").first())


def _join(row: Delivery, leader: Delivery) -> Delivery:
    row.status, row.group, row.finished_at = S.GROUPED, leader, timezone.now()
    row.incident_key = leader.incident_key
    if leader.status != S.PENDING:
        row.last_error = f"folded into delivery {leader.id}, already sent: not sent again"
    row.save()
    if leader.status == S.PENDING and severity_rank(row.severity) > severity_rank(leader.severity):
        Delivery.objects.filter(id=leader.id).update(severity=row.severity)
    return row


def _incident_key(endpoint: Endpoint, finding: Finding) -> str:
    """The incident an alert about ``finding`` belongs to: that of its first alert on this endpoint, if any."""
    first = _first_alert(endpoint, finding)
    return first.incident_key if first else f"clusterdx-{endpoint.cluster_id}-finding-{finding.id}"


def _first_alert(endpoint: Endpoint, finding: Finding, *, sent: bool = False) -> Delivery | None:
    """The finding's first alert on this endpoint that was not held back (suppressed), else its first at all
    (``sent``: None then). A silence that ended makes the first real alert a later row than the suppressed one."""
    qs = (Delivery.objects.filter(endpoint=endpoint, finding=finding, event__in=("opened", "escalated"))
          .select_related("group").order_by("id"))
    row = qs.exclude(status=S.SUPPRESSED).first() or (None if sent else qs.first())
    return None if row is None else (row.group or row)


SILENCES_PER_SWEEP = 20
_release_failures: dict[int, tuple[int, float]] = {}  # silence id -> (failures, retry not before): pushed back


def silences_due(limit: int = SILENCES_PER_SWEEP) -> list[int]:
    """Silences that have ended and whose held-back alerts are not yet planned."""
    return list(Silence.objects.filter(released_at=None, ends_at__lte=timezone.now())
                .order_by("ends_at").values_list("id", flat=True)[:limit])


def release_silences(limit: int = SILENCES_PER_SWEEP) -> list[Delivery]:
    """The sweep's part once a silence ends: the findings it covered that are still open (and not acknowledged, not
    under another silence) alert now. Claimed in the transaction that writes the deliveries, like the outbox: a
    crash rolls both back, and a second sweeper finds it claimed."""
    out: list[Delivery] = []
    for pk in silences_due(limit):
        failures, not_before = _release_failures.get(pk, (0, 0.0))
        if time.monotonic() < not_before:
            continue
        try:
            with transaction.atomic():
                if Silence.objects.filter(id=pk, released_at=None).update(released_at=timezone.now()) != 1:
                    continue
                silence = Silence.objects.get(id=pk)
                for finding in (Finding.objects.filter(cluster_id=silence.cluster_id, state=Finding.State.OPEN)
                                .select_related("node", "cluster").order_by("id")):
                    if silences.covers(silence.scope, silence.target, silences.facts(finding)):
                        out += plan(finding, "opened", after=silence)
            _release_failures.pop(pk, None)
        except Exception:
            # Rolled back with its claim, and tried again later (not every second): never a crash loop, never dropped.
            delay = min(600.0, 2.0 ** (failures + 1))
            _release_failures[pk] = (failures + 1, time.monotonic() + delay)
            log.exception("alerts: releasing silence %s failed; retried in %.0f s", pk, delay)
    return out


def plan_resolve(endpoint: Endpoint, finding: Finding) -> Delivery | None:
    """One resolve per alert, once every finding it carried has resolved; nothing if no alert went out."""
    alert = _first_alert(endpoint, finding)
    if alert is None or alert.finding_id is None:
        return None
    carried = Finding.objects.filter(deliveries__group=alert).values_list("id", flat=True)
    if Finding.objects.filter(id__in=[alert.finding_id, *carried], state=Finding.State.OPEN).exists():
        return None  # the last of them to resolve sends it
    row = Delivery(endpoint=endpoint, finding_id=alert.finding_id, event="resolved", severity=alert.severity,
                   dedup=f"{alert.finding_id}:resolved", resolves=alert, incident_key=alert.incident_key,
                   group_key=alert.group_key, max_attempts=conf.get("ALERTS_MAX_ATTEMPTS"),
                   next_attempt_at=timezone.now())
    if alert.status in (S.SUPPRESSED, S.FAILED):
        row.status, row.finished_at = S.SUPPRESSED, timezone.now()
        row.last_error = f"delivery {alert.id}, which this would resolve, was not delivered ({alert.status})"
    row.save()
    return row
