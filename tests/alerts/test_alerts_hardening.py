"""Issue 12, items 3 and 9: a slow receiver cannot hold a delivery past its deadline; the private-address guard knows
the IPv6 transition prefixes, private receivers are allowed by network, and nobody reads a receiver's reply."""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.test import Client

import dashboard.alerts.webhook  # noqa: F401  (imported now: the first delivery's timing is the request's alone)
from dashboard.alerts import conf, endpoints, http
from dashboard.alerts.models import Delivery
from dashboard.alerts.tasks import send_due
from dashboard.envconf import ConfigError
from tests.alerts.alerts_support import Receiver, Reply, make_finding, signal

S = Delivery.Status


class Trickle:
    """A raw receiver on 127.0.0.1: reads the request, sends ``head`` at once, then ``drip`` one byte per
    ``every_s`` (a slow loris), and hangs up after ``give_up_s`` at the latest."""

    def __init__(self, drip: bytes, *, head: bytes = b"", every_s: float = 1.0, give_up_s: float = 8.0) -> None:
        self.drip, self.head, self.every_s, self.give_up_s = drip, head, every_s, give_up_s
        self.stopping = threading.Event()
        self.requests = 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.05)
        self.port = self.server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/hook"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:  # closed by stop()
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(2.0)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:
                body += conn.recv(65536)
            self.requests += 1
            conn.sendall(self.head)
            end = time.monotonic() + self.give_up_s
            for byte in self.drip:
                if self.stopping.wait(self.every_s) or time.monotonic() > end:
                    return
                conn.sendall(bytes([byte]))

    def stop(self) -> None:
        self.stopping.set()
        self.server.close()


@pytest.fixture
def trickle() -> Iterator[Callable[..., Trickle]]:
    made: list[Trickle] = []

    def make(drip: bytes, **options: Any) -> Trickle:
        made.append(Trickle(drip, **options))
        return made[-1]

    yield make
    for t in made:
        t.stop()


def webhook_to(cluster: Any, url: str) -> Any:
    return endpoints.create(cluster, name="oncall", kind="webhook", url=url)[0]


def opened(cluster: Any, node: Any) -> Delivery:
    signal(make_finding(cluster, node=node, gpu_index=0), "opened")
    return Delivery.objects.get(event="opened", group=None)


ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


# --- item 3: one deadline for the whole request ---------------------------------------------------------------------

def test_it_gives_up_on_a_slow_loris_at_the_deadline_and_retries(cluster: Any, nodes: list[Any],
                                                                 trickle: Callable[..., Trickle],
                                                                 alerts_settings: dict[str, Any]) -> None:
    alerts_settings["ALERTS_HTTP_TIMEOUT_S"] = 2.0
    loris = trickle(ANSWER * 10)  # one byte a second: every read succeeds well within a per-read timeout
    webhook_to(cluster, loris.url)
    row = opened(cluster, nodes[0])
    started = time.monotonic()
    send_due()
    elapsed = time.monotonic() - started
    row.refresh_from_db()
    assert 1.9 <= elapsed < 3.0, (elapsed, row.duration_ms)
    assert (row.status, row.attempts, row.response_code) == (S.RETRYING, 1, None)
    assert row.last_error == "receiver too slow: no complete answer within 2 s"
    assert 1900 <= row.duration_ms < 3000
    assert loris.requests == 1


def test_a_test_send_to_a_slow_loris_fails_once_at_the_deadline(cluster: Any, trickle: Callable[..., Trickle],
                                                                alerts_settings: dict[str, Any]) -> None:
    alerts_settings["ALERTS_HTTP_TIMEOUT_S"] = 1.0
    loris = trickle(ANSWER, head=b"HTTP/1.1 2")  # the status line never completes
    started = time.monotonic()
    row = endpoints.send_test(webhook_to(cluster, loris.url))
    assert time.monotonic() - started < 2.0
    assert (row.status, row.attempts) == (S.FAILED, 1)
    assert row.last_error == "receiver too slow: no complete answer within 1 s (test sends are not retried)"


