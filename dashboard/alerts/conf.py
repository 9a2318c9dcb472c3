"""Alert settings: ``settings.CLUSTERDX[NAME]`` when present (tests override there), else ``CLUSTERDX_<NAME>``
from the environment, read through the strict helpers so a typo is an error, not a silent default."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Iterable
from typing import Any

from django.conf import settings

from dashboard.envconf import ConfigError, env_float, env_int, env_str

log = logging.getLogger(__name__)
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

_DEFAULTS: dict[str, Callable[[str], Any]] = {
    # A new alert waits this long for others of its group (a storm arrives within one diagnosis pass).
    "ALERTS_GROUP_WAIT_S": lambda n: env_float(n, 1.0, min=0.0),
    # Findings of the same group opened within this window of the first are folded into its alert.
    "ALERTS_GROUP_WINDOW_S": lambda n: env_float(n, 300.0, min=0.0),
    "ALERTS_MAX_ATTEMPTS": lambda n: env_int(n, 8, min=1),
    "ALERTS_BACKOFF_BASE_S": lambda n: env_float(n, 2.0, min=0.01),
    "ALERTS_BACKOFF_MAX_S": lambda n: env_float(n, 600.0, min=0.01),
    # The whole request: resolve, connect, TLS, send and the answer's head. A receiver slower than this (a slow
    # loris dripping a byte at a time) is given up on and retried, so it cannot hold a sender for hours.
    "ALERTS_HTTP_TIMEOUT_S": lambda n: env_float(n, 10.0, min=0.1),
    # Private networks that receivers may be in (on-premises), as a CIDR list; everything else private is refused.
    "ALERTS_ALLOW_NETWORKS": lambda n: parse_networks(env_str(n, ""), n),
    # Empty: the Celery default queue. A queue of their own keeps alerts ahead of a backlog of heavy tasks.
    "ALERTS_QUEUE": lambda n: env_str(n, ""),
    # Production sweep re-enqueues rows overdue by this much (a message lost with a broker).
    "ALERTS_SWEEP_GRACE_S": lambda n: env_float(n, 60.0, min=1.0),
}


def get(name: str) -> Any:
    overrides = settings.CLUSTERDX
    if name in overrides:
        return overrides[name]
    return _DEFAULTS[name](f"CLUSTERDX_{name}")


def allow_private() -> bool:
    """Every private destination allowed (the old all-or-nothing switch; ALERTS_ALLOW_NETWORKS is the narrow one)."""
    return bool(settings.CLUSTERDX.get("ALERTS_ALLOW_PRIVATE", False))


def allow_networks() -> tuple[Network, ...]:
    return parse_networks(get("ALERTS_ALLOW_NETWORKS"))  # a settings override may be a string or a list


def parse_networks(raw: str | Iterable[str | Network], name: str = "CLUSTERDX_ALERTS_ALLOW_NETWORKS") -> tuple[Network, ...]:
    """``10.0.5.0/24, fd00::/64`` -> networks. Strict: host bits set, a typo or a catch-all is an error."""
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    networks = []
    for item in (str(i).strip() for i in items):
        if not item:
            continue
        try:
            network = ipaddress.ip_network(item, strict=True)
        except ValueError as exc:
            why = "has host bits set" if "host bits set" in str(exc) else "is not a network (use CIDR: 10.0.5.0/24)"
            raise ConfigError(f"{name}: {item!r} {why}") from None
        if network.prefixlen == 0:
            raise ConfigError(f"{name}: {item!r} allows every address (cloud metadata included): list your "
                              "receivers' networks")
        networks.append(network)
    return tuple(networks)


def claim_lease_s() -> float:
    """How long a claimed delivery belongs to its worker: the request's deadline with a wide margin (it was per
    phase once). After that a redelivered task may take it over (the worker that claimed it was killed)."""
    return 3 * float(get("ALERTS_HTTP_TIMEOUT_S")) + 2.0


def check() -> None:
    for name in _DEFAULTS:
        get(name)
    allow_networks()
    if allow_private():
        log.warning("alerts: CLUSTERDX_ALERTS_ALLOW_PRIVATE allows every private address, internal services "
                    "included; prefer CLUSTERDX_ALERTS_ALLOW_NETWORKS with your receivers' networks")
