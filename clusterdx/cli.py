"""The ``clusterdx`` command: one entry point, subcommands living next to the code they drive.

Each subcommand is a module exposing ``configure(parser)`` and ``main(args) -> int``. Modules are imported only
to build their parser, and must keep heavy imports (Django, torch, pynvml) inside ``main`` so that
``clusterdx agent`` on a GPU node never pays for, or needs, the server's dependencies.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from clusterdx import __version__

# name -> (module, one-line help). The module owns its flags; this table owns only the names.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("dashboard.cli.demo", "run the server on the embedded default with a simulated cluster"),
    "server": ("dashboard.cli.server", "run the ASGI server (and, embedded, its scheduler)"),
    "token": ("dashboard.cli.token", "create, list or revoke a cluster's ingest tokens, or a personal API token"),
    "user": ("dashboard.cli.user", "add a local user account"),
    "cluster": ("dashboard.cli.cluster", "create clusters, set their interconnect, add members with roles"),
    "worker": ("dashboard.cli.worker", "run a Celery worker (production deployment)"),
    "agent": ("collectors.agent.cli", "run the node agent"),
    "simulate": ("collectors.sim.cli", "run a simulated cluster against a server"),
    "doctor": ("collectors.doctor.cli", "read NCCL / Xid / nvidia-smi / torch / IB logs and give a verdict"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clusterdx", description="Live diagnostics for GPU clusters that train large models.")
    parser.add_argument("--version", action="version", version=f"clusterdx {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # Only a missing optional dependency of that command is tolerated; our own missing module is a bug.
            if exc.name and (exc.name == module_name or module_name.startswith(exc.name + ".")):
                continue
            sub.add_parser(name, help=f"{help_text} (unavailable: pip install 'clusterdx[...]' for {exc.name})")
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.configure(p)
        p.set_defaults(_main=module.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "_main", None)
    if run is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(run(args) or 0)
    except KeyboardInterrupt:
        return 130
