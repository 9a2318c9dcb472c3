"""PagerDuty Events API v2: ``trigger`` for opened and escalated, ``resolve`` for resolved, one incident per alert
(``dedup_key`` is the alert's incident key: the finding, or the first finding of a grouped storm)."""

from __future__ import annotations

from typing import Any

from dashboard.alerts.alert import Alert
from dashboard.alerts.base import Transport

EVENTS_URL = "https://events.pagerduty.com/v2/enqueue"


class PagerDuty(Transport):
    kind = "pagerduty"
    default_url = EVENTS_URL

    @classmethod
    def clean_config(cls, url: str, secret: str) -> tuple[str, str]:
        if not secret or len(secret) != 32 or not secret.isalnum():
            raise ValueError("the secret must be the 32-character routing (integration) key")
        return url or EVENTS_URL, secret

    def body(self, alert: Alert) -> dict[str, Any]:
        key = alert.incident_key or alert.message_id
        if alert.event == "resolved":
            return {"routing_key": self.endpoint.secret, "event_action": "resolve", "dedup_key": key}
        head = alert.findings[0] if alert.findings else None
        details: dict[str, Any] = {"event": alert.event, "findings": alert.findings}
        if head:
            details |= {"subject": head["subject"], "evidence": head["evidence"], "action": head["action"]}
        return {
            "routing_key": self.endpoint.secret,
            "event_action": "trigger",
            "dedup_key": key,
            "payload": {
                "summary": alert.title[:1024],
                "source": (head["node"] or head["subject"]) if head else alert.cluster,
                # clusterdx severities are PagerDuty's four.
                "severity": alert.severity,
                "component": head["subject"] if head else "clusterdx",
                "group": alert.cluster,
                "class": head["kind"] if head else "test",
                "custom_details": details,
            },
            "client": "clusterdx",
            "client_url": alert.link,
            "links": [{"href": alert.link, "text": "Open in clusterdx"}],
        }
