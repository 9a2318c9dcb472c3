"""The simulated cluster speaks the real wire format and bends the right signals for each fault."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from clusterdx import wire
from collectors.sim.model import SimCluster
from collectors.sim.scenario import FAULT_KINDS, ScenarioError, load, parse

T0 = 1_700_000_000.0
SCENARIOS = Path(__file__).resolve().parents[2] / "collectors" / "sim" / "scenarios"


def run(scenario_data: dict, seconds: int = 60) -> list[dict]:
    sim = SimCluster(parse(scenario_data), start_ts=1_700_000_000.0)
    out = []
    for t in range(1, seconds + 1):
        out += sim.tick(1_700_000_000.0 + t)
    return out


def target(kind: str) -> dict:
    return {"rank": {"rank": 5}, "node": {"node": 1}, "gpu": {"node": 1, "gpu": 3}, "run": {}}[FAULT_KINDS[kind][0]]


@pytest.mark.parametrize("kind", sorted(FAULT_KINDS))
def test_every_fault_kind_produces_valid_batches(kind: str) -> None:
    batches = run({"cluster": {"nodes": 2, "gpus_per_node": 4, "step_time_s": 0.5},
                   "fault": [{"kind": kind, "at_s": 10, **target(kind)}]}, seconds=40)
    assert batches
    for b in batches:
        wire.validate_batch(b)


def test_sequence_numbers_increase_per_node_without_gaps() -> None:
    batches = run({"cluster": {"nodes": 3}}, seconds=10)
    for host in ("node-000", "node-001", "node-002"):
        assert [b["seq"] for b in batches if b["host"] == host] == list(range(10))


def test_ddp_levels_step_time_and_the_culprit_shows_in_its_own_data_wait() -> None:
    batches = run({"cluster": {"nodes": 2, "gpus_per_node": 4, "step_time_s": 0.5},
                   "fault": [{"kind": "data_starvation", "at_s": 0, "rank": 6, "magnitude": 0.8}]}, seconds=30)
    steps = [s for b in batches for s in b["steps"]]
    by_step: dict[int, set[float]] = {}
    for s in steps:
        by_step.setdefault(s["step"], set()).add(round(s["step_time_s"], 9))
    assert all(len(v) == 1 for v in by_step.values()), "every rank of a DDP step has the same step time"
    wait = {r: statistics.median(s["data_wait_s"] for s in steps if s["rank"] == r) for r in range(8)}
    comm = {r: statistics.median(s["comm_s"] for s in steps if s["rank"] == r) for r in range(8)}
    assert wait[6] > 0.3 and max(w for r, w in wait.items() if r != 6) < 0.05
    assert comm[6] < min(c for r, c in comm.items() if r != 6), "the others wait for rank 6 in the all-reduce"


def test_a_dead_node_goes_silent_and_the_run_stops() -> None:
    batches = run({"cluster": {"nodes": 2, "gpus_per_node": 2, "step_time_s": 0.5},
                   "fault": [{"kind": "node_down", "at_s": 20, "node": 1}]}, seconds=40)
    late = [b for b in batches if b["sent_at"] > 1_700_000_000 + 22]
    assert late and all(b["host"] == "node-000" for b in late)
    assert not any(b["steps"] for b in late)


def test_scenario_files_are_checked() -> None:
    assert load(SCENARIOS / "demo.toml").faults
    with pytest.raises(ScenarioError, match="unknown kind"):
        parse({"fault": [{"kind": "cosmic_ray", "at_s": 1}]})
    with pytest.raises(ScenarioError, match="needs rank"):
        parse({"cluster": {"nodes": 1, "gpus_per_node": 2}, "fault": [{"kind": "straggler", "at_s": 1, "rank": 9}]})
    with pytest.raises(ScenarioError, match="unknown keys"):
        parse({"cluster": {"nodez": 3}})


def test_every_batch_places_its_node_in_a_rack_behind_its_leaf() -> None:
    batches = run({"cluster": {"nodes": 20, "gpus_per_node": 1, "nodes_per_rack": 8}}, seconds=2)
    places = {b["host"]: wire.validate_batch(b)["topology"] for b in batches}
    assert len(places) == 20 and len(batches) == 40, "every batch carries it, not only the first"
    assert places["node-000"] == {"rack": "rack-00", "switch": "leaf-00", "spine": None}
    assert places["node-007"]["rack"] == "rack-00" and places["node-008"]["rack"] == "rack-01"
    assert places["node-019"] == {"rack": "rack-02", "switch": "leaf-02", "spine": None}
    assert {b["topology"]["rack"] for b in run({"cluster": {"nodes": 4, "nodes_per_rack": 2}}, seconds=1)} == {
        "rack-00", "rack-01"}


@pytest.mark.parametrize("bad", [0, -1, 2.5, "8"])
def test_nodes_per_rack_must_be_a_positive_whole_number(bad: object) -> None:
    with pytest.raises(ScenarioError, match="nodes_per_rack"):
        parse({"cluster": {"nodes_per_rack": bad}})


def test_nccl_init_lines_give_every_rank_its_transport_once() -> None:
    """With ``nccl_logs`` each rank's NCCL init lines go through the agent's parser once, at the run's start: every
    rank on IB with GPUDirect RDMA to its rail peer, and sockets on a node that fell back to them."""
    s = parse({"cluster": {"nodes": 3, "gpus_per_node": 4, "nccl_logs": True},
               "fault": [{"kind": "nccl_socket_fallback", "at_s": 0, "node": 2}]})
    sim = SimCluster(s, T0)
    first = sim.tick(T0 + 1)
    later = [e for i in range(2, 5) for b in sim.tick(T0 + i) for e in b["events"] if e["data"].get("fact")]
    for b in first:
        wire.validate_batch(b)
    net = {e["rank"]: e["data"] for b in first for e in b["events"]
           if e["data"].get("fact") == "transport" and "P2P" not in e["data"]["transport"]}
    assert sorted(net) == list(range(12)), "one inter-node transport per rank"
    assert {r: (d["transport"], d.get("gdr")) for r, d in net.items() if r < 8} == {r: ("IB", "true") for r in range(8)}
    assert {d["transport"] for r, d in net.items() if r >= 8} == {"Socket"}
    assert not later, "NCCL prints its transports once, at init"
    assert all(e["data"]["fact"] != "transport" for b in SimCluster(parse({"cluster": {"nodes": 2}}), T0).tick(T0 + 1)
               for e in b["events"] if "fact" in e["data"]), "off by default"


def test_nodes_report_their_interfaces_at_start_and_every_five_minutes() -> None:
    sim = SimCluster(parse({"cluster": {"nodes": 2, "gpus_per_node": 2}}), T0)
    sent = [i for i in range(1, 602) for b in sim.tick(T0 + i) if b["host"] == "node-000"
            and "interfaces" in b["hosts"][0]]
    assert sent == [1, 301, 601]
    sim = SimCluster(parse({"cluster": {"nodes": 2, "gpus_per_node": 2}}), T0)
    first = sim.tick(T0 + 1)[1]
    wire.validate_batch(first)
    names = {i["name"]: i for i in first["hosts"][0]["interfaces"]}
    assert sorted(names) == ["eth0", "ib0", "ib1", "lo"] and names["eth0"]["state"] == "up"
