"""Changes to who may do what in a cluster, and to its settings: one function per change, each audit-logged.

The settings page and the ``clusterdx cluster`` command both call these, so the rules (a cluster keeps at least one
owner; a role is one of viewer / member / owner) and the audit entries are the same whoever makes the change.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction

from dashboard.telemetry import audit, interconnect
from dashboard.telemetry.models import Cluster, Membership, Role

INTERCONNECTS = ("auto", *interconnect.KINDS)


class Refused(ValueError):
    """A change the rules do not allow; the message says why."""


def check_role(role: str) -> str:
    if role not in Role.values:
        raise Refused(f"role must be one of {', '.join(Role.values)}, got {role!r}")
    return role


def set_role(cluster: Cluster, user: Any, role: str, *, actor: Any) -> str:
    """Add ``user`` with ``role`` or change their role; returns "added", "changed" or "unchanged"."""
    check_role(role)
    with transaction.atomic():
        row = Membership.objects.select_for_update().filter(cluster=cluster, user=user).first()
        if row is None:
            Membership.objects.create(cluster=cluster, user=user, role=role)
            audit.record(actor, "member.add", cluster=cluster, target=user.username, role=role)
            return "added"
        if row.role == role:
            return "unchanged"
        if row.role == Role.OWNER:
            _keep_an_owner(cluster, user, "demote")
        old, row.role = row.role, role
        row.save(update_fields=["role"])
        audit.record(actor, "member.role", cluster=cluster, target=user.username, role=role, was=old)
        return "changed"


def remove(cluster: Cluster, user: Any, *, actor: Any) -> bool:
    with transaction.atomic():
        row = Membership.objects.select_for_update().filter(cluster=cluster, user=user).first()
        if row is None:
            return False
        if row.role == Role.OWNER:
            _keep_an_owner(cluster, user, "remove")
        row.delete()
        audit.record(actor, "member.remove", cluster=cluster, target=user.username, was=row.role)
        return True


def _keep_an_owner(cluster: Cluster, user: Any, verb: str) -> None:
    # Locked rows: two owners removing each other at once cannot both succeed and leave the cluster ownerless.
    owners = list(Membership.objects.select_for_update().filter(cluster=cluster, role=Role.OWNER)
                  .values_list("user_id", flat=True))
    if owners == [user.pk]:
        raise Refused(f"cannot {verb} {user.username}: the last owner of {cluster.name} (make another owner first)")


def set_interconnect(cluster: Cluster, value: str, *, actor: Any) -> bool:
    if value not in INTERCONNECTS:
        raise Refused(f"interconnect must be one of {', '.join(INTERCONNECTS)}, got {value!r}")
    if cluster.interconnect == value:
        return False
    old, cluster.interconnect = cluster.interconnect, value
    cluster.save(update_fields=["interconnect"])
    audit.record(actor, "cluster.interconnect", cluster=cluster, target=cluster.name, value=value, was=old)
    return True
