"""One slow path between two healthy nodes, on the real testbed: the link is named, not either node.

Four namespaces with real agents probing each other (no training job: a path fault shows in the probes alone, and
leaving torch out keeps this under a minute), pings only: a delay is a latency fault, and bulk transfers measured
on a shared two-core machine are the rate-limit scenario's business (test_faults.py), not this one's. NFQUEUE holds
only what node-c sends into node-b, so both directions of that pair's round trip are delayed and every other pair
of both nodes stays fast, which is what an ECMP route over a bad spine link looks like. The pass must name
``node-b~node-c`` and nothing else.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from netns_testbed import Testbed, run
from netns_watch import FAULT_KINDS, Watch, describe, probe_rounds, wait_for

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(120)]

DELAY_MS = 30


def _delay_path(bed: Testbed, into: str, sender: str, program: Path, queue: int = 1) -> None:
    """Hold the packets ``sender`` sends into ``into`` for DELAY_MS; the rest of ``into``'s traffic passes."""
    node = bed.node(into)
    proc = bed.spawn(node, [str(program), str(queue), str(DELAY_MS)], "path.delay.log", stdin=subprocess.PIPE)
    wait_for(lambda: "ready" in bed.log("path.delay.log") or proc.poll() is not None, 10, "the delay program")
    assert proc.poll() is None, bed.log("path.delay.log")
    run("ip", "netns", "exec", node.ns, "iptables", "-A", "INPUT", "-i", "eth0", "-s", bed.node(sender).addr,
        "-j", "NFQUEUE", "--queue-num", str(queue), "--queue-bypass")


def _rounds_since(cluster, since: float) -> dict[str, int]:
    """node -> distinct seconds since ``since`` in which its agent reported probes."""
    return probe_rounds(cluster, since)


def test_a_delay_on_one_path_between_two_healthy_nodes_names_that_link(site, bed: Testbed, delay_program,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    config = Testbed._agent_config
    monkeypatch.setattr(Testbed, "_agent_config",
                        lambda self, *args: config(self, *args).replace(f"bulk_bytes = {4 << 20}", "bulk_bytes = 0"))
    bed.start_agents(site.server.url, site.token)
    watch = Watch(site.cluster, bed, "paths")
    settled = time.time() + 2  # the agents' first rounds run while all four start on two cores
    wait_for(lambda: (r := _rounds_since(site.cluster, settled)) and len(r) == len(bed.nodes)
             and min(r.values()) >= 3, 60, "3 probe rounds from every agent", bed)
    healthy = [d for d in watch.diagnose() if d.kind in FAULT_KINDS]
    assert not healthy, f"a healthy cluster was diagnosed: {[describe(d) for d in healthy]}\n{watch.seen()}"

    since = time.time()
    _delay_path(bed, "node-b", "node-c", delay_program)
    out = watch.until("slow_link", "node-b~node-c", since, timeout=60,
                      accept=lambda d: (d.evidence["metrics"]["rtt_ms"] or 0) > DELAY_MS * 0.8)
    seen = watch.seen()
    print(f"\n[paths] named after {out.seconds:.1f} s in {len(out.passes)} pass(es): "
          f"{describe(out.detection) if out.detection else None}\n{seen}")
    assert out.detection is not None, f"never named the path; last pass: {[describe(d) for d in out.last()]}\n{seen}"
    d = out.detection
    assert (d.subject_type, d.node, d.peer_node) == ("link", "node-b", "node-c")
    assert d.evidence["metrics"]["layer"] == "path" and "ECMP" in d.action
    wrong = [f"after {at:.1f} s: {describe(x)}" for at, found in out.passes for x in found
             if x.kind in FAULT_KINDS and x.key != ("slow_link", "node-b~node-c")]
    assert not wrong, "also named:\n" + "\n".join(wrong) + f"\n{seen}"
