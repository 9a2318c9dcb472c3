"""The local hook socket, through the agent process on a node without NVML."""

from __future__ import annotations

import ctypes.util
import json
import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from agent_support import Receiver, start_agent, wait_for

STEP = {"run": "r1", "rank": 3, "step": 41, "ts": 1.7e9, "step_time_s": 0.5, "data_wait_s": 0.2}
RUN = {"run": "r1", "rank": 3, "world_size": 8, "ts": 1.7e9}
EVENT = {"ts": 1.7e9, "kind": "checkpoint", "message": "saved step 40", "run": "r1", "rank": 3}


def datagram(dropped: dict[str, int], **lists: Any) -> bytes:
    return json.dumps({"v": 1, "host": "test-node", "pid": 4242, **lists, "dropped": dropped}).encode()


def send(port: int, *payloads: bytes) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for p in payloads:
            s.sendto(p, ("127.0.0.1", port))


@pytest.mark.skipif(bool(ctypes.util.find_library("nvidia-ml")), reason="this machine has a real NVML")
def test_hooks_are_forwarded_and_bad_datagrams_counted_without_nvml(tmp_path: Path) -> None:
    receiver = Receiver()
    agent = start_agent(tmp_path, receiver.url, lib_dir=None, interval=0.1)
    try:
        wait_for(lambda: receiver.accepted, what="a first batch")
        send(agent.hook_port,
             datagram({"queue_full": 2}, steps=[STEP], runs=[RUN], events=[EVENT]),
             b"not json at all",
             datagram({}, steps=[{**STEP, "step_time_s": "slow"}]),
             datagram({}, steps=[{**STEP, "step_time_s": -1}]))
        time.sleep(0.3)
        send(agent.hook_port, datagram({"queue_full": 5}, steps=[{**STEP, "step": 42}]))
        wait_for(lambda: [s for b in receiver.accepted for s in b["steps"] if s["step"] == 42], what="step 42")
    finally:
        agent.stop()
        receiver.stop()
    batches = receiver.accepted
    assert all(b["gpus"] == [] for b in batches)
    steps = [s for b in batches for s in b["steps"]]
    assert [(s["run"], s["rank"], s["step"], s["data_wait_s"]) for s in steps] == [("r1", 3, 41, 0.2),
                                                                                   ("r1", 3, 42, 0.2)]
    assert [r["world_size"] for b in batches for r in b["runs"]] == [8]
    assert [e["message"] for b in batches for e in b["events"]] == ["saved step 40"]
    totals: dict[str, int] = {}
    for b in batches:
        for reason, n in (b["dropped"] or {}).items():
            totals[reason] = totals.get(reason, 0) + n
    # The hook's counter is cumulative (2, then 5): the agent forwards the increase, never the sum of totals.
    assert totals == {"hook_queue_full": 5, "hook_bad_datagram": 3}
    log = agent.log()
    assert re.search(r"gpu\s+off\s+no NVML library \(libnvidia-ml.so.1 not found\)", log)
    assert log.count("no NVML library") == 1  # said once, at start
    assert log.count("bad datagram on the hook socket (not JSON)") == 1
    assert log.count("bad datagram on the hook socket (steps[].step_time_s)") == 1  # both bad steps: one line
