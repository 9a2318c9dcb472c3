"""``clusterdx token create|list|revoke``: per-cluster ingest tokens (only their hash is stored).

``--host``/``--hosts`` make an agent token bound to its node(s), ``--hook`` a token for training jobs; without
either, a cluster token (anything as any node: the legacy scope). See dashboard.telemetry.tokens."""

from __future__ import annotations

import argparse

from dashboard.cli import setup_django


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = sub.add_parser("create", help="create a token for CLUSTER (the cluster is created if new)")
    create.add_argument("cluster")
    create.add_argument("--name", default="", help="a label, e.g. 'agents' or 'hooks'")
    scope = create.add_mutually_exclusive_group()
    scope.add_argument("--host", help="an agent token that may post only as node H (one token per node)")
    scope.add_argument("--hosts", metavar="PATTERNS",
                       help="an agent token for the nodes matching comma-separated patterns, e.g. 'node-*,gpu-??'")
    scope.add_argument("--hook", action="store_true",
                       help="a hook token for training jobs posting directly: steps, beats, runs and their events")
    lst = sub.add_parser("list", help="list tokens (prefixes only)")
    lst.add_argument("cluster", nargs="?")
    revoke = sub.add_parser("revoke", help="revoke the token with PREFIX (as shown by list)")
    revoke.add_argument("prefix")


def main(args: argparse.Namespace) -> int:
    setup_django()
    from dashboard.telemetry import tokens
    from dashboard.telemetry.models import Cluster, IngestToken

    if args.action == "create":
        from django.core.exceptions import ValidationError
        from django.core.validators import validate_slug

        try:
            validate_slug(args.cluster)
        except ValidationError:
            print(f"error: cluster name {args.cluster!r} must be letters, digits, '-' or '_'")
            return 2
        scope, hosts = _scope(args)
        try:
            if scope == "agent" and not tokens.check_hosts(hosts):
                raise ValueError("--host/--hosts needs at least one host name or pattern")
        except ValueError as exc:
            print(f"error: {exc}")
            return 2
        cluster, created = Cluster.objects.get_or_create(name=args.cluster)
        row, secret = tokens.create_token(cluster, args.name, scope=scope, hosts=hosts)
        print(f"{'created cluster ' + cluster.name + '; ' if created else ''}{row.scope} token {row.prefix} for "
              f"{cluster.name}{' as ' + ' or '.join(row.hosts.split()) if row.hosts else ''}."
              " It is shown once; store it now (e.g. in the agent's --token-file):")
        print(secret)
        return 0
    if args.action == "list":
        qs = IngestToken.objects.select_related("cluster").order_by("cluster__name", "created_at")
        if args.cluster:
            qs = qs.filter(cluster__name=args.cluster)
        for t in qs:
            state = f"revoked {t.revoked_at:%Y-%m-%d %H:%M}" if t.revoked_at else "active"
            used = f"last used {t.last_used_at:%Y-%m-%d %H:%M}" if t.last_used_at else "never used"
            hosts = ",".join(t.hosts.split()) or "-"
            print(f"{t.prefix}  {t.cluster.name:<20} {t.scope:<7} {hosts:<20} {t.name or '-':<12} {state:<22} {used}")
        return 0
    if tokens.revoke(args.prefix):
        print(f"revoked {args.prefix}")
        return 0
    print(f"error: no active token with prefix {args.prefix!r}")
    return 1


def _scope(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The scope the flags ask for; no flag is the legacy cluster scope (anything, as any node)."""
    if args.host is not None:
        return "agent", [args.host]
    if args.hosts is not None:
        return "agent", args.hosts.split(",")
    return ("hook", []) if args.hook else ("cluster", [])
