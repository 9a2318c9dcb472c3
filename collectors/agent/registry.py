"""Which sources exist, and turning the config's ``[sources.<name>]`` tables into started sources.

Sources are imported by name, lazily: a node without InfiniBand never imports the IB reader's dependencies, and a
source module that is missing from this build, fails to import, rejects its options or fails to start is reported
as off with the reason, never a crash. Only a misspelt option is an error, since the admin can fix it.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any

from collectors.agent.config import ConfigError, suggest
from collectors.agent.source import Source

log = logging.getLogger("clusterdx.agent")

SOURCES: dict[str, str] = {
    "gpu": "collectors.gpu.source:GpuSource",
    "hooks": "collectors.agent.hooks:HookSource",
    "host": "collectors.sources.host:HostSource",
    "ib": "collectors.sources.ib:IbSource",
    "kmsg": "collectors.sources.kmsg:KmsgSource",
    "nccl": "collectors.sources.nccl_tail:NcclLogSource",
    "probes": "collectors.sources.probes:ProbeSource",
}


@dataclass
class Status:
    name: str
    source: Source | None  # None when off
    why: str  # what it measures when on, why it is off otherwise
    notes: tuple[str, ...] = ()


def load_class(path: str) -> tuple[type | None, str]:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            return None, f"not part of this install ({module_name} is missing)"
        return None, f"needs {exc.name} (pip install 'clusterdx[agent]')"
    except Exception as exc:  # a broken source module must not take the agent down
        return None, f"failed to import: {type(exc).__name__}: {exc}"
    cls = getattr(module, attr, None)
    return (cls, "") if cls is not None else (None, f"{module_name} has no {attr}")


def check_options(name: str, cls: type, options: dict[str, Any]) -> list[str]:
    """Misspelt or unknown options, by the source's own keyword parameters."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    known = [p for p, v in params.items() if v.kind in (v.KEYWORD_ONLY, v.POSITIONAL_OR_KEYWORD)]
    return [f"sources.{name}.{key}: unknown option{suggest(key, known or ['(none)'])}"
            for key in options if key not in known]


def build(tables: dict[str, dict[str, Any]], registry: dict[str, str] | None = None) -> list[Status]:
    """Construct and start every source. Raises :class:`ConfigError` only for misspelt options."""
    registry = SOURCES if registry is None else registry
    statuses: list[Status] = []
    problems: list[str] = []
    for name, path in registry.items():
        table = dict(tables.get(name, {}))
        if not table.pop("enabled", True):
            statuses.append(Status(name, None, "disabled in the config"))
            continue
        cls, why = load_class(path)
        if cls is None:
            statuses.append(Status(name, None, why))
            continue
        bad = check_options(name, cls, table)
        if bad:
            problems += bad
            continue
        statuses.append(_start(name, cls, table))
    if problems:
        for status in statuses:
            close(status)
        raise ConfigError(problems)
    return statuses


def _start(name: str, cls: type, options: dict[str, Any]) -> Status:
    try:
        source = cls(**options)
        reason = source.start()
    except Exception as exc:
        log.debug("source %s failed to start", name, exc_info=True)
        return Status(name, None, f"failed to start: {type(exc).__name__}: {exc}")
    notes = tuple(getattr(source, "notes", ()) or ())
    if reason is not None:
        _close_quietly(source)
        return Status(name, None, reason, notes)
    return Status(name, source, str(getattr(source, "detail", "") or "on"), notes)


def close(status: Status) -> None:
    if status.source is not None:
        _close_quietly(status.source)


def _close_quietly(source: Any) -> None:
    try:
        source.close()
    except Exception:
        log.debug("closing %s failed", getattr(source, "name", source), exc_info=True)


def summary(statuses: list[Status]) -> str:
    width = max((len(s.name) for s in statuses), default=4)
    lines = []
    for s in statuses:
        lines.append(f"  {s.name:<{width}}  {'on ' if s.source else 'off'}  {s.why}")
        lines += [f"  {'':<{width}}       - {note}" for note in s.notes]
    return "\n".join(lines)