def test_the_answer_body_is_not_waited_for(cluster: Any, nodes: list[Any], trickle: Callable[..., Trickle]) -> None:
    # The status says delivered; a body dripping after it must not hold the sender (nor is it read at all).
    loris = trickle(b"x" * 100, head=b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
    webhook_to(cluster, loris.url)
    row = opened(cluster, nodes[0])
    started = time.monotonic()
    send_due()
    assert time.monotonic() - started < 0.9
    row.refresh_from_db()
    assert (row.status, row.response_code, row.last_error) == (S.DELIVERED, 200, "")


def test_post_honours_the_deadline_itself(trickle: Callable[..., Trickle]) -> None:
    loris = trickle(ANSWER * 10, every_s=0.2)
    started = time.monotonic()
    result = http.post(loris.url, b"{}", {}, timeout=0.5, allow_private=True)
    assert 0.45 <= time.monotonic() - started < 1.5
    assert (result.status, result.retryable, result.error) == (
        None, True, "receiver too slow: no complete answer within 0.5 s")


def test_a_tls_handshake_that_never_ends_is_given_up_at_the_deadline() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel completes TCP; nobody ever answers TLS
        started = time.monotonic()
        result = http.post(f"https://127.0.0.1:{silent.getsockname()[1]}/", b"{}", {}, timeout=0.5,
                           allow_private=True)
        assert 0.45 <= time.monotonic() - started < 1.5
        assert result.error == "receiver too slow: no complete answer within 0.5 s" and result.retryable


# --- item 9: the guard ---------------------------------------------------------------------------------------------

def resolver(*addresses: str, calls: list[str] | None = None) -> Any:
    def resolve(host: str, port: int, **kwargs: Any) -> list[tuple[Any, ...]]:
        if calls is not None:
            calls.append(host)
            if len(calls) > 1:  # a rebinding DNS server: the second answer points inside
                return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.9.9.9", port))]
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                for a in addresses]

    return resolve


@pytest.mark.parametrize(("address", "why"), [
    ("2002:7f00:1::1", "6to4 tunnel"),                        # 6to4 of 127.0.0.1
    ("2002:a00:1::", "6to4 tunnel"),                          # 6to4 of 10.0.0.1
    ("2002:a9fe:a9fe::1", "6to4 tunnel"),                     # 6to4 of 169.254.169.254 (cloud metadata)
    ("2002:5db8:d822::1", "6to4 tunnel"),                     # even of a public address: relays go anywhere
    ("64:ff9b::a00:1", "NAT64-translated private"),          # NAT64 of 10.0.0.1
    ("64:ff9b::7f00:1", "NAT64-translated loopback"),
    ("64:ff9b::a9fe:a9fe", "NAT64-translated link-local"),
    ("64:ff9b:1::a00:1", "local NAT64"),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "Teredo tunnel"),
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:93.184.216.34", "IPv4-mapped"),
    ("::ffff:0:a00:1", "IPv4-translated"),  # ::ffff:0:0:0/96 (SIIT) of 10.0.0.1
])
def test_it_refuses_ipv6_transition_addresses(address: str, why: str) -> None:
    with pytest.raises(http.Refused) as err:
        http.check_destination("hooks.example.org", 443, allow_private=False, resolve=resolver(address))
    assert f"resolves to {address}, a {why} address" in str(err.value)


def test_nat64_of_a_public_address_is_allowed() -> None:
    # IPv6-only networks reach IPv4 receivers this way (DNS64): refusing it would cut them off.
    assert http.check_destination("hooks.example.org", 443, allow_private=False,
                                  resolve=resolver("64:ff9b::5db8:d822")) == "64:ff9b::5db8:d822"


def test_every_answer_is_checked_even_a_transition_one() -> None:
    with pytest.raises(http.Refused):
        http.check_destination("x.example.org", 443, allow_private=False,
                               resolve=resolver("93.184.216.34", "2606:2800:220:1::1", "2002:a00:1::1"))


