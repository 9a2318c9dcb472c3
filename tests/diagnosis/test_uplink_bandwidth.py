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


# -- pings queued behind narrow transfers: the onset of a rate limit, pass by pass --------------------------------------

ONSET = 8  # the fault starts at this second; a diagnosis pass runs every second from then on
QUEUED_MS = 15.0  # a ping that waited in the shaper behind the transfers (the testbed saw 7-21 ms at 100 Mb/s)
DELAY_MS = 30.0

Rtt = Callable[[str, str, dict[str, str], int], float]


def passes(leaves: dict[str, str], bw: Bw, rtt: Rtt, bulk_every: int, seconds: int = 16,
           in_step_until: int = 0) -> list[set[tuple[str, str]]]:
    """What each pass names from the onset on, the mesh growing by one second between passes, as the server's
    schedule sees it. Pings each second; a bulk transfer every ``bulk_every`` seconds per node, staggered, to its
    peers in turn (the testbeds: every 3 s on two racks, every second on one bridge). So the uplink and node rules
    get their seconds of narrow transfers only seconds after the onset, while a pair's pings are slow from its first
    round. From the onset to second ``in_step_until`` the agents send in step instead, as agents started together
    do: all in the same second, each its n-th transfer to its n-th peer, so several land on one node at once."""
    buf = WindowBuffer()
    out = []
    for sec in range(seconds):
        ts = T0 + sec
        in_step = ONSET <= sec < in_step_until
        for i, src in enumerate(sorted(leaves)):
            peers = sorted(h for h in leaves if h != src)
            turn, due = divmod(sec if in_step else sec + i, bulk_every)
            bulk = peers[turn % len(peers)] if due == 0 else None
            # In step, the rounds (and the transfers that end them) end a few ms apart: within CONTENDED_S.
            end = ts + 0.02 * i if in_step else ts
            probes = [{"ts": end, "peer": dst, "sent": 4, "lost": 0, "rtt_ms": rtt(src, dst, leaves, sec),
                       **({"bw_gbps": bw(src, dst, leaves, sec)} if dst == bulk else {})} for dst in peers]
            buf.add({"host": src, "sent_at": end, "probes": probes, "hosts": [{"ts": ts, "cpu_pct": 30.0}],
                     "topology": {"rack": "r" + leaves[src][-1], "switch": leaves[src]}})
        if sec >= ONSET:
            out.append({d.key for d in run_all(buf.window(ts), Thresholds())})
    return out


def test_a_crossing_pair_queued_behind_a_narrow_uplink_is_the_uplink_not_a_path() -> None:
    # The uplink between the two leaves is rate-limited from ONSET: every transfer across it is narrow, and one
    # crossing pair's pings keep landing behind those transfers in the shaper's queue (agents probe in step, so the
    # same pair for rounds on end). The pair is slow in every one of its newest probes while both its ends are fine
    # with everyone else: the path rule's pattern, a second or two before the uplink rule has its three seconds of
    # narrow transfers. That pair is the uplink's queue, not a bad route: no pass may name it.
    def limited(a: str, b: str, leaves: dict[str, str], sec: int) -> float:
        return LIMITED_GBPS if sec >= ONSET and leaves[a] != leaves[b] else LINK_GBPS

    def queued(a: str, b: str, leaves: dict[str, str], sec: int) -> float:
        return QUEUED_MS if sec >= ONSET and {a, b} == {"n02", "n07"} else QUIET_MS

    got = passes(TWO, limited, queued, bulk_every=3)
    assert all(found <= {("slow_link", "leaf-1~leaf-2")} for found in got), got
    assert got[-1] == {("slow_link", "leaf-1~leaf-2")}, got


def test_a_crossing_pair_queued_behind_transfers_sent_in_step_is_the_uplink_not_a_path() -> None:
    # As the testbed caught it: the first round of transfers after the onset is sent in step, four at a time into one
    # node across the uplink, so every one of them shared its receiver (contended) and the uplink rule, which leaves
    # those out, waits for the later, lone ones. The four at once share the 100 Mb/s: a quarter of it each, far less
    # than a quarter of the receiver's link. The crossing pair queued behind them is the uplink's, not a path.
    def limited(a: str, b: str, leaves: dict[str, str], sec: int) -> float:
        if sec < ONSET or leaves[a] == leaves[b]:
            return LINK_GBPS
        return LIMITED_GBPS / 4 if sec < ONSET + 3 else LIMITED_GBPS

    def queued(a: str, b: str, leaves: dict[str, str], sec: int) -> float:
        return QUEUED_MS if sec >= ONSET and {a, b} == {"n02", "n07"} else QUIET_MS

    got = passes(TWO, limited, queued, bulk_every=3, in_step_until=ONSET + 3)
    assert all(found <= {("slow_link", "leaf-1~leaf-2")} for found in got), got
    assert got[-1] == {("slow_link", "leaf-1~leaf-2")}, got


