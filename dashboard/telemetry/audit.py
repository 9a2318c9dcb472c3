"""The audit log: one call per change of members, roles, tokens, webhooks, silences or cluster settings.

Pages, the command line and the API all record through :func:`record`, so the log reads the same whoever changed what.
"""

from __future__ import annotations

import getpass
from typing import Any

from dashboard.telemetry.models import AuditEntry, Cluster


def cli_actor() -> str:
    """The name the command line records: the OS user who ran it (there is no signed-in user there)."""
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # a container user without a passwd entry
        return "cli:unknown"


def record(actor: Any, action: str, *, cluster: Cluster | None = None, target: str = "", **detail: Any) -> AuditEntry:
    """Log ``action`` (``"<thing>.<verb>"``, e.g. ``"member.add"``) by ``actor``: a user, or a name (``cli_actor()``)."""
    user = actor if getattr(actor, "pk", None) is not None else None
    name = getattr(actor, "username", None) or str(actor)
    return AuditEntry.objects.create(cluster=cluster, actor=user, actor_name=name[:150], action=action[:48],
                                     target=target[:255], detail=detail)
