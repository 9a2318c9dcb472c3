"""The link matrix and a link's page: the simulator's slow node is marked (and nothing else), nodes are ordered by
rack, the matrix is sparse, and only members see any of it."""

from __future__ import annotations

import time
from typing import Any

import pytest

from dashboard.telemetry.models import Node
from tests.server import framed
from tests.server.conftest import World
from tests.server.test_diagnosis_pass import Feed

pytestmark = pytest.mark.django_db
SLOW = "node-006"


@pytest.fixture
def slow_feed(world: World) -> Feed:
    """Eight simulated nodes; node-006's network is slow from the 2nd second on (+2 ms RTT, a third of the
    bandwidth), with the real writer and the real diagnosis pass, so the slow_link finding is open too."""
    feed = Feed(world, [{"kind": "slow_link", "at_s": 2, "node": 6, "magnitude": 2.0}])
    feed.run(14)
    return feed


def _matrix(client: Any, world: World, query: str = "range=15m") -> dict[str, Any]:
    client.force_login(world.owner)
    r = client.get(f"/api/v1/clusters/{world.cluster.name}/links?{query}")
    assert r.status_code == 200, r.content
    return r.json()


def test_it_marks_every_pair_of_the_slow_node_bad_and_no_healthy_pair(client: Any, world: World,
                                                                       slow_feed: Feed) -> None:
    m = _matrix(client, world)
    hosts = [n["host"] for n in m["nodes"]]
    assert hosts == [f"node-{i:03d}" for i in range(8)], "one rack behind one leaf: host name order"
    assert m["grouped_by"] == "switch" and m["groups"] == [{"label": "leaf-00", "start": 0, "end": 8}]
    p = m["pairs"]
    probed = {(hosts[i], hosts[j]) for i, j in zip(p["i"], p["j"], strict=True)}
    with_slow = {pair for pair in probed if SLOW in pair}
    assert len(with_slow) == 14, "8 nodes probe each other: 7 pairs from node-006 and 7 to it"
    bad = {(b["from"], b["to"]) for b in m["bad"]}
    assert bad == with_slow, f"bad pairs other than node-006's: {bad - with_slow}; missed: {with_slow - bad}"
    assert all(b["url"] == f"/clusters/prod-a/links/{min(b['from'], b['to'])}/{max(b['from'], b['to'])}/"
               for b in m["bad"])
    # The marked values really are beyond the lines the API reports, and the healthy ones are not.
    th = m["thresholds"]
    rtt = {(hosts[i], hosts[j]): v for i, j, v in zip(p["i"], p["j"], p["rtt_ms"], strict=True)}
    assert min(rtt[x] for x in with_slow) > th["rtt_ms"] > max(rtt[x] for x in probed - with_slow)
    assert th["baseline_rtt_ms"] < 0.2 and th["bw_gbps"] > 100
    kinds = {(f["kind"], f["subject"]) for f in m["findings"]}
    assert ("slow_link", SLOW) in kinds
    f = next(f for f in m["findings"] if f["subject"] == SLOW)
    assert f["url"] == f"/findings/{f['id']}/" and f["subject_url"] == f"/clusters/prod-a/nodes/{SLOW}/"


def test_nodes_are_ordered_by_rack_with_group_boundaries(client: Any, world: World) -> None:
    _synthetic(world, 8, 7, 3, slow="h0006")
    # Racks that cut across host-name order: r1 holds the odd nodes, r0 the even ones; h0007 has no rack.
    Node.objects.filter(cluster=world.cluster).update(switch="", rack="")
    for i in range(7):
        Node.objects.filter(cluster=world.cluster, hostname=f"h{i:04d}").update(rack=f"r{i % 2}")
    m = _matrix(client, world)
    hosts = [n["host"] for n in m["nodes"]]
    assert hosts == ["h0000", "h0002", "h0004", "h0006", "h0001", "h0003", "h0005", "h0007"]
    assert m["grouped_by"] == "rack"
    assert m["groups"] == [{"label": "r0", "start": 0, "end": 4}, {"label": "r1", "start": 4, "end": 7},
                           {"label": "unplaced", "start": 7, "end": 8}]
    # Indices follow the new order: the bad pairs still name node-006, now at index 3.
    assert m["bad"] and all(3 in (b["i"], b["j"]) for b in m["bad"])
    Node.objects.filter(cluster=world.cluster).update(switch="leaf-9")
    Node.objects.filter(cluster=world.cluster, hostname="h0007").update(switch="leaf-1")
    m = _matrix(client, world)
    assert m["grouped_by"] == "switch" and [g["label"] for g in m["groups"]] == ["leaf-1", "leaf-9"]
    assert m["nodes"][0]["host"] == "h0007"


