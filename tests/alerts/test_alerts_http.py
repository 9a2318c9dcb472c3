"""The one outbound HTTP module: the private-address guard (with DNS answers checked and pinned), Retry-After."""

from __future__ import annotations

import socket
import time
from email.utils import formatdate
from typing import Any

import pytest

from dashboard.alerts import http
from dashboard.alerts.models import Delivery
from tests.alerts.alerts_support import Receiver, drain, make_finding, signal


def resolver(*addresses: str) -> Any:
    def resolve(host: str, port: int, **kwargs: Any) -> list[tuple[Any, ...]]:
        family = socket.AF_INET6 if ":" in addresses[0] else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 6, "", (a, port)) for a in addresses]

    return resolve


@pytest.mark.parametrize(("address", "why"), [
    ("127.0.0.1", "loopback"), ("10.1.2.3", "private"), ("192.168.0.10", "private"), ("172.16.5.4", "private"),
    ("169.254.169.254", "link-local"), ("::1", "loopback"), ("fe80::1", "link-local"), ("fd00::5", "private"),
    ("::ffff:10.0.0.1", "private"), ("0.0.0.0", "unspecified"), ("100.64.0.1", "not globally routable"),
])
def test_it_refuses_non_global_destinations(address: str, why: str) -> None:
    with pytest.raises(http.Refused) as err:
        http.check_destination("hooks.example.org", 443, allow_private=False, resolve=resolver(address))
    assert f"resolves to {address}, a {why} address" in str(err.value)


def test_one_private_answer_among_public_ones_is_enough_to_refuse() -> None:
    with pytest.raises(http.Refused):
        http.check_destination("x.example.org", 443, allow_private=False, resolve=resolver("93.184.216.34", "10.0.0.7"))
    assert http.check_destination("x.example.org", 443, allow_private=False,
                                  resolve=resolver("93.184.216.34")) == "93.184.216.34"


def test_a_refused_destination_fails_for_good_without_a_request(cluster: Any, nodes: list[Any], receiver: Receiver,
                                                                endpoint_for: Any,
                                                                alerts_settings: dict[str, Any]) -> None:
    endpoint_for(receiver)
    alerts_settings["ALERTS_ALLOW_PRIVATE"] = False
    signal(make_finding(cluster, node=nodes[0], gpu_index=0), "opened")
    drain()
    row = Delivery.objects.get()
    assert receiver.requests == []
    assert (row.status, row.attempts) == (Delivery.Status.FAILED, 1)
    assert row.last_error == ("refused: 127.0.0.1 resolves to 127.0.0.1, a loopback address "
                              "(add its network to CLUSTERDX_ALERTS_ALLOW_NETWORKS to allow it)")


def test_it_connects_to_the_address_it_checked_and_keeps_the_host(receiver: Receiver) -> None:
    # The name resolves (through the injected resolver) to the receiver's address only: a second lookup by the
    # HTTP client would fail, so a delivered request proves the checked address was the one used.
    result = http.post(f"http://alerts.invalid:{receiver.port}/hook", b"{}", {}, timeout=5, allow_private=True,
                       resolve=resolver("127.0.0.1"))
    assert result.delivered and result.status == 200
    assert receiver.requests[0].headers["host"] == f"alerts.invalid:{receiver.port}"


def test_an_unresolvable_host_is_retried() -> None:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(-2, "Name or service not known")

    result = http.post("https://hooks.invalid/x", b"{}", {}, timeout=1, allow_private=False, resolve=fail)
    assert (result.status, result.retryable) == (None, True)
    assert result.error.startswith("cannot resolve the receiver's host")


def test_retry_after_in_seconds_or_as_a_date() -> None:
    assert http.parse_retry_after("7") == 7.0
    assert 29 <= http.parse_retry_after(formatdate(time.time() + 30, usegmt=True)) <= 30  # type: ignore[operator]
    assert http.parse_retry_after("soon") is None and http.parse_retry_after(None) is None
    assert http.parse_retry_after("999999") == http.MAX_RETRY_AFTER_S


def test_the_httpx_request_log_that_would_show_a_slack_url_is_silenced() -> None:
    import logging

    assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
