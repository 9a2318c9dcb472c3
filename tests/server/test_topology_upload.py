"""An owner's topology file for the whole cluster: uploaded with the real ``clusterdx cluster topology`` command or on
the settings page (owner only, audit-logged), shown by the API, and never overwritten by what the agents report
through the ingest endpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from dashboard.telemetry.models import AuditEntry, Node
from tests.server.conftest import World, make_batch, post
from tests.server.test_cli import cli_db, clusterdx  # noqa: F401  (cli_db is a fixture)

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "topology"
URL = "/clusters/prod-a/settings/topology/"


def places() -> dict[str, tuple[str, str, str, str]]:
    return {n.hostname: (n.rack, n.switch, n.spine, n.placed_by) for n in Node.objects.order_by("hostname")}


def test_the_command_places_known_nodes_and_names_the_unknown(cli_db: None, world: World, client: Any,  # noqa: F811
                                                              tmp_path: Path) -> None:
    for host in ("node-000", "node-001"):
        post(client, make_batch(seq=0, host=host, topology={"rack": "rack-x", "switch": "leaf-x"}), world.token)
    done = clusterdx("cluster", "topology", "prod-a", str(FIX / "cluster.csv"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == ("prod-a: 2 nodes placed, 0 unchanged; 1 host not seen yet, placed when their "
                                   "agents first report: node-009")
    assert places() == {"node-000": ("rack-00", "leaf-00", "spine-0", "file"),
                        "node-001": ("rack-00", "leaf-00", "spine-0", "file")}
    # node-009's agent comes up later, configured for another rack: the file's place is what it gets.
    post(client, make_batch(seq=0, host="node-009", topology={"rack": "rack-x", "switch": "leaf-x"}), world.token)
    assert places()["node-009"] == ("rack-01", "leaf-01", "", "file")
    entry = AuditEntry.objects.get(action="topology.upload")
    assert entry.actor_name.startswith("cli:") and entry.target == "cluster.csv"
    assert entry.detail == {"placed": 2, "unchanged": 0, "unknown": 1}
    conf = tmp_path / "topology.conf"
    conf.write_text("SwitchName=leaf1 Nodes=gpu[1-\n")
    bad = clusterdx("cluster", "topology", "prod-a", str(conf))
    assert bad.returncode == 2 and bad.stdout.startswith(f"error: {conf}: line 1: bad host list 'gpu[1-'"), bad.stdout
    assert AuditEntry.objects.filter(action="topology.upload").count() == 1, "a refused file changes nothing"


@pytest.mark.django_db
def test_an_uploaded_place_wins_over_the_agents_report(client: Any, world: World) -> None:
    post(client, make_batch(seq=0, topology={"rack": "rack-07", "switch": "leaf-07"}), world.token)
    post(client, make_batch(seq=0, host="node-009", topology={"rack": "rack-09"}), world.token)
    assert places()["node-000"] == ("rack-07", "leaf-07", "", "agent")
    web = Client()
    web.force_login(world.owner)
    answer = web.post(URL, {"file": SimpleUploadedFile("fabric.json", (FIX / "cluster.json").read_bytes())})
    assert answer.status_code == 302, answer.content[:300]
    assert places() == {"node-000": ("rack-00", "leaf-00", "spine-0", "file"),
                        "node-009": ("rack-01", "leaf-01", "", "file")}
    # The agent still says rack-07 (its config was copied from another rack), and now a new switch too: ignored.
    for seq, topo in enumerate([{"rack": "rack-07", "switch": "leaf-07"}, {"switch": "leaf-99", "spine": "s9"}], 1):
        assert post(client, make_batch(seq=seq, topology=topo), world.token).status_code == 200
    assert places()["node-000"] == ("rack-00", "leaf-00", "spine-0", "file")
    # A node the file leaves out still follows its agent.
    post(client, make_batch(seq=0, host="node-005", topology={"rack": "rack-05", "spine": "spine-1"}), world.token)
    assert places()["node-005"] == ("rack-05", "", "spine-1", "agent")
    node = web.get("/api/v1/clusters/prod-a/nodes/node-000").json()["node"]
    assert (node["rack"], node["switch"], node["spine"], node["placed_by"]) == ("rack-00", "leaf-00", "spine-0", "file")
    page = web.get("/clusters/prod-a/settings/").content.decode()
    assert "2 nodes placed by an uploaded file" in page and "2 nodes placed, 0 unchanged" in page


@pytest.mark.django_db
def test_only_an_owner_uploads_and_a_bad_file_is_a_400_with_the_line(world: World) -> None:
    post(Client(), make_batch(seq=0, topology={"rack": "rack-07"}), world.token)
    web = Client()
    web.force_login(world.teammate)  # a member
    assert web.post(URL, {"file": SimpleUploadedFile("t.csv", b"node-000,r1\n")}).status_code == 403
    web.force_login(world.outsider)
    assert web.post(URL, {"file": SimpleUploadedFile("t.csv", b"node-000,r1\n")}).status_code == 404
    web.force_login(world.owner)
    bad = web.post(URL, {"file": SimpleUploadedFile("t.csv", b"host,rack\nnode-000,rack 1\n")})
    assert bad.status_code == 400 and "t.csv: line 2: rack: the string &#x27;rack 1&#x27; does not match" in \
        bad.content.decode()
    assert web.post(URL, {}).status_code == 400
    assert places()["node-000"] == ("rack-07", "", "", "agent")
    assert not AuditEntry.objects.filter(action="topology.upload").exists()