def _synthetic(world: World, n: int, peers: int, rounds: int, slow: str = "") -> float:
    """``n`` nodes each probing ``peers`` fixed peers (its rack's neighbours) once a second for ``rounds`` s, each
    second one post per node (stored as frames, as ingest frames a post); pairs with ``slow`` at either end take
    2 ms more."""
    Node.objects.bulk_create([Node(cluster=world.cluster, hostname=f"h{i:04d}", rack=f"r{i // 32}") for i in range(n)])
    ids = dict(Node.objects.filter(cluster=world.cluster).values_list("hostname", "id"))
    now = time.time()
    for r in range(rounds):
        ts = now - rounds + r
        for i in range(n):
            a = f"h{i:04d}"
            probes = []
            for k in range(1, peers + 1):
                b = f"h{(i + k) % n:04d}"
                rtt = 0.08 + 0.001 * (i % 7) + (2.0 if slow in (a, b) else 0.0)
                probes.append({"ts": ts, "peer": b, "sent": 5, "lost": 0, "rtt_ms": rtt, "rtt_p99_ms": rtt * 1.3,
                               "bw_gbps": 180.0})
            framed.probes(world.cluster, ids[a], probes)
    return now


def test_the_matrix_is_sparse(client: Any, world: World) -> None:
    _synthetic(world, 64, 4, 3)
    m = _matrix(client, world)
    assert len(m["nodes"]) == 64
    assert len(m["pairs"]["i"]) == 64 * 4, "one entry per probed pair, not 64 x 64"
    assert set(m["pairs"]) == {"i", "j", "rtt_ms", "rtt_p99_ms", "bw_gbps", "loss"}
    assert all(len(v) == 64 * 4 for v in m["pairs"].values())
    assert m["bad"] == [] and not m["truncated"]
    assert [g["label"] for g in m["groups"]] == ["r0", "r1"]


def test_a_link_page_and_its_series(client: Any, world: World, slow_feed: Feed) -> None:
    client.force_login(world.owner)
    r = client.get("/clusters/prod-a/links/node-006/node-002/?range=1h")
    assert r.status_code == 302 and r["Location"] == "/clusters/prod-a/links/node-002/node-006/?range=1h"
    page = client.get(r["Location"])
    assert page.status_code == 200 and b"/static/web/link.js" in page.content
    assert b'href="/clusters/prod-a/nodes/node-006/"' in page.content
    s = client.get("/api/v1/clusters/prod-a/links/node-002/node-006/series?range=15m").json()
    assert [(d["from"], d["to"]) for d in s["directions"]] == [("node-002", "node-006"), ("node-006", "node-002")]
    for d in s["directions"]:
        ser = d["series"]
        assert len(ser["t"]) >= 5 and set(ser) >= {"rtt_ms", "rtt_p99_ms", "loss", "bw_gbps"}
        assert max(v for v in ser["rtt_ms"]["max"] if v is not None) > s["thresholds"]["rtt_ms"]
    assert set(s["cpu"]) == {"node-002", "node-006"} and s["cpu"]["node-006"]["t"]
    assert ("slow_link", SLOW) in {(f["kind"], f["subject"]) for f in s["findings"]}
    assert s["a"]["url"] == "/clusters/prod-a/nodes/node-002/"
    assert client.get("/api/v1/clusters/prod-a/links/node-002/nowhere/series").status_code == 404
    assert client.get("/api/v1/clusters/prod-a/links/node-002/node-002/series").status_code == 400
    assert client.get("/api/v1/clusters/prod-a/links?range=2d").status_code == 400


def test_outsiders_get_404_and_strangers_401(client: Any, world: World) -> None:
    _synthetic(world, 4, 2, 2)
    urls_api = ["/api/v1/clusters/prod-a/links", "/api/v1/clusters/prod-a/links/h0001/h0002/series"]
    urls_page = ["/clusters/prod-a/links/", "/clusters/prod-a/links/h0001/h0002/"]
    for url in urls_api:
        r = client.get(url)
        assert r.status_code == 401 and r.json()["error"] == "unauthenticated", url
    for url in urls_page:
        r = client.get(url)
        assert r.status_code == 302 and r["Location"].startswith("/login/"), url
    client.force_login(world.outsider)
    for url in urls_api + urls_page:
        assert client.get(url).status_code == 404, url
    client.force_login(world.teammate)
    for url in urls_api + urls_page:
        assert client.get(url).status_code == 200, url
