"""A node's network interfaces, from the agent's host samples to the NCCL audit and the node page: stored through the
real ingest, hostile names refused with the field named, the newest list per node read by the diagnosis loader
though samples carry it only every few minutes, and a wrong NCCL_SOCKET_IFNAME named with the node's real
interfaces."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from dashboard.diagnosis.loader import load_window
from dashboard.diagnosis.tasks import run_pass
from dashboard.telemetry.models import HostSample
from tests.server.conftest import World, make_batch, post

pytestmark = pytest.mark.django_db

ETH0 = {"name": "eth0", "state": "up", "kind": "ether", "virtual": False, "mtu": 9000, "speed_mbps": 100000,
        "addresses": ["10.77.0.2/24", "fe80::2/64"]}
ETH1 = {"name": "eth1", "state": "down", "kind": "ether", "virtual": False, "mtu": 1500, "speed_mbps": None,
        "addresses": []}
LO = {"name": "lo", "state": "unknown", "kind": "loopback", "virtual": True, "mtu": 65536, "speed_mbps": None,
      "addresses": ["127.0.0.1/8"]}


def _host(ts: float, interfaces: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    sample: dict[str, Any] = {"ts": ts, "cpu_pct": 10.0}
    if interfaces is not None:
        sample["interfaces"] = interfaces
    return sample


def _send(client: Any, world: World, seq: int, host: str, ts: float, **extra: Any) -> None:
    batch = make_batch(seq, host=host, **extra)
    batch["sent_at"] = batch["gpus"][0]["ts"] = batch["gpus"][1]["ts"] = ts
    for s in batch["steps"]:
        s["ts"] = ts
    response = post(client, batch, world.token)
    assert response.status_code == 200, response.content


@pytest.mark.parametrize("name, why", [
    ("eth\u0000", "NUL characters are not allowed"),
    ("eth\u0001x", "does not match"),
    ("e" * 10_000, "too long: 10000 > 15"),
    ("eth 0", "does not match"),
])
def test_a_hostile_interface_name_is_a_400_naming_the_field(client: Any, world: World, name: str, why: str) -> None:
    batch = make_batch(0, hosts=[_host(time.time(), [ETH0, {**LO, "name": name}])])
    response = post(client, batch, world.token)
    assert response.status_code == 400
    body = response.json()
    assert body["error"] == "invalid_batch"
    assert body["detail"].startswith("hosts[0].interfaces[1].name: ") and why in body["detail"]
    assert not HostSample.objects.exists()


def test_interfaces_are_stored_as_sent_and_absent_ones_stay_null(client: Any, world: World) -> None:
    now = time.time()
    _send(client, world, 0, "node-a", now - 1, hosts=[_host(now - 1, [ETH0, LO])])
    _send(client, world, 1, "node-a", now, hosts=[_host(now)])
    assert list(HostSample.objects.order_by("ts").values_list("interfaces", flat=True)) == [[ETH0, LO], None]


def test_the_node_keeps_the_newest_list_and_an_unchanged_resend_writes_nothing(
        world: World, django_capture_on_commit_callbacks: Any) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from clusterdx import wire
    from dashboard.ingest.writer import store_batch
    from dashboard.telemetry.models import Node

    now = time.time()

    def store(seq: int, ts: float, interfaces: list[dict[str, Any]] | None) -> list[str]:
        batch = wire.validate_batch(make_batch(seq, host="node-a", hosts=[_host(ts, interfaces)], steps=[]))
        with CaptureQueriesContext(connection) as queries, django_capture_on_commit_callbacks(execute=True):
            store_batch(world.cluster, batch)
        return [q["sql"] for q in queries if "interfaces" in q["sql"] and "telemetry_node" in q["sql"]]

    assert store(0, now - 10, [ETH0, ETH1, LO]) and store(1, now - 5, [ETH0, LO])
    assert store(2, now - 8, [ETH0, ETH1, LO]), "a late batch's list differs from the one stored last: asked"
    node = Node.objects.get(hostname="node-a")
    assert node.interfaces == [ETH0, LO], "the late, older list did not replace the newer one"
    assert node.interfaces_at.timestamp() == pytest.approx(now - 5, abs=0.01)
    assert store(3, now - 1, [ETH0, LO]), "this process last stored the late list: the current one is written again"
    assert store(4, now, [ETH0, LO]) == [], "an unchanged list resent a few minutes later is not written again"
    assert store(5, now, None) == []


def test_a_group_writes_every_nodes_list_in_one_statement_and_never_an_older_one(
        world: World, django_capture_on_commit_callbacks: Any) -> None:
    """The group commit's path (a server meeting 2,048 nodes at start): each node's newest list of the group, one
    UPDATE for all of them, and a replayed older list (a drained spool) still loses to a newer one."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from clusterdx import wire
    from dashboard.ingest.writer import clear_caches, store_group
    from dashboard.telemetry.models import Node

    now = time.time()

    def group(*items: tuple[int, str, float, list[dict[str, Any]]]) -> None:
        jobs = [(world.cluster, wire.validate_batch(make_batch(seq, host=host, hosts=[_host(ts, ifs)], steps=[])), "")
                for seq, host, ts, ifs in items]
        with django_capture_on_commit_callbacks(execute=True):
            assert [o.status for o in store_group(jobs)] == ["accepted"] * len(jobs)

    group((0, "node-a", now - 5, [ETH0, LO]), (0, "node-b", now - 5, [ETH0, ETH1, LO]),
          (1, "node-a", now - 4, [ETH0, ETH1, LO]))
    got = {n.hostname: n.interfaces for n in Node.objects.all()}
    assert got == {"node-a": [ETH0, ETH1, LO], "node-b": [ETH0, ETH1, LO]}, "each node's newest list of the group"
    clear_caches()  # another process (or a restart): only the database can refuse the older list
    with CaptureQueriesContext(connection) as queries:
        group((2, "node-a", now - 9, [LO]), (1, "node-b", now - 1, [ETH0, LO]))
    got = {n.hostname: n.interfaces for n in Node.objects.all()}
    assert got == {"node-a": [ETH0, ETH1, LO], "node-b": [ETH0, LO]}
    updates = [q for q in queries if q["sql"].startswith("UPDATE") and "interfaces" in q["sql"]]
    if connection.vendor == "postgresql":
        # The two nodes' lists went in one statement of psycopg's own (which Django does not capture), not an ORM
        # UPDATE each.
        assert updates == []
    else:
        assert len(updates) == 1 and "FROM (VALUES" in updates[0]["sql"], updates


