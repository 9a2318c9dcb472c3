"""Findings: one row per (cluster, kind, subject) while open; history kept once resolved."""

from __future__ import annotations

from django.db import models
from django.db.models import Q

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
