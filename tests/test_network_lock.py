"""tests/network_lock.py: a browser waits while another process changes the host's addresses, and the other way."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import network_lock

ROOT = Path(__file__).resolve().parents[1]
HOLD = """
import sys, time
sys.path.insert(0, {root!r})
from tests import network_lock
network_lock.LOCK_PATH = __import__("pathlib").Path({path!r})
with network_lock.{kind}():
    print("held", flush=True)
    time.sleep(1.5)
"""


def hold(kind: str, path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(root=str(ROOT), path=str(path), kind=kind)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.parametrize(("other", "mine"), [("changing", "browsing"), ("browsing", "changing")])
def test_one_kind_waits_for_the_other_held_in_another_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             other: str, mine: str) -> None:
    monkeypatch.setattr(network_lock, "LOCK_PATH", tmp_path / "lock")
    monkeypatch.setattr(network_lock, "SETTLE_S", 0.0)
    proc = hold(other, tmp_path / "lock")
    t0 = time.monotonic()
    with getattr(network_lock, mine)():
        waited = time.monotonic() - t0
    proc.wait(10)
    assert waited > 0.5, waited  # the other still held it for most of its 1.5 s (+ its settle, for a change)


def test_browsers_share_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(network_lock, "LOCK_PATH", tmp_path / "lock")
    proc = hold("browsing", tmp_path / "lock")
    t0 = time.monotonic()
    with network_lock.browsing():
        assert time.monotonic() - t0 < 0.5
    proc.wait(10)
