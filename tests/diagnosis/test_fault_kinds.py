"""Every simulator fault kind at 8 nodes, fed in simulated time straight into the detectors (no database): the
right kind and exact subject, nothing else, within seconds of the fault becoming visible."""

from __future__ import annotations

from typing import Any

import pytest

from collectors.sim.model import SimCluster
from collectors.sim.scenario import FAULT_KINDS, parse
from dashboard.diagnosis.detectors import Detection, run_all
from dashboard.diagnosis.detectors.buffer import WindowBuffer

T0 = 1_760_000_000.0


def simulate(faults: list[dict[str, Any]], seconds: int, nodes: int = 8, gpus: int = 4,
             **cluster: Any) -> list[tuple[int, Detection]]:
    """(second, detection) for each (kind, subject) the first time it is detected."""
    scenario = parse({"cluster": {"nodes": nodes, "gpus_per_node": gpus, "run": "r", "seed": 2, **cluster},
                      "fault": faults})
    sim, buf = SimCluster(scenario, T0), WindowBuffer()
    first: dict[tuple[str, str], tuple[int, Detection]] = {}
    for i in range(1, seconds + 1):
        for batch in sim.tick(T0 + i):
            buf.add(batch)
        for d in run_all(buf.window(T0 + i)):
            first.setdefault(d.key, (i, d))
    return sorted(first.values(), key=lambda x: x[0])


CASES = [
    ({"kind": "data_starvation", "rank": 21, "magnitude": 0.3}, "data_starvation", "r/rank21", 6),
    ({"kind": "straggler", "rank": 3, "magnitude": 0.25}, "straggler", "r/rank3", 6),
    ({"kind": "slow_link", "node": 6, "magnitude": 2.0}, "slow_link", "node-006", 4),
    ({"kind": "slow_link", "node": 1, "magnitude": 2.0, "mode": "bandwidth"}, "slow_link", "node-001", 4),
    ({"kind": "link_flap", "node": 4}, "slow_link", "node-004", 2),
    ({"kind": "ecc_storm", "node": 2, "gpu": 3}, "failing_gpu", "node-002/gpu3", 4),
    ({"kind": "xid", "node": 7, "gpu": 0}, "failing_gpu", "node-007/gpu0", 1),
    ({"kind": "node_down", "node": 5}, "node_down", "node-005", 5),
    ({"kind": "hang"}, "hang", "r", 7),
    ({"kind": "nccl_socket_fallback", "node": 3}, "nccl_config", "node-003", 1),
    ({"kind": "nccl_env_drift", "rank": 30}, "nccl_config", "r/rank30", 1),
    ({"kind": "memory_pressure", "rank": 9, "magnitude": 0.97}, "memory_pressure", "r/rank9", 35),
    # The rank that stopped the run is named from the beats, not the run: silent while its node's agent reports.
    ({"kind": "rank_killed", "rank": 13}, "rank_down", "r/rank13", 5),
    ({"kind": "rank_killed", "rank": 26, "survivors": "crash"}, "rank_down", "r/rank26", 5),
    ({"kind": "rank_frozen", "rank": 7}, "rank_down", "r/rank7", 5),
    ({"kind": "loader_stuck", "rank": 18}, "hang", "r/rank18", 7),
]


def test_every_fault_kind_is_covered() -> None:
    assert {c[0]["kind"] for c in CASES} | {"checkpoint_stop"} == set(FAULT_KINDS)


@pytest.mark.parametrize(("fault", "kind", "subject", "within_s"), CASES, ids=[c[0]["kind"] + "-" + c[2] for c in CASES])
def test_it_names_the_fault_and_only_the_fault(fault: dict[str, Any], kind: str, subject: str, within_s: int) -> None:
    found = simulate([{**fault, "at_s": 15}], 15 + within_s + 5)
    assert [(d.kind, d.subject) for _, d in found] == [(kind, subject)]
    when, d = found[0]
    assert when - 15 <= within_s, f"{when - 15} s to detect"
    assert d.action and d.evidence and d.title and d.severity in {"warning", "error", "critical"}


def test_a_stopped_checkpoint_writer_is_overdue_with_the_cost_at_risk() -> None:
    found = simulate([{"kind": "checkpoint_stop", "at_s": 40}], 80, checkpoint_every=15, step_time_s=0.5)
    assert [(d.kind, d.subject) for _, d in found] == [("checkpoint_overdue", "r")]
    m = found[0][1].evidence["metrics"]
    assert m["cadence_steps"] == 15 and m["gpus"] == 32 and m["usd_at_risk"] == pytest.approx(
        m["gpu_hours_at_risk"] * 2.5, abs=0.02)


def test_a_healthy_run_stays_quiet_for_ten_simulated_minutes() -> None:
    assert simulate([], 600) == []


def test_a_fault_that_ends_stops_being_detected() -> None:
    found = simulate([{"kind": "straggler", "rank": 5, "magnitude": 0.5, "at_s": 10, "duration_s": 10}], 25)
    assert [(d.kind, d.subject) for _, d in found] == [("straggler", "r/rank5")]
    scenario = parse({"cluster": {"nodes": 4, "gpus_per_node": 4, "run": "r", "seed": 2},
                      "fault": [{"kind": "straggler", "rank": 5, "magnitude": 0.5, "at_s": 10, "duration_s": 10}]})
    sim, buf = SimCluster(scenario, T0), WindowBuffer()
    active = []
    for i in range(1, 40):
        for batch in sim.tick(T0 + i):
            buf.add(batch)
        active.append(any(d.kind == "straggler" for d in run_all(buf.window(T0 + i))))
    assert any(active[10:22]) and not any(active[30:])


def test_the_buffer_keeps_one_checkpoint_per_step_whatever_the_node_count() -> None:
    buf = WindowBuffer()
    meta = {"run": "r", "rank": 0, "world_size": 2, "ts": T0}
    for n in range(100):
        buf.add({"host": f"node-{n}", "sent_at": T0, "runs": [meta] if n == 0 else [], "events": [
            {"ts": T0, "kind": "checkpoint", "run": "r", "step": s, "rank": n} for s in (20, 40)]})
    assert buf.window(T0).runs[0].checkpoints == [(T0, 20), (T0, 40)]


def test_the_steps_flagged_count_is_of_the_recent_steps_only() -> None:
    """A long starvation: every step the window holds is flagged, yet the evidence counts only the recent steps the
    decision looked at (it once said "11/8")."""
    scenario = parse({"cluster": {"nodes": 8, "gpus_per_node": 4, "run": "r", "seed": 2},
                      "fault": [{"kind": "data_starvation", "rank": 21, "magnitude": 0.3, "at_s": 10}]})
    sim, buf = SimCluster(scenario, T0), WindowBuffer()
    counts = []
    for i in range(1, 60):
        for batch in sim.tick(T0 + i):
            buf.add(batch)
        counts += [d.evidence["metrics"]["steps_flagged"] for d in run_all(buf.window(T0 + i))
                   if d.key == ("data_starvation", "r/rank21")]
    assert counts, "the starvation was never named"
    pairs = [tuple(int(x) for x in c.split("/")) for c in counts]
    assert all(0 < flagged <= recent for flagged, recent in pairs), counts
    assert pairs[-1][0] == pairs[-1][1], counts  # by then every recent step is flagged
