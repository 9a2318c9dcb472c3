"""Token scopes: an agent token posts only as its node(s), a hook token only steps, beats, runs and the hooks' own
events; a legacy (cluster) token is unchanged. Checked over real HTTP on both doors: the ASGI fast path
(dashboard.asgi) and the plain Django view (Django's own ASGI handler, as a deployment without the fast path)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dashboard.storage import frames as fr
from dashboard.telemetry import models as m
from dashboard.telemetry import tokens
from tests.server import framed
from tests.server.conftest import make_batch

ROOT = Path(__file__).resolve().parents[2]


class Server:
    """uvicorn in a thread, serving ``app`` (an import string or an ASGI application) on a free port."""

    def __init__(self, app: Any) -> None:
        import socket

        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off",
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(params=["fast", "django"])
def door(request: pytest.FixtureRequest, transactional_db: None) -> Iterator[str]:
    from django.core.asgi import get_asgi_application

    server = Server("dashboard.asgi:application" if request.param == "fast" else get_asgi_application())
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def cluster(transactional_db: None) -> m.Cluster:
    return m.Cluster.objects.create(name="prod-a")


def send(url: str, token: str, batch: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    r = httpx.post(f"{url}/api/v1/ingest", json=batch, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    return r.status_code, r.json()


def stored() -> tuple[int, int, int, int]:
    return (m.AgentBatch.objects.count(), framed.count(fr.GPUS), m.Event.objects.count(), framed.count(fr.STEPS))


XID = {"ts": 0.0, "kind": "xid", "severity": "critical", "code": 79, "gpu_index": 0, "message": "fallen off the bus"}
BEAT = {"run": "run-1", "rank": 0, "ts": 0.0, "state": "step", "state_s": 0.5, "step": 3}
RUN = {"run": "run-1", "rank": 0, "world_size": 2, "ts": 0.0}


def hook_batch(seq: int, **extra: Any) -> dict[str, Any]:
    """What trainer_hooks' direct transport sends: steps, beats, runs and its own events, no samples."""
    batch = make_batch(seq=seq, host="node-003", agent_id="hook-node-003-4242-1")
    now = batch["sent_at"]
    batch.pop("gpus")
    batch.update(beats=[{**BEAT, "ts": now}], runs=[{**RUN, "ts": now}],
                 events=[{"ts": now, "kind": "checkpoint", "run": "run-1", "rank": 0, "step": 1},
                         {"ts": now, "kind": "hook", "run": "run-1", "rank": 0, "message": "rank 0 finished"}])
    batch.update(extra)
    return batch


def test_it_refuses_an_agent_token_posting_as_another_node(door: str, cluster: m.Cluster) -> None:
    _, token = tokens.create_token(cluster, "node-003", scope="agent", hosts=["node-003"])
    now = time.time()
    status, body = send(door, token, make_batch(host="node-004", events=[{**XID, "ts": now}]))
    assert (status, body) == (403, {"error": "token_scope", "detail": "this token may only post as node-003"})
    assert stored() == (0, 0, 0, 0)
    assert send(door, token, make_batch(host="node-003", events=[{**XID, "ts": now}]))[0] == 200
    assert stored() == (1, 2, 1, 2)


def test_an_agent_token_for_a_fleet_matches_its_host_patterns(door: str, cluster: m.Cluster) -> None:
    _, token = tokens.create_token(cluster, "fleet", scope="agent", hosts=["node-*", "gpu-??"])
    assert [send(door, token, make_batch(host=h))[0] for h in ("node-017", "gpu-01", "gpu-001", "login-1")] == [
        200, 200, 403, 403]
    assert send(door, token, make_batch(host="login-1"))[1]["detail"] == "this token may only post as node-* or gpu-??"
    assert m.Node.objects.filter(cluster=cluster).count() == 2


def test_a_hook_token_may_send_only_steps_beats_runs_and_its_own_events(door: str, cluster: m.Cluster) -> None:
    _, token = tokens.create_token(cluster, "hooks", scope="hook")
    now = time.time()
    refused = [
        (hook_batch(1, gpus=make_batch()["gpus"]), "a hook token may not send gpus"),
        (hook_batch(2, hosts=[{"ts": now, "cpu_pct": 5.0}]), "a hook token may not send hosts"),
        (hook_batch(3, probes=[{"ts": now, "peer": "node-004", "sent": 10, "lost": 0}]),
         "a hook token may not send probes"),
        (hook_batch(4, events=[{**XID, "ts": now}]),
         "a hook token may not send events of kind 'xid' (only checkpoint, error, hook)"),
        (hook_batch(5, topology={"rack": "r1"}), "a hook token may not send topology"),
    ]
    for batch, detail in refused:
        assert send(door, token, batch) == (403, {"error": "token_scope", "detail": detail})
    assert stored() == (0, 0, 0, 0)
    status, body = send(door, token, hook_batch(6))
    assert (status, body["status"]) == (200, "accepted")
    assert stored() == (1, 0, 2, 2)


def test_a_legacy_cluster_token_still_posts_anything_as_any_node(door: str, cluster: m.Cluster) -> None:
    row, token = tokens.create_token(cluster, "agents")
    assert row.scope == "cluster" and row.hosts == ""
    now = time.time()
    for seq, host in enumerate(("node-003", "node-004")):
        assert send(door, token, make_batch(seq=seq, host=host, events=[{**XID, "ts": now}]))[0] == 200
    assert stored() == (2, 4, 2, 4)


# -- the command line --------------------------------------------------------------------------------------------
def clusterdx(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clusterdx", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "DJANGO_SETTINGS_MODULE": "dashboard.settings"})


@pytest.fixture
def cli_db(transactional_db: None) -> Iterator[None]:
    """The subprocess must use the test database: point it at the same one this test process uses."""
    from django.db import connection

    name = connection.settings_dict["NAME"]
    url = os.environ.get("DATABASE_URL", "")
    if connection.vendor == "sqlite":
        os.environ["CLUSTERDX_SQLITE_PATH"] = name
    else:
        os.environ["DATABASE_URL"] = url.rsplit("/", 1)[0] + "/" + name
    yield
    os.environ.pop("CLUSTERDX_SQLITE_PATH", None)
    if connection.vendor != "sqlite":
        os.environ["DATABASE_URL"] = url


def test_the_cli_creates_and_lists_scoped_tokens(cli_db: None) -> None:
    made = [clusterdx("token", "create", "gpu-farm", *extra) for extra in (
        ["--host", "node-003"], ["--hosts", "node-*,gpu-??"], ["--hook"], ["--name", "old"])]
    assert [p.returncode for p in made] == [0, 0, 0, 0], [p.stdout + p.stderr for p in made]
    rows = list(m.IngestToken.objects.order_by("id").values_list("scope", "hosts"))
    assert rows == [("agent", "node-003"), ("agent", "node-* gpu-??"), ("hook", ""), ("cluster", "")]
    listed = clusterdx("token", "list", "gpu-farm").stdout.splitlines()
    assert [line.split()[2:4] for line in listed] == [["agent", "node-003"], ["agent", "node-*,gpu-??"],
                                                     ["hook", "-"], ["cluster", "-"]]
    bad = [clusterdx("token", "create", "gpu-farm", *extra) for extra in (
        ["--host", "node 3"], ["--host", "a", "--hosts", "b*"], ["--host", "node-003", "--hook"])]
    assert [p.returncode for p in bad] == [2, 2, 2]
    assert "not a host name" in bad[0].stdout + bad[0].stderr
    assert m.IngestToken.objects.count() == 4
