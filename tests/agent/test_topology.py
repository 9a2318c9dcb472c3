"""The node's rack and switch: from ``[topology]`` or the environment (which wins), checked by the wire's rules at
start, and carried in every batch the agent sends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from agent_support import Receiver, start_agent, wait_for

from clusterdx import wire
from collectors.agent import registry
from collectors.agent.agent import Agent
from collectors.agent.config import ConfigError, build

SOURCES = tuple(registry.SOURCES)
BASE = {"server": "https://dx.example", "token_file": "/etc/clusterdx/token"}


def topology(table: Any = None, **environ: str) -> dict[str, str]:
    raw = {**BASE, **({"topology": table} if table is not None else {})}
    return build(raw, {}, SOURCES, environ=environ).topology


def problems(table: Any = None, **environ: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        topology(table, **environ)
    return info.value.problems


def test_it_reads_the_topology_table() -> None:
    assert topology({"rack": "rack-12", "switch": "leaf-12", "spine": "spine-2"}) == {
        "rack": "rack-12", "switch": "leaf-12", "spine": "spine-2"}
    assert topology() == {}


def test_the_environment_wins_over_the_file_and_an_empty_variable_is_unset() -> None:
    got = topology({"rack": "rack-01", "switch": "leaf-01"}, CLUSTERDX_RACK="rack-09", CLUSTERDX_SWITCH="")
    assert got == {"rack": "rack-09", "switch": "leaf-01"}
    assert topology(CLUSTERDX_SWITCH=" leaf-03 ", CLUSTERDX_SPINE="spine-1") == {"switch": "leaf-03",
                                                                                  "spine": "spine-1"}


def test_mistakes_are_reported_by_where_they_came_from() -> None:
    assert problems({"rak": "r1", "switch": "leaf 1"}, CLUSTERDX_RACK="x" * 65) == [
        "topology.rak: unknown option; did you mean 'rack'?",
        "topology.switch: the string 'leaf 1' does not match [A-Za-z0-9_][A-Za-z0-9_.:-]*",
        "CLUSTERDX_RACK: too long: 65 > 64",
    ]
    assert problems("rack-1") == ['topology: expected a table ([topology] with rack = "...", switch = "...")']
    assert problems({"rack": 12}) == ["topology.rack: expected a string, got a number"]


class _NoSpool:
    depth = size_bytes = 0


def test_every_batch_carries_the_topology_and_validates() -> None:
    cfg = build({**BASE, "topology": {"rack": "rack-02"}}, {}, SOURCES, environ={"CLUSTERDX_SWITCH": "leaf-02"})
    bodies = Agent(cfg, [], _NoSpool()).batches(1_700_000_000.0)  # type: ignore[arg-type]
    assert bodies
    for body, _ in bodies:
        batch = wire.validate_batch({**body, "seq": 0})
        assert batch["topology"] == {"rack": "rack-02", "switch": "leaf-02", "spine": None}


def test_an_agent_without_topology_sends_none() -> None:
    cfg = build(BASE, {}, SOURCES, environ={})
    (body, _), = Agent(cfg, [], _NoSpool()).batches(1_700_000_000.0)  # type: ignore[arg-type]
    assert "topology" not in body


def test_the_running_agent_sends_its_place(tmp_path: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERDX_SWITCH", "leaf-17")
    agent = start_agent(tmp_path, receiver.url, lib_dir=None, interval=0.1, toml='[topology]\nrack = "rack-17"\n')
    try:
        wait_for(lambda: len(receiver.seqs()) >= 2, what="two accepted batches")
    finally:
        agent.stop()
    assert {(b["topology"]["rack"], b["topology"]["switch"]) for b in receiver.accepted} == {("rack-17", "leaf-17")}
