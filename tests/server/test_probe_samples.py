"""dashboard.storage.probe_samples: the one module the node and link pages, the link matrix, the evidence and "why
was step N slow" read network probes through. Its answers against a direct computation over the rows written (both
databases: the suite runs this file on SQLite and on PostgreSQL). tests/server/test_sample_readers.py keeps it the
one module."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import pytest

from dashboard.storage import probe_samples
from dashboard.telemetry.models import Cluster, Node, Probe
from dashboard.web.series import TimeRange
from tests.server.conftest import World

T0 = 1_700_000_040.0  # a whole minute
SECONDS = 180
HOSTS = ("n0", "n1", "n2", "n3")
BARE = "10.0.0.9"  # a probed address without an agent


def _dt(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


@dataclass
class Mesh:
    cluster: Cluster
    nodes: dict[str, Node]
    rows: list[Probe]


@pytest.fixture
def mesh(world: World) -> Mesh:
    """Every node probes every other node and the bare address each second; n0 <-> n1 is slow and lossy from second
    60, the probes to n3 sent nothing one second in ten (no loss to speak of, not 0 %). Another cluster has a node
    named n0 too: nothing of it may leak in."""
    nodes = {h: Node.objects.create(cluster=world.cluster, hostname=h) for h in HOSTS}
    rows = []
    for s in range(SECONDS):
        for a in HOSTS:
            for b in (*HOSTS, BARE):
                if a == b:
                    continue
                slow = {a, b} == {"n0", "n1"} and s >= 60
                sent = 0 if b == "n3" and s % 10 == 0 else 10
                rows.append(Probe(cluster=world.cluster, node=nodes[a], peer=b, ts=_dt(T0 + s), sent=sent,
                                  lost=min(sent, 3 if slow else (s + len(a + b)) % 2),
                                  rtt_ms=(8.0 if slow else 0.2) + 0.001 * s, rtt_p99_ms=(9.0 if slow else 0.4),
                                  bw_gbps=None if b == BARE else (2.0 if slow else 90.0 - 0.01 * s)))
    Probe.objects.bulk_create(rows)
    stranger = Node.objects.create(cluster=world.other_cluster, hostname="n0")
    Probe.objects.bulk_create([Probe(cluster=world.other_cluster, node=stranger, peer=p, ts=_dt(T0 + s), sent=10,
                                     lost=10, rtt_ms=500.0, bw_gbps=0.1) for s in range(SECONDS) for p in HOSTS])
    return Mesh(world.cluster, nodes, rows)


TR = TimeRange(T0, T0 + SECONDS - 1, points=3)  # 60 s buckets


def _loss(r: Probe) -> float | None:
    return r.lost / r.sent if r.sent else None


def _want(rows: list[Probe], value: Callable[[Probe], float | None]) -> dict[float, list[float]]:
    """Bucket start -> the values of the rows in it."""
    out: dict[float, list[float]] = {}
    for r in rows:
        v = value(r)
        if v is not None:
            out.setdefault(math.floor(r.ts.timestamp() / 60) * 60, []).append(v)
    return out


def _check(got: dict | None, rows: list[Probe], field: str, value: Callable[[Probe], float | None]) -> None:
    want = _want(rows, value)
    assert got is not None and rows
    assert got["t"] == sorted(want)
    assert got[field]["mean"] == pytest.approx([float(np.mean(want[t])) for t in got["t"]])
    assert got[field]["max"] == pytest.approx([max(want[t]) for t in got["t"]])
    assert got[field]["min"] == pytest.approx([min(want[t]) for t in got["t"]])


@pytest.mark.django_db
def test_probes_from_and_to_a_node(mesh: Mesh) -> None:
    n0, n3 = mesh.nodes["n0"], mesh.nodes["n3"]
    _check(probe_samples.from_node(n0.id, TR, ["rtt_ms"]), [r for r in mesh.rows if r.node_id == n0.id],
           "rtt_ms", lambda r: r.rtt_ms)
    _check(probe_samples.from_node(n0.id, TR, ["bw_gbps"], peer="n1"),
           [r for r in mesh.rows if r.node_id == n0.id and r.peer == "n1"], "bw_gbps", lambda r: r.bw_gbps)
    # Loss as a fraction and as a percentage; a probe that sent nothing has none (not 0).
    to_n3 = [r for r in mesh.rows if r.peer == "n3"]
    _check(probe_samples.to_node(mesh.cluster.id, "n3", TR, ["loss"]), to_n3, "loss", _loss)
    _check(probe_samples.to_node(mesh.cluster.id, "n3", TR, ["loss_pct"]), to_n3, "loss_pct",
           lambda r: r.lost * 100.0 / r.sent if r.sent else None)
    assert probe_samples.from_node(n3.id, TimeRange(T0 - 600, T0 - 1, points=3), ["rtt_ms"]) is None
    with pytest.raises(ValueError):
        probe_samples.from_node(n0.id, TR, ["rtt_ms", "lost) FROM x --"])


@pytest.mark.django_db
def test_each_peer_and_each_sender_apart(mesh: Mesh) -> None:
    n1 = mesh.nodes["n1"]
    by_peer = probe_samples.from_node_by_peer(n1.id, TR, ["rtt_ms"])
    assert set(by_peer) == {"n0", "n2", "n3", BARE}
    for peer, s in by_peer.items():
        _check(s, [r for r in mesh.rows if r.node_id == n1.id and r.peer == peer], "rtt_ms", lambda r: r.rtt_ms)
    by_sender = probe_samples.to_node_by_sender(mesh.cluster.id, "n0", TR, ["loss"])
    assert set(by_sender) == {"n1", "n2", "n3"}  # the other cluster's n0 probes n0 too, and is not counted
    for sender, s in by_sender.items():
        _check(s, [r for r in mesh.rows if r.peer == "n0" and r.node_id == mesh.nodes[sender].id], "loss", _loss)


@pytest.mark.django_db
def test_a_node_a_pair_and_a_switch(mesh: Mesh) -> None:
    n0, n1, n2 = (mesh.nodes[h] for h in ("n0", "n1", "n2"))
    _check(probe_samples.of_node(mesh.cluster.id, n2.id, "n2", TR, ["rtt_ms"]),
           [r for r in mesh.rows if r.node_id == n2.id or r.peer == "n2"], "rtt_ms", lambda r: r.rtt_ms)
    pair = [r for r in mesh.rows if (r.node_id, r.peer) in ((n0.id, "n1"), (n1.id, "n0"))]
    _check(probe_samples.of_pair((n0.id, "n0"), (n1.id, "n1"), TR, ["rtt_ms"]), pair, "rtt_ms", lambda r: r.rtt_ms)
    inside_hosts = ["n0", "n1"]
    ids = {mesh.nodes[h].id for h in inside_hosts}
    leaving, inside = probe_samples.across(mesh.cluster.id, inside_hosts, TR, ["rtt_ms"])
    _check(leaving, [r for r in mesh.rows if r.node_id in ids and r.peer not in inside_hosts], "rtt_ms",
           lambda r: r.rtt_ms)
    _check(inside, [r for r in mesh.rows if r.node_id in ids and r.peer in inside_hosts], "rtt_ms",
           lambda r: r.rtt_ms)
    assert probe_samples.across(mesh.cluster.id, ["nobody"], TR, ["rtt_ms"]) == (None, None)


@pytest.mark.django_db
def test_pair_buckets_sum_the_counts_and_average_the_times(mesh: Mesh) -> None:
    tr = TimeRange(T0 + 30, T0 + 149)
    got = probe_samples.pair_buckets(mesh.cluster.id, tr, 30.0, 10_000)
    want: dict[tuple[int, str, int], list[Probe]] = {}
    for r in mesh.rows:
        if tr.t0 <= r.ts.timestamp() <= tr.t1:
            want.setdefault((r.node_id, r.peer, math.floor(r.ts.timestamp() / 30)), []).append(r)
    assert len(got) == len(want)
    for node_id, peer, bucket, sent, lost, rtt, p99, bw in got:
        rs = want[(node_id, peer, int(bucket))]
        assert (sent, lost) == (sum(r.sent for r in rs), sum(r.lost for r in rs))
        assert rtt == pytest.approx(np.mean([r.rtt_ms for r in rs]))
        assert p99 == pytest.approx(np.mean([r.rtt_p99_ms for r in rs]))
        assert bw == (None if peer == BARE else pytest.approx(np.mean([r.bw_gbps for r in rs])))
    assert len(probe_samples.pair_buckets(mesh.cluster.id, tr, 30.0, 7)) == 7


@pytest.mark.django_db
def test_newest_values_exists_and_around(mesh: Mesh) -> None:
    cid, n0 = mesh.cluster.id, mesh.nodes["n0"]
    assert probe_samples.newest(cid, TimeRange(T0, T0 + 99.5)) == pytest.approx(T0 + 99)
    assert probe_samples.newest(cid, TimeRange(T0 - 99, T0 - 1)) is None
    vals = probe_samples.values(cid, TimeRange(T0 + 10, T0 + 12), ("rtt_ms", "bw_gbps"), 100_000)
    want = [(r.rtt_ms, r.bw_gbps) for r in mesh.rows if T0 + 10 <= r.ts.timestamp() <= T0 + 12]
    assert sorted(vals, key=repr) == sorted(want, key=repr)
    assert len(probe_samples.values(cid, TimeRange(T0, T0 + SECONDS), ("rtt_ms",), 5)) == 5
    assert probe_samples.exists(cid, n0.id, BARE) and not probe_samples.exists(cid, n0.id, "10.0.0.10")
    got = probe_samples.around(cid, T0 + 70, T0 + 71, ("rtt_ms", "lost", "sent"), 100_000)
    want_a = [(h, r.peer, r.rtt_ms, r.lost, r.sent) for r in mesh.rows for h in HOSTS
              if mesh.nodes[h].id == r.node_id and T0 + 70 <= r.ts.timestamp() <= T0 + 71]
    assert sorted(got) == sorted(want_a)
