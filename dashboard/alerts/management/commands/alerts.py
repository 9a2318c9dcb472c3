"""``manage.py alerts add|list|test|disable|enable``: alert endpoints from the command line.

The secret of a new endpoint is printed once, to standard output only (never to the log). A secret given to ``add``
is read from a file or standard input (``--secret-file``), never from the command line, where ``ps`` shows it.
"""

from __future__ import annotations

import getpass
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from dashboard.alerts import base, endpoints
from dashboard.alerts.models import Endpoint
from dashboard.diagnosis.models import SEVERITIES
from dashboard.telemetry.models import Cluster


class Command(BaseCommand):
    help = "Manage alert endpoints (webhook, Slack, PagerDuty) of a cluster"

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        add = sub.add_parser("add", help="add an endpoint; prints its secret once")
        add.add_argument("--cluster", required=True)
        add.add_argument("--kind", required=True, choices=sorted(base.REGISTRY))
        add.add_argument("--url", default="", help="receiver URL (PagerDuty: defaults to the Events API v2)")
        add.add_argument("--secret-file", default="", metavar="FILE",
                         help="read the secret from FILE ('-': standard input, a hidden prompt on a terminal). "
                         "webhook: whsec_... (generated when omitted); pagerduty: the routing key")
        add.add_argument("--secret", default="", help="deprecated: the secret on the command line is visible to "
                         "every user in `ps`; use --secret-file")
        add.add_argument("--name", default="")
        add.add_argument("--min-severity", default="warning", choices=SEVERITIES)
        add.add_argument("--kinds", default="", help="finding kinds, comma-separated (default: all)")
        add.add_argument("--max-per-hour", type=int, default=30)
        lst = sub.add_parser("list", help="list endpoints (secrets are never shown)")
        lst.add_argument("--cluster", default="")
        for action in ("test", "disable", "enable"):
            one = sub.add_parser(action, help=f"{action} an endpoint")
            one.add_argument("id", type=int)

    def handle(self, *args: Any, **opts: Any) -> None:
        getattr(self, f"do_{opts['action']}")(opts)

    def do_add(self, opts: dict[str, Any]) -> None:
        cluster = Cluster.objects.filter(name=opts["cluster"]).first()
        if cluster is None:
            raise CommandError(f"no cluster named {opts['cluster']!r}")
        kinds = [k.strip() for k in opts["kinds"].split(",") if k.strip()]
        given = self._secret(opts)
        try:
            endpoint, secret = endpoints.create(cluster, name=opts["name"], kind=opts["kind"], url=opts["url"],
                                                secret=given, min_severity=opts["min_severity"],
                                                kinds=kinds, max_per_hour=opts["max_per_hour"])
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"endpoint {endpoint.id} ({endpoint.kind}) added to {cluster.name}")
        if secret and secret != given:  # one the operator gave is not echoed back to the terminal
            self.stdout.write(f"secret (shown once): {secret}")

    def _secret(self, opts: dict[str, Any]) -> str:
        if opts["secret"]:
            if opts["secret_file"]:
                raise CommandError("give the secret once: --secret-file (or the deprecated --secret)")
            self.stderr.write("warning: --secret is deprecated: the secret was visible to every user in `ps` while "
                              "this ran; use --secret-file FILE or --secret-file - (standard input)")
            return str(opts["secret"])
        source = opts["secret_file"]
        if not source:
            return ""
        if source == "-":
            if sys.stdin.isatty():
                return getpass.getpass("secret: ").strip()
            return sys.stdin.readline().strip()
        try:
            with open(source, encoding="utf-8") as fh:
                return fh.read().strip()
        except OSError as exc:
            raise CommandError(f"--secret-file {source!r} cannot be read: {exc.strerror}") from None

    def do_list(self, opts: dict[str, Any]) -> None:
        rows = Endpoint.objects.select_related("cluster").order_by("cluster__name", "id")
        if opts["cluster"]:
            rows = rows.filter(cluster__name=opts["cluster"])
        for e in rows:
            state = "enabled" if e.enabled else "disabled"
            kinds = ",".join(e.kinds) or "all"
            self.stdout.write(f"{e.id}\t{e.cluster.name}\t{e.name}\t{e.kind}\t{endpoints.masked_url(e)}\t"
                              f">={e.min_severity}\t{kinds}\t{e.max_per_hour}/h\t{state}")

    def _endpoint(self, opts: dict[str, Any]) -> Endpoint:
        endpoint = Endpoint.objects.select_related("cluster").filter(id=opts["id"]).first()
        if endpoint is None:
            raise CommandError(f"no endpoint {opts['id']}")
        return endpoint

    def do_test(self, opts: dict[str, Any]) -> None:
        row = endpoints.send_test(self._endpoint(opts))
        line = f"test delivery {row.id}: {row.status}, HTTP {row.response_code or '-'}, {row.duration_ms or 0:.0f} ms"
        if row.last_error:
            line += f": {row.last_error}"
        self.stdout.write(line)
        if row.status != "delivered":
            raise CommandError("the test alert was not delivered")

    def do_disable(self, opts: dict[str, Any]) -> None:
        self._set_enabled(opts, False)

    def do_enable(self, opts: dict[str, Any]) -> None:
        self._set_enabled(opts, True)

    def _set_enabled(self, opts: dict[str, Any], enabled: bool) -> None:
        endpoint = self._endpoint(opts)
        endpoint.enabled = enabled
        endpoint.save(update_fields=["enabled"])
        self.stdout.write(f"endpoint {endpoint.id} {'enabled' if enabled else 'disabled'}")
