"""dashboard.storage.probe_samples: the one module the node and link pages, the link matrix, the evidence and "why
was step N slow" read network probes through. Its answers against a direct computation over the probes seeded as
frames (both databases: the suite runs this file on SQLite and on PostgreSQL), its reads one index range each.
tests/server/test_sample_readers.py keeps it the one module."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from dashboard.storage import frames as fr
from dashboard.storage import probe_samples
from dashboard.telemetry.models import Cluster, Node
from dashboard.web.series import TimeRange
from tests.server import framed
from tests.server.conftest import World

T0 = 1_700_000_040.0  # a whole minute
SECONDS = 180
POST_S = 3  # a node posts every 3 s: some posts straddle a 10 s frame window and make two frames
HOSTS = ("n0", "n1", "n2", "n3")
BARE = "10.0.0.9"  # a probed address without an agent


@dataclass(frozen=True)
class P:
    """One probe as seeded: what the answers are computed from, independently of the frames."""

    node_id: int
    peer: str
    ts: float
    sent: int
    lost: int
    rtt_ms: float | None = None
    rtt_p99_ms: float | None = None
    bw_gbps: float | None = None

    def wire(self) -> dict[str, Any]:
        return {"ts": self.ts, "peer": self.peer, "sent": self.sent, "lost": self.lost, "rtt_ms": self.rtt_ms,
                "rtt_p99_ms": self.rtt_p99_ms, "bw_gbps": self.bw_gbps}


def _post(cluster: Cluster, probes: list[P]) -> None:
    """Store ``probes`` as their nodes' posts of ``POST_S`` seconds each, framed as ingest frames them."""
    posts: dict[tuple[int, int], list[P]] = {}
    for p in probes:
        posts.setdefault((p.node_id, math.floor((p.ts - T0) / POST_S)), []).append(p)
    for (node_id, _), ps in posts.items():
        framed.probes(cluster, node_id, [p.wire() for p in ps])


@dataclass
class Mesh:
    cluster: Cluster
    nodes: dict[str, Node]
    rows: list[P]


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
                rows.append(P(nodes[a].id, b, T0 + s, sent, min(sent, 3 if slow else (s + len(a + b)) % 2),
                              rtt_ms=(8.0 if slow else 0.2) + 0.001 * s, rtt_p99_ms=(9.0 if slow else 0.4),
                              bw_gbps=None if b == BARE else (2.0 if slow else 90.0 - 0.01 * s)))
    _post(world.cluster, rows)
    stranger = Node.objects.create(cluster=world.other_cluster, hostname="n0")
    _post(world.other_cluster, [P(stranger.id, p, T0 + s, 10, 10, rtt_ms=500.0, bw_gbps=0.1)
                                for s in range(SECONDS) for p in HOSTS])
    return Mesh(world.cluster, nodes, rows)


TR = TimeRange(T0, T0 + SECONDS - 1, points=3)  # 60 s buckets


def _loss(r: P) -> float | None:
    return r.lost / r.sent if r.sent else None


def _want(rows: list[P], value: Callable[[P], float | None]) -> dict[float, list[float]]:
    """Bucket start -> the values of the probes in it."""
    out: dict[float, list[float]] = {}
    for r in rows:
        v = value(r)
        if v is not None:
            out.setdefault(math.floor(r.ts / 60) * 60, []).append(v)
    return out


def _check(got: dict | None, rows: list[P], field: str, value: Callable[[P], float | None]) -> None:
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


