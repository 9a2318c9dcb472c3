"""The only outbound HTTP of the alerts: one POST with timeouts, a guard against private destinations, and the
answer classified (delivered / retry later / permanent) so callers store it as data instead of raising.

The guard resolves the host itself, refuses the request if ANY address is private, loopback, link-local or
otherwise not global (unless ``CLUSTERDX["ALERTS_ALLOW_PRIVATE"]``), and then connects to the address it checked,
keeping the Host header and TLS server name: a DNS answer that changes between check and connect (rebinding)
cannot redirect the request inside the network.
"""

from __future__ import annotations

import email.utils
import ipaddress
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

log = logging.getLogger(__name__)
# httpx logs every request's URL at INFO; a Slack webhook URL is a secret, and secrets are never logged.
logging.getLogger("httpx").setLevel(logging.WARNING)

Resolver = Callable[..., list[tuple[Any, ...]]]
MAX_RETRY_AFTER_S = 3600.0
BODY_EXCERPT = 300


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


def _why_not_global(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return _why_not_global(ip.ipv4_mapped)
    for attr, what in (("is_unspecified", "unspecified"), ("is_loopback", "loopback"), ("is_link_local", "link-local"),
                       ("is_private", "private"), ("is_multicast", "multicast"), ("is_reserved", "reserved")):
        if getattr(ip, attr):
            return what
    return None if ip.is_global else "not globally routable"


def check_destination(host: str, port: int, *, allow_private: bool, resolve: Resolver = socket.getaddrinfo) -> str:
    """The address to connect to for ``host``; raises Refused, or OSError when the name does not resolve."""
    infos = resolve(host, port, type=socket.SOCK_STREAM)
    addresses = list(dict.fromkeys(str(info[4][0]).split("%")[0] for info in infos))
    if not addresses:
        raise OSError(f"{host} has no address")
    if not allow_private:
        for addr in addresses:
            why = _why_not_global(ipaddress.ip_address(addr))
            if why:
                raise Refused(f"refused: {host} resolves to {addr}, a {why} address "
                              "(set CLUSTERDX_ALERTS_ALLOW_PRIVATE=1 to allow on-premises receivers)")
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


def classify(status: int, headers: httpx.Headers, body: str, duration_ms: float) -> HttpResult:
    if 200 <= status < 300:
        return HttpResult(status, "", False, None, duration_ms)
    excerpt = " ".join(body.split())[:BODY_EXCERPT]
    error = f"HTTP {status}" + (f": {excerpt}" if excerpt else "")
    # 408 and 429 say "later"; 5xx is the receiver's trouble; every other answer (404, 410, 400, 3xx) will not change.
    retryable = status in (408, 429) or status >= 500
    retry_after = parse_retry_after(headers.get("retry-after")) if retryable else None
    return HttpResult(status, error, retryable, retry_after, duration_ms)


def _pinned(url: httpx.URL, address: str) -> tuple[httpx.URL, dict[str, str], dict[str, Any]]:
    host_header = url.netloc.decode("ascii")
    extensions = {"sni_hostname": url.host} if url.scheme == "https" else {}
    return url.copy_with(host=address), {"Host": host_header}, extensions


def post(url: str, body: bytes, headers: dict[str, str], *, timeout: float, allow_private: bool,
         resolve: Resolver = socket.getaddrinfo) -> HttpResult:
    """POST ``body``; never raises for anything the network or the receiver does."""
    started = time.monotonic()

    def done(error: str, retryable: bool) -> HttpResult:
        return HttpResult(None, error, retryable, None, (time.monotonic() - started) * 1000)

    try:
        target = httpx.URL(url)
        if target.scheme not in ("http", "https") or not target.host:
            return done(f"unsupported URL scheme {target.scheme!r}", False)
        address = check_destination(target.host, target.port or (443 if target.scheme == "https" else 80),
                                    allow_private=allow_private, resolve=resolve)
    except Refused as exc:
        return done(str(exc), False)
    except httpx.InvalidURL as exc:
        return done(f"invalid URL: {exc}", False)
    except OSError as exc:  # DNS trouble is usually passing
        return done(f"cannot resolve the receiver's host: {exc}", True)
    pinned, host_header, extensions = _pinned(target, address)
    try:
        with httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False) as client:
            request = client.build_request("POST", pinned, content=body, headers={**headers, **host_header},
                                           extensions=extensions)
            response = client.send(request, stream=True)
            try:
                text = _read_excerpt(response)
            finally:
                response.close()
            return classify(response.status_code, response.headers, text, (time.monotonic() - started) * 1000)
    except httpx.TimeoutException as exc:
        return done(f"timeout after {timeout:g} s ({type(exc).__name__})", True)
    except httpx.TransportError as exc:  # connection refused or reset, TLS failure, protocol error
        return done(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, True)


def _read_excerpt(response: httpx.Response) -> str:
    """At most a few KB of the answer: enough for an error message, never a receiver's whole page."""
    chunks: list[bytes] = []
    size = 0
    for chunk in response.iter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size >= 4096:
            break
    return b"".join(chunks)[:4096].decode("utf-8", "replace")
