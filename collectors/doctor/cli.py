"""``clusterdx doctor FILE... [--kind K] [--json]``: explain NCCL / Xid / nvidia-smi / torch / IB logs.

Several files are read as several ranks' logs of one job and merged; ``-`` is standard input. Files are streamed,
so a multi-gigabyte log needs no more memory than a small one. Exit 0 with a report, 2 on usage errors.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

KIND_CHOICES = ("nccl", "xid", "nvidia-smi", "torch", "ib")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="log files; '-' reads standard input")
    parser.add_argument("--kind", choices=KIND_CHOICES, help="skip detection and read the files as this kind")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def main(args: argparse.Namespace) -> int:
    from collectors.doctor import diagnose

    sources: list[object] = []
    for name in args.files:
        if name == "-":
            sources.append(sys.stdin.buffer)
            continue
        path = Path(name)
        if not path.is_file():
            print(f"clusterdx doctor: {name}: no such file", file=sys.stderr)
            return 2
        sources.append(path)
    try:
        report = diagnose(sources, kind=args.kind)  # type: ignore[arg-type]
    except OSError as exc:
        print(f"clusterdx doctor: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(report.to_json() + "\n" if args.json else report.render_text())
    return 0
