"""Ingest tokens: ``cdx_<prefix>_<secret>``. Only the SHA-256 of the whole token is stored."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

from django.utils import timezone

from dashboard.telemetry.models import Cluster, IngestToken

PREFIX = "cdx_"


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(cluster: Cluster, name: str = "") -> tuple[IngestToken, str]:
    """Returns the row and the secret token, which exists nowhere else once this returns."""
    prefix = secrets.token_hex(6)
    token = f"{PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
    row = IngestToken.objects.create(cluster=cluster, name=name, prefix=prefix, digest=_digest(token))
    return row, token


# digest -> (row, checked at). Every node posts every second: a database round trip per request only to learn that
# the token is still valid is most of an ingest's fixed cost. A revocation reaches other processes within this TTL.
CACHE_TTL_S = 5.0
_cache: dict[str, tuple[IngestToken, float]] = {}


def lookup(token: str) -> IngestToken | None:
    """The live (not revoked) token row matching ``token``, or None."""
    if not token.startswith(PREFIX) or len(token) > 200:
        return None
    digest = _digest(token)
    hit = _cache.get(digest)
    now = time.monotonic()
    if hit is not None and now - hit[1] < CACHE_TTL_S:
        return hit[0]
    prefix = token[len(PREFIX):].split("_", 1)[0]
    row = IngestToken.objects.select_related("cluster").filter(prefix=prefix, revoked_at=None).first()
    if row is None or not hmac.compare_digest(row.digest, digest):
        _cache.pop(digest, None)
        return None
    if len(_cache) > 10_000:  # bounded: a flood of distinct valid tokens cannot grow it without limit
        _cache.clear()
    _cache[digest] = (row, now)
    return row


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
