"""Settings and the source registry: typos are errors with suggestions, broken sources are reported as off."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from agent_support import REPO

from collectors.agent import batch, registry
from collectors.agent.config import ConfigError, build, load_toml
from collectors.agent.source import Collected

SOURCES = tuple(registry.SOURCES)
BASE = {"server": "https://dx.example", "token_file": "/etc/clusterdx/token"}


def problems(raw: dict[str, Any], **overrides: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        build({**BASE, **raw}, overrides, SOURCES)
    return info.value.problems


def test_it_reports_every_mistake_at_once_with_suggestions() -> None:
    assert problems({"intervl_s": 1, "interval_s": 0.05, "spool_max_batches": "many",
                     "sources": {"ncll": {}, "gpu": {"enabled": "yes"}}}) == [
        "intervl_s: unknown option; did you mean 'interval_s'?",
        "interval_s: must be between 0.1 and 3600, got 0.05",
        "spool_max_batches: expected int, got str 'many'",
        "sources.ncll: unknown source; did you mean 'nccl'?",
        "sources.gpu.enabled: expected true or false, got 'yes'",
    ]


def test_flags_override_the_file_and_defaults_come_from_the_machine(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('server = "https://dx.example"\ntoken_file = "/t"\ninterval_s = 5\n[sources.gpu]\n'
                    "slow_interval_s = 30\n")
    cfg = build(load_toml(path), {"interval_s": 0.5, "host": "gpu-node-17"}, SOURCES)
    assert (cfg.interval_s, cfg.host, cfg.agent_id) == (0.5, "gpu-node-17", "gpu-node-17")
    assert cfg.sources == {"gpu": {"slow_interval_s": 30}}
    assert cfg.spool_path.endswith("spool.sqlite3")


def test_server_and_token_are_required_and_checked() -> None:
    with pytest.raises(ConfigError) as info:
        build({"server": "dx.example"}, {}, SOURCES)
    assert info.value.problems[:2] == [
        "server: expected an http:// or https:// URL, got 'dx.example'",
        'token_file: required (--token-file F or token_file = "/etc/clusterdx/token")',
    ]


class Steady:
    name = "steady"

    def __init__(self, *, root: str = "/sys", period_s: float = 1.0) -> None:
        self.root = root
        self.detail = f"reading {root}"

    def start(self) -> str | None:
        return None

    def collect(self, now: float, out: Collected) -> None:
        out.events.append({"ts": now, "kind": "agent", "message": "hello"})

    def close(self) -> None:
        pass


class Absent(Steady):
    def start(self) -> str | None:
        return "no such hardware here"


class Explodes(Steady):
    def start(self) -> str | None:
        raise RuntimeError("driver said no")


REGISTRY = {
    "steady": f"{__name__}:Steady", "absent": f"{__name__}:Absent", "explodes": f"{__name__}:Explodes",
    "missing": "collectors.sources.does_not_exist:Nope", "off": f"{__name__}:Steady",
}


def test_sources_that_are_missing_absent_or_broken_are_off_with_the_reason() -> None:
    statuses = registry.build({"steady": {"root": "/tmp"}, "off": {"enabled": False}}, REGISTRY)
    text = registry.summary(statuses)
    assert text.splitlines() == [
        "  steady    on   reading /tmp",
        "  absent    off  no such hardware here",
        "  explodes  off  failed to start: RuntimeError: driver said no",
        "  missing   off  not part of this install (collectors.sources.does_not_exist is missing)",
        "  off       off  disabled in the config",
    ]


def test_a_misspelt_source_option_is_an_error_naming_the_right_one() -> None:
    with pytest.raises(ConfigError) as info:
        registry.build({"steady": {"rot": "/tmp"}}, REGISTRY)
    assert info.value.problems == ["sources.steady.rot: unknown option; did you mean 'root'?"]


def test_invalid_source_records_are_dropped_and_counted_not_sent() -> None:
    out = Collected(gpus=[{"ts": 1.0, "index": 0, "power_w": -5.0}, {"ts": 1.0, "index": 1, "power_w": 300.0}])
    dropped: dict[str, int] = {}
    lists = batch.Checker().records(out, dropped)
    assert [g["index"] for g in lists["gpus"]] == [1]
    assert dropped == {"invalid_record": 1}


def test_a_batch_over_the_wire_bounds_is_split() -> None:
    steps = [{"run": "r", "rank": 0, "step": i, "ts": 1.0, "step_time_s": 0.1} for i in range(45_000)]
    parts = batch.split({"gpus": [], "steps": steps})
    assert [len(p["steps"]) for p in parts] == [11_250] * 4
    assert [s["step"] for p in parts for s in p["steps"]] == list(range(45_000))


def test_the_command_refuses_to_start_on_a_bad_config(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('server = "https://dx.example"\ninterval = 1\n')
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    proc = subprocess.run([sys.executable, "-m", "clusterdx", "agent", "--config", str(config), "--token-file",
                           str(token)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"clusterdx agent: {config} has problems:\n  interval: unknown option; did you mean 'interval_s'?" \
        in proc.stderr


def test_the_shipped_example_config_is_valid_for_every_source_it_names() -> None:
    raw = load_toml(REPO / "docker/agent/agent.toml.example")
    cfg = build(raw, {}, SOURCES)
    assert set(cfg.sources) == set(registry.SOURCES)
    for name, table in cfg.sources.items():
        cls, _ = registry.load_class(registry.SOURCES[name])
        if cls is not None:  # a source missing from this install is reported as off, not checked
            assert registry.check_options(name, cls, {k: v for k, v in table.items() if k != "enabled"}) == []
