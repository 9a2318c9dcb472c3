"""Fixtures for the agent tests; the helpers live in agent_support (importable by the test modules too)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_support import Receiver, build_standin


@pytest.fixture(scope="session")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in libnvidia-ml.so.1, built once per session; its directory goes on LD_LIBRARY_PATH."""
    return build_standin(tmp_path_factory.mktemp("nvml"))


@pytest.fixture(scope="session")
def standin_old(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in as an old driver: no clock event reasons, no memory info v2, no row remapping."""
    return build_standin(tmp_path_factory.mktemp("nvml-old"), "STANDIN_OLD_DRIVER")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()