def test_loss_pct_is_the_float_sql_computed() -> None:
    """lost * 100.0 / sent, in that order: 100 * (lost / sent) differs in the last bit for some counts."""
    rows = fr.Rows(fr.PROBES, np.array([[T0, s, lo, 0, 0, 0] for s in range(1, 40) for lo in range(s + 1)], float),
                   {}, {})
    got = probe_samples._value(rows, "loss_pct")
    want = [lo * 100.0 / s for s in range(1, 40) for lo in range(s + 1)]
    assert got.tolist() == want
    assert any(lo * 100.0 / s != 100 * (lo / s) for s in range(1, 40) for lo in range(s + 1))


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
    want: dict[tuple[int, str, int], list[P]] = {}
    for r in mesh.rows:
        if tr.t0 <= r.ts <= tr.t1:
            want.setdefault((r.node_id, r.peer, math.floor(r.ts / 30)), []).append(r)
    assert len(got) == len(want)
    for node_id, peer, bucket, sent, lost, rtt, p99, bw in got:
        rs = want[(node_id, peer, int(bucket))]
        assert (sent, lost) == (sum(r.sent for r in rs), sum(r.lost for r in rs))
        assert type(sent) is int and type(lost) is int and type(node_id) is int
        assert rtt == pytest.approx(np.mean([r.rtt_ms for r in rs]))
        assert p99 == pytest.approx(np.mean([r.rtt_p99_ms for r in rs]))
        assert bw == (None if peer == BARE else pytest.approx(np.mean([r.bw_gbps for r in rs])))
    # Cut, it keeps the first of (node id, peer, bucket) order: a pair's buckets together, the lowest nodes first.
    cut = probe_samples.pair_buckets(mesh.cluster.id, tr, 30.0, 7)
    assert len(cut) == 7 and cut == sorted(got)[:7]


@pytest.mark.django_db
def test_newest_values_exists_and_around(mesh: Mesh) -> None:
    cid, n0 = mesh.cluster.id, mesh.nodes["n0"]
    assert probe_samples.newest(cid, TimeRange(T0, T0 + 99.5)) == pytest.approx(T0 + 99)
    assert probe_samples.newest(cid, TimeRange(T0 - 99, T0 - 1)) is None
    vals = probe_samples.values(cid, TimeRange(T0 + 10, T0 + 12), ("rtt_ms", "bw_gbps"), 100_000)
    want = [(r.rtt_ms, r.bw_gbps) for r in mesh.rows if T0 + 10 <= r.ts <= T0 + 12]
    assert sorted(vals, key=repr) == sorted(want, key=repr)
    cut = probe_samples.values(cid, TimeRange(T0, T0 + SECONDS), ("rtt_ms",), 5)
    assert len(cut) == 5 and all(v < 0.2 + 0.001 * POST_S for (v,) in cut), "the oldest frames' probes"
    assert probe_samples.exists(cid, n0.id, BARE) and not probe_samples.exists(cid, n0.id, "10.0.0.10")
    got = probe_samples.around(cid, T0 + 70, T0 + 71, ("rtt_ms", "lost", "sent"), 100_000)
    want_a = [(h, r.peer, r.rtt_ms, r.lost, r.sent) for r in mesh.rows for h in HOSTS
              if mesh.nodes[h].id == r.node_id and T0 + 70 <= r.ts <= T0 + 71]
    assert sorted(got) == sorted(want_a)
    assert all(type(lost) is int and type(sent) is int for *_, lost, sent in got)
    assert len(probe_samples.around(cid, T0, T0 + SECONDS, ("rtt_ms",), 9)) == 9


@pytest.mark.django_db
def test_newest_is_the_newest_sample_not_the_newest_frame(world: World) -> None:
    """A frame's ts is its oldest sample's: a frame begun earlier can hold a newer sample than a later frame."""
    a, b = (Node.objects.create(cluster=world.cluster, hostname=h) for h in ("a", "b"))
    framed.probes(world.cluster, a, [{"ts": T0 + 1, "peer": "b", "sent": 5, "lost": 0},
                                     {"ts": T0 + 9, "peer": "b", "sent": 5, "lost": 0}])
    framed.probes(world.cluster, b, [{"ts": T0 + 5, "peer": "a", "sent": 5, "lost": 0}])
    cid = world.cluster.id
    assert probe_samples.newest(cid, TimeRange(T0, T0 + 9.5)) == T0 + 9
    assert probe_samples.newest(cid, TimeRange(T0 + 3, T0 + 8)) == T0 + 5
    assert probe_samples.newest(cid, TimeRange(T0 + 6, T0 + 20)) == T0 + 9
    assert probe_samples.newest(cid, TimeRange(T0 + 2, T0 + 4)) is None
    # A frame's ts column keeps its sample's time to the microsecond, rounded (here up, past a window's start).
    late = T0 + 19.9999996
    stored = datetime.fromtimestamp(late, UTC).timestamp()
    assert stored > late and fr.window_start(stored) > late
    framed.probes(world.cluster, b, [{"ts": late, "peer": "a", "sent": 5, "lost": 0}])
    assert probe_samples.newest(cid, TimeRange(T0, T0 + 25)) == late