def test_the_pass_names_a_wrong_socket_ifname_with_the_nodes_real_interfaces(client: Any, world: World) -> None:
    now = time.time()
    env = {"NCCL_SOCKET_IFNAME": "ib9", "NCCL_DEBUG": "WARN"}
    runs = [{"run": "run-1", "rank": r, "world_size": 4, "ts": now - 200, "host": "node-a", "env": env}
            for r in range(2)]
    # node-a's agent sent its list 10 minutes ago and then (unchanged) nothing: only 1 Hz samples without it since.
    _send(client, world, 0, "node-a", now - 600, hosts=[_host(now - 600, [{**ETH0, "addresses": ["10.9.9.9/8"]}])])
    _send(client, world, 1, "node-a", now - 200, hosts=[_host(now - 200, [ETH0, ETH1, LO])], runs=runs)
    for seq, ago in enumerate((100, 3, 2, 1), start=2):
        _send(client, world, seq, "node-a", now - ago, hosts=[_host(now - ago)])
    # node-b runs with a good setting next to an interface list that has eth0: nothing to say about it.
    good = [{**r, "rank": r["rank"] + 2, "host": "node-b", "env": {**env, "NCCL_SOCKET_IFNAME": "eth"}} for r in runs]
    _send(client, world, 0, "node-b", now - 2, hosts=[_host(now - 2, [ETH0, LO])], runs=good)

    w = load_window(world.cluster, now, beats=[])
    assert w.hosts["node-a"]["interfaces"] == [ETH0, ETH1, LO], "the newest list, not the older one"
    assert w.hosts["node-a"]["cpu_pct"] == 10.0 and w.hosts["node-a"]["ts"] == pytest.approx(now - 1, abs=0.01)

    found = [d for d in run_pass(world.cluster, now).detections if d.kind == "nccl_config"]
    assert [(d.subject, d.severity) for d in found] == [("node-a", "error")]
    det = found[0]
    assert [r["rule"] for r in det.evidence["metrics"]["rules"]] == ["socket_ifname_missing"]
    assert det.title == "NCCL_SOCKET_IFNAME=ib9 selects none of the node's interfaces (eth0 up 10.77.0.2/24, lo; " \
                        "down: eth1) on node-a"
    assert "set NCCL_SOCKET_IFNAME=eth0 on every rank of this node" in det.action
    assert {i["name"]: i["state"] for i in det.evidence["metrics"]["interfaces"]} == \
        {"eth0": "up", "eth1": "down", "lo": "unknown"}
    json.dumps(det.evidence)  # stored as JSON on the finding


def test_a_setting_that_selects_only_down_interfaces_is_named(client: Any, world: World) -> None:
    now = time.time()
    runs = [{"run": "run-1", "rank": r, "world_size": 2, "ts": now - 5, "host": "node-a",
             "env": {"NCCL_SOCKET_IFNAME": "=eth1"}} for r in range(2)]
    _send(client, world, 0, "node-a", now - 1, hosts=[_host(now - 1, [ETH0, ETH1, LO])], runs=runs)
    found = [d for d in run_pass(world.cluster, now).detections if d.kind == "nccl_config"]
    assert [d.subject for d in found] == ["node-a"]
    assert found[0].title.startswith("NCCL_SOCKET_IFNAME==eth1 selects only interfaces that are down (eth1; the node "
                                     "has eth0 up 10.77.0.2/24, lo; down: eth1)")
    assert "NCCL_SOCKET_IFNAME=eth0" in found[0].action
