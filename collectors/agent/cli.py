"""``clusterdx agent``: the node agent (one process per node).

Settings come from ``--config agent.toml`` and are overridden by flags. The agent prints which sources are on and
why any is off, then samples every interval, spools each batch and sends it to ``<server>/api/v1/ingest``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from typing import Any

log = logging.getLogger("clusterdx.agent")

# flag destination -> config key
_OVERRIDES = {
    "server": "server", "token_file": "token_file", "interval": "interval_s", "send_interval": "send_interval_s",
    "agent_id": "agent_id",
    "host": "host", "spool": "spool_path", "metrics_port": "metrics_port", "metrics_addr": "metrics_addr",
    "log_level": "log_level",
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", metavar="URL", help="the clusterdx server, e.g. https://clusterdx.example:8000")
    parser.add_argument("--token-file", metavar="F", help="file holding the cluster's ingest token")
    parser.add_argument("--config", metavar="agent.toml", help="TOML file with any of the options (flags win)")
    parser.add_argument("--interval", type=float, metavar="S", help="seconds between samples (default 1, min 0.1)")
    parser.add_argument("--send-interval", type=float, metavar="S",
                        help="post at most every S seconds, several samples per batch (default: every sample, or "
                             "what the server asks for)")
    parser.add_argument("--agent-id", help="stable id of this node's agent (default: the host name)")
    parser.add_argument("--host", help="this node's name in the dashboard (default: the host name)")
    parser.add_argument("--spool", metavar="PATH", help="SQLite spool for unsent batches")
    parser.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus /metrics on PORT")
    parser.add_argument("--metrics-addr", metavar="ADDR", help="address for /metrics (default 0.0.0.0)")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--dry-run", action="store_true",
                        help="print the source summary and one batch as JSON, send nothing, then exit")


def main(args: argparse.Namespace) -> int:
    from collectors.agent import registry
    from collectors.agent.config import ConfigError, build, load_toml, read_token

    logging.basicConfig(stream=sys.stderr, format="%(asctime)s clusterdx-agent %(levelname)s %(message)s",
                        level=(args.log_level or "info").upper())
    overrides = {key: getattr(args, dest) for dest, key in _OVERRIDES.items()}
    if args.dry_run:
        overrides["server"] = overrides["server"] or "http://dry-run.invalid"
        overrides["token_file"] = overrides["token_file"] or "/dev/null"
    try:
        raw = load_toml(args.config) if args.config else {}
        cfg = build(raw, overrides, tuple(registry.SOURCES))
        if not args.dry_run:
            read_token(cfg.token_file)
        logging.getLogger().setLevel(cfg.log_level.upper())
        statuses = registry.build(cfg.sources)
    except ConfigError as exc:
        where = args.config or "agent settings"
        print(f"clusterdx agent: {where} has problems:\n" + "\n".join(f"  {p}" for p in exc.problems),
              file=sys.stderr)
        return 2
    if args.dry_run:
        return _dry_run(cfg, statuses)
    return _run(cfg, statuses)


def _run(cfg: Any, statuses: list[Any]) -> int:
    from collectors.agent import registry
    from collectors.agent.agent import Agent
    from collectors.agent.spool import Spool

    try:
        spool = Spool(cfg.spool_path, max_batches=cfg.spool_max_batches, max_bytes=int(cfg.spool_max_mb * 2**20),
                      wire_version=cfg.wire_version)
    except OSError as exc:
        print(f"clusterdx agent: cannot open the spool {cfg.spool_path}: {exc}", file=sys.stderr)
        return 2
    agent = Agent(cfg, statuses, spool)
    log.info("agent %s on %s: a sample every %gs, a batch at most every %gs (or as the server asks) to %s; "
             "spool %s (%d waiting)\n%s", cfg.agent_id, cfg.host, cfg.interval_s,
             max(cfg.interval_s, cfg.send_interval_s), cfg.server, cfg.spool_path, spool.depth,
             registry.summary(statuses))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.stop())
    if cfg.metrics_port:
        from collectors.agent import metrics

        try:
            metrics.serve(agent, cfg.metrics_addr, cfg.metrics_port)
        except OSError as exc:
            log.error("cannot serve /metrics on %s:%d (%s); continuing without", cfg.metrics_addr,
                      cfg.metrics_port, exc)
    agent.run()
    log.info("stopped; %d batch(es) left in the spool for next time", spool.depth)
    return 0


def _dry_run(cfg: Any, statuses: list[Any]) -> int:
    from collectors.agent import registry
    from collectors.agent.agent import Agent

    class _NoSpool:
        depth = size_bytes = 0

    print(registry.summary(statuses), file=sys.stderr)
    agent = Agent(cfg, statuses, _NoSpool())  # type: ignore[arg-type]
    agent.batches(time.time())  # rates need two readings
    time.sleep(cfg.interval_s)
    bodies = agent.batches(time.time())
    for status in statuses:
        registry.close(status)
    for body, dropped in bodies:
        print(json.dumps({**body, "seq": 0, **({"dropped": dropped} if dropped else {})}, indent=1))
    return 0
