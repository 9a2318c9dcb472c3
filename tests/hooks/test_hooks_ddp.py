"""Four real gloo ranks training with DDP and the timing comm hook, one with a slow DataLoader and one with extra
compute: the per-rank records must say which is which, and the hook must leave the gradients as they were."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
from hooks_support import free_port, gloo_env, run_ranks, wait_for

WORLD, SLOW_DATA, SLOW_COMPUTE, DELAY, STEPS = 4, 1, 2, 0.08, 12
WORKER = Path(__file__).with_name("ddp_worker.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """Runs the ranks once for all the tests of this module: (per-rank steps, runs, events, grad-check verdicts)."""
    from hooks_support import UdpAgent

    agent = UdpAgent()
    result = tmp_path_factory.mktemp("ddp") / "result.json"
    port = free_port()
    args = [sys.executable, str(WORKER), str(result), str(SLOW_DATA), str(SLOW_COMPUTE), str(DELAY), str(STEPS)]
    run_ranks([(args, gloo_env(rank, WORLD, port, CLUSTERDX_AGENT_ADDR=agent.addr, CLUSTERDX_RUN="ddp-test"))
               for rank in range(WORLD)], timeout=90)
    assert wait_for(lambda: len(agent.records("steps")) == WORLD * STEPS, timeout=5), len(agent.records("steps"))
    agent.close()
    assert not agent.errors, agent.errors
    steps: dict[int, list[dict]] = {r: [] for r in range(WORLD)}
    for s in agent.records("steps"):
        steps[s["rank"]].append(s)
    verdicts = [json.loads(Path(f"{result}.{r}").read_text()) for r in range(WORLD)]
    return steps, agent.records("runs"), agent.records("events"), verdicts


def median(steps: list[dict], field: str) -> float:
    # The first steps pay for DDP's bucket rebuild and lazy initialisation: not what a straggler looks like.
    return statistics.median(s[field] for s in steps[3:])


def test_the_comm_hook_leaves_gradients_bitwise_identical(ddp_run):
    *_, verdicts = ddp_run
    for verdict in verdicts:
        assert verdict["bitwise"] is True
        assert verdict["averaged"] is True  # the check compares all-reduced gradients, not local ones
        assert verdict["comm_s"] > 0


def test_every_rank_reports_every_step_with_its_identity(ddp_run):
    steps, runs, events, _ = ddp_run
    for rank in range(WORLD):
        assert [s["step"] for s in steps[rank]] == list(range(STEPS))
        assert all(s["run"] == "ddp-test" and s["samples"] == 8 for s in steps[rank])
        assert set(steps[rank][-1]["phases"]) == {"forward", "backward"}
        assert "loss" in steps[rank][-1]["metrics"]
    first = {r["rank"]: r for r in runs}
    assert sorted(first) == list(range(WORLD))
    assert {r["world_size"] for r in runs} == {WORLD}
    assert {r["local_rank"] for r in first.values()} == set(range(WORLD))
    assert first[0]["parallel"] == {"tp": 1, "dp": WORLD}
    assert first[0]["params"] == 32 * 64 + 64 + 64 * 64 + 64 + 64 + 1
    assert first[0]["env"]["GLOO_SOCKET_IFNAME"] == "lo"
    assert [(e["kind"], e["rank"], e["step"]) for e in events if e["kind"] == "checkpoint"] == [("checkpoint", 0, 5)]
    ended = sorted((e["rank"], e["data"]["state"]) for e in events if e["kind"] == "hook")
    assert ended == [(r, "finished") for r in range(4)], "every rank says it ended cleanly"


def test_the_slow_loader_rank_shows_data_wait_and_arrives_late(ddp_run):
    steps, *_ = ddp_run
    for rank in range(WORLD):
        wait = median(steps[rank], "data_wait_s")
        if rank == SLOW_DATA:
            assert wait > 0.8 * DELAY, (rank, wait)
        else:
            assert wait < 0.25 * DELAY, (rank, wait)


def test_the_slow_compute_rank_shows_compute_and_the_others_wait_in_comm(ddp_run):
    steps, *_ = ddp_run
    compute = {r: median(steps[r], "compute_s") for r in range(WORLD)}
    comm = {r: median(steps[r], "comm_s") for r in range(WORLD)}
    arrive = {r: median(steps[r], "comm_arrive_s") for r in range(WORLD)}
    assert compute[SLOW_COMPUTE] > 0.8 * DELAY, compute
    assert all(compute[r] < 0.4 * DELAY for r in range(WORLD) if r != SLOW_COMPUTE), compute
    for fast in set(range(WORLD)) - {SLOW_DATA, SLOW_COMPUTE}:
        # The healthy ranks reach the all-reduce early and wait there for both slow ones.
        assert comm[fast] > 0.6 * DELAY, comm
        assert comm[fast] > max(comm[SLOW_DATA], comm[SLOW_COMPUTE]) + 0.4 * DELAY, comm
        assert arrive[fast] < 0.25 * DELAY, arrive
    assert arrive[SLOW_DATA] > 0.8 * DELAY and arrive[SLOW_COMPUTE] > 0.8 * DELAY, arrive
    # Every rank's step lasts as long as the slowest: that is what a straggler costs everyone.
    for rank in range(WORLD):
        assert median(steps[rank], "step_time_s") > 0.9 * DELAY
