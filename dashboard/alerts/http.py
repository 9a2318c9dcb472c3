"""The only outbound HTTP of the alerts: one POST under one deadline, a guard against private destinations, and the
answer classified (delivered / retry later / permanent) so callers store it as data instead of raising.

The guard resolves the host itself and refuses the request if ANY address is private, loopback, link-local, a
tunnel or translation that may lead to one (6to4, Teredo, NAT64 of a private address, IPv4-mapped) or otherwise not
global, unless its network is in ``ALERTS_ALLOW_NETWORKS`` (or ``ALERTS_ALLOW_PRIVATE`` allows them all). It then
connects to the address it checked (:class:`PinnedBackend`), keeping the URL's host for the Host header and TLS: a
DNS answer that changes between check and connect (rebinding) cannot redirect the request inside the network.

One deadline covers the whole request (resolve, connect, TLS, send, the answer's head): every socket operation gets
only the time left, so a receiver dripping a byte at a time cannot hold a sender past it. Only the status line and
headers are read, never the body: what an internal service answers is nobody's to read, and the stored error is the
status code with its standard reason.
"""

from __future__ import annotations

import email.utils
import functools
import ipaddress
import logging
import socket
import ssl
import time
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx

log = logging.getLogger(__name__)
# httpx logs every request's URL at INFO; a Slack webhook URL is a secret, and secrets are never logged.
logging.getLogger("httpx").setLevel(logging.WARNING)

Resolver = Callable[..., list[tuple[Any, ...]]]
IP = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
MAX_RETRY_AFTER_S = 3600.0
WRITE_CHUNK = 16 * 1024
ALLOW_HINT = "(add its network to CLUSTERDX_ALERTS_ALLOW_NETWORKS to allow it)"

# IPv6 prefixes that carry an IPv4 address (or lead through a relay): judged before the generic checks, which
# Python's ipaddress gets wrong for some of them (2002::/16 is "global" in 3.11).
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # DNS64 on IPv6-only networks: fine when the IPv4 inside is public
_TUNNELS = (
    (ipaddress.IPv6Network("2002::/16"), "6to4 tunnel"),  # RFC 7526 deprecated it; relays reach anything
    (ipaddress.IPv6Network("2001::/32"), "Teredo tunnel"),
    (ipaddress.IPv6Network("64:ff9b:1::/48"), "local NAT64"),  # RFC 8215: translated into the local network
    (ipaddress.IPv6Network("::ffff:0:0:0/96"), "IPv4-translated"),  # SIIT
)


class Refused(Exception):
    """The destination is not allowed (a permanent error: retrying cannot help)."""


@dataclass(frozen=True)
class HttpResult:
    status: int | None  # None: no response at all
    error: str  # "" when delivered
    retryable: bool
    retry_after_s: float | None
    duration_ms: float

    @property
    def delivered(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def _why_not_global(ip: IP) -> str | None:
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:  # no DNS answer has a reason to be one
            return _why_not_global(ip.ipv4_mapped) or "IPv4-mapped"
        for network, what in _TUNNELS:
            if ip in network:
                return what
        if ip in _NAT64:
            why = _why_not_global(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
            return f"NAT64-translated {why}" if why else None
    for attr, what in (("is_unspecified", "unspecified"), ("is_loopback", "loopback"), ("is_link_local", "link-local"),
                       ("is_private", "private"), ("is_multicast", "multicast"), ("is_reserved", "reserved")):
        if getattr(ip, attr):
            return what
    return None if ip.is_global else "not globally routable"


def why_refused(ip: IP, *, allow_private: bool, allow_networks: Iterable[Network] = ()) -> str | None:
    """Why ``ip`` may not be connected to (a phrase: "a {why} address"), or None when it may."""
    if allow_private:
        return None
    plain = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else ip
    # Same version first: ipaddress compares the bare integers, so 10.0.5.7 would otherwise be "in" ::/96.
    if any(plain.version == net.version and plain in net for net in allow_networks):
        return None
    return _why_not_global(ip)


def check_destination(host: str, port: int, *, allow_private: bool, allow_networks: Iterable[Network] = (),
                      resolve: Resolver = socket.getaddrinfo) -> str:
    """The address to connect to for ``host``; raises Refused, or OSError when the name does not resolve."""
    infos = resolve(host, port, type=socket.SOCK_STREAM)
    addresses = list(dict.fromkeys(str(info[4][0]).split("%")[0] for info in infos))
    if not addresses:
        raise OSError(f"{host} has no address")
    networks = tuple(allow_networks)
    for addr in addresses:
        why = why_refused(ipaddress.ip_address(addr), allow_private=allow_private, allow_networks=networks)
        if why:
            raise Refused(f"refused: {host} resolves to {addr}, a {why} address {ALLOW_HINT}")
    return addresses[0]


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), capped; None when absent or garbage."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def classify(status: int, headers: Mapping[str, str], duration_ms: float) -> HttpResult:
    if 200 <= status < 300:
        return HttpResult(status, "", False, None, duration_ms)
    # The standard reason, never the receiver's words: its reply may be an internal service's page.
    error = f"HTTP {status} {httpx.codes.get_reason_phrase(status)}".rstrip()
    # 408 and 429 say "later"; 5xx is the receiver's trouble; every other answer (404, 410, 400, 3xx) will not change.
    retryable = status in (408, 429) or status >= 500
    retry_after = parse_retry_after(headers.get("retry-after")) if retryable else None
    return HttpResult(status, error, retryable, retry_after, duration_ms)


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self, timeout: type[Exception]) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise timeout("the request's deadline has passed")
        return left


