"""The pass against the database when batches arrive late: the loader reads how late each node's newest batch
reached this server (the ingest ledger's ``received_at - sent_at``) and the cluster's median, and a node whose data
is only late is not named down, while one whose batches stopped on time still is.

The batches go through the real validator and writer; their arrival times are then set on the ledger as a server
receiving them would have (the test stores in a second what took a minute)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pytest

from clusterdx import wire
from collectors.sim.model import SimCluster
from collectors.sim.scenario import parse
from dashboard.diagnosis import loader
from dashboard.diagnosis.models import Finding
from dashboard.diagnosis.tasks import run_pass
from dashboard.ingest.writer import store_batch
from dashboard.telemetry.models import AgentBatch, Node
from dashboard.web.evidence_headline import headline
from tests.server.conftest import World, make_batch

pytestmark = pytest.mark.django_db

SECONDS = 45
NODES = 6


def feed(world: World, stop: dict[str, float], delay: dict[str, float], start: float) -> None:
    """NODES nodes x 2 GPUs, one sample a second from ``start`` for SECONDS; node -> how many seconds before the end
    its batches stop (``stop``) and how late they arrive (``delay``; 0.05 s for the others)."""
    sim = SimCluster(parse({"cluster": {"nodes": NODES, "gpus_per_node": 2, "run": "llm", "seed": 5}}), start)
    end = start + SECONDS
    for t in range(1, SECONDS + 1):
        for batch in sim.tick(start + t):
            if start + t <= end - stop.get(batch["host"], 0.0):
                store_batch(world.cluster, wire.validate_batch(batch))
    for b in AgentBatch.objects.filter(cluster=world.cluster):
        AgentBatch.objects.filter(id=b.id).update(received_at=b.sent_at + timedelta(seconds=delay.get(b.host, 0.05)))
    for node in Node.objects.filter(cluster=world.cluster):  # when its last batch arrived
        node.last_seen = AgentBatch.objects.filter(cluster=world.cluster, host=node.hostname).latest("received_at") \
            .received_at
        node.save(update_fields=["last_seen"])


def test_the_loader_reads_each_nodes_newest_arrival_delay_and_the_clusters_median(world: World) -> None:
    now = time.time()
    feed(world, {"node-002": 30.0}, {"node-001": 12.0, "node-002": 3600.0}, now - SECONDS)
    delays, lag, _, _ = loader._ingest_delays(world.cluster.id, now + 1, NODES)
    assert delays["node-001"] == pytest.approx(12.0, abs=1e-3)
    assert delays["node-000"] == pytest.approx(0.05, abs=1e-3)
    # Its newest batch (an hour late: received an hour after the pass) is not yet received as of the pass; the one
    # received before is not among the newest two a node of the cluster's arrivals either.
    assert "node-002" not in delays
    assert lag == pytest.approx(0.05, abs=1e-3)  # one late node does not make the cluster late
    assert loader.load_window(world.cluster, now + 1).ingest_delay == delays


def test_a_node_whose_batches_arrive_late_is_not_named_down_and_one_that_stopped_is(world: World) -> None:
    now = time.time()
    # node-001's data is 25 s behind the others' because its batches take 25 s to arrive; node-005's stopped 25 s ago
    # and had arrived on time. Both are silent 25 s, past the 15 s heartbeat.
    feed(world, {"node-001": 25.0, "node-005": 25.0}, {"node-001": 25.0}, now - SECONDS)
    res = run_pass(world.cluster, now)
    assert res.changes is not None
    down = sorted(f.subject for f in res.changes.opened if f.kind == "node_down")
    assert down == ["node-005"], [(f.kind, f.subject, f.title) for f in res.changes.opened]
    f = Finding.objects.get(kind="node_down")
    assert f.evidence["metrics"]["ingest_delay_s"] <= 0.1  # its own, on time (rounded to 0.1 s)


def test_without_the_delay_the_late_node_would_be_named(world: World, monkeypatch: Any) -> None:
    """The same history with the ledger's delays hidden from the pass: what the server said before it read them."""
    now = time.time()
    feed(world, {"node-001": 25.0, "node-005": 25.0}, {"node-001": 25.0}, now - SECONDS)
    monkeypatch.setattr(loader, "_ingest_delays", lambda *_: ({}, 0.0, {}, {}))
    res = run_pass(world.cluster, now)
    assert res.changes is not None
    assert sorted(f.subject for f in res.changes.opened if f.kind == "node_down") == ["node-001", "node-005"]



def late_server(world: World, now: float, stopped: float = 40.0) -> None:
    """A server that receives every node's batches 12 s late; node-001's stopped ``stopped`` s ago (its clock)."""
    feed(world, {"node-001": stopped}, {f"node-{n:03d}": 12.0 for n in range(NODES)}, now - SECONDS)


