"""Two racks of four nodes: a slow rack uplink names the uplink, a slow path between racks names that link.

Eight namespaces, node-a..d on rack-1's bridge (leaf-1), node-e..h on rack-2's (leaf-2), the bridges joined by one
veth pair, the uplink; the agents post over a separate management bridge, so shaping the uplink slows only the
node-to-node traffic (``netns_testbed``). Each agent reports its rack and leaf and probes the seven others (pings
each second and a 4 MiB bulk transfer a second, to its peers in turn). No training job: these faults show in the
probes alone, and eight ranks would not fit two shared cores.

Each test watches the healthy cluster for several diagnosis passes (nothing may be named), injects one fault and
runs the pass about once a second until the expected subject is named; no pass may name anything else. What each
pass saw is printed (``-s``) and is the failure message.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from netns_testbed import Testbed, remove_stale, run
from netns_watch import FAULT_KINDS, Watch, check_named, describe, wait_for

from tests.conftest import service_missing

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(150)]

UPLINK = "leaf-1~leaf-2"  # with two racks, neither leaf's uplink can be told from the other's: both are named
HEALTHY_PASSES = 5


@pytest.fixture
def bed(tmp_path: Path, delay_program: Path) -> Iterator[Testbed]:
    """The two-rack testbed in place of conftest's four nodes (the ``site`` fixture serves whichever ``bed``)."""
    remove_stale()
    testbed = Testbed(tmp_path, racks=2, per_rack=4)
    try:
        try:
            testbed.build()
        except RuntimeError as exc:
            service_missing(f"cannot build the testbed here: {exc}")
        yield testbed
    finally:
        testbed.close()
    assert testbed.leftovers() == [], "the testbed left namespaces or links behind"


def _healthy(site: Any, bed: Testbed, name: str) -> Watch:
    """Agents up, every one has made three bulk rounds, the server knows every node's rack, and several passes over
    the healthy cluster name nothing."""
    from dashboard.telemetry.models import Node

    t0 = time.monotonic()
    # Samples every 0.5 s, under the 1 s probe round: the probes source reports only its newest finished round at
    # each sample, and sampling once a second lost every bulk round of some agents for good.
    bed.start_agents(site.server.url, site.token)
    watch = Watch(site.cluster, bed, name)
    settled = time.time() + 2  # eight agents starting on two cores: their first rounds are not a steady state
    try:
        wait_for(lambda: (r := watch.bulk_rounds_since(settled)) and len(r) == len(bed.nodes)
                 and min(r.values()) >= 3, 60, "3 bulk probe rounds from every agent", bed)
    except AssertionError as exc:
        raise AssertionError(f"bulk rounds: {watch.bulk_rounds_since(settled)}\n{watch.seen()}\n{exc}") from None
    places = dict(Node.objects.filter(cluster=site.cluster).values_list("hostname", "switch"))
    assert places == {n.name: n.switch for n in bed.nodes}, places
    warm = time.monotonic() - t0
    for _ in range(HEALTHY_PASSES):
        started = time.monotonic()
        found = [d for d in watch.diagnose() if d.kind in FAULT_KINDS]
        assert not found, f"a healthy cluster was diagnosed: {[describe(d) for d in found]}\n{watch.seen()}"
        time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
    print(f"\n[{name}] warm-up {warm:.1f} s, then {HEALTHY_PASSES} healthy passes named nothing")
    return watch


def test_a_rate_limit_on_the_rack_uplink_names_the_uplink_not_its_nodes(site, bed: Testbed) -> None:
    watch = _healthy(site, bed, "uplink")
    since = time.time()
    bed.limit_uplink("100mbit")
    # Named on bulk bandwidth (100 Mb/s shared by the cross-rack transfers), or on the RTT of pings queued behind
    # those transfers in the uplink's shaper: either way the evidence must show the uplink, with the inside fine. The
    # first pass after the limit may still count transfers that began before it (a median of 0.38 Gb/s was seen),
    # so the evidence is awaited, and no pass meanwhile may name anything else (a leaf alone, a node).
    out = watch.until("slow_link", UPLINK, since, timeout=45, accept=_shows_the_uplink)
    check_named(watch, out, {("slow_link", UPLINK)})
    d = out.detection
    metrics = d.evidence["metrics"]
    assert d.subject_type == "switch" and d.node is None and metrics["nodes"] == [n.name for n in bed.nodes], metrics
    assert metrics["groups"] == ["leaf-1", "leaf-2"], metrics


def _shows_the_uplink(d: Any) -> bool:
    m = d.evidence["metrics"]
    if "bw_gbps" in m:
        return bool(m["bw_gbps"] < 0.12 < 0.5 < m["inside_bw_gbps"])
    return bool(m["rtt_ms"] > 5 * max(m["inside_rtt_ms"], 0.2))


def test_a_delay_on_one_path_between_racks_names_that_link(site, bed: Testbed, delay_program: Path) -> None:
    watch = _healthy(site, bed, "xpath")
    since = time.time()
    bed.add_delay("node-b", 30, delay_program, queue=1, source="node-f")  # what node-f sends into node-b
    out = watch.until("slow_link", "node-b~node-f", since, timeout=45,
                      accept=lambda d: (d.evidence["metrics"]["rtt_ms"] or 0) > 24)
    check_named(watch, out, {("slow_link", "node-b~node-f")})
    d = out.detection
    assert (d.subject_type, d.node, d.peer_node) == ("link", "node-b", "node-f")
    assert d.evidence["metrics"]["layer"] == "path"


def test_a_crashed_two_rack_testbed_is_removed_whole(tmp_path: Path, bed: Testbed) -> None:
    """Rack bridges, the uplink, the management bridge and every node's two veths match the sweep's names."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    crashed = Testbed(tmp_path / "crashed", owner=int(gone.stdout), racks=2, per_rack=4)
    (tmp_path / "crashed").mkdir()
    try:
        crashed.build(link_rate=None)
        crashed.limit_uplink("10mbit")
        stale = crashed.leftovers()
        assert len(stale) == 8 * 3 + 3 + 2  # namespaces and their two host ends; r1, r2, mg; u1, u2
        assert all(len(name) < 16 for name in stale)
        live = bed.leftovers()

        removed = remove_stale()

        assert set(removed) >= set(stale) and crashed.leftovers() == []
        assert f"10.78.{crashed.subnet}." not in run("ip", "-4", "-o", "addr", "show").stdout
        assert bed.leftovers() == live
    finally:
        crashed.close()
