"""``manage.py alerts``: the secret is printed once, listings never show it, tests and disabling work."""

from __future__ import annotations

import io
import logging
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from dashboard.alerts.models import Endpoint
from tests.alerts.alerts_support import Receiver, Reply


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("alerts", *args, stdout=out)
    return out.getvalue()


def test_add_prints_the_secret_once_and_list_never(cluster: Any, receiver: Receiver, caplog: Any) -> None:
    caplog.set_level(logging.DEBUG)
    out = run("add", "--cluster", "prod-a", "--kind", "webhook", "--url", receiver.url, "--name", "oncall",
              "--min-severity", "error", "--kinds", "failing_gpu, node_down")
    endpoint = Endpoint.objects.get()
    assert out == f"endpoint {endpoint.id} (webhook) added to prod-a\nsecret (shown once): {endpoint.secret}\n"
    assert (endpoint.min_severity, endpoint.kinds) == ("error", ["failing_gpu", "node_down"])
    listing = run("list")
    assert listing == (f"{endpoint.id}\tprod-a\toncall\twebhook\t{receiver.url}\t>=error\tfailing_gpu,node_down\t"
                       "30/h\tenabled\n")
    receiver.secret = endpoint.secret
    assert run("test", str(endpoint.id)).startswith("test delivery 1: delivered, HTTP 200, ")
    assert receiver.requests[0].verified is True
    assert receiver.requests[0].json()["data"]["link"].endswith("/clusters/prod-a/"), "a test alert opens the cluster"
    assert endpoint.secret not in caplog.text


def test_slack_urls_are_masked_in_listings(cluster: Any) -> None:
    run("add", "--cluster", "prod-a", "--kind", "slack", "--url", "https://hooks.slack.com/services/T0/B0/secretpart")
    assert "secretpart" not in run("list") and "https://hooks.slack.com/…" in run("list")


def test_a_failed_test_exits_non_zero_with_the_reason(cluster: Any, receiver: Receiver) -> None:
    run("add", "--cluster", "prod-a", "--kind", "webhook", "--url", receiver.url)
    receiver.script = [Reply(404)]
    with pytest.raises(CommandError, match="not delivered"):
        run("test", str(Endpoint.objects.get().id))
    assert len(receiver.requests) == 1


def test_disable_and_enable(cluster: Any) -> None:
    run("add", "--cluster", "prod-a", "--kind", "pagerduty", "--secret", "a" * 32)
    pk = str(Endpoint.objects.get().id)
    assert run("disable", pk) == f"endpoint {pk} disabled\n" and not Endpoint.objects.get().enabled
    assert run("enable", pk) == f"endpoint {pk} enabled\n" and Endpoint.objects.get().enabled
    assert Endpoint.objects.get().url == "https://events.pagerduty.com/v2/enqueue"


def test_errors_are_command_errors(cluster: Any) -> None:
    with pytest.raises(CommandError, match="no cluster named 'nope'"):
        run("add", "--cluster", "nope", "--kind", "webhook", "--url", "https://x.example.org")
    with pytest.raises(CommandError, match="routing"):
        run("add", "--cluster", "prod-a", "--kind", "pagerduty", "--secret", "short")
    with pytest.raises(CommandError, match="no endpoint 99"):
        run("disable", "99")