@pytest.mark.django_db
def test_a_host_is_matched_by_its_whole_name(world: World) -> None:
    """The frames holding probes to a host are found by a substring of ``peers``; the probes are the host's alone:
    not a host whose name holds it ("n1" in "n10"), nor one LIKE's "_" would match ("axb" for "a_b"), nor one
    differing in case (SQLite's LIKE ignores it)."""
    s = Node.objects.create(cluster=world.cluster, hostname="s")
    for h in ("a_b", "axb", "n1", "n10", "N1"):
        Node.objects.create(cluster=world.cluster, hostname=h)
    rtt = {"a_b": 1.0, "axb": 2.0, "n10": 3.0, "N1": 4.0}
    framed.probes(world.cluster, s, [{"ts": T0 + t, "peer": p, "sent": 5, "lost": 0, "rtt_ms": v}
                                     for t in range(3) for p, v in rtt.items()])
    cid, tr = world.cluster.id, TimeRange(T0 - 10, T0 + 9.5, points=1)  # one 20 s bucket from T0
    for host, v in rtt.items():
        got = probe_samples.to_node(cid, host, tr, ["rtt_ms"])
        assert got is not None and got["rtt_ms"] == {"min": [v], "mean": [v], "max": [v]}, host
        assert set(probe_samples.to_node_by_sender(cid, host, tr, ["rtt_ms"])) == {"s"}
        assert probe_samples.from_node(s.id, tr, ["rtt_ms"], peer=host)["rtt_ms"]["max"] == [v]
        assert probe_samples.exists(cid, s.id, host)
    assert probe_samples.to_node(cid, "n1", tr, ["rtt_ms"]) is None
    assert probe_samples.from_node(s.id, tr, ["rtt_ms"], peer="n1") is None
    assert not probe_samples.exists(cid, s.id, "n1") and not probe_samples.exists(cid, s.id, "a")


@pytest.mark.django_db
def test_each_read_is_one_query(mesh: Mesh) -> None:
    """No read grows with the nodes or the frames it touches: one query each (newest: the newest frame's time, then
    the frames of its window on; the probes to a host: the inbound index's mark and rows, then the frames, a query
    per 2,000 listed and one for the unindexed)."""
    cid, n0, n1 = mesh.cluster.id, mesh.nodes["n0"], mesh.nodes["n1"]
    calls: list[tuple[int, Callable[[], Any]]] = [
        (1, lambda: probe_samples.from_node(n0.id, TR, ["rtt_ms", "loss"])),
        (1, lambda: probe_samples.from_node(n0.id, TR, ["rtt_ms"], peer="n1")),
        (3, lambda: probe_samples.to_node(cid, "n1", TR, ["loss_pct"])),
        (1, lambda: probe_samples.from_node_by_peer(n0.id, TR, ["rtt_ms"])),
        (3, lambda: probe_samples.to_node_by_sender(cid, "n1", TR, ["rtt_ms"])),
        (4, lambda: probe_samples.of_node(cid, n0.id, "n0", TR, ["rtt_ms"])),
        (1, lambda: probe_samples.of_pair((n0.id, "n0"), (n1.id, "n1"), TR, ["rtt_ms"])),
        (1, lambda: probe_samples.across(cid, ["n0", "n1"], TR, ["rtt_ms"])),
        (1, lambda: probe_samples.pair_buckets(cid, TR, 30.0, 10_000)),
        (2, lambda: probe_samples.newest(cid, TR)),
        (1, lambda: probe_samples.values(cid, TR, ("rtt_ms",), 10_000)),
        (1, lambda: probe_samples.exists(cid, n0.id, BARE)),
        (1, lambda: probe_samples.around(cid, T0, T0 + 30, ("rtt_ms",), 10_000)),
    ]
    for n, call in calls:
        with CaptureQueriesContext(connection) as seen:
            assert call()
        assert len(seen.captured_queries) == n, [q["sql"] for q in seen.captured_queries]


