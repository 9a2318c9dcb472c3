"""Ingest tokens: ``cdx_<prefix>_<secret>``. Only the SHA-256 of the whole token is stored.

A token has a scope, checked against each batch by :func:`scope_refusal`:

- ``agent``: posts anything, but only as the nodes its host names or patterns (``node-*``, ``gpu-??``; fnmatch
  syntax, case-sensitive) match. One per node is the tightest; a pattern suits a fleet that shares one token.
- ``hook``: what training processes post directly: steps, beats, run metadata and the hooks' own events
  (:data:`clusterdx.wire.HOOK_EVENT_KINDS`), never GPU, host or port samples, probes, topology or node events.
- ``cluster``: anything as any node. The legacy scope (every token made before scopes existed); still accepted.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Iterable
from fnmatch import fnmatchcase
from typing import Any, Protocol

from django.utils import timezone

from clusterdx import wire
from dashboard.telemetry.models import Cluster, IngestToken

PREFIX = "cdx_"


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


SCOPES = ("cluster", "agent", "hook")
# A host name (as the wire's Hostname) with the fnmatch wildcards * ? [ ] added.
_HOST_PATTERN = re.compile(r"[A-Za-z0-9_*?\[][A-Za-z0-9_.*?\[\]!-]{0,252}")


def check_hosts(hosts: Iterable[str]) -> list[str]:
    """The host names or patterns, checked; raises ValueError naming the first bad one."""
    out = [h.strip() for h in hosts if h.strip()]
    for host in out:
        if not _HOST_PATTERN.fullmatch(host):
            raise ValueError(f"{host!r} is not a host name or pattern (letters, digits, . _ - and * ? [ ])")
    return out


def create_token(cluster: Cluster, name: str = "", *, scope: str = "cluster",
                 hosts: Iterable[str] = ()) -> tuple[IngestToken, str]:
    """Returns the row and the secret token, which exists nowhere else once this returns.

    ``hosts`` binds an ``agent`` token (required there, refused for the other scopes)."""
    bound = check_hosts(hosts)
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    if (scope == "agent") != bool(bound):
        raise ValueError("an agent token needs host names or patterns" if scope == "agent"
                         else f"a {scope} token is not bound to hosts")
    prefix = secrets.token_hex(6)
    token = f"{PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
    row = IngestToken.objects.create(cluster=cluster, name=name, prefix=prefix, digest=_digest(token), scope=scope,
                                     hosts=" ".join(bound))
    return row, token


class Scoped(Protocol):
    scope: str
    hosts: str


def scope_refusal(row: Scoped, batch: dict[str, Any]) -> str | None:
    """Why ``row`` may not post this (validated) batch, or None. Refused as a whole: nothing of it is stored."""
    if row.scope == "agent":
        patterns = row.hosts.split()
        if not any(fnmatchcase(batch["host"], p) for p in patterns):
            return f"this token may only post as {' or '.join(patterns)}"
    elif row.scope == "hook":
        for key in ("gpus", "hosts", "ports", "probes", "topology"):
            if batch[key]:
                return f"a hook token may not send {key}"
        for event in batch["events"]:
            if event["kind"] not in wire.HOOK_EVENT_KINDS:
                return (f"a hook token may not send events of kind {event['kind']!r} "
                        f"(only {', '.join(wire.HOOK_EVENT_KINDS)})")
    return None


# digest -> (row, checked at). Every node posts every second: a database round trip per request only to learn that
# the token is still valid is most of an ingest's fixed cost. A revocation reaches other processes within this TTL.
CACHE_TTL_S = 5.0
_cache: dict[str, tuple[IngestToken, float]] = {}


def find_hashed(token: str, prefix: str, cache: dict[str, tuple[Any, float]], row_for: Any) -> Any | None:
    """The live row a ``<prefix><public part>_<secret>`` token names, or None; one lookup for ingest tokens and
    personal API tokens alike. ``row_for(public part)`` reads the candidate row; its stored digest is compared in
    constant time, and a hit is cached for CACHE_TTL_S (a revoked token stops within that time elsewhere)."""
    if not token.startswith(prefix) or len(token) > 200:
        return None
    digest = _digest(token)
    hit = cache.get(digest)
    now = time.monotonic()
    if hit is not None and now - hit[1] < CACHE_TTL_S:
        return hit[0]
    row = row_for(token[len(prefix):].split("_", 1)[0])
    if row is None or not hmac.compare_digest(row.digest, digest):
        cache.pop(digest, None)
        return None
    if len(cache) > 10_000:  # bounded: a flood of distinct valid tokens cannot grow it without limit
        cache.clear()
    cache[digest] = (row, now)
    return row


def lookup(token: str) -> IngestToken | None:
    """The live (not revoked) token row matching ``token``, or None."""
    return find_hashed(token, PREFIX, _cache, lambda public: IngestToken.objects.select_related("cluster")
                       .filter(prefix=public, revoked_at=None).first())


class _NotCached(Exception):
    pass


def _not_cached(public: str) -> None:
    raise _NotCached


def cached(token: str) -> IngestToken | bool | None:
    """What the cache alone says, without a query (the ingest path asks this in the event loop): the row of a live
    token checked within CACHE_TTL_S, False (not a token at all), or None (the cache does not know: ask
    :func:`lookup`)."""
    try:
        return find_hashed(token, PREFIX, _cache, _not_cached) or False
    except _NotCached:
        return None


def clear_cache() -> None:
    _cache.clear()
    _last_marked.clear()


_last_marked: dict[int, float] = {}
MARK_USED_EVERY_S = 60.0


def mark_used(row: IngestToken) -> None:
    """Record that a token is in use, at most once a minute per process (an UPDATE per request would be waste)."""
    now = time.monotonic()
    if now - _last_marked.get(row.id, -MARK_USED_EVERY_S) >= MARK_USED_EVERY_S:
        IngestToken.objects.filter(id=row.id).update(last_used_at=timezone.now())
        _last_marked[row.id] = now


def revoke(prefix: str) -> bool:
    done = IngestToken.objects.filter(prefix=prefix, revoked_at=None).update(revoked_at=timezone.now()) == 1
    _cache.clear()  # this process stops accepting it at once; others within CACHE_TTL_S
    return done