def test_behind_a_late_server_a_node_that_stopped_is_named_that_much_later(world: World, client: Any) -> None:
    now = time.time()
    late_server(world, now)  # silent 40 s: past 15 s + the cluster's 12 s
    res = run_pass(world.cluster, now)
    assert res.changes is not None
    assert [(f.kind, f.subject) for f in res.changes.opened] == [("node_down", "node-001")]
    f = Finding.objects.get(kind="node_down")
    assert f.evidence["metrics"]["ingest_delay_s"] == 12.0
    assert f.evidence["metrics"]["silent_s"] == pytest.approx(40, abs=1.5)
    assert "the 12 s its batches take to arrive" in f.title
    # Its evidence: the silence against the line that decided, the heartbeat plus the delay (no probe loss here).
    client.force_login(world.teammate)
    panel = client.get(f"/api/v1/findings/{f.id}").json()["chart"]["panels"][0]
    assert panel["id"] == "silence" and panel["thresholds"][0]["name"] == "heartbeat_s 15 + 12 s arrival delay"
    assert panel["thresholds"][0]["value"] == 27.0 and panel["breach"]["over"] is True


@pytest.mark.parametrize("read_delays", [True, False])
def test_behind_a_late_server_a_node_silent_less_than_the_heartbeat_and_the_lag_is_not_named_yet(
        world: World, monkeypatch: Any, read_delays: bool) -> None:
    now = time.time()
    late_server(world, now, stopped=22.0)  # past 15 s, not past 15 s + 12 s
    if not read_delays:  # what the server said before it read the delays: down
        monkeypatch.setattr(loader, "_ingest_delays", lambda *_: ({}, 0.0, {}, {}))
    res = run_pass(world.cluster, now)
    assert res.changes is not None
    assert [f.subject for f in res.changes.opened if f.kind == "node_down"] == ([] if read_delays else ["node-001"])


def test_the_lag_is_how_late_batches_arrive_now_and_nodes_not_heard_since_do_not_dilute_it(world: World) -> None:
    """What a server falling behind at a run's start looked like (2,048 nodes: 661-814 healthy nodes named down a
    run): the batches arriving now are 12 s late (node-001 and node-002), node-000's on time, and node-003..005 have
    not been heard for 18 s, their newest batch received on time before the backlog. Counting those three old, prompt
    batches puts the lag at 0.05 s and names them down at 18 s > 15 s; the nodes heard lately say 12 s, so the three
    are silent 18 s < 15 + 12 and are not named yet."""
    now = time.time()
    late = {"node-001": 12.0, "node-002": 12.0}
    feed(world, {**late, "node-003": 18.0, "node-004": 18.0, "node-005": 18.0}, late, now - SECONDS)
    delays, lag, _, _ = loader._ingest_delays(world.cluster.id, now, NODES)
    assert delays["node-003"] == pytest.approx(0.05, abs=1e-3) and delays["node-001"] == pytest.approx(12.0, abs=1e-3)
    assert float(np.median(list(delays.values()))) == pytest.approx(0.05, abs=1e-3), "every node's newest: diluted"
    assert lag == pytest.approx(12.0, abs=1e-3)
    res = run_pass(world.cluster, now)
    assert res.changes is not None
    assert [(f.kind, f.subject) for f in res.changes.opened] == []


def test_a_node_whose_newest_sample_is_a_host_sample_past_its_span_is_silent_since_it(world: World) -> None:
    """Host samples are read for 10 s, GPU rows for 20 s. A node whose newest word is a host sample 13.5 s old (a
    CPU-only node; at a 2,048-node benchmark's start, the registration that was all 165 nodes had sent yet) has
    nothing in the window, and is placed at its last batch's arrival less its delay: silent 13.5 s, not yet past the
    15 s heartbeat. It was put at the GPU span, 20 s, and named down. (A node with GPUs still is: it sends their
    rows every second, test_without_the_delay_the_late_node_would_be_named.)"""
    now = time.time()
    store_batch(world.cluster, wire.validate_batch(make_batch(1, host="node-a")))
    then = now - 13.5
    store_batch(world.cluster, wire.validate_batch(make_batch(1, host="node-x", sent_at=then, gpus=[], steps=[],
                                                              hosts=[{"ts": then, "cpu_pct": 3.0}])))
    arrived = datetime.fromtimestamp(then + 0.05, tz=UTC)
    AgentBatch.objects.filter(host="node-x").update(received_at=arrived)
    Node.objects.filter(hostname="node-x").update(last_seen=arrived)
    w = loader.load_window(world.cluster, now)
    assert w.last_heard["node-x"] == pytest.approx(then, abs=0.01)
    res = run_pass(world.cluster, now)
    assert res.changes is not None
    assert [(f.kind, f.subject) for f in res.changes.opened if f.kind == "node_down"] == []
    res = run_pass(world.cluster, now + 2.5)  # silent 16 s, past the heartbeat (node-a heard within 3 s: no shift)
    assert res.changes is not None
    assert [(f.kind, f.subject) for f in res.changes.opened if f.kind == "node_down"] == [("node_down", "node-x")]


