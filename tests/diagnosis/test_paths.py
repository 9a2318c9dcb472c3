"""Pingmesh-style localisation: the pattern of bad probe pairs names a path, a node or a leaf switch, and only that.

Every node pings every other node each second for ten seconds (a full mesh, through the same ``WindowBuffer`` the
fault suite uses), with the node's rack and leaf switch in its batches as the agent sends them; ``rtt(a, b)`` says
how slow each pair is. The whole diagnosis (:func:`run_all`) runs, so a test also sees that nothing else is named.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dashboard.diagnosis.detectors import Thresholds, run_all
from dashboard.diagnosis.detectors.buffer import WindowBuffer

T0 = 1_760_000_000.0
QUIET_MS = 0.05
SLOW_MS = 30.0

# Three leaves of four nodes: leaf-1 (n1..n4), leaf-2 (n5..n8), leaf-3 (n9..n12).
THREE = {f"n{i:02d}": f"leaf-{(i - 1) // 4 + 1}" for i in range(1, 13)}
TWO = {h: leaf for h, leaf in THREE.items() if leaf != "leaf-3"}

Rtt = Callable[[str, str, dict[str, str]], float]


def named(leaves: dict[str, str], rtt: Rtt, seconds: int = 10, with_topology: bool = True) -> set[tuple[str, str]]:
    buf = WindowBuffer()
    for sec in range(seconds):
        ts = T0 + sec
        for src in leaves:
            probes = [{"ts": ts, "peer": dst, "sent": 4, "lost": 0, "rtt_ms": rtt(src, dst, leaves)}
                      for dst in leaves if dst != src]
            batch = {"host": src, "sent_at": ts, "probes": probes, "hosts": [{"ts": ts, "cpu_pct": 30.0}]}
            if with_topology:
                batch["topology"] = {"rack": "r" + leaves[src][-1], "switch": leaves[src]}
            buf.add(batch)
    return {d.key for d in run_all(buf.window(T0 + seconds - 1), Thresholds())}


def healthy(a: str, b: str, leaves: dict[str, str]) -> float:
    return QUIET_MS


def one_path(a: str, b: str, leaves: dict[str, str]) -> float:
    return SLOW_MS if {a, b} == {"n02", "n07"} else QUIET_MS


def two_paths_of_one_node(a: str, b: str, leaves: dict[str, str]) -> float:
    return SLOW_MS if {a, b} in ({"n02", "n07"}, {"n02", "n11"}) else QUIET_MS


def a_node(a: str, b: str, leaves: dict[str, str]) -> float:
    return SLOW_MS if "n06" in (a, b) else QUIET_MS


def leaf_2_uplink(a: str, b: str, leaves: dict[str, str]) -> float:
    """Every pair that leaves leaf-2 is slow; inside leaf-2, and between the other leaves, all is fine."""
    return SLOW_MS if (leaves[a] == "leaf-2") != (leaves[b] == "leaf-2") else QUIET_MS


def between_leaves(a: str, b: str, leaves: dict[str, str]) -> float:
    return SLOW_MS if leaves[a] != leaves[b] else QUIET_MS


def between_leaves_busy_leaf_1(a: str, b: str, leaves: dict[str, str]) -> float:
    """Every cross pair is slow, and so are two of leaf-1's six inside pairs (pings queued at two busy nodes, as the
    testbed saw on two loaded cores): leaf-1 fails its own check, yet with two leaves every cross pair is shared."""
    return SLOW_MS if leaves[a] != leaves[b] or {a, b} in ({"n01", "n02"}, {"n03", "n04"}) else QUIET_MS


@pytest.mark.parametrize(("leaves", "rtt", "expected"), [
    pytest.param(THREE, healthy, set(), id="healthy mesh: nothing"),
    pytest.param(THREE, one_path, {("slow_link", "n02~n07")}, id="one bad path: that link only"),
    pytest.param(THREE, two_paths_of_one_node, {("slow_link", "n02~n07"), ("slow_link", "n02~n11")},
                 id="two bad paths of one node: the two links, not the node"),
    pytest.param(THREE, a_node, {("slow_link", "n06")}, id="every pair of one node: the node"),
    pytest.param(THREE, leaf_2_uplink, {("slow_link", "leaf-2")}, id="cross pairs of one leaf: the switch"),
    pytest.param(TWO, between_leaves, {("slow_link", "leaf-1~leaf-2")},
                 id="two leaves, every cross pair: the uplinks between them"),
    pytest.param(TWO, between_leaves_busy_leaf_1,
                 {("slow_link", "leaf-1~leaf-2")},
                 id="two leaves, every cross pair, one leaf busy inside: still the uplinks between them"),
    pytest.param(THREE, between_leaves, {("slow_link", "leaf-1~leaf-2~leaf-3")},
                 id="every leaf's cross pairs: the spine"),
])
def test_it_names_the_layer_the_bad_pairs_share(leaves: dict[str, str], rtt: Rtt,
                                                 expected: set[tuple[str, str]]) -> None:
    assert named(leaves, rtt) == expected


def test_without_topology_a_slow_leaf_is_not_a_storm_of_paths() -> None:
    # Nothing says n05..n08 share a switch. Each has 8 of its 11 pairs slow (73%, under the node bar) and is slow
    # with most of its other peers, so none of its pairs is "one bad path between two healthy nodes": the 32 cross
    # pairs must not become 32 path findings, and no node of a healthy leaf may be named.
    got = named(THREE, leaf_2_uplink, with_topology=False)
    assert all(h in {"n05", "n06", "n07", "n08"} for _, subject in got for h in subject.split("~")), got
    assert len(got) <= 4, got


def test_a_path_finding_names_the_layer_and_both_ends_health() -> None:
    buf = WindowBuffer()
    for sec in range(10):
        for src in THREE:
            buf.add({"host": src, "sent_at": T0 + sec, "probes": [
                {"ts": T0 + sec, "peer": dst, "sent": 4, "lost": 0, "rtt_ms": one_path(src, dst, THREE)}
                for dst in THREE if dst != src]})
    (d,) = run_all(buf.window(T0 + 9), Thresholds())
    assert (d.subject_type, d.node, d.peer_node) == ("link", "n02", "n07")
    m = d.evidence["metrics"]
    assert m["layer"] == "path" and m["rtt_ms"] == SLOW_MS and m["baseline_rtt_ms"] == QUIET_MS
    assert m["other_pairs"] == {"n02": {"pairs": 10, "bad": 0}, "n07": {"pairs": 10, "bad": 0}}
    assert "ECMP" in d.action and "route" in d.action


def test_a_switch_finding_lists_its_nodes_and_the_inside_rtt() -> None:
    buf = WindowBuffer()
    for sec in range(10):
        for src in THREE:
            buf.add({"host": src, "sent_at": T0 + sec, "topology": {"switch": THREE[src]}, "probes": [
                {"ts": T0 + sec, "peer": dst, "sent": 4, "lost": 0, "rtt_ms": leaf_2_uplink(src, dst, THREE)}
                for dst in THREE if dst != src]})
    (d,) = run_all(buf.window(T0 + 9), Thresholds())
    m = d.evidence["metrics"]
    assert (d.subject_type, d.subject, d.node) == ("switch", "leaf-2", None)
    assert m["nodes"] == ["n05", "n06", "n07", "n08"] and m["grouped_by"] == "switch"
    assert m["rtt_ms"] == SLOW_MS and m["inside_rtt_ms"] == QUIET_MS and m["inside_bad_frac"] == 0.0
    assert "uplink" in d.action


def test_one_slow_round_is_not_a_path() -> None:
    # The pair is slow in one second only (one ping burst queued behind a bulk transfer): not persistent.
    buf = WindowBuffer()
    for sec in range(10):
        for src in THREE:
            buf.add({"host": src, "sent_at": T0 + sec, "probes": [
                {"ts": T0 + sec, "peer": dst, "sent": 4, "lost": 0,
                 "rtt_ms": SLOW_MS if {src, dst} == {"n02", "n07"} and sec == 9 else QUIET_MS}
                for dst in THREE if dst != src]})
    assert run_all(buf.window(T0 + 9), Thresholds()) == []
