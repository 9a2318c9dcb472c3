"""A rank launched with an NCCL_SOCKET_IFNAME its node does not have, on the four-node testbed: the node's real agent
reports its interfaces (eth0 with its address, lo), the rank's hooks report its NCCL_* environment, and the NCCL audit
names that node with its real interfaces and the fix; nothing else is named.

The job runs over gloo (GLOO_SOCKET_IFNAME=eth0), which ignores NCCL_SOCKET_IFNAME: the ranks keep stepping, as a
real job does until NCCL initialises, and the finding comes from what the node reports, not from a crash."""

from __future__ import annotations

import time

import pytest
from netns_testbed import Testbed
from netns_watch import FAULT_KINDS, Watch, describe, wait_for

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(90)]


def test_a_wrong_socket_ifname_is_named_with_the_nodes_real_interfaces(site, bed: Testbed) -> None:
    t0 = time.monotonic()
    bed.start_agents(site.server.url, site.token)
    bed.start_job("ifname", env={1: {"NCCL_SOCKET_IFNAME": "ib9"}})  # rank 1 runs on node-b
    watch = Watch(site.cluster, bed, "ifname")
    wait_for(lambda: len(watch.last_steps()) == len(bed.nodes), 60, "steps from every rank", bed)
    addr = bed.node("node-b").addr
    out = watch.until("nccl_config", "node-b", time.time(), accept=lambda d: f"eth0 up {addr}/" in d.title)
    found = [d for _, ds in out.passes for d in ds]
    print(f"\n[ifname] named after {time.monotonic() - t0:.1f} s: "
          f"{describe(out.detection) if out.detection else None}\n{watch.seen()}")
    assert out.detection is not None, f"never named; last pass: {[describe(d) for d in out.last()]}"
    det = out.detection
    assert det.severity == "error" and det.title.startswith("NCCL_SOCKET_IFNAME=ib9 selects none of the node's "
                                                            f"interfaces (eth0 up {addr}/"), det.title
    assert "set NCCL_SOCKET_IFNAME=eth0" in det.action
    assert [r["rule"] for r in det.evidence["metrics"]["rules"]] == ["socket_ifname_missing"]
    # Besides the audit on node-b, only the drift of rank 1's setting from the other ranks' may be said (it is the
    # same fault, on the same node); no other node, and no fault of another kind.
    wrong = [describe(d) for d in found if d.kind in FAULT_KINDS or (d.kind == "nccl_config" and d.node != "node-b")]
    assert not wrong, "also named:\n" + "\n".join(wrong)
