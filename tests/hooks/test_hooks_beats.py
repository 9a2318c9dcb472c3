"""Beats: the shipping thread says where the training thread is, once a second, also while it is blocked — so the
server can tell which rank stopped a run (the silent one, or the one stuck fetching data)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from hooks_support import wait_for

from trainer_hooks import Monitor

ROOT = Path(__file__).resolve().parents[2]


def beats_while(udp_agent, state: str) -> list[dict]:
    return [b for b in udp_agent.records("beats") if b["state"] == state]


def test_a_rank_blocked_inside_a_step_keeps_beating(udp_agent, hook_env):
    hook_env.setenv("CLUSTERDX_AGENT_ADDR", udp_agent.addr)
    hook_env.setenv("CLUSTERDX_HOOK_BEAT_S", "1")
    mon = Monitor(run="beats", interval=0.05)
    for _ in mon.loader(range(3)):
        with mon.step():
            pass
    with mon.step():
        # Blocked as in a collective whose peer died: the training thread does nothing, beats go on.
        assert wait_for(lambda: len(beats_while(udp_agent, "step")) >= 2, timeout=5)
    mon.close()
    blocked = beats_while(udp_agent, "step")
    assert [b["step"] for b in blocked][:2] == [2, 2], "the last step that ended, not the one in progress"
    assert blocked[1]["state_s"] > blocked[0]["state_s"] >= 0.0
    assert blocked[1]["ts"] - blocked[0]["ts"] >= 0.8, "about one beat a second"


def test_a_rank_stuck_fetching_data_says_data(udp_agent, hook_env):
    hook_env.setenv("CLUSTERDX_AGENT_ADDR", udp_agent.addr)
    hook_env.setenv("CLUSTERDX_HOOK_BEAT_S", "0.2")
    mon = Monitor(run="beats", interval=0.05)

    def slow_loader():
        yield 0
        deadline = time.monotonic() + 5
        while not beats_while(udp_agent, "data") and time.monotonic() < deadline:
            time.sleep(0.01)
        yield 1

    for _ in mon.loader(slow_loader()):
        with mon.step():
            pass
    mon.close()
    (data, *_) = beats_while(udp_agent, "data")
    assert data["step"] == 0 and data["state_s"] >= 0.0
    assert wait_for(lambda: udp_agent.records("beats")[-1]["state"] == "finished")  # the last one, at close


def test_a_rank_dying_of_an_exception_says_why(udp_agent, hook_env):
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(ROOT)!r})
        from trainer_hooks import Monitor
        mon = Monitor(run="crash", interval=0.05)
        for i in mon.loader(range(5)):
            with mon.step():
                pass
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Read error [10.77.1.2]:46829: Connection reset by peer")
    """)
    env = {**os.environ, "CLUSTERDX_AGENT_ADDR": udp_agent.addr, "CLUSTERDX_HOOK_TRANSPORT": "agent",
           "CLUSTERDX_HOOK_BEAT_S": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Connection reset by peer" in out.stderr, "the crash itself is unchanged"
    assert wait_for(lambda: len(udp_agent.records("events")) == 2)
    error, ended = udp_agent.records("events")
    assert error["kind"] == "error" and error["step"] == 4 and "Read error [10.77.1.2]" in error["message"]
    assert ended["data"] == {"state": "crashed"}
    assert wait_for(lambda: udp_agent.records("beats")[-1]["state"] == "crashed")