@pytest.mark.parametrize(("address", "allowed"), [
    ("10.0.5.7", True), ("10.0.6.1", False), ("fd00::5", True), ("fd00:0:0:1::5", False),
    ("::ffff:10.0.5.7", True), ("169.254.169.254", False), ("127.0.0.1", False), ("2002:a00:507::1", False),
    ("93.184.216.34", True),
])
def test_allowed_networks_open_only_themselves(address: str, allowed: bool) -> None:
    networks = conf.parse_networks("10.0.5.0/24, fd00::/64")

    def check() -> str:
        return http.check_destination("hooks.corp", 443, allow_private=False, allow_networks=networks,
                                      resolve=resolver(address))

    if allowed:
        assert check() == address
    else:
        with pytest.raises(http.Refused) as err:
            check()
        assert str(err.value).endswith("(add its network to CLUSTERDX_ALERTS_ALLOW_NETWORKS to allow it)")


def test_the_allow_list_is_parsed_strictly() -> None:
    assert conf.parse_networks(" 10.0.5.0/24,fd00::/64 ,192.168.1.9") == (
        ipaddress.ip_network("10.0.5.0/24"), ipaddress.ip_network("fd00::/64"), ipaddress.ip_network("192.168.1.9/32"))
    assert conf.parse_networks("") == () and conf.parse_networks(["10.1.0.0/16"]) == (
        ipaddress.ip_network("10.1.0.0/16"),)
    for raw, why in [("10.0.5.1/24", "has host bits set"), ("10.0.5.0/33", "not a network"),
                     ("intranet", "not a network"), ("10.0.0.0/8;fd00::/8", "not a network"),
                     ("0.0.0.0/0", "allows every address"), ("::/0", "allows every address")]:
        with pytest.raises(ConfigError) as err:
            conf.parse_networks(raw)
        assert str(err.value).startswith("CLUSTERDX_ALERTS_ALLOW_NETWORKS: ") and why in str(err.value), raw


def test_a_bad_allow_list_fails_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERDX_ALERTS_ALLOW_NETWORKS", "10.0.5.0/33")
    with pytest.raises(ConfigError, match=re.escape("CLUSTERDX_ALERTS_ALLOW_NETWORKS: '10.0.5.0/33' is not a network")):
        conf.check()
    monkeypatch.setenv("CLUSTERDX_ALERTS_ALLOW_NETWORKS", "10.0.5.0/24")
    conf.check()
    assert conf.allow_networks() == (ipaddress.ip_network("10.0.5.0/24"),)


def test_allow_private_still_works_but_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dashboard.alerts.conf"):
        conf.check()
    assert conf.allow_private() is True
    assert "CLUSTERDX_ALERTS_ALLOW_PRIVATE allows every private address" in caplog.text


def test_a_receiver_in_an_allowed_network_gets_its_alerts(cluster: Any, nodes: list[Any], receiver: Receiver,
                                                          alerts_settings: dict[str, Any]) -> None:
    alerts_settings.update(ALERTS_ALLOW_PRIVATE=False, ALERTS_ALLOW_NETWORKS="127.0.0.0/30")
    webhook_to(cluster, receiver.url)
    row = opened(cluster, nodes[0])
    send_due()
    row.refresh_from_db()
    assert (row.status, row.response_code) == (S.DELIVERED, 200)


def test_a_receiver_outside_the_allowed_networks_is_refused_for_good(cluster: Any, nodes: list[Any],
                                                                     receiver: Receiver,
                                                                     alerts_settings: dict[str, Any]) -> None:
    alerts_settings.update(ALERTS_ALLOW_PRIVATE=False, ALERTS_ALLOW_NETWORKS="10.0.5.0/24")
    webhook_to(cluster, receiver.url)
    row = opened(cluster, nodes[0])
    send_due()
    row.refresh_from_db()
    assert receiver.requests == []
    assert (row.status, row.attempts) == (S.FAILED, 1)
    assert row.last_error == ("refused: 127.0.0.1 resolves to 127.0.0.1, a loopback address "
                              "(add its network to CLUSTERDX_ALERTS_ALLOW_NETWORKS to allow it)")


def test_it_connects_to_the_vetted_address_despite_rebinding(receiver: Receiver) -> None:
    calls: list[str] = []
    result = http.post(f"http://alerts.invalid:{receiver.port}/hook", b"{}", {}, timeout=2, allow_private=False,
                       allow_networks=conf.parse_networks("127.0.0.1"), resolve=resolver("127.0.0.1", calls=calls))
    assert result.delivered and calls == ["alerts.invalid"]  # resolved once; a second answer would be 10.9.9.9


