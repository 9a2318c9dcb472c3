"""Alert endpoints (per cluster) and the delivery log.

A Delivery is one finding event for one endpoint. Most are sent; the rest say why not, as data: folded into another
delivery of their group, suppressed by the rate limit, or failed with the receiver's answer. The row is also the
work item: a worker claims it with a conditional UPDATE, so a task that runs twice sends once.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from dashboard.diagnosis.models import SEVERITIES

EVENTS = ["opened", "escalated", "resolved", "test"]


def severity_rank(severity: str) -> int:
    return SEVERITIES.index(severity) if severity in SEVERITIES else 0


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


class Endpoint(models.Model):
    class Kind(models.TextChoices):
        WEBHOOK = "webhook", "Signed JSON webhook"
        SLACK = "slack", "Slack incoming webhook"
        PAGERDUTY = "pagerduty", "PagerDuty Events API v2"

    cluster = models.ForeignKey("telemetry.Cluster", on_delete=models.CASCADE, related_name="alert_endpoints")
    name = models.CharField(max_length=64)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    # For Slack the URL itself is the secret: it is masked wherever it is shown after creation.
    url = models.URLField(max_length=500)
    # webhook: the signing secret (whsec_<base64>); pagerduty: the routing key; slack: unused.
    secret = models.CharField(max_length=200, blank=True)
    min_severity = models.CharField(max_length=16, choices=[(s, s) for s in SEVERITIES], default="warning")
    kinds = models.JSONField(default=list, blank=True)  # finding kinds to send; empty = all
    enabled = models.BooleanField(default=True)
    max_per_hour = models.PositiveIntegerField(default=30)  # alerts (not resolves, not tests) per rolling hour
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True,
                                   related_name="+")

    def __str__(self) -> str:
        return f"{self.name} ({self.kind})"

    def wants(self, kind: str, severity: str) -> bool:
        return severity_rank(severity) >= severity_rank(self.min_severity) and (not self.kinds or kind in self.kinds)


class Delivery(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending"  # waiting for its group to gather, or for its first attempt
        SENDING = "sending"  # claimed by a worker (until claimed_at + the claim lease)
        RETRYING = "retrying"  # a transient failure; next_attempt_at says when
        DELIVERED = "delivered"
        FAILED = "failed"  # a permanent answer, or no attempts left
        GROUPED = "grouped"  # carried by another delivery of its group (``group``)
        SUPPRESSED = "suppressed"  # not sent on purpose: rate limit, endpoint disabled...; the reason in last_error

    ACTIVE = (Status.PENDING, Status.SENDING, Status.RETRYING)

    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="deliveries")
    finding = models.ForeignKey("diagnosis.Finding", on_delete=models.SET_NULL, null=True, blank=True,
                                related_name="deliveries")
    event = models.CharField(max_length=16, choices=[(e, e) for e in EVENTS])
    severity = models.CharField(max_length=16, blank=True)
    # "<finding>:<event>[:<severity>]": one delivery per finding event and endpoint, whatever the signal repeats.
    dedup = models.CharField(max_length=120)
    group_key = models.CharField(max_length=200, blank=True)
    group = models.ForeignKey("self", on_delete=models.CASCADE, null=True, blank=True, related_name="members")
    resolves = models.ForeignKey("self", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    # The receiver's idempotency key (Standard Webhooks ``webhook-id``, PagerDuty ``dedup_key`` is incident_key).
    message_id = models.CharField(max_length=40, unique=True, default=new_message_id)
    incident_key = models.CharField(max_length=120, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    max_attempts = models.PositiveSmallIntegerField(default=8)
    created_at = models.DateTimeField(auto_now_add=True)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    response_code = models.PositiveSmallIntegerField(null=True, blank=True)
    duration_ms = models.FloatField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["endpoint", "dedup"], name="delivery_once_per_event")]
        indexes = [
            models.Index(fields=["status", "next_attempt_at"]),
            models.Index(fields=["endpoint", "created_at"]),
            models.Index(fields=["endpoint", "group_key", "created_at"], condition=Q(group=None),
                         name="delivery_group_leaders"),
        ]

    def __str__(self) -> str:
        return f"delivery {self.id} {self.event} ({self.status})"


class Outbox(models.Model):
    """A finding event whose deliveries are still owed, written in the transaction that changed the finding.

    The planner's on_commit hook is only a fast path: a process that dies between the commit and the hook would lose
    the alert for good. This row commits (or rolls back) with the finding, and the alert sweep plans every row left
    unplanned. Planning claims the row (``planned_at``) in the same transaction as the deliveries it writes, and the
    deliveries are unique per endpoint and event, so a row drained twice, or by the hook and a sweep at once, still
    gives one delivery per endpoint.
    """

    finding = models.ForeignKey("diagnosis.Finding", on_delete=models.CASCADE, related_name="+")
    event = models.CharField(max_length=16, choices=[(e, e) for e in EVENTS])
    severity = models.CharField(max_length=16)  # the finding's at the event: a later escalation is its own row
    created_at = models.DateTimeField(default=timezone.now)
    next_attempt_at = models.DateTimeField(default=timezone.now)
    planned_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveSmallIntegerField(default=0)  # failed planning attempts (each pushed back)
    last_error = models.TextField(blank=True)

    class Meta:
        indexes = [models.Index(fields=["next_attempt_at"], condition=Q(planned_at=None), name="outbox_owed"),
                   models.Index(fields=["finding", "event"], name="outbox_finding_event")]

    def __str__(self) -> str:
        return f"outbox {self.id} {self.event} of finding {self.finding_id}"
