"""A rate-limited leaf uplink shows in bulk transfers only (idle RTT stays quiet): the switch is named, not its nodes.

Every node pings every other node each second and, as the agent does, sends one bulk transfer a second to its peers
in turn, never two into one node at once; ``bw(a, b)`` says what each transfer measures. The whole diagnosis
(:func:`run_all`) runs on the window, so a test also sees that no node and no single path is named instead.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dashboard.diagnosis.detectors import Thresholds, run_all
from dashboard.diagnosis.detectors.buffer import WindowBuffer
from dashboard.diagnosis.detectors.paths import contended

T0 = 1_760_000_000.0
QUIET_MS = 0.05
LINK_GBPS = 1.0
LIMITED_GBPS = 0.08  # four nodes' cross transfers sharing a 100 Mb/s uplink

# Three leaves of four nodes: leaf-1 (n01..n04), leaf-2 (n05..n08), leaf-3 (n09..n12).
THREE = {f"n{i:02d}": f"leaf-{(i - 1) // 4 + 1}" for i in range(1, 13)}
TWO = {h: leaf for h, leaf in THREE.items() if leaf != "leaf-3"}

Bw = Callable[[str, str, dict[str, str], int], float]


def named(leaves: dict[str, str], bw: Bw, seconds: int = 12) -> list:
    buf = WindowBuffer()
    for sec in range(seconds):
        ts = T0 + sec
        for i, src in enumerate(sorted(leaves)):
            peers = sorted(h for h in leaves if h != src)
            bulk = peers[(i + sec) % len(peers)]  # each node receives one transfer a second (contention: below)
            probes = [{"ts": ts, "peer": dst, "sent": 4, "lost": 0, "rtt_ms": QUIET_MS,
                       **({"bw_gbps": bw(src, dst, leaves, sec)} if dst == bulk else {})} for dst in peers]
            buf.add({"host": src, "sent_at": ts, "probes": probes, "hosts": [{"ts": ts, "cpu_pct": 30.0}],
                     "topology": {"rack": "r" + leaves[src][-1], "switch": leaves[src]}})
    return run_all(buf.window(T0 + seconds - 1), Thresholds())


def keys(leaves: dict[str, str], bw: Bw) -> set[tuple[str, str]]:
    return {d.key for d in named(leaves, bw)}


def healthy(a: str, b: str, leaves: dict[str, str], sec: int) -> float:
    # Now and then a transfer comes out slow (another transfer to the same node, a busy CPU): noise, not a fault.
    return 0.3 if (sec + ord(a[-1]) + ord(b[-1])) % 5 == 0 else LINK_GBPS


def leaf_2_limited(a: str, b: str, leaves: dict[str, str], sec: int) -> float:
    return LIMITED_GBPS if (leaves[a] == "leaf-2") != (leaves[b] == "leaf-2") else LINK_GBPS


def between_leaves(a: str, b: str, leaves: dict[str, str], sec: int) -> float:
    return LIMITED_GBPS if leaves[a] != leaves[b] else LINK_GBPS


def one_node(a: str, b: str, leaves: dict[str, str], sec: int) -> float:
    return LIMITED_GBPS if "n06" in (a, b) else LINK_GBPS


def one_pair(a: str, b: str, leaves: dict[str, str], sec: int) -> float:
    return LIMITED_GBPS if {a, b} == {"n02", "n07"} else LINK_GBPS


@pytest.mark.parametrize(("leaves", "bw", "expected"), [
    pytest.param(THREE, healthy, set(), id="healthy, noisy transfers: nothing"),
    pytest.param(THREE, leaf_2_limited, {("slow_link", "leaf-2")}, id="one leaf's way out narrow: that switch"),
    pytest.param(TWO, between_leaves, {("slow_link", "leaf-1~leaf-2")},
                 id="two leaves, the uplink between them narrow: the uplinks, no node"),
    pytest.param(THREE, one_node, {("slow_link", "n06")}, id="one node's transfers narrow: the node, not its leaf"),
])
def test_bulk_bandwidth_names_the_layer_the_narrow_transfers_share(leaves: dict[str, str], bw: Bw,
                                                                     expected: set[tuple[str, str]]) -> None:
    assert keys(leaves, bw) == expected


def test_one_narrow_pair_is_no_switch() -> None:
    assert not [k for k in keys(THREE, one_pair) if k[1].startswith("leaf")]


def test_a_narrow_uplink_finding_carries_the_transfers_not_the_idle_rtt() -> None:
    (d,) = named(TWO, between_leaves)
    m = d.evidence["metrics"]
    assert (d.subject_type, d.node, d.peer_node) == ("switch", None, None)
    assert m["nodes"] == sorted(TWO) and m["layer"] == "switch_uplink"
    assert m["bw_gbps"] == LIMITED_GBPS and m["inside_bw_gbps"] == LINK_GBPS and m["cross_bad_frac"] == 1.0
    assert m["rtt_ms"] == m["inside_rtt_ms"] == QUIET_MS  # idle RTT does not show a rate limit
    assert "bulk bandwidth 0.08 Gb/s" in d.title


def test_a_starved_moment_slowing_every_transfer_is_no_uplink() -> None:
    # The last three seconds every transfer is slow, inside the leaves too (a CPU-starved host, a burst of transfers
    # colliding): the inside transfers of those same seconds are the comparison, not older fast ones.
    def starved(a: str, b: str, leaves: dict[str, str], sec: int) -> float:
        return 0.4 if sec >= 9 else LINK_GBPS

    assert not [k for k in keys(TWO, starved) if k[1].startswith("leaf")]


def test_transfers_colliding_at_one_receiver_are_no_uplink() -> None:
    # Every second, the four nodes of leaf-1 send their transfer to the same node of leaf-2 at the same moment (agents
    # that probe in step): each measures a quarter of the receiver's link. That is contention at one node, not a
    # narrow uplink; the same transfers one at a time run at the link's rate.
    buf = WindowBuffer()
    for sec in range(12):
        ts = T0 + sec
        target = f"n{5 + sec % 4:02d}"
        for src in TWO:
            peers = sorted(h for h in TWO if h != src)
            probes = [{"ts": ts + 0.01 * int(src[1:]), "peer": dst, "sent": 4, "lost": 0, "rtt_ms": QUIET_MS,
                       **({"bw_gbps": 0.25} if TWO[src] == "leaf-1" and dst == target else {})} for dst in peers]
            buf.add({"host": src, "sent_at": ts, "probes": probes, "topology": {"switch": TWO[src]}})
        buf.add({"host": "n06", "sent_at": ts, "probes": [{"ts": ts + 0.5, "peer": "n07", "sent": 4, "lost": 0,
                                                           "rtt_ms": QUIET_MS, "bw_gbps": LINK_GBPS}]})
    window = buf.window(T0 + 11)
    assert not [d.key for d in run_all(window, Thresholds()) if d.subject.startswith("leaf")]
    # All 48 of leaf-1's transfers shared their receiver; the lone one inside leaf-2 did not.
    assert contended(window).sum() == 4 * 12


def test_two_leaves_share_their_uplink_even_when_one_leafs_inside_is_noisy() -> None:
    # Leaf-1's own transfers are slow too for the last seconds (contention at its nodes): that cannot make the one
    # uplink between two leaves leaf-2's alone.
    def noisy(a: str, b: str, leaves: dict[str, str], sec: int) -> float:
        if leaves[a] != leaves[b]:
            return LIMITED_GBPS
        return 0.4 if leaves[a] == "leaf-1" and sec >= 9 else LINK_GBPS

    assert keys(TWO, noisy) == {("slow_link", "leaf-1~leaf-2")}
