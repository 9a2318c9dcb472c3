"""A RoCE retransmit storm on one node, through the real agents: each node's IB source reads a stand-in
``/sys/class/infiniband`` (a copy of a captured RoCE port: link layer Ethernet, the PMA counters and the mlx5
``hw_counters``), and while the agents run, one node's counters grow as they do in a storm on a lossy traffic
class: out-of-sequence packets and sequence-error NAKs, local ACK timeouts and RNR retries running out, slow
restarts, CNPs sent and handled, transmit wait (PFC pauses). The other nodes' ports only carry data. The diagnosis
must name congestion on that node, and nothing else.

Agents only (no training job): the storm is in the counters, which is all the detector reads.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from netns_watch import FAULT_KINDS, Watch, describe, wait_for

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(90)]

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sys" / "class_infiniband_t0"
HCA = "mlx5_2"  # the fixture's RoCE HCA (its others are InfiniBand, one of them down): each node gets this one alone
PORT = f"{HCA}/ports/1"
# Per second on the storm node; the detector's limits (detectors/congestion.py) are 10/s for loss, 0.1/s for
# timeouts, 5000/s for CNPs and 1e6/s of transmit wait.
STORM = {"hw_counters/out_of_sequence": 400, "hw_counters/packet_seq_err": 300, "hw_counters/roce_slow_restart": 20,
         "hw_counters/local_ack_timeout_err": 3, "hw_counters/rnr_nak_retry_err": 2, "hw_counters/np_cnp_sent": 20_000,
         "hw_counters/rp_cnp_handled": 15_000, "counters/port_xmit_wait": 40_000_000}
TRAFFIC = {"counters/port_xmit_data": 25_000_000, "counters/port_rcv_data": 25_000_000,
           "counters/port_xmit_packets": 100_000, "counters/port_rcv_packets": 100_000}
WIDTH = 20  # counters are rewritten in place at a fixed width: the agent holds the files open and re-reads them


def _stand_in(root: Path) -> Path:
    shutil.copytree(FIXTURE / HCA, root / HCA)
    for name in (*STORM, *TRAFFIC):
        _write(root / PORT / name, 1000)
    return root


def _write(path: Path, value: int) -> None:
    # pwrite over the same bytes, never truncate-and-write: a read between the two would see an empty counter.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        os.pwrite(fd, f"{value:>{WIDTH}}\n".encode(), 0)
    finally:
        os.close(fd)


class Counters(threading.Thread):
    """Grows each stand-in tree's counters every 0.2 s: traffic on every node, the storm on ``storm_on`` once set."""

    def __init__(self, roots: dict[str, Path]) -> None:
        super().__init__(daemon=True)
        self.roots, self.storm_on = roots, ""
        self.stop = threading.Event()
        self.values = {(n, c): 1000.0 for n in roots for c in (*STORM, *TRAFFIC)}  # fractions carry over

    def run(self) -> None:
        while not self.stop.wait(0.2):
            for node, root in self.roots.items():
                rates = {**TRAFFIC, **(STORM if node == self.storm_on else {})}
                for name, per_s in rates.items():
                    self.values[(node, name)] += per_s * 0.2
                    _write(root / PORT / name, int(self.values[(node, name)]))


def _ports_from(cluster, since: float) -> set[str]:
    from datetime import UTC, datetime

    from dashboard.telemetry.models import PortSample

    return set(PortSample.objects.filter(node__cluster=cluster, ts__gte=datetime.fromtimestamp(since, tz=UTC))
               .values_list("node__hostname", flat=True))


def test_a_roce_counter_storm_on_one_node_is_named_congestion_on_that_node(site, bed, tmp_path: Path) -> None:
    roots = {n.name: _stand_in(tmp_path / f"{n.name}.sys") for n in bed.nodes}
    counters = Counters(roots)
    counters.start()
    try:
        bed.start_agents(site.server.url, site.token, probes={"bulk_bytes": 0}, ib_roots=roots)
        watch = Watch(site.cluster, bed, "none")
        started = time.time()
        # A few samples of every node's healthy port first (the detector wants growth in several samples).
        wait_for(lambda: _ports_from(site.cluster, started) == {n.name for n in bed.nodes}, 30,
                 "port samples from every agent", bed)
        time.sleep(3)
        healthy = watch.diagnose()
        print(f"\n[roce] healthy pass: {[d.key for d in healthy]}")
        assert not [d for d in healthy if d.kind in (*FAULT_KINDS, "congestion")], [describe(d) for d in healthy]

        since = time.time()
        counters.storm_on = "node-b"
        # Until every class of the storm shows: the loss counters cross their limit first, the timeouts (a few a
        # second) need three samples that grew.
        out = watch.until("congestion", "node-b", since, timeout=20,
                          accept=lambda d: {"loss", "timeouts"} <= set(d.evidence["metrics"]["classes"]))
    finally:
        counters.stop.set()
        counters.join(5)
    print(f"[roce] congestion on node-b after {out.seconds:.1f} s in {len(out.passes)} pass(es): "
          f"{describe(out.detection) if out.detection else None}")
    assert out.detection is not None, f"never named; last pass: {[describe(d) for d in out.last()]}\n" + \
        "\n".join(bed.log(f"{n.name}.agent.log", 600) for n in bed.nodes)
    m = out.detection.evidence["metrics"]
    assert out.detection.subject_type == "node" and out.detection.severity == "error", describe(out.detection)
    assert {"loss", "timeouts"} <= set(m["classes"]) and m["fabric"] == "roce", m
    (port,) = m["ports"]
    assert port["port"] == "mlx5_2:1" and port["counters"]["hw.out_of_sequence"] > 0, port
    # The storm's rates, as the agent's deltas carry them: 700/s (the newest 6 s may still hold a healthy sample or
    # two, and the thread's 0.2 s ticks jitter on a busy machine).
    assert 150 <= port["per_s"]["loss"] <= 1400, port["per_s"]
    assert "PFC" in out.detection.action and "NCCL_IB_TC" in out.detection.action, out.detection.action
    wrong = [f"after {at:.1f} s: {describe(d)}" for at, found in out.passes for d in found
             if (d.kind in FAULT_KINDS or d.kind == "congestion") and d.key != ("congestion", "node-b")]
    assert not wrong, "also named:\n" + "\n".join(wrong)
