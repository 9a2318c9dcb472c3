"""``clusterdx cluster topology CLUSTER FILE``: an owner's topology file applied from the command line, through
:func:`dashboard.telemetry.placement.upload` as the settings page does, audit-logged as ``cli:<os user>``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def upload(cluster: Any, file: str) -> int:
    from clusterdx.topology import TopologyError
    from dashboard.telemetry import audit, placement

    try:
        data = sys.stdin.buffer.read() if file == "-" else Path(file).read_bytes()
    except OSError as exc:
        print(f"error: cannot read {file} ({exc.strerror})")
        return 1
    try:
        done = placement.upload(cluster, data, "stdin" if file == "-" else Path(file).name, actor=audit.cli_actor())
    except TopologyError as exc:
        print(f"error: {file}: {exc}")
        return 2
    print(done.summary(cluster))
    return 0
