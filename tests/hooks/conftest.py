"""Fixtures for the hooks tests: the receivers live in hooks_support (importable by the test modules too)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hooks_support import IngestServer, UdpAgent


@pytest.fixture
def udp_agent() -> Iterator[UdpAgent]:
    agent = UdpAgent()
    yield agent
    agent.close()
    assert not agent.errors, agent.errors


@pytest.fixture
def ingest() -> Iterator[IngestServer]:
    server = IngestServer()
    yield server
    server.close()
    assert not server.errors, server.errors


@pytest.fixture
def hook_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A clean CLUSTERDX_* environment so a developer's own settings cannot leak into a test."""
    for name in ("CLUSTERDX_AGENT_ADDR", "CLUSTERDX_SERVER", "CLUSTERDX_TOKEN", "CLUSTERDX_TOKEN_FILE",
                 "CLUSTERDX_HOOK_TRANSPORT", "CLUSTERDX_RUN", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID",
                 "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    # Beats arrive on a clock, not per record: tests that count records exactly run without them
    # (test_hooks_beats turns them back on).
    monkeypatch.setenv("CLUSTERDX_HOOK_BEAT_S", "0")
    return monkeypatch
