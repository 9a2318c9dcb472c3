"""From ``finding_changed`` to Delivery rows: endpoint filters, grouping, the rate limit and the one resolve.

Decisions for one endpoint are made in one transaction holding that endpoint's row lock, so two detectors
signalling at once cannot both start a group or both slip under the rate limit.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from dashboard.alerts import conf
from dashboard.alerts.models import Delivery, Endpoint, severity_rank
from dashboard.diagnosis.models import Finding

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


def on_finding_changed(sender: Any, finding: Finding, event: str, **kwargs: Any) -> None:
    """Signal receiver. It must never break the detector that sent the signal: failures are logged."""
    from dashboard.alerts.tasks import schedule

    try:
        for delivery in plan(finding, event):
            # After the commit, should a detector ever signal inside a transaction: a worker must find the row.
            transaction.on_commit(lambda d=delivery: schedule(d))
    except Exception:
        log.exception("alerts: planning deliveries for finding %s (%s) failed", finding.pk, event)


def plan(finding: Finding, event: str) -> list[Delivery]:
    """The deliveries to send for this event, one per interested endpoint (already written, status pending)."""
    out = []
    for endpoint_id in Endpoint.objects.filter(cluster_id=finding.cluster_id, enabled=True).values_list("id",
                                                                                                          flat=True):
        try:
            with transaction.atomic():
                endpoint = Endpoint.objects.select_for_update().get(id=endpoint_id)
                delivery = plan_resolve(endpoint, finding) if event == "resolved" else \
                    plan_alert(endpoint, finding, event)
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


def plan_alert(endpoint: Endpoint, finding: Finding, event: str) -> Delivery | None:
    if not endpoint.wants(finding.kind, finding.severity):
        return None
    key = dedup(finding, event)
    if Delivery.objects.filter(endpoint=endpoint, dedup=key).exists():
        return None
    now = timezone.now()
    row = Delivery(endpoint=endpoint, finding=finding, event=event, severity=finding.severity, dedup=key,
                   group_key=group_key(finding, event), max_attempts=conf.get("ALERTS_MAX_ATTEMPTS"))
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


def _first_alert(endpoint: Endpoint, finding: Finding) -> Delivery | None:
    row = (Delivery.objects.filter(endpoint=endpoint, finding=finding, event__in=("opened", "escalated"))
           .select_related("group").order_by("id").first())
    return None if row is None else (row.group or row)


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
