"""Alert settings: ``settings.CLUSTERDX[NAME]`` when present (tests override there), else ``CLUSTERDX_<NAME>``
from the environment, read through the strict helpers so a typo is an error, not a silent default."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings

from dashboard.envconf import env_float, env_int, env_str

_DEFAULTS: dict[str, Callable[[str], Any]] = {
    # A new alert waits this long for others of its group (a storm arrives within one diagnosis pass).
    "ALERTS_GROUP_WAIT_S": lambda n: env_float(n, 1.0, min=0.0),
    # Findings of the same group opened within this window of the first are folded into its alert.
    "ALERTS_GROUP_WINDOW_S": lambda n: env_float(n, 300.0, min=0.0),
    "ALERTS_MAX_ATTEMPTS": lambda n: env_int(n, 8, min=1),
    "ALERTS_BACKOFF_BASE_S": lambda n: env_float(n, 2.0, min=0.01),
    "ALERTS_BACKOFF_MAX_S": lambda n: env_float(n, 600.0, min=0.01),
    # Per phase (connect, write, read): httpx has no total timeout, so the claim lease below allows for all three.
    "ALERTS_HTTP_TIMEOUT_S": lambda n: env_float(n, 10.0, min=0.1),
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
    return bool(settings.CLUSTERDX.get("ALERTS_ALLOW_PRIVATE", False))


def claim_lease_s() -> float:
    """How long a claimed delivery belongs to its worker: three HTTP phases plus slack. After that a redelivered
    task may take it over (the worker that claimed it was killed)."""
    return 3 * float(get("ALERTS_HTTP_TIMEOUT_S")) + 2.0


def check() -> None:
    for name in _DEFAULTS:
        get(name)
