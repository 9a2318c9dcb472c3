"""Creating endpoints and sending test alerts: shared by the pages and ``manage.py alerts``."""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from django.utils import timezone

from dashboard.alerts import base
from dashboard.alerts import delivery as attempts
from dashboard.alerts.models import Delivery, Endpoint, new_message_id
from dashboard.diagnosis.models import SEVERITIES
from dashboard.telemetry.models import Cluster


def create(cluster: Cluster, *, name: str, kind: str, url: str = "", secret: str = "", min_severity: str = "warning",
           kinds: Iterable[str] = (), max_per_hour: int = 30, user: object = None) -> tuple[Endpoint, str]:
    """The new endpoint and the secret to show once (generated for webhooks when not given)."""
    if kind not in base.REGISTRY:
        raise ValueError(f"unknown kind {kind!r}: use one of {', '.join(base.REGISTRY)}")
    if min_severity not in SEVERITIES:
        raise ValueError(f"unknown severity {min_severity!r}: use one of {', '.join(SEVERITIES)}")
    transport = base.transport_class(kind)
    url, secret = transport.clean_config(url.strip() or transport.default_url, secret.strip())
    if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
        raise ValueError("the URL must be http:// or https:// with a host")
    endpoint = Endpoint.objects.create(cluster=cluster, name=name or kind, kind=kind, url=url, secret=secret,
                                       min_severity=min_severity, kinds=sorted(set(kinds)),
                                       max_per_hour=max_per_hour, created_by=user if getattr(user, "pk", None) else None)
    shown = secret if kind != "slack" else url
    return endpoint, shown


def masked_url(endpoint: Endpoint) -> str:
    """The URL as pages and listings show it: a Slack URL is a secret, so only its host is shown."""
    if endpoint.kind == "slack":
        return f"https://{urlsplit(endpoint.url).hostname}/…"
    return endpoint.url


def send_test(endpoint: Endpoint) -> Delivery:
    """Send a test alert now, in this process, once (never retried), and return its logged row."""
    message_id = new_message_id()
    row = Delivery.objects.create(endpoint=endpoint, event="test", severity="info", dedup=f"test:{message_id}",
                                  message_id=message_id, incident_key=f"clusterdx-test-{message_id}",
                                  max_attempts=1, next_attempt_at=timezone.now())
    attempts.attempt(row.id, 1)
    row.refresh_from_db()
    return row
