"""Turning one interval's :class:`Collected` into wire batches the server will accept.

Every source record is validated here, before it is spooled: one malformed record from one source must cost that
record (counted as ``invalid_record`` and logged once per field), not the 400 that would reject the whole batch.
A batch over the server's size limit or a list bound is split into several, each with its own seq.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import fields
from typing import Any

from clusterdx import wire
from collectors.agent.source import Collected

log = logging.getLogger("clusterdx.agent")

LISTS: dict[str, type[wire.Record]] = {
    "gpus": wire.GpuSample, "hosts": wire.HostSample, "ports": wire.PortSample, "events": wire.Event,
    "steps": wire.Step, "probes": wire.Probe, "runs": wire.RunMeta, "beats": wire.RankBeat,
}
# Records from the hook socket were validated on arrival.
PREVALIDATED = frozenset({"steps", "runs", "beats"})
# The wire's bounds on each list, read from the Batch declaration so they cannot drift apart.
LIMITS: dict[str, int] = {}
for _name, (_tp, _default) in wire._fields(wire.Batch).items():
    _meta = getattr(_tp, "__metadata__", ())
    _len = next((m for m in _meta if isinstance(m, wire.Len)), None)
    if _len is not None and _name in LISTS:
        LIMITS[_name] = _len.max

assert {f.name for f in fields(Collected)} == {*LISTS, "dropped"}, "Collected and wire.Batch disagree"


class Checker:
    """Validates records, remembering which mistakes it has already logged."""

    def __init__(self) -> None:
        self._logged: set[str] = set()

    def records(self, collected: Collected, dropped: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for name, cls in LISTS.items():
            items = getattr(collected, name)
            if name in PREVALIDATED:
                out[name] = items
                continue
            good = []
            for i, item in enumerate(items):
                try:
                    wire.validate(cls, item, f"{name}[{i}]")
                except wire.WireError as exc:
                    dropped["invalid_record"] = dropped.get("invalid_record", 0) + 1
                    self._log(exc)
                else:
                    good.append(item)
            out[name] = good
        return out

    def _log(self, exc: wire.WireError) -> None:
        key = re.sub(r"\[\d+\]", "[]", exc.path)
        if key not in self._logged:
            self._logged.add(key)
            log.error("a source produced an invalid record, dropped (%s); further ones like it are only counted", exc)


def split(lists: dict[str, list[dict[str, Any]]], max_bytes: int = wire.MAX_BATCH_BYTES) -> list[dict[str, Any]]:
    """The record lists as one or more batch bodies within the list bounds and ``max_bytes``."""
    if fits(lists, max_bytes):
        return [lists]
    if sum(len(v) for v in lists.values()) <= 1:
        log.error("a single record is larger than %d bytes; dropped", max_bytes)
        return []
    first = {k: v[: (len(v) + 1) // 2] for k, v in lists.items()}
    second = {k: v[(len(v) + 1) // 2:] for k, v in lists.items()}
    return split(first, max_bytes) + split(second, max_bytes)


def fits(lists: dict[str, list[dict[str, Any]]], max_bytes: int = wire.MAX_BATCH_BYTES) -> bool:
    """Whether the record lists make one batch within the list bounds and ``max_bytes``."""
    if any(len(v) > LIMITS.get(k, len(v)) for k, v in lists.items()):
        return False
    # Cheap test first: most batches are far below the limit, and measuring means encoding.
    if sum(len(v) for v in lists.values()) < 50:
        return True
    return len(json.dumps(lists, separators=(",", ":"))) + 512 <= max_bytes
