"""``clusterdx cluster create|list|set|add-member|remove-member|topology``: clusters, their members' roles and settings.

Each change goes through :mod:`dashboard.accounts.members` (the same rules as the settings page) and is audit-logged
as ``cli:<os user>``."""

from __future__ import annotations

import argparse
from typing import Any

from dashboard.cli import setup_django

ROLES = ("viewer", "member", "owner")
INTERCONNECTS = ("auto", "ib", "roce", "eth")


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = sub.add_parser("create", help="create a cluster")
    create.add_argument("name")
    create.add_argument("--interconnect", choices=INTERCONNECTS, default="auto",
                        help="override what the agents' ports show (default: auto, use the detected one)")
    sub.add_parser("list", help="list clusters, their interconnect and members")
    st = sub.add_parser("set", help="change a cluster's settings")
    st.add_argument("cluster")
    st.add_argument("--interconnect", choices=INTERCONNECTS, required=True)
    add = sub.add_parser("add-member", help="add USER to CLUSTER with a role, or change their role")
    add.add_argument("cluster")
    add.add_argument("user")
    add.add_argument("--role", choices=ROLES, default="member")
    rm = sub.add_parser("remove-member", help="remove USER from CLUSTER (a cluster keeps at least one owner)")
    rm.add_argument("cluster")
    rm.add_argument("user")
    topo = sub.add_parser("topology", help="place CLUSTER's nodes from FILE: CSV host,rack,switch,spine, JSON, or "
                          "Slurm's topology.conf (wins over the agents' own reports)")
    topo.add_argument("cluster")
    topo.add_argument("file", help="the topology file; - reads standard input")


def main(args: argparse.Namespace) -> int:
    setup_django()
    from dashboard.accounts import members
    from dashboard.telemetry.models import Cluster

    if args.action == "create":
        return _create(args)
    if args.action == "list":
        return _list()
    cluster = Cluster.objects.filter(name=args.cluster).first()
    if cluster is None:
        print(f"error: no cluster {args.cluster!r} (clusterdx cluster create NAME)")
        return 1
    if args.action == "topology":
        from dashboard.cli.topology import upload

        return upload(cluster, args.file)
    try:
        return _change(args, cluster)
    except members.Refused as exc:
        print(f"error: {exc}")
        return 1


def _create(args: argparse.Namespace) -> int:
    from django.core.exceptions import ValidationError
    from django.core.validators import validate_slug

    from dashboard.telemetry import audit
    from dashboard.telemetry.models import Cluster

    try:
        validate_slug(args.name)
    except ValidationError:
        print(f"error: cluster name {args.name!r} must be letters, digits, '-' or '_'")
        return 2
    cluster, created = Cluster.objects.get_or_create(name=args.name, defaults={"interconnect": args.interconnect})
    if not created:
        print(f"error: cluster {args.name!r} exists (clusterdx cluster set to change it)")
        return 1
    audit.record(audit.cli_actor(), "cluster.create", cluster=cluster, target=cluster.name,
                 interconnect=cluster.interconnect)
    print(f"created cluster {cluster.name}; interconnect {cluster.interconnect_label()}")
    return 0


def _change(args: argparse.Namespace, cluster: Any) -> int:
    from django.contrib.auth import get_user_model

    from dashboard.accounts import members
    from dashboard.telemetry import audit

    actor = audit.cli_actor()
    if args.action == "set":
        changed = members.set_interconnect(cluster, args.interconnect, actor=actor)
        print(f"{cluster}: interconnect {cluster.interconnect_label()}{'' if changed else ' (unchanged)'}")
        return 0
    user = get_user_model().objects.filter(username=args.user).first()
    if user is None:
        print(f"error: no user {args.user!r} (clusterdx user add NAME)")
        return 1
    if args.action == "add-member":
        done = members.set_role(cluster, user, args.role, actor=actor)
        print(f"{user.username} {done} as {args.role} of {cluster}")
        return 0
    if not members.remove(cluster, user, actor=actor):
        print(f"error: {user.username} is not a member of {cluster}")
        return 1
    print(f"removed {user.username} from {cluster}")
    return 0


def _list() -> int:
    from dashboard.telemetry.models import Cluster

    for cluster in Cluster.objects.prefetch_related("memberships__user").order_by("name"):
        people = ", ".join(f"{m.user.username} ({m.role})" for m in sorted(cluster.memberships.all(),
                                                                           key=lambda m: m.user.username))
        print(f"{cluster.name:<24} {cluster.interconnect_label():<40} {people or '-'}")
    return 0
