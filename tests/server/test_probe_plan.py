"""Server-planned probe peers: the plan (a pure function), the endpoint (token and scope rules, over Django's test
client), and an agent's ProbeSource asking the real server (uvicorn) for its peers."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collectors.agent.config import build
from collectors.sources.probes import ProbeSource
from dashboard.telemetry import probe_api, tokens
from dashboard.telemetry.models import Cluster, Node
from dashboard.telemetry.probeplan import Layout, epochs_to_cover


@pytest.fixture(autouse=True)
def _fresh_layouts() -> Iterator[None]:
    probe_api.clear_cache()
    yield
    probe_api.clear_cache()


def _fabric(leaves: int, per_leaf: int) -> list[tuple[str, str, str]]:
    # Odd rows carry only a rack: the leaf is the switch, else the rack.
    return [(f"n{leaf:03d}-{i:02d}", f"sw{leaf}" if leaf % 2 == 0 else "", f"rack{leaf}")
            for leaf in range(leaves) for i in range(per_leaf)]


# -- the plan -----------------------------------------------------------------------------------------------------

def test_plan_covers_every_leaf_pair_with_bounded_fanout() -> None:
    layout = Layout.build(_fabric(leaves=16, per_leaf=8))  # 128 nodes
    k_local, k_remote = 3, 4
    need = epochs_to_cover(16, k_remote)
    assert need == 4  # ceil(15 / 4)
    leaf = {h: layout.leaf_of(h) for h in layout.where}
    covered: set[frozenset[str]] = set()
    for epoch in range(100, 100 + need):
        for host in layout.where:
            peers = layout.peers(host, epoch, k_local, k_remote)
            assert len(peers) == len(set(peers)) <= k_local + k_remote
            assert host not in peers
            local = [p for p in peers if leaf[p] == leaf[host]]
            assert len(local) == k_local
            covered.update(frozenset((leaf[host], leaf[p])) for p in peers if leaf[p] != leaf[host])
    all_pairs = {frozenset(pair) for pair in itertools.combinations(layout.leaves, 2)}
    assert covered == all_pairs
    # One epoch fewer leaves some pair out: the rotation, not a fixed sample, is what covers the fabric.
    partial = {frozenset((leaf[h], leaf[p])) for h in layout.where for p in layout.peers(h, 100, k_local, k_remote)
               if leaf[p] != leaf[h]}
    assert partial < all_pairs


def test_plan_is_deterministic_symmetric_inside_a_leaf_and_rotates() -> None:
    rows = _fabric(leaves=4, per_leaf=6)
    a, b = Layout.build(rows), Layout.build(list(reversed(rows)))
    for host in a.where:
        assert a.peers(host, 7) == b.peers(host, 7)  # the same answer whatever order the rows came in
    # Same-leaf neighbours are mutual (a ring, both sides), so a bad pair inside a leaf is probed from both ends.
    for host in a.where:
        for p in a.peers(host, 7, k_local=2, k_remote=0):
            assert host in a.peers(p, 7, k_local=2, k_remote=0)
    assert a.peers("n000-00", 7) != a.peers("n000-00", 8)
    assert a.peers("nobody", 7) == []


def test_plan_of_2048_nodes_is_linear() -> None:
    layout = Layout.build(_fabric(leaves=64, per_leaf=32))
    pairs = sum(len(layout.peers(h, 3)) for h in layout.where)
    assert pairs == 2048 * 8  # k_local + k_remote each, not 2048²


def test_unplaced_nodes_share_one_leaf_and_small_leaves_cap_fanout() -> None:
    layout = Layout.build([("a", "", ""), ("b", "", ""), ("c", "sw1", "")])
    assert layout.peers("a", 0) == ["b", "c"]
    assert layout.peers("c", 0) in (["a"], ["b"])


# -- the endpoint -------------------------------------------------------------------------------------------------

def _nodes(cluster: Any) -> None:
    Node.objects.bulk_create(Node(cluster=cluster, hostname=h, switch=s, rack=r) for h, s, r in _fabric(3, 4))


def _ask(client: Any, token: str | None, **query: str) -> Any:
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    return client.get("/api/v1/probes/peers", query, **headers)


@pytest.mark.django_db
def test_endpoint_plans_for_the_token_and_refuses_others(client: Any) -> None:
    cluster = Cluster.objects.create(name="fab")
    _nodes(cluster)
    _, cluster_token = tokens.create_token(cluster, "all")
    _, agent_token = tokens.create_token(cluster, "leaf0", scope="agent", hosts=["n000-*"])
    _, hook_token = tokens.create_token(cluster, "hooks", scope="hook")

    answer = _ask(client, agent_token, host="n000-01", port="9000")
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert body["plan"] == "same-leaf k + rotating cross-leaf sample" and body["round_s"] > 0
    assert body["leaf"] == "sw0"
    hosts = [p["host"] for p in body["peers"]]
    assert hosts[:3] == ["n000-02", "n000-00", "n000-03"]  # its leaf's other three, nearest first
    assert {h[:4] for h in hosts[3:]} == {"n001", "n002"}  # then one on each other leaf
    assert all(p["address"] == p["host"] and p["port"] == 9000 for p in body["peers"])
    assert _ask(client, cluster_token, host="n002-00").status_code == 200

    def refused(token: str | None, status: int, code: str, **query: str) -> None:
        got = _ask(client, token, **query)
        assert (got.status_code, got.json()["error"]) == (status, code), got.content

    refused(agent_token, 403, "scope", host="n001-00")  # not a host this token may post as
    refused(hook_token, 403, "scope", host="n000-01")
    refused(None, 401, "missing_token", host="n000-01")
    refused("cdx_nothing_here", 401, "unknown_token", host="n000-01")
    refused(agent_token, 404, "unknown_host", host="n000-99")
    refused(agent_token, 400, "bad_request")
    refused(agent_token, 400, "bad_request", host="n000-01", port="0")
    assert client.post("/api/v1/probes/peers?host=n000-01", HTTP_AUTHORIZATION=f"Bearer {agent_token}").status_code == 405
    # The other cluster's token knows none of these nodes.
    _, other = tokens.create_token(Cluster.objects.create(name="elsewhere"), "x")
    refused(other, 404, "unknown_host", host="n000-01")
    # A node that reported after the layout was cached is planned at once.
    Node.objects.create(cluster=cluster, hostname="n000-09", switch="sw0")
    assert _ask(client, agent_token, host="n000-09").status_code == 200


def test_endpoint_is_in_the_openapi_document(client: Any) -> None:
    doc = client.get("/api/openapi.json").json()
    op = doc["paths"]["/api/v1/probes/peers"]["get"]
    assert op["security"] == [{"clusterToken": []}] and {"200", "401", "403", "404"} <= set(op["responses"])


# -- the agent ----------------------------------------------------------------------------------------------------

def test_agent_probe_source_gets_its_peers_from_the_server(asgi_server: Any, tmp_path: Path) -> None:
    cluster = Cluster.objects.create(name="fab")
    _nodes(cluster)
    _, token = tokens.create_token(cluster, "n1", scope="agent", hosts=["n001-02"])
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    # The agent config fills in the server, token and host for the server plan.
    cfg = build({"server": asgi_server.url, "token_file": str(token_file), "host": "n001-02",
                 "sources": {"probes": {"plan": "server", "peers": ["extra=127.0.0.1:9"], "listen": False}}},
                {}, ("probes",))
    options = cfg.sources["probes"]
    assert (options["server"], options["self_name"]) == (asgi_server.url, "n001-02")
    source = ProbeSource(**{k: v for k, v in options.items() if k != "enabled"}, port=8651)
    try:
        peers = source.peers()
        labels = [p.label for p in peers]
        assert "extra" in labels  # merged with the static peers
        planned = [p for p in peers if p.label != "extra"]
        assert len(planned) == 5 and all(p.port == 8651 and p.host == p.label for p in planned)
        assert sum(p.label.startswith("n001-") for p in planned) == 3
        # The server goes away (the token is revoked): the last plan is kept, and the next ask waits.
        tokens.revoke(tokens.lookup(token).prefix)  # type: ignore[union-attr]
        source._plan_due = 0.0
        assert source.peers() == peers
        assert source._plan_error and "401" in source._plan_error
    finally:
        source.close()
    with pytest.raises(ValueError, match="server"):
        ProbeSource(plan="server", listen=False)
