"""What every agent source implements. The agent owns the loop; a source only measures.

A source is started once; ``start()`` returns ``None`` when it is active, or a one-line reason why it is off
("no NVML library: libnvidia-ml.so.1 not found"), which the agent prints in its startup summary and never
repeats. ``collect(now, out)`` appends wire records (plain dicts shaped as in :mod:`clusterdx.wire`) to ``out``;
it must not block for longer than a small fraction of the interval and must not raise for odd hardware: a
measurement that fails becomes ``None`` (with a reason in ``unavailable`` where the record has one).

How the agent builds a source: ``cls(**options)``, where ``options`` are the keys of the source's
``[sources.<name>]`` table in ``agent.toml`` (``enabled`` excepted). A source declares its options as keyword
parameters with defaults (``def __init__(self, *, root: str = "/sys/class/infiniband") -> None``); the agent checks
the table against that signature before calling it, so a misspelt option is reported by name, with a suggestion.
Records a source had to drop go into ``out.dropped`` by reason; the agent sums them into the batch.
Optional attributes the startup summary shows when present: ``detail`` (a short line on what an active source
reads, e.g. "8 GPU(s): NVIDIA H100 80GB HBM3") and ``notes`` (a list of one-line caveats).
The registry of names (``gpu``, ``hooks``, ``ib``, ``host``, ``kmsg``, ``nccl``, ``probes``) lives in
:mod:`collectors.agent.registry`; a source module that is missing or fails to import is reported as off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Collected:
    """Records gathered during one interval, keyed like the batch lists in :class:`clusterdx.wire.Batch`."""

    gpus: list[dict[str, Any]] = field(default_factory=list)
    hosts: list[dict[str, Any]] = field(default_factory=list)
    ports: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    probes: list[dict[str, Any]] = field(default_factory=list)
    beats: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)


class Source(Protocol):
    name: str

    def start(self) -> str | None: ...

    def collect(self, now: float, out: Collected) -> None: ...

    def close(self) -> None: ...
