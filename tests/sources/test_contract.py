"""What the agent core relies on from every source here: its import path, how it is built and named."""

from __future__ import annotations

import importlib
import inspect

import pytest

from collectors.agent.source import Source

SOURCES = {
    "ib": "collectors.sources.ib:IbSource",
    "host": "collectors.sources.host:HostSource",
    "kmsg": "collectors.sources.kmsg:KmsgSource",
    "nccl": "collectors.sources.nccl_tail:NcclLogSource",
    "probes": "collectors.sources.probes:ProbeSource",
}


def _load(path: str) -> type:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_each_source_is_built_from_keyword_options_with_defaults(name: str) -> None:
    cls = _load(SOURCES[name])
    params = list(inspect.signature(cls).parameters.values())
    assert params, f"{cls.__name__} takes no options"
    for param in params:
        assert param.kind is inspect.Parameter.KEYWORD_ONLY, f"{cls.__name__}({param.name}) must be keyword-only"
        assert param.default is not inspect.Parameter.empty, f"{cls.__name__}({param.name}) needs a default"
        assert f"``{param.name}``" in (cls.__doc__ or ""), f"{cls.__name__} does not document {param.name}"
    source = cls()
    assert source.name == name
    for method in ("start", "collect", "close"):  # the Source protocol, structurally
        assert callable(getattr(source, method))
        assert list(inspect.signature(getattr(source, method)).parameters) == \
            list(inspect.signature(getattr(Source, method)).parameters)[1:]


def test_the_agent_registry_points_here() -> None:
    registry = importlib.import_module("collectors.agent.registry")
    for name, path in SOURCES.items():
        assert registry.SOURCES[name] == path
