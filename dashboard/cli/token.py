"""``clusterdx token create|list|revoke``: per-cluster ingest tokens (only their hash is stored).

``--host``/``--hosts`` make an agent token bound to its node(s), ``--hook`` a token for training jobs; without
either, a cluster token (anything as any node: the legacy scope). See dashboard.telemetry.tokens.

``create-personal USER`` makes a personal API token (``cdxp_…``) that reads the JSON API as USER (dashboard.accounts);
``revoke`` takes the prefix of either kind."""

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
    personal = sub.add_parser("create-personal", help="a personal API token: reads the JSON API as USER (GET only)")
    personal.add_argument("user")
    personal.add_argument("--name", default="", help="a label, e.g. 'grafana'")
    lst_personal = sub.add_parser("list-personal", help="list personal API tokens (prefixes only)")
    lst_personal.add_argument("user", nargs="?")
    revoke = sub.add_parser("revoke", help="revoke the token with PREFIX (as shown by list or list-personal)")
    revoke.add_argument("prefix")


def main(args: argparse.Namespace) -> int:
    setup_django()
    from dashboard.telemetry import audit, tokens
    from dashboard.telemetry.models import Cluster, IngestToken

    if args.action in ("create-personal", "list-personal"):
        return _personal(args)
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
        audit.record(audit.cli_actor(), "token.create", cluster=cluster, target=row.prefix, scope=row.scope,
                     hosts=row.hosts)
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
    row = IngestToken.objects.filter(prefix=args.prefix, revoked_at=None).first()
    if row is not None and tokens.revoke(args.prefix):
        audit.record(audit.cli_actor(), "token.revoke", cluster=row.cluster, target=args.prefix)
        print(f"revoked {args.prefix}")
        return 0
    from dashboard.accounts import tokens as personal
    from dashboard.accounts.models import PersonalToken

    mine = PersonalToken.objects.select_related("user").filter(prefix=args.prefix, revoked_at=None).first()
    if mine is not None and personal.revoke(mine, actor=audit.cli_actor()):
        print(f"revoked personal token {args.prefix} of {mine.user.username}")
        return 0
    print(f"error: no active token with prefix {args.prefix!r}")
    return 1


def _personal(args: argparse.Namespace) -> int:
    from django.contrib.auth import get_user_model

    from dashboard.accounts import tokens as personal
    from dashboard.accounts.models import PersonalToken
    from dashboard.telemetry import audit

    if args.action == "list-personal":
        qs = PersonalToken.objects.select_related("user").order_by("user__username", "created_at")
        for t in qs.filter(user__username=args.user) if args.user else qs:
            state = f"revoked {t.revoked_at:%Y-%m-%d %H:%M}" if t.revoked_at else "active"
            used = f"last used {t.last_used_at:%Y-%m-%d %H:%M}" if t.last_used_at else "never used"
            print(f"{t.prefix}  {t.user.username:<20} {t.name or '-':<12} {state:<22} {used}")
        return 0
    user = get_user_model().objects.filter(username=args.user, is_active=True).first()
    if user is None:
        print(f"error: no active user {args.user!r} (clusterdx user add NAME)")
        return 1
    row, secret = personal.create(user, args.name, actor=audit.cli_actor())
    print(f"personal API token {row.prefix} for {user.username}: reads the JSON API as them (GET only), with "
          "Authorization: Bearer. It is shown once; store it now:")
    print(secret)
    return 0


def _scope(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The scope the flags ask for; no flag is the legacy cluster scope (anything, as any node)."""
    if args.host is not None:
        return "agent", [args.host]
    if args.hosts is not None:
        return "agent", args.hosts.split(",")
    return ("hook", []) if args.hook else ("cluster", [])
