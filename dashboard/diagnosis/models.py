"""Findings: one row per (cluster, kind, subject) while open; history kept once resolved."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

SEVERITIES = ["info", "warning", "error", "critical"]


class Finding(models.Model):
    class State(models.TextChoices):
        OPEN = "open"
        RESOLVED = "resolved"

    cluster = models.ForeignKey("telemetry.Cluster", on_delete=models.CASCADE, related_name="findings")
    run = models.ForeignKey("telemetry.Run", on_delete=models.SET_NULL, null=True, blank=True, related_name="findings")
    kind = models.CharField(max_length=32)  # data_starvation, straggler, slow_link, failing_gpu, ...
    # What is at fault, exactly: "cluster", "node", "gpu", "rank", "link" or "run", and a stable key such as
    # "node-003", "node-003/gpu4", "rank5", "node-001~node-002".
    subject_type = models.CharField(max_length=16)
    subject = models.CharField(max_length=300)
    node = models.ForeignKey("telemetry.Node", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    peer_node = models.ForeignKey("telemetry.Node", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    gpu_index = models.PositiveSmallIntegerField(null=True, blank=True)
    rank = models.PositiveIntegerField(null=True, blank=True)
    severity = models.CharField(max_length=16, choices=[(s, s) for s in SEVERITIES])
    state = models.CharField(max_length=16, choices=State.choices, default=State.OPEN)
    title = models.CharField(max_length=300)
    action = models.TextField(blank=True)
    confidence = models.FloatField(default=1.0)
    # The numbers behind the finding: {"metrics": {...}, "window": [t0, t1], "series": {...}} for the page to plot.
    evidence = models.JSONField(default=dict)
    opened_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    last_seen_at = models.DateTimeField()  # last pass in which the condition held
    resolved_at = models.DateTimeField(null=True, blank=True)
    clear_passes = models.PositiveIntegerField(default=0)  # consecutive passes without the condition (hysteresis)
    # Acknowledged: someone is on it, so it alerts no more (dashboard.diagnosis.silences). The ack lives on this row,
    # so it ends with it: a condition that comes back opens a new row, which alerts again.
    acked_at = models.DateTimeField(null=True, blank=True)
    acked_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True,
                                 related_name="+")
    acked_by_name = models.CharField(max_length=150, blank=True)  # kept when the account goes

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["cluster", "kind", "subject"], condition=Q(state="open"),
                                    name="finding_one_open_per_subject"),
        ]
        indexes = [
            models.Index(fields=["cluster", "state", "updated_at"]),
            models.Index(fields=["run", "state"]),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.subject} ({self.state})"


class Silence(models.Model):
    """No alert for findings about ``target`` until ``ends_at`` (a node's maintenance, a known-bad link...).

    Findings still open and show, marked silenced. Once it has ended, the alert sweep claims it (``released_at``)
    and sends what it held back for findings still open (dashboard.alerts.planner.release_silences)."""

    class Scope(models.TextChoices):
        NODE = "node"  # a host name: the node, its GPUs and ranks, and the links it is an end of
        GPU = "gpu"  # "<host>/gpu<N>"
        LINK = "link"  # "<host>~<host>", either order
        RUN = "run"  # a run id: the run's own findings
        KIND = "kind"  # a finding kind, on the whole cluster

    cluster = models.ForeignKey("telemetry.Cluster", on_delete=models.CASCADE, related_name="silences")
    scope = models.CharField(max_length=8, choices=Scope.choices)
    target = models.CharField(max_length=300)
    reason = models.CharField(max_length=500)
    starts_at = models.DateTimeField(default=timezone.now)
    ends_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True,
                                   related_name="+")
    created_by_name = models.CharField(max_length=150, blank=True)
    ended_by_name = models.CharField(max_length=150, blank=True)  # who ended it early, if anyone
    released_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["cluster", "ends_at"]),
                   models.Index(fields=["ends_at"], condition=Q(released_at=None), name="silence_unreleased")]

    def __str__(self) -> str:
        return f"silence {self.scope} {self.target} until {self.ends_at:%Y-%m-%d %H:%M}"


class RunEfficiency(models.Model):
    """A run's goodput and MFU, folded in by each diagnosis pass (dashboard.diagnosis.efficiency); ``figures`` holds
    the goodput accounting (productive / stall / checkpoint / restart / replayed seconds, wall time, restarts)."""

    run = models.OneToOneField("telemetry.Run", on_delete=models.CASCADE, related_name="efficiency")
    goodput = models.FloatField(null=True)
    mfu = models.FloatField(null=True)  # over the run's steps so far (token-weighted)
    tokens_per_s = models.FloatField(null=True)
    figures = models.JSONField(default=dict)
    tokens = models.FloatField(default=0.0)  # sums behind the run-wide MFU
    step_seconds = models.FloatField(default=0.0)
    updated_at = models.DateTimeField(auto_now=True)


class StepEfficiency(models.Model):
    """One executed step of a run, aggregated over its ranks: its time, tokens and MFU (a replayed step replaces the
    execution it repeats)."""

    run = models.ForeignKey("telemetry.Run", on_delete=models.CASCADE, related_name="+")
    step = models.BigIntegerField()
    ts = models.DateTimeField()
    step_time_s = models.FloatField()
    tokens = models.BigIntegerField(null=True)
    mfu = models.FloatField(null=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "step"], name="step_efficiency_unique")]
