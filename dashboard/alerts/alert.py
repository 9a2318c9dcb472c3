"""What a delivery says: the findings it carries (one, or a group), rendered once for every transport."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.conf import settings
from django.utils import timezone

from dashboard.alerts.models import Delivery, severity_rank
from dashboard.diagnosis.models import Finding
from dashboard.web.links import cluster_url, finding_url

EVIDENCE_ITEMS = 8


@dataclass
class Alert:
    event: str  # opened, escalated, resolved, test
    cluster: str
    message_id: str
    incident_key: str
    severity: str
    findings: list[dict[str, Any]]
    link: str
    created_at: datetime = field(default_factory=timezone.now)

    @property
    def title(self) -> str:
        if self.event == "test":
            return f"clusterdx test alert for cluster {self.cluster}"
        head = self.findings[0]
        verb = {"opened": "", "escalated": "Escalated: ", "resolved": "Resolved: "}[self.event]
        more = len(self.findings) - 1
        suffix = f" (+{more} more on {head['node'] or head['subject']})" if more else ""
        return f"{verb}{head['title']}{suffix}"

    def payload(self) -> dict[str, Any]:
        """The generic JSON body (Standard Webhooks shape: type, timestamp, data)."""
        return {
            "type": f"finding.{self.event}",
            "timestamp": self.created_at.isoformat(),
            "data": {"cluster": self.cluster, "event": self.event, "severity": self.severity, "title": self.title,
                     "incident_key": self.incident_key, "link": self.link, "findings": self.findings},
        }


def evidence_summary(evidence: dict[str, Any]) -> list[str]:
    """A few "name = value" lines from the evidence metrics (the series stay on the dashboard)."""
    metrics = evidence.get("metrics") if isinstance(evidence, dict) else None
    lines = []
    if isinstance(metrics, dict):
        for name, value in list(metrics.items())[:EVIDENCE_ITEMS]:
            shown = f"{value:.4g}" if isinstance(value, float) else str(value)
            lines.append(f"{name} = {shown[:120]}")
    window = evidence.get("window") if isinstance(evidence, dict) else None
    if isinstance(window, list | tuple) and len(window) == 2 and all(isinstance(t, int | float) for t in window):
        lines.append(f"window = {window[1] - window[0]:.0f} s")
    return lines


def dashboard_link(finding: Finding | None, cluster_name: str) -> str:
    """Where an alert opens: the finding's own page (its evidence drawn, what to do, its history), whatever the
    subject; a test alert, which carries no finding, opens the cluster."""
    if finding is not None:
        return settings.SITE_URL + finding_url(finding.id)
    return settings.SITE_URL + cluster_url(cluster_name)


def finding_info(f: Finding) -> dict[str, Any]:
    return {
        "id": f.id, "kind": f.kind, "subject": f.subject, "subject_type": f.subject_type, "severity": f.severity,
        "state": f.state, "title": f.title, "action": f.action, "evidence": evidence_summary(f.evidence),
        "node": f.node.hostname if f.node_id else None, "gpu_index": f.gpu_index, "rank": f.rank,
        "run": f.run.name if f.run_id else None, "opened_at": f.opened_at.isoformat(),
        "resolved_at": f.resolved_at.isoformat() if f.resolved_at else None,
        # Who was on it: an acknowledged finding alerts no more, but its resolve notice still goes (it closes the
        # incident the first alert opened) and says who had acknowledged it.
        "acked_by": f.acked_by_name or None, "acked_at": f.acked_at.isoformat() if f.acked_at else None,
        "link": dashboard_link(f, f.cluster.name),
    }


def carried_findings(delivery: Delivery) -> list[Finding]:
    """The delivery's own finding first, then those grouped into it (or, for a resolve, into the alert it ends)."""
    head = delivery.resolves or delivery
    members = Finding.objects.filter(deliveries__group=head).select_related("node", "run", "cluster")
    own = [delivery.finding] if delivery.finding else []
    return own + sorted((f for f in members if f.id != delivery.finding_id), key=lambda f: f.id)


def build(delivery: Delivery) -> Alert:
    cluster = delivery.endpoint.cluster.name
    if delivery.event == "test":
        return Alert("test", cluster, delivery.message_id, delivery.incident_key, "info", [],
                     dashboard_link(None, cluster))
    findings = carried_findings(delivery)
    severity = max((f.severity for f in findings), key=severity_rank, default=delivery.severity)
    return Alert(delivery.event, cluster, delivery.message_id, delivery.incident_key, severity,
                 [finding_info(f) for f in findings], dashboard_link(delivery.finding, cluster))