def test_a_pair_queued_behind_a_narrow_node_link_is_the_node_not_a_path() -> None:
    # n06's own link is rate-limited (tbf on its veth): its transfers are narrow and one of its pairs' pings wait
    # behind them. The node rule names n06 once it has its rounds of transfers; before that, no pass may name the
    # path n01~n06 instead.
    def limited(a: str, b: str, leaves: dict[str, str], sec: int) -> float:
        return LIMITED_GBPS if sec >= ONSET and "n06" in (a, b) else LINK_GBPS

    def queued(a: str, b: str, leaves: dict[str, str], sec: int) -> float:
        return QUEUED_MS if sec >= ONSET and {a, b} == {"n01", "n06"} else QUIET_MS

    got = passes(THREE, limited, queued, bulk_every=1)
    assert all(found <= {("slow_link", "n06")} for found in got), got
    assert got[-1] == {("slow_link", "n06")}, got


@pytest.mark.parametrize("bulk_every", [3, 1])
def test_a_delayed_path_is_named_though_its_own_transfers_are_narrow(bulk_every: int) -> None:
    # A genuinely bad route between n02 and n07: 30 ms on every ping, and its own transfers come out narrow (TCP's
    # slow start over 30 ms). Every other transfer, across the uplink too, is as healthy (and as noisy: one in five
    # comes out slow, so with a transfer a second each pass sees one or two near the pair) as before: nothing else
    # loads the pair's links, so it is the path.
    def delayed_bw(a: str, b: str, leaves: dict[str, str], sec: int) -> float:
        return LIMITED_GBPS if sec >= ONSET and {a, b} == {"n02", "n07"} else healthy(a, b, leaves, sec)

    def delayed(a: str, b: str, leaves: dict[str, str], sec: int) -> float:
        return DELAY_MS if sec >= ONSET and {a, b} == {"n02", "n07"} else QUIET_MS

    got = passes(TWO, delayed_bw, delayed, bulk_every)
    assert all(found <= {("slow_link", "n02~n07")} for found in got), got
    assert got[-1] == {("slow_link", "n02~n07")}, got


def _crossing_only(bw: Bw, seconds: int, bulk_every: int = 1) -> WindowBuffer:
    """The two leaves' mesh where n08's bulk transfers are all with nodes of the other leaf (it sends only across,
    and its own leaf sends it none): which peers get a transfer is the agents' rotation, chance as far as the fabric
    goes."""
    buf = WindowBuffer()
    for sec in range(seconds):
        ts = T0 + sec
        for i, src in enumerate(sorted(TWO)):
            peers = sorted(h for h in TWO if h != src)
            across = [h for h in peers if TWO[h] != TWO[src]]
            rotation = across if src == "n08" else [h for h in peers if h != "n08" or TWO[src] != TWO["n08"]]
            turn, due = divmod(sec + i, bulk_every)
            bulk = None if due else rotation[turn % len(rotation)]
            probes = [{"ts": ts, "peer": dst, "sent": 4, "lost": 0, "rtt_ms": QUIET_MS,
                       **({"bw_gbps": bw(src, dst, TWO, sec)} if dst == bulk else {})} for dst in peers]
            buf.add({"host": src, "sent_at": ts, "probes": probes, "hosts": [{"ts": ts, "cpu_pct": 30.0}],
                     "topology": {"rack": "r" + TWO[src][-1], "switch": TWO[src]}})
    return buf


@pytest.mark.parametrize("bulk_every", [3, 1])
def test_a_node_whose_transfers_all_crossed_a_narrow_uplink_is_left_to_the_switch_rule(bulk_every: int) -> None:
    # The uplink between the leaves is narrow, so every one of n08's transfers is slow, against several peers: the
    # node rule's own test of a narrow node. But the other nodes' transfers across the uplink are slow too, so they
    # say as much of the uplink; the node rule alone (before the switch rule has its seconds, as seen on the netns
    # testbed: "slow_link node-h" beside the uplink) must not name n08. A narrow node link leaves the others' cross
    # transfers healthy: that node is still named by the node rule alone.
    from dashboard.diagnosis.detectors.network import slow_links

    uplink = _crossing_only(between_leaves, 12, bulk_every).window(T0 + 11)
    assert not slow_links(uplink, Thresholds(), set())

    def n08_narrow(a: str, b: str, leaves: dict[str, str], sec: int) -> float:
        return LIMITED_GBPS if "n08" in (a, b) else LINK_GBPS

    node = _crossing_only(n08_narrow, 12, bulk_every).window(T0 + 11)
    assert [d.subject for d in slow_links(node, Thresholds(), set())] == ["n08"]
    assert {d.key for d in run_all(node, Thresholds())} == {("slow_link", "n08")}
