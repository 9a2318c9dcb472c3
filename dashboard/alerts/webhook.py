"""Generic JSON, signed as the Standard Webhooks specification says, so any of its libraries can verify it.

Headers: ``webhook-id`` (the same on every attempt: receivers deduplicate on it), ``webhook-timestamp`` (this
attempt, in seconds) and ``webhook-signature: v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`` keyed with the
base64-decoded part of the ``whsec_`` secret.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import time
from typing import Any

from dashboard.alerts.alert import Alert
from dashboard.alerts.base import Transport

PREFIX = "whsec_"


def new_secret() -> str:
    return PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def secret_key(secret: str) -> bytes:
    raw = secret.removeprefix(PREFIX)
    try:
        key = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the secret must be whsec_ followed by base64") from None
    if len(key) < 24:  # the spec asks for 24 to 64 bytes
        raise ValueError("the secret must hold at least 24 random bytes")
    return key


def sign(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    signed = f"{message_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


class Webhook(Transport):
    kind = "webhook"

    @classmethod
    def clean_config(cls, url: str, secret: str) -> tuple[str, str]:
        secret = secret or new_secret()
        secret_key(secret)
        return url, secret

    def body(self, alert: Alert) -> dict[str, Any]:
        return alert.payload()

    def headers(self, alert: Alert, body: bytes) -> dict[str, str]:
        now = int(time.time())  # each attempt signs afresh: receivers reject stale timestamps
        return {"webhook-id": alert.message_id, "webhook-timestamp": str(now),
                "webhook-signature": sign(self.endpoint.secret, alert.message_id, now, body)}