class _Stream(httpcore.NetworkStream):
    """A socket whose every operation gets only what is left of the request's deadline, not a fresh timeout."""

    def __init__(self, inner: httpcore.NetworkStream, deadline: _Deadline) -> None:
        self._inner, self._deadline = inner, deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, self._deadline.left(httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        for start in range(0, len(buffer), WRITE_CHUNK):  # one send per chunk, each within the time left
            self._inner.write(buffer[start:start + WRITE_CHUNK], self._deadline.left(httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        inner = self._inner.start_tls(ssl_context, server_hostname, self._deadline.left(httpcore.ConnectTimeout))
        return _Stream(inner, self._deadline)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class PinnedBackend(httpcore.NetworkBackend):
    """Connects to the vetted address whatever host it is asked for (the URL's host stays for Host and TLS), checks
    that address once more, and puts every socket operation under one deadline."""

    def __init__(self, address: str, *, deadline_s: float, allow_private: bool,
                 allow_networks: Iterable[Network] = ()) -> None:
        self.address, self.deadline = address, _Deadline(deadline_s)
        self.allow_private, self.allow_networks = allow_private, tuple(allow_networks)

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: typing.Iterable[Any] | None = None) -> httpcore.NetworkStream:
        why = why_refused(ipaddress.ip_address(self.address), allow_private=self.allow_private,
                          allow_networks=self.allow_networks)
        if why:
            raise Refused(f"refused: {self.address} is a {why} address {ALLOW_HINT}")
        stream = httpcore.SyncBackend().connect_tcp(self.address, port, self.deadline.left(httpcore.ConnectTimeout),
                                                    local_address, socket_options)
        return _Stream(stream, self.deadline)

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: typing.Iterable[Any] | None = None) -> httpcore.NetworkStream:
        raise Refused("refused: alerts never go to a unix socket")


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    return httpx.create_ssl_context(trust_env=False)  # certifi's CAs, as httpx uses; built once


def post(url: str, body: bytes, headers: dict[str, str], *, timeout: float, allow_private: bool,
         allow_networks: Iterable[Network] = (), resolve: Resolver = socket.getaddrinfo) -> HttpResult:
    """POST ``body``, all of it within ``timeout`` seconds; never raises for anything the network or receiver does."""
    started = time.monotonic()

    def done(error: str, retryable: bool) -> HttpResult:
        return HttpResult(None, error, retryable, None, (time.monotonic() - started) * 1000)

    networks = tuple(allow_networks)
    try:
        target = httpx.URL(url)
        if target.scheme not in ("http", "https") or not target.host:
            return done(f"unsupported URL scheme {target.scheme!r}", False)
        address = check_destination(target.host, target.port or (443 if target.scheme == "https" else 80),
                                    allow_private=allow_private, allow_networks=networks, resolve=resolve)
    except Refused as exc:
        return done(str(exc), False)
    except httpx.InvalidURL as exc:
        return done(f"invalid URL: {exc}", False)
    except OSError as exc:  # DNS trouble is usually passing
        return done(f"cannot resolve the receiver's host: {exc}", True)
    backend = PinnedBackend(address, deadline_s=timeout - (time.monotonic() - started), allow_private=allow_private,
                            allow_networks=networks)
    try:
        return _send(target, body, headers, backend, started)
    except Refused as exc:
        return done(str(exc), False)
    except httpcore.TimeoutException:
        return done(f"receiver too slow: no complete answer within {timeout:g} s", True)
    except httpcore.ProtocolError as exc:  # h11's message quotes what the receiver sent: not ours to show
        return done(f"{type(exc).__name__}: no valid HTTP answer", True)
    except httpcore.NetworkError as exc:  # connection refused or reset, TLS failure
        return done(f"{type(exc).__name__}: {exc}"[:200] if str(exc) else type(exc).__name__, True)


def _send(target: httpx.URL, body: bytes, headers: dict[str, str], backend: PinnedBackend,
          started: float) -> HttpResult:
    url = httpcore.URL(scheme=target.raw_scheme, host=target.raw_host, port=target.port, target=target.raw_path)
    request_headers = [("Host", target.netloc.decode("ascii")), *headers.items()]
    # Leaving the block closes the connection with the body unread: the status and headers are all we use.
    with (httpcore.ConnectionPool(ssl_context=_ssl_context(), network_backend=backend, retries=0) as pool,
          pool.stream("POST", url, headers=request_headers, content=body) as response):
        answer = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in response.headers}
        return classify(response.status, answer, (time.monotonic() - started) * 1000)
