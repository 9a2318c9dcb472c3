"""The transport base: a transport turns an Alert into one HTTP request; :mod:`http` sends it.

One small class per integration (webhook.py, slack.py, pagerduty.py), found through ``REGISTRY``.
"""

from __future__ import annotations

import importlib
import json
from typing import Any, ClassVar

from dashboard.alerts import conf, http
from dashboard.alerts.alert import Alert
from dashboard.alerts.models import Endpoint

REGISTRY: dict[str, str] = {
    "webhook": "dashboard.alerts.webhook.Webhook",
    "slack": "dashboard.alerts.slack.Slack",
    "pagerduty": "dashboard.alerts.pagerduty.PagerDuty",
}


class Transport:
    kind: ClassVar[str]
    default_url: ClassVar[str] = ""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint

    @classmethod
    def clean_config(cls, url: str, secret: str) -> tuple[str, str]:
        """Validated (url, secret) for a new endpoint; raises ValueError with a message for the user."""
        return url, secret

    def body(self, alert: Alert) -> dict[str, Any]:
        raise NotImplementedError

    def headers(self, alert: Alert, body: bytes) -> dict[str, str]:
        return {}

    def notify(self, alert: Alert) -> http.HttpResult:
        body = json.dumps(self.body(alert), separators=(",", ":"), default=str).encode()
        headers = {"Content-Type": "application/json", "User-Agent": "clusterdx-alerts/1",
                   **self.headers(alert, body)}
        return http.post(self.endpoint.url, body, headers, timeout=float(conf.get("ALERTS_HTTP_TIMEOUT_S")),
                         allow_private=conf.allow_private(), allow_networks=conf.allow_networks())


def transport_class(kind: str) -> type[Transport]:
    module, _, name = REGISTRY[kind].rpartition(".")
    return getattr(importlib.import_module(module), name)


def for_endpoint(endpoint: Endpoint) -> Transport:
    return transport_class(endpoint.kind)(endpoint)
