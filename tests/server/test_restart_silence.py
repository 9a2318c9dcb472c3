"""A server restarted after a while down does not name the nodes silent for the time it was away.

Real servers (uvicorn with the ASGI app's lifespan, whose beat says since when ingest listens: dashboard.ingest.
listening) on the test database, agents' batches over HTTP. Three nodes post; the server stops for longer than the
heartbeat; a new one starts, two of the nodes post again at once, the third never does. Measured from the nodes'
last words alone, the first pass after the restart named all three silent (the demo, down seven minutes, opened a
critical cluster_silent this way). Now the third node is named down once the new server has listened a heartbeat,
and the two that came back are never named.

Embedded, the passes are the server's own (its scheduler, the pass in its child process, handed the listening start);
on PostgreSQL + Redis the test runs the Celery task's body, which reads the web worker's beat from Redis."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from django.conf import settings as django_settings

from dashboard.diagnosis import tasks
from dashboard.diagnosis.models import Finding
from dashboard.ingest import listening
from tests.server.conftest import AsgiServer, World, make_batch

HEARTBEAT_S = 8.0  # the first pass after a start comes ~4 s after it here (the pass's child process starting)


def post(server: AsgiServer, world: World, host: str, seq: int) -> None:
    batch = make_batch(seq, host=host, steps=[])
    r = httpx.post(f"{server.url}/api/v1/ingest", json=batch, headers={"Authorization": f"Bearer {world.token}"},
                   timeout=10)
    assert r.status_code == 200, r.text


def test_a_restarted_server_names_only_the_node_that_did_not_come_back(
        transactional_db: None, world: World, settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    settings.CLUSTERDX = {**django_settings.CLUSTERDX, "HEARTBEAT_TIMEOUT_S": HEARTBEAT_S}
    monkeypatch.setattr(listening, "BEAT_S", 0.5)  # beats every half second; the stretch ends 2 s after the last
    monkeypatch.setattr(listening, "BREAK_S", 2.0)
    embedded = not django_settings.REDIS_URL
    cid = world.cluster.id

    first = AsgiServer().start()
    try:
        for seq, host in enumerate(("node-a", "node-b", "node-c")):
            post(first, world, host, seq)
        assert listening.since() is not None  # its beat says it listens
    finally:
        first.stop()
    time.sleep(HEARTBEAT_S)  # down: every node's last word is past the heartbeat by the first pass
    assert listening.since() is None, "a server of an earlier test still beats in this process: nothing is down"

    passes: list[float] = []  # when each pass after the restart ended
    restart = time.time()
    second = AsgiServer().start()
    try:
        deadline = restart + HEARTBEAT_S + 8.0
        seq = 10
        while time.time() < deadline and not Finding.objects.filter(kind="node_down").exists():
            for host in ("node-a", "node-b"):  # their agents post again; node-c's never does
                post(second, world, host, seq)
                seq += 1
            if embedded:  # the server's scheduler runs its passes: read when the last one ended
                ended = tasks._paced.get(cid, (0.0,))[0]
                if ended > restart and ended not in passes:
                    passes.append(ended)
            else:
                tasks.diagnose()
                passes.append(time.time())
            time.sleep(0.5)
    finally:
        second.stop()

    opened = [(f.kind, f.subject, f.opened_at.timestamp()) for f in Finding.objects.order_by("opened_at")]
    assert [(kind, subject) for kind, subject, _ in opened] == [("node_down", "node-c")], opened
    # The new server's beat began its stretch of listening after ``restart``: node-c is named a heartbeat after it.
    assert opened[0][2] >= restart + HEARTBEAT_S, (opened, restart)
    held = [p for p in passes if p < opened[0][2]]
    assert held, f"no pass ran before the finding opened (passes {passes}): the hold was never put to the test"
    assert min(held) - restart < HEARTBEAT_S, (held, restart)
    assert "node-c's agent is silent for" in Finding.objects.get(kind="node_down").title
