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


def lookup(token: str) -> IngestToken | None:
    """The live (not revoked) token row matching ``token``, or None."""
    if not token.startswith(PREFIX) or len(token) > 200:
        return None
    prefix = token[len(PREFIX):].split("_", 1)[0]
    row = IngestToken.objects.select_related("cluster").filter(prefix=prefix, revoked_at=None).first()
    if row is None or not hmac.compare_digest(row.digest, _digest(token)):
        return None
    return row


_last_marked: dict[int, float] = {}
MARK_USED_EVERY_S = 60.0


def mark_used(row: IngestToken) -> None:
    """Record that a token is in use, at most once a minute per process (an UPDATE per request would be waste)."""
    now = time.monotonic()
    if now - _last_marked.get(row.id, -MARK_USED_EVERY_S) >= MARK_USED_EVERY_S:
        IngestToken.objects.filter(id=row.id).update(last_used_at=timezone.now())
        _last_marked[row.id] = now


def revoke(prefix: str) -> bool:
    return IngestToken.objects.filter(prefix=prefix, revoked_at=None).update(revoked_at=timezone.now()) == 1
