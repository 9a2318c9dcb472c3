"""Strict little readers for settings from the environment.

A typo in a boolean ("ture", "yes-ish") is an error at start-up, not a silent False. Every secret ``X`` may also be
given as ``X_FILE`` naming a file that holds it (Docker and Kubernetes secrets).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class ConfigError(ValueError):
    pass


def env_str(name: str, default: str = "", environ: Mapping[str, str] = os.environ) -> str:
    path = environ.get(f"{name}_FILE")
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                return fh.read().strip()
        except OSError as exc:
            raise ConfigError(f"{name}_FILE={path!r} cannot be read: {exc.strerror}") from None
    return environ.get(name, default)


def env_bool(name: str, default: bool = False, environ: Mapping[str, str] = os.environ) -> bool:
    raw = environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean: use one of 1/0, true/false, yes/no, on/off")


def env_int(name: str, default: int, *, min: int | None = None, environ: Mapping[str, str] = os.environ) -> int:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if min is not None and value < min:
        raise ConfigError(f"{name}={value} must be at least {min}")
    return value


def env_float(name: str, default: float, *, min: float | None = None, environ: Mapping[str, str] = os.environ) -> float:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if min is not None and value < min:
        raise ConfigError(f"{name}={value} must be at least {min}")
    return value


def env_list(name: str, default: str = "", environ: Mapping[str, str] = os.environ) -> list[str]:
    return [item.strip() for item in environ.get(name, default).split(",") if item.strip()]


def database_from_url(url: str, pool_size: int = 10) -> dict[str, object]:
    """``postgresql://user:pass@host:port/name`` -> Django DATABASES entry (psycopg 3)."""
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("postgres", "postgresql"):
        raise ConfigError(f"DATABASE_URL scheme {parts.scheme!r} is not supported: use postgresql://")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")) or "clusterdx",
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
        # Under ASGI every request runs in a thread of its own: persistent per-thread connections would pile up
        # past max_connections. A bounded psycopg pool shares a few connections instead (Django 5.1+).
        "CONN_MAX_AGE": 0,
        "OPTIONS": {"pool": {"min_size": 1, "max_size": pool_size, "timeout": 20}},
    }
