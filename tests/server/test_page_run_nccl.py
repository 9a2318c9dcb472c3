"""The run page's NCCL panel: each rank's transports from its NCCL logs, parsed by the agent's parser and stored
through real ingest, held for the life of the run (not a recent window), in node order, with the ranks on sockets
flagged and linked where the cluster has InfiniBand."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import jsonschema
import pytest

from collectors.doctor.nccl import NcclStreamParser
from dashboard.telemetry.models import Run
from tests.server.conftest import World, post
from tests.server.test_diagnosis_pass import Feed

pytestmark = pytest.mark.django_db

GPUS, NODES = 4, 8
WORLD = GPUS * NODES
SOCKET_NODE = 5  # ranks 20-23 run over sockets
NO_GDR_RANK = 14
SILENT = (30, 31)  # no NCCL log reached the agent


def nccl_log(rank: int, pid: int, net: str = "") -> list[str]:
    """What NCCL 2.21 prints for a rank of the 8 x 4 run: its world comm, a ring to the next GPU over P2P, the
    rank above it on the next node over the network (both directions)."""
    n, g = divmod(rank, GPUS)
    head = f"node-{n:03d}:{pid}:{pid + 7} [{g}] NCCL INFO "
    up, down = (rank + GPUS) % WORLD, (rank - GPUS) % WORLD
    if not net:
        net = "Socket/0" if n == SOCKET_NODE else "IB/0" if rank == NO_GDR_RANK else "IB/0/GDRDMA"
    return [head + "Using network " + ("Socket" if net.startswith("Socket") else "IB"),
            head + f"ncclCommInitRank comm 0x7f{rank:02d} rank {rank} nranks {WORLD} cudaDev {g} nvmlDev {g} "
                   f"busId {g + 1}b000 commId 0xfeed - Init START",
            head + f"Channel 00/0 : {rank}[{g}] -> {n * GPUS + (g + 1) % GPUS}[{(g + 1) % GPUS}] via P2P/IPC/read",
            head + f"Channel 01/0 : {down}[{g}] -> {rank}[{g}] [receive] via NET/{net}",
            head + f"Channel 01/0 : {rank}[{g}] -> {up}[{g}] [send] via NET/{net}",
            head + f"comm 0x7f{rank:02d} rank {rank} nranks {WORLD} cudaDev {g} busId {g + 1}b000 - Init COMPLETE"]


def agent_batches(ts: float, logs: dict[int, list[str]], seq: int = 1000) -> list[dict[str, Any]]:
    """One batch per node, its events from one parser per process file, as collectors.sources.nccl_tail sends."""
    per_node: dict[str, list[dict[str, Any]]] = {}
    for lines in logs.values():
        parser = NcclStreamParser()
        for line in lines:
            for e in parser.feed(line):
                e["ts"] = ts
                e["data"]["file"] = f"/var/log/nccl/nccl.{lines[0].split(':')[0]}.{lines[0].split(':')[1]}.log"
                per_node.setdefault(e["data"]["host"], []).append(e)
    return [{"v": 1, "agent_id": f"agent-{host}", "seq": seq, "host": host, "sent_at": time.time(), "events": events}
            for host, events in per_node.items()]


def ingest(client: Any, world: World, batches: list[dict[str, Any]]) -> None:
    for b in batches:
        r = post(client, b, world.token)
        assert r.status_code == 200, r.content


@pytest.fixture
def run(world: World, client: Any) -> Run:
    feed = Feed(world, [])
    feed.run(3, passes=False)
    run = Run.objects.get(name="llm")
    # The run began three hours ago and steps still: NCCL said what it set up at init, never again since.
    began = run.last_step_at - timedelta(hours=3)
    Run.objects.filter(id=run.id).update(created_at=began)
    run.refresh_from_db()
    logs = {r: nccl_log(r, 5000 + r) for r in range(WORLD) if r not in SILENT}
    ingest(client, world, agent_batches((began + timedelta(seconds=20)).timestamp(), logs))
    return run


def test_each_rank_keeps_the_transports_nccl_set_up_at_init(client: Any, world: World, run: Run) -> None:
    client.force_login(world.owner)
    body = client.get(f"/api/v1/runs/{run.id}/nccl").json()
    doc = client.get("/api/openapi.json").json()["paths"]["/api/v1/runs/{run_id}/nccl"]["get"]
    jsonschema.validate(body, doc["responses"]["200"]["content"]["application/json"]["schema"])
    assert body["interconnect"] == "ib" and body["socket_expected"] is True
    ranks = body["ranks"]
    assert len(ranks["order"]) == WORLD and ranks["order"][:5] == [0, 1, 2, 3, 4], "node order, then local rank"
    assert [(n["host"], n["first"], n["count"]) for n in ranks["nodes"]][:2] == [("node-000", 0, 4), ("node-001", 4, 4)]
    keys = [c["key"] for c in ranks["classes"]]
    cls = {rank: keys[c] for rank, c in zip(ranks["order"], ranks["cls"], strict=True)}
    assert {r for r, c in cls.items() if c == "socket"} == {20, 21, 22, 23}
    assert cls[NO_GDR_RANK] == "ib" and cls[0] == "ib_gdr" and cls[30] == cls[31] == "unknown"
    counts = {c["key"]: c["ranks"] for c in ranks["classes"]}
    assert counts == {"socket": 4, "ib": 1, "net": 0, "ib_gdr": 25, "intra": 0, "unknown": 2}
    assert [c["suspect"] for c in ranks["classes"]] == [True, False, False, False, False, False]
    assert ranks["transports"] == {"P2P/IPC": 30, "IB": 26, "Socket": 4}
    combo = ranks["combos"][ranks["combo"][ranks["order"].index(0)]]
    assert combo == "IB (GDR) · P2P/IPC"
    assert ranks["socket_count"] == 4
    assert [s["rank"] for s in ranks["socket"]] == [20, 21, 22, 23]
    s = ranks["socket"][0]
    assert ranks["rank_url_prefix"] + "20/" == s["url"]
    assert (s["url"], s["node_url"], s["gpu_url"], s["transports"]) == (
        f"/runs/{run.id}/ranks/20/", "/clusters/prod-a/nodes/node-005/", "/clusters/prod-a/nodes/node-005/gpus/0/",
        ["P2P/IPC", "Socket"])
    # the node table keeps its rows; the socket node first
    assert body["nodes"][0]["host"] == "node-005" and body["nodes"][0]["suspect"]
    assert "Socket" in body["nodes"][0]["transports"]
    warned = {(w["host"], w["rank"]) for w in body["warnings"]}
    assert ("node-005", 20) in warned, "a socket connection is a warning, linked to its rank"


def test_facts_from_before_the_run_or_from_a_subgroup_do_not_count(client: Any, world: World, run: Run) -> None:
    client.force_login(world.owner)
    # the node's previous job (an hour before this run began) ran rank 0 over sockets
    before = (run.created_at - timedelta(hours=1)).timestamp()
    ingest(client, world, agent_batches(before, {0: nccl_log(0, 3000, net="Socket/0")}, seq=2000))
    # this run's rank 1 process set up a 4-rank subgroup whose rank 0 reached over sockets: rank 0 of the subgroup
    # is not the run's rank 0
    head = "node-000:5001:5008 [1] NCCL INFO "
    sub = [head + "ncclCommInitRank comm 0x99 rank 0 nranks 4 cudaDev 1 nvmlDev 1 busId 2b000 commId 0x1 - Init START",
           head + "Channel 00/0 : 0[1] -> 1[2] [send] via NET/Socket/0"]
    ingest(client, world, agent_batches(run.last_step_at.timestamp(), {99: sub}, seq=2001))
    body = client.get(f"/api/v1/runs/{run.id}/nccl").json()
    keys = [c["key"] for c in body["ranks"]["classes"]]
    cls = {rank: keys[c] for rank, c in zip(body["ranks"]["order"], body["ranks"]["cls"], strict=True)}
    assert cls[0] == "ib_gdr" and cls[1] == "ib_gdr"
    assert body["ranks"]["socket_count"] == 4


def test_a_rank_restarted_with_sockets_fixed_shows_its_new_process(client: Any, world: World, run: Run) -> None:
    client.force_login(world.owner)
    ingest(client, world, agent_batches(run.last_step_at.timestamp(), {20: nccl_log(20, 9020, net="IB/0/GDRDMA")},
                                        seq=3000))
    body = client.get(f"/api/v1/runs/{run.id}/nccl").json()
    assert body["ranks"]["socket_count"] == 3 and 20 not in [s["rank"] for s in body["ranks"]["socket"]]


def test_sockets_are_no_fault_on_an_ethernet_cluster(client: Any, world: World, run: Run) -> None:
    world.cluster.interconnect = "eth"
    world.cluster.save(update_fields=["interconnect"])
    client.force_login(world.owner)
    body = client.get(f"/api/v1/runs/{run.id}/nccl").json()
    assert body["socket_expected"] is False and not any(c["suspect"] for c in body["ranks"]["classes"])
    assert not next(n for n in body["nodes"] if n["host"] == "node-005")["suspect"]