def _plan(sql: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN QUERY PLAN " + sql)
        return " | ".join(str(r[-1]) for r in cursor.fetchall())


@pytest.mark.django_db
def test_the_frames_are_read_by_an_index_range_never_a_scan(mesh: Mesh) -> None:
    """Every frame query is an index range, bounded by the range's time on both sides: (node, ts) for a node's
    probes (each side of an OR on its own, a switch's nodes each), (cluster, ts) for the cluster's; the probes to a
    host are the frames the inbound index lists (by id) and the unindexed ones past its mark (the primary key's range,
    or (cluster, ts): whichever SQLite deems narrower)."""
    if connection.vendor != "sqlite":
        pytest.skip("the plan checked is SQLite's (PostgreSQL plans these few rows with a sequential scan)")
    from dashboard.storage import probe_index

    cid, n0, n1 = mesh.cluster.id, mesh.nodes["n0"], mesh.nodes["n1"]
    node, cluster = "telemetry_p_node_id_a5fa84_idx (node_id=? AND ts>? AND ts<?)", \
        "telemetry_p_cluster_bab882_idx (cluster_id=? AND ts>? AND ts<?)"
    by_id, past = "INTEGER PRIMARY KEY (rowid=?)", "INTEGER PRIMARY KEY (rowid>?)"
    inbound = [cluster, past, by_id]
    # (each frame query's plan: the index uses it must show, and which they may be)
    calls: list[tuple[int, list[str], Callable[[], Any]]] = [
        (1, [node], lambda: probe_samples.from_node(n0.id, TR, ["rtt_ms"], peer="n1")),
        (1, inbound, lambda: probe_samples.to_node_by_sender(cid, "n1", TR, ["rtt_ms"])),
        (1, [node, *inbound], lambda: probe_samples.of_node(cid, n0.id, "n0", TR, ["rtt_ms"])),
        (2, [node], lambda: probe_samples.of_pair((n0.id, "n0"), (n1.id, "n1"), TR, ["rtt_ms"])),
        (1, [node], lambda: probe_samples.across(cid, ["n0", "n1"], TR, ["rtt_ms"])),
        (1, [cluster], lambda: probe_samples.pair_buckets(cid, TR, 30.0, 10_000)),
        (1, [cluster], lambda: probe_samples.newest(cid, TR)),
        # Whether a link is still kept at all: the node's frames, whatever their time.
        (1, ["telemetry_p_node_id_a5fa84_idx (node_id=?)"], lambda: probe_samples.exists(cid, n0.id, BARE)),
    ]
    for indexed in (False, True):
        if indexed:
            probe_index.update()  # now the probes to a host are read through the inbound index's ids too
        for uses, allowed, call in calls:
            with CaptureQueriesContext(connection) as seen:
                call()
            plans = [_plan(q["sql"]) for q in seen.captured_queries if '"telemetry_probeframe"' in q["sql"]]
            assert plans, seen.captured_queries
            for plan in plans:
                assert "SCAN telemetry_probeframe" not in plan, plan
                frames = [p for p in plan.split(" | ") if "telemetry_probeframe" in p]  # not a join's node lookup
                assert len(frames) == uses and all(any(a in p for a in allowed) for p in frames), plan
