"""A personal API token: acts as its user (the user's roles, nothing more) on the read-only JSON API."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class PersonalToken(models.Model):
    """Only a SHA-256 digest of the token is stored; the secret is shown once (dashboard.accounts.tokens)."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=64, blank=True)
    prefix = models.CharField(max_length=16, unique=True)
    digest = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.prefix} of {self.user}"
