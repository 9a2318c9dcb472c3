"""A RoCE counter storm, end to end: a stand-in ``/sys/class/infiniband`` per node read by the real IB source, its
port samples posted as wire batches to the ingest API, the diagnosis pass over the database, and the finding's
evidence chart. Only node-b's NIC sees retransmits and out-of-sequence packets; three quiet nodes stay quiet."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from collectors.agent.source import Collected
from collectors.sources.ib import IbSource
from tests.server.conftest import post

pytestmark = pytest.mark.django_db

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sys"
NODES = ("node-a", "node-b", "node-c", "node-d")
STORM = {"hw_counters/packet_seq_err": 400, "hw_counters/out_of_sequence": 300}
BACKGROUND = {"counters/port_xmit_data": 10**8, "counters/port_xmit_wait": 5000, "hw_counters/np_cnp_sent": 20}


def _tree(root: Path) -> Path:
    """One RoCE port: the healthy HCA of the checked-in snapshot, its link layer Ethernet."""
    shutil.copytree(FIXTURES / "class_infiniband_t0" / "mlx5_0", root / "mlx5_0")
    (root / "mlx5_0" / "ports" / "1" / "link_layer").write_text("Ethernet\n")
    return root


def _bump(root: Path, counters: dict[str, int]) -> None:
    """Counters grow in place, as the kernel updates the files."""
    for rel, by in counters.items():
        path = root / "mlx5_0" / "ports" / "1" / rel
        path.write_text(f"{int(path.read_text()) + by}\n")


def test_a_counter_storm_in_sysfs_becomes_a_congestion_finding_on_that_node(tmp_path: Path, client) -> None:
    from dashboard.diagnosis.models import Finding
    from dashboard.diagnosis.tasks import run_pass
    from dashboard.telemetry import tokens
    from dashboard.telemetry.models import Cluster
    from dashboard.web.evidence import chart

    cluster = Cluster.objects.create(name="roce")
    _, token = tokens.create_token(cluster, "agents")
    roots = {h: _tree(tmp_path / h) for h in NODES}
    sources = {h: IbSource(root=str(roots[h])) for h in NODES}
    assert all(s.start() is None for s in sources.values())
    start = time.time() - 12
    try:
        for sec in range(9):
            for seq, host in enumerate(NODES):
                _bump(roots[host], BACKGROUND)
                if host == "node-b" and sec >= 3:
                    _bump(roots[host], STORM)
                out = Collected()
                sources[host].collect(start + sec, out)
                batch = {"v": 1, "agent_id": host, "seq": sec, "host": host, "sent_at": start + sec,
                         "ports": out.ports}
                r = post(client, batch, token)
                assert r.status_code == 200, (seq, r.content)
    finally:
        for s in sources.values():
            s.close()

    run_pass(cluster, start + 8)
    (f,) = Finding.objects.filter(cluster=cluster, kind="congestion")
    assert (f.subject_type, f.subject, f.severity, f.node.hostname) == ("node", "node-b", "error", "node-b")
    metrics = f.evidence["metrics"]
    assert metrics["fabric"] == "roce" and metrics["classes"] == ["loss"]  # link_layer Ethernet: detected as RoCE
    assert metrics["ports"][0]["per_s"]["loss"] == pytest.approx(700.0, abs=0.1)  # stored timestamps: microseconds
    assert "PFC" in f.action and "NCCL_IB_TC" in f.action and "NCCL_IB_GID_INDEX" in f.action
    assert not Finding.objects.filter(cluster=cluster).exclude(id=f.id).exists()

    (panel,) = chart(f, now=start + 9)["panels"]
    subject = next(s for s in panel["series"] if s["role"] == "subject")
    assert subject["name"] == "loss" and max(subject["y"]) == pytest.approx(700.0) and panel["thresholds"][0]["value"] == 10.0
    assert panel["breach"] is not None