def test_the_transport_connects_only_to_the_vetted_address(receiver: Receiver) -> None:
    allowed = conf.parse_networks("127.0.0.1")
    backend = http.PinnedBackend("127.0.0.1", deadline_s=1, allow_private=False, allow_networks=allowed)
    backend.connect_tcp("rebound.example.org", receiver.port).close()  # whatever host it is asked for
    refusing = http.PinnedBackend("127.0.0.1", deadline_s=1, allow_private=False, allow_networks=())
    with pytest.raises(http.Refused):
        refusing.connect_tcp("127.0.0.1", receiver.port)


# --- item 9: nobody reads the reply -------------------------------------------------------------------------------

SECRET_PAGE = b"<h1>Jenkins</h1> root password: hunter2"


def test_the_stored_error_is_a_status_line_without_the_reply(cluster: Any, nodes: list[Any],
                                                              trickle: Callable[..., Trickle]) -> None:
    answer = b"HTTP/1.1 403 internal-admin-console\r\nContent-Length: %d\r\n\r\n%s" % (len(SECRET_PAGE), SECRET_PAGE)
    t = trickle(b"", head=answer)
    webhook_to(cluster, t.url)
    row = opened(cluster, nodes[0])
    send_due()
    row.refresh_from_db()
    assert (row.status, row.response_code, row.last_error) == (S.FAILED, 403, "HTTP 403 Forbidden")


def test_a_non_http_service_does_not_leak_its_banner(cluster: Any, trickle: Callable[..., Trickle]) -> None:
    t = trickle(b"", head=b"SSH-2.0-OpenSSH_9.6 internal-bastion-7\r\nProtocol mismatch.\r\n\r\n", give_up_s=0)
    row = endpoints.send_test(webhook_to(cluster, t.url))
    assert row.status == S.FAILED and row.response_code is None
    assert "internal-bastion" not in row.last_error and "SSH" not in row.last_error
    assert row.last_error == "RemoteProtocolError: no valid HTTP answer (test sends are not retried)"


@pytest.fixture
def member(cluster: Any, django_user_model: Any) -> Client:
    user = django_user_model.objects.create_user("bob")  # no password: nothing to hash
    cluster.members.add(user)
    client = Client()
    client.force_login(user)
    return client


def test_send_test_shows_the_status_and_never_the_reply(cluster: Any, member: Client, receiver: Receiver) -> None:
    receiver.script = [Reply(404)]
    endpoint = webhook_to(cluster, receiver.url)
    page = member.post(f"/clusters/prod-a/alerts/{endpoint.id}/test/", follow=True).content.decode()
    assert "Test to oncall: failed HTTP 404 Not Found" in page
    assert "test receiver" not in page  # the body said "answer 404 from the test receiver"
    log = member.get("/clusters/prod-a/alerts/deliveries/").content.decode()
    assert "HTTP 404 Not Found" in log and "test receiver" not in log


def test_send_test_that_delivers_says_so(cluster: Any, member: Client, receiver: Receiver) -> None:
    endpoint = webhook_to(cluster, receiver.url)
    page = member.post(f"/clusters/prod-a/alerts/{endpoint.id}/test/", follow=True).content.decode()
    assert "Test to oncall: delivered HTTP 200 OK" in page


def test_the_log_hides_replies_stored_before_the_fix(cluster: Any, member: Client, receiver: Receiver) -> None:
    endpoint = webhook_to(cluster, receiver.url)
    for n, error in enumerate(["HTTP 404: <h1>Jenkins</h1> root password: hunter2",
                               "HTTP 502: Bad gateway\nfrom vault.internal (gave up after 8 attempts)"]):
        Delivery.objects.create(endpoint=endpoint, event="test", dedup=f"old-{n}", status=S.FAILED,
                                response_code=int(error[5:8]), last_error=error)
    log = member.get("/clusters/prod-a/alerts/deliveries/").content.decode()
    assert "hunter2" not in log and "vault.internal" not in log
    assert "<td>HTTP 404</td>" in log and "<td>HTTP 502 (gave up after 8 attempts)</td>" in log