def test_a_cluster_whose_batches_all_arrive_late_is_this_server_behind(world: World) -> None:
    """Every node's batches arrive 20 s after they were sent: what the pass has of each ends 20 s ago. One
    cluster_silent that names this server's ingest, not the nodes; and no node_down for any of them."""
    now = time.time()
    hosts = [f"node-{n:03d}" for n in range(NODES)]
    feed(world, dict.fromkeys(hosts, 20.0), dict.fromkeys(hosts, 20.0), now - SECONDS)
    res = run_pass(world.cluster, now)
    assert res.changes is not None
    assert [(f.kind, f.subject) for f in res.changes.opened] == [("cluster_silent", "cluster")]
    f = Finding.objects.get(kind="cluster_silent")
    assert f.title.startswith("this server receives the cluster's batches 20 s late")
    assert f.evidence["metrics"]["ingest_lag_s"] == pytest.approx(20.0, abs=0.1)


def behind(batch: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The batch as a node whose clock runs ``seconds`` behind would have stamped it."""
    out = dict(batch, sent_at=batch["sent_at"] - seconds)
    for key, value in batch.items():
        if isinstance(value, list) and value and isinstance(value[0], dict) and "ts" in value[0]:
            out[key] = [dict(r, ts=r["ts"] - seconds) for r in value]
    return out


def skewed_node(world: World, now: float) -> None:
    """NODES nodes for SECONDS up to ``now``; node-003's clock runs 300 s behind: every batch it sends arrives (on
    this server's clock) 300 s after the times it stamps."""
    sim = SimCluster(parse({"cluster": {"nodes": NODES, "gpus_per_node": 2, "run": "llm", "seed": 5}}), now - SECONDS)
    for t in range(1, SECONDS + 1):
        for batch in sim.tick(now - SECONDS + t):
            skewed = batch["host"] == "node-003"
            store_batch(world.cluster, wire.validate_batch(behind(batch, 300.0) if skewed else batch))
    for b in AgentBatch.objects.filter(cluster=world.cluster):  # each arrived 50 ms after it was really sent
        real = b.sent_at + timedelta(seconds=300.0 if b.host == "node-003" else 0.0)
        AgentBatch.objects.filter(id=b.id).update(received_at=real + timedelta(seconds=0.05))


def test_a_node_whose_clock_is_behind_is_named_clock_skew_and_not_down(world: World, client: Any) -> None:
    """Before the pass read its arrivals node-003 was named down (silent 300 s, past the heartbeat and the 120 s
    cap); its evidence is its batches' arrival delays, flat."""
    now = time.time()
    skewed_node(world, now)
    w = loader.load_window(world.cluster, now + 0.5)
    assert list(w.arrivals) == ["node-003"] and len(w.arrivals["node-003"]) == loader.ARRIVALS_BATCHES
    assert w.arrivals["node-003"][:, 1] == pytest.approx(300.05, abs=1e-3)
    res = run_pass(world.cluster, now + 0.5)
    assert res.changes is not None
    opened = [(f.kind, f.subject) for f in res.changes.opened if f.kind in ("clock_skew", "node_down")]
    assert opened == [("clock_skew", "node-003")], [(f.kind, f.subject, f.title) for f in res.changes.opened]
    f = Finding.objects.get(kind="clock_skew")
    assert f.title.startswith("node-003's clock is 300 s behind") and f.severity == "warning"
    assert f.node is not None and f.node.hostname == "node-003"
    client.force_login(world.teammate)
    got = client.get(f"/api/v1/findings/{f.id}").json()
    panel = got["chart"]["panels"][0]
    assert panel["id"] == "arrival_delay" and panel["breach"]["over"] is True
    assert min(panel["series"][0]["y"]) == pytest.approx(300.05, abs=0.01)
    assert panel["thresholds"][0]["value"] == pytest.approx(30.05, abs=0.06)  # the lag as stored, to 0.1 s
    assert headline(f).startswith("clock 300 s behind")  # the line the overview and lists show


def test_the_loader_reads_how_often_each_node_posts(world: World) -> None:
    """A node that posts 4 s of samples at once (the server's advice at 2,048 nodes) is heard from every 4 s: the
    link and path detectors must not take it for quiet between two posts (``network.quiet_nodes``)."""
    from collectors.sim.sender import merge

    start = time.time() - 30
    sim = SimCluster(parse({"cluster": {"nodes": 3, "gpus_per_node": 2, "seed": 8}}), start)
    pending: dict[str, list[dict[str, Any]]] = {}
    for t in range(24):
        for batch in sim.tick(start + t):
            pending.setdefault(batch["host"], []).append(batch)
            every = 4 if batch["host"] != "node-000" else 1
            if len(pending[batch["host"]]) == every:
                for merged in merge(pending.pop(batch["host"])):
                    store_batch(world.cluster, wire.validate_batch(merged))
    *_, posts = loader._ingest_delays(world.cluster.id, time.time() + 1, 3)  # received: now
    assert posts == pytest.approx({"node-000": 1.0, "node-001": 4.0, "node-002": 4.0}, abs=1e-3)
    w = loader.load_window(world.cluster, time.time() + 1, beats=[])
    assert w.post_interval == pytest.approx(posts, abs=1e-3)
