"""Strict little readers for settings from the environment.

A typo in a boolean ("ture", "yes-ish") is an error at start-up, not a silent False. Every secret ``X`` may also be
given as ``X_FILE`` naming a file that holds it (Docker and Kubernetes secrets).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path

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


def env_choice(name: str, default: str, choices: tuple[str, ...], environ: Mapping[str, str] = os.environ) -> str:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ConfigError(f"{name}={raw!r} is not one of {', '.join(choices)}")
    return value


def env_list(name: str, default: str = "", environ: Mapping[str, str] = os.environ) -> list[str]:
    return [item.strip() for item in environ.get(name, default).split(",") if item.strip()]


# --- single sign-on (OpenID Connect, docs/sso.md) ----------------------------------------------------------------------
OIDC_ROLES = ("viewer", "member", "owner")


def parse_oidc_roles(raw: str, name: str = "CLUSTERDX_OIDC_ROLES") -> list[tuple[str, str, str]]:
    """``"gpu-oncall=prod:member,gpu-admins=prod:owner"`` -> ``[(group, cluster, role), ...]``. A typo is an error at
    start-up: a mapping that silently matched nothing would strip every SSO user of their roles at the next login."""
    out = []
    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            continue
        group, eq, target = entry.rpartition("=")  # a group path may hold "=", a cluster name never does
        cluster, colon, role = target.partition(":")
        if not eq or not group.strip() or not colon or not cluster.strip() or role.strip() not in OIDC_ROLES:
            raise ConfigError(f"{name}: {entry!r} is not <group>=<cluster>:<role> with a role of "
                              f"{', '.join(OIDC_ROLES)}")
        out.append((group.strip(), cluster.strip(), role.strip()))
    return out


def env_oidc(environ: Mapping[str, str] = os.environ) -> dict[str, object] | None:
    """The OpenID Connect settings, or None (SSO off) when ``CLUSTERDX_OIDC_CLIENT_ID`` is unset.

    Endpoints come from the issuer's discovery document unless each is given (a provider without discovery)."""
    client_id = env_str("CLUSTERDX_OIDC_CLIENT_ID", "", environ)
    if not client_id:
        return None
    issuer = env_str("CLUSTERDX_OIDC_ISSUER", "", environ).rstrip("/")
    endpoints = {key: env_str(f"CLUSTERDX_OIDC_{key.upper()}", "", environ)
                 for key in ("authorization_endpoint", "token_endpoint", "userinfo_endpoint", "jwks_uri")}
    missing = [f"CLUSTERDX_OIDC_{k.upper()}" for k, v in endpoints.items() if not v]
    if not issuer and missing:
        raise ConfigError(f"CLUSTERDX_OIDC_CLIENT_ID is set: set CLUSTERDX_OIDC_ISSUER (endpoints from its discovery "
                          f"document) or {', '.join(missing)}")
    secret = env_str("CLUSTERDX_OIDC_CLIENT_SECRET", "", environ)
    if not secret:
        raise ConfigError("CLUSTERDX_OIDC_CLIENT_ID is set: CLUSTERDX_OIDC_CLIENT_SECRET (or _FILE) is required")
    return {
        "issuer": issuer, **endpoints, "client_id": client_id, "client_secret": secret,
        "groups_claim": env_str("CLUSTERDX_OIDC_GROUPS_CLAIM", "groups", environ),
        "username_claim": env_str("CLUSTERDX_OIDC_USERNAME_CLAIM", "preferred_username", environ),
        "roles": parse_oidc_roles(env_str("CLUSTERDX_OIDC_ROLES", "", environ)),
        "scopes": env_str("CLUSTERDX_OIDC_SCOPES", "openid email profile", environ),
        "sign_algo": env_str("CLUSTERDX_OIDC_SIGN_ALGO", "RS256", environ),
        "label": env_str("CLUSTERDX_OIDC_LABEL", "Sign in with SSO", environ),
        # Roles follow the groups at each login: a session this short makes someone who left a group log in again.
        "session_hours": env_float("CLUSTERDX_OIDC_SESSION_HOURS", 12.0, min=0.1, environ=environ),
    }


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


# --- files that hold secrets ----------------------------------------------------------------------------------------
def private_dir(path: Path) -> Path:
    """Create ``path`` as 0700 (webhook secrets and PagerDuty keys live in the SQLite file under it), and close one an
    older version left open. A directory someone else owns (a mount prepared by an admin) is left as it is."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _tighten(path, 0o700)
    return path


def private_file(path: Path) -> None:
    """``path`` exists and is 0600, created so from its first byte (never created open, then closed)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600))
    except FileExistsError:
        _tighten(path, 0o600)


def _tighten(path: Path, mode: int) -> None:
    st = path.stat()
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & ~mode:
        path.chmod(mode)


def read_or_create_secret(path: Path, make: Callable[[], str]) -> str:
    """The secret in ``path``, created with ``make()`` when missing. Written to a 0600 temporary file and linked into
    place, so no reader ever sees it readable by others or half-written, and two processes starting together agree."""
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)  # left by a crashed process that had our pid
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(make())
                fh.flush()
                os.fsync(fh.fileno())
            with contextlib.suppress(FileExistsError):  # another process won the race: use its key
                os.link(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    _tighten(path, 0o600)
    return path.read_text(encoding="utf-8").strip()
