"""Nodes learn their rack and switch from the batches their agents send: through the real ingest door (the Django
view and the ASGI fast path), written only when they change, and a bad label is a 400 that stores nothing."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from dashboard.telemetry import models as m
from tests.server.conftest import AsgiServer, World, make_batch, post
from tests.server.test_ingest import counts
from tests.server.test_live import ingest


def place(host: str = "node-000") -> tuple[str, str]:
    node = m.Node.objects.get(hostname=host)
    return node.rack, node.switch


@pytest.mark.django_db
def test_it_places_the_node_and_follows_a_move(client: Any, world: World) -> None:
    r = post(client, make_batch(seq=0, topology={"rack": "rack-07", "switch": "leaf-07", "spine": "spine-1"}),
             world.token)
    assert r.status_code == 200, r.content
    assert place() == ("rack-07", "leaf-07")
    # Recabled to another leaf: the new switch is stored, the rack stays.
    post(client, make_batch(seq=1, topology={"rack": "rack-07", "switch": "leaf-08"}), world.token)
    assert place() == ("rack-07", "leaf-08")


@pytest.mark.django_db
def test_a_batch_without_topology_or_with_a_field_left_out_keeps_what_was_known(client: Any, world: World) -> None:
    post(client, make_batch(seq=0, topology={"rack": "rack-01", "switch": "leaf-01"}), world.token)
    assert post(client, make_batch(seq=1), world.token).status_code == 200  # an old agent: no topology at all
    assert place() == ("rack-01", "leaf-01")
    post(client, make_batch(seq=2, topology={"rack": "rack-02"}), world.token)  # knows only its rack
    assert place() == ("rack-02", "leaf-01")
    post(client, make_batch(seq=3, topology={"rack": None, "switch": "leaf-09"}), world.token)
    assert place() == ("rack-02", "leaf-09")


@pytest.mark.django_db(transaction=True)  # the cache fills on commit, which a test transaction never does
def test_an_unchanged_topology_costs_no_write(client: Any, world: World) -> None:
    topo = {"rack": "rack-03", "switch": "leaf-03"}
    post(client, make_batch(seq=0, topology=topo), world.token)
    with CaptureQueriesContext(connection) as queries:
        for seq in range(1, 4):
            assert post(client, make_batch(seq=seq, topology=topo), world.token).status_code == 200
    writes = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("UPDATE") and "rack" in q["sql"]]
    assert writes == [], writes
    # A change still gets through the cache.
    post(client, make_batch(seq=4, topology={**topo, "switch": "leaf-04"}), world.token)
    assert place() == ("rack-03", "leaf-04")


@pytest.mark.django_db
def test_two_nodes_keep_their_own_places(client: Any, world: World) -> None:
    post(client, make_batch(seq=0, host="node-000", topology={"rack": "rack-00", "switch": "leaf-00"}), world.token)
    post(client, make_batch(seq=0, host="node-009", topology={"rack": "rack-01", "switch": "leaf-01"}), world.token)
    assert (place("node-000"), place("node-009")) == (("rack-00", "leaf-00"), ("rack-01", "leaf-01"))


@pytest.mark.django_db
@pytest.mark.parametrize(("topology", "reason"), [
    ({"rack": "rack 7"}, "topology.rack: the string 'rack 7' does not match"),
    ({"switch": "x" * 65}, "topology.switch: too long: 65 > 64"),
    ({"rack": ""}, "topology.rack: too short"),
    ({"rack": 7}, "topology.rack: expected a string, got a number"),
    ({"row": "r1"}, "topology.row: unknown field (a Topology has no such field)"),
    ("rack-7", "topology: expected an object, got the string 'rack-7'"),
])
def test_a_bad_topology_is_a_400_with_the_reason_and_nothing_is_stored(
        client: Any, world: World, topology: Any, reason: str) -> None:
    post(client, make_batch(seq=0, topology={"rack": "rack-01", "switch": "leaf-01"}), world.token)
    before = counts()
    r = post(client, make_batch(seq=1, topology=topology), world.token)
    assert r.status_code == 400, r.content
    assert r.json()["error"] == "invalid_batch"
    assert r.json()["detail"].startswith(reason), r.json()["detail"]
    assert counts() == before, "a refused batch must change nothing"
    assert place() == ("rack-01", "leaf-01")


def test_the_asgi_fast_path_places_the_node(asgi_server: AsgiServer, world: World) -> None:
    r = ingest(asgi_server, world.token, make_batch(seq=0, topology={"rack": "rack-05", "switch": "leaf-05"}))
    assert r.status_code == 200, r.text
    assert place() == ("rack-05", "leaf-05")
    bad = ingest(asgi_server, world.token, make_batch(seq=1, topology={"switch": "leaf/05"}))
    assert bad.status_code == 400 and bad.json()["detail"].startswith("topology.switch:")


@pytest.mark.django_db
def test_the_openapi_document_describes_the_topology(client: Any) -> None:
    schemas = client.get("/api/openapi.json").json()["components"]["schemas"]
    assert {"$ref": "#/components/schemas/Topology"} in schemas["Batch"]["properties"]["topology"]["anyOf"]
    assert "topology" not in schemas["Batch"]["required"]
    assert set(schemas["Topology"]["properties"]) == {"rack", "switch", "spine"}
    assert schemas["Topology"]["properties"]["rack"]["anyOf"][0]["maxLength"] == 64
