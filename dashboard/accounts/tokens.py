"""Personal API tokens: ``cdxp_<prefix>_<secret>``. Only the SHA-256 of the whole token is stored.

The ``cdxp_`` prefix differs from the ingest tokens' ``cdx_``: neither kind is ever looked up as the other, so a
personal token cannot post batches and an agent's token cannot read the API.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import Any

from django.utils import timezone

from dashboard.accounts.models import PersonalToken
from dashboard.telemetry import audit
from dashboard.telemetry.tokens import find_hashed

PREFIX = "cdxp_"
# digest -> (row, checked at): a script polling the API every second should not add a query per request only to learn
# that its token is still valid. A revocation reaches other processes within telemetry.tokens.CACHE_TTL_S.
MARK_USED_EVERY_S = 60.0
_cache: dict[str, tuple[PersonalToken, float]] = {}
_last_marked: dict[int, float] = {}


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create(user: Any, name: str = "", *, actor: Any = None) -> tuple[PersonalToken, str]:
    """The row and the secret token, which exists nowhere else once this returns. ``actor``: who made it (the user
    on the page; ``audit.cli_actor()`` on the command line)."""
    prefix = secrets.token_hex(6)
    token = f"{PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
    row = PersonalToken.objects.create(user=user, name=name[:64], prefix=prefix, digest=_digest(token))
    audit.record(actor or user, "api_token.create", target=f"{user.username}:{prefix}", name=row.name)
    return row, token


def revoke(row: PersonalToken, *, actor: Any) -> bool:
    done = PersonalToken.objects.filter(id=row.id, revoked_at=None).update(revoked_at=timezone.now()) == 1
    _cache.clear()  # this process stops accepting it at once; others within the cache's TTL
    if done:
        audit.record(actor, "api_token.revoke", target=f"{row.user.username}:{row.prefix}")
    return done


def lookup(token: str) -> PersonalToken | None:
    """The live token row (with its active user) matching ``token``, or None."""
    return find_hashed(token, PREFIX, _cache, lambda public: PersonalToken.objects.select_related("user")
                       .filter(prefix=public, revoked_at=None, user__is_active=True).first())


def mark_used(row: PersonalToken) -> None:
    """At most once a minute per process and token: an UPDATE per API read would be waste."""
    now = time.monotonic()
    if now - _last_marked.get(row.id, -MARK_USED_EVERY_S) >= MARK_USED_EVERY_S:
        PersonalToken.objects.filter(id=row.id).update(last_used_at=timezone.now())
        _last_marked[row.id] = now


def clear_cache() -> None:
    _cache.clear()
    _last_marked.clear()
