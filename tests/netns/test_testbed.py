"""The testbed's own housekeeping: a crashed run's namespaces, links and processes are found and removed, and a
live run's are left alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from netns_testbed import Testbed, remove_stale, run

pytestmark = pytest.mark.netns


def test_a_crashed_runs_namespaces_links_and_processes_are_removed(tmp_path: Path, bed: Testbed) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    crashed = Testbed(tmp_path / "crashed", owner=int(gone.stdout))  # its owner has exited: a stale testbed
    (tmp_path / "crashed").mkdir()
    try:
        crashed.build()
        sleeper = crashed.spawn(crashed.nodes[1], ["sleep", "60"], "sleep.log")
        crashed.limit_rate("node-c", "10mbit")
        stale = crashed.leftovers()
        assert len(stale) == 4 + 4 + 1  # namespaces, host ends of the veths, bridge
        live = bed.leftovers()

        removed = remove_stale()

        assert set(removed) >= set(stale)
        assert crashed.leftovers() == []
        assert sleeper.wait(5) == -9  # the process in the stale namespace is gone too
        assert f"10.77.{crashed.subnet}." not in run("ip", "-4", "-o", "addr", "show").stdout
        assert bed.leftovers() == live  # this process's own testbed is not stale
    finally:
        crashed.close()
