"""The live path end to end: HTTP ingest -> database -> broadcast -> a real websocket on a real ASGI server."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import jsonschema
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from dashboard.live.events import FRAME_SCHEMA, GPU_ROW, STEP_ROW
from dashboard.telemetry.models import Run
from tests.server.conftest import AsgiServer, World, make_batch, session_cookie


def ws_connect(server: AsgiServer, path: str, cookie: str | None) -> Any:
    """A socket whose snapshot holds what was posted before: an acknowledged batch is committed, and reaches the live
    state a moment later, off the answer's path (CI on PostgreSQL + Redis: a snapshot without the second of two
    nodes posted just before)."""
    from dashboard.live import publish

    publish.publisher.drain()
    headers = {"Origin": server.url}
    if cookie:
        headers["Cookie"] = cookie
    return connect(f"ws://127.0.0.1:{server.port}{path}", additional_headers=headers, open_timeout=10)


def recv_json(ws: Any, timeout: float = 10) -> dict[str, Any]:
    frame = json.loads(ws.recv(timeout=timeout))
    jsonschema.validate(frame, FRAME_SCHEMA)
    return frame


def ingest(server: AsgiServer, token: str, batch: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/api/v1/ingest", json=batch, headers={"Authorization": f"Bearer {token}"}, timeout=10)


def with_ranks(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch plus the hooks' metadata of its ranks (run-1's ranks 0 and 1 on the batch's node), which is how the
    server knows a run's nodes."""
    return {**batch, "runs": [{"run": "run-1", "rank": r, "world_size": 2, "ts": batch["sent_at"], "host": batch["host"]}
                              for r in range(2)]}


def test_it_pushes_an_ingested_step_to_the_run_page_socket(asgi_server: AsgiServer, world: World, client: Any) -> None:
    assert ingest(asgi_server, world.token, with_ranks(make_batch(seq=0))).status_code == 200
    run = Run.objects.get(name="run-1")
    with ws_connect(asgi_server, f"/ws/live/?run={run.id}", session_cookie(client, world.owner)) as ws:
        snap = recv_json(ws)
        assert snap["type"] == "snapshot" and snap["run"]["name"] == "run-1"
        assert snap["columns"] == {"steps": STEP_ROW, "gpus": GPU_ROW}
        assert sorted((row[0], row[1]) for row in snap["steps"]) == [(1, 0), (1, 1)]
        t0 = time.monotonic()
        batch = make_batch(seq=1)
        batch["steps"][0]["data_wait_s"] = 0.42
        batch["gpus"][0]["util_gpu_pct"] = 7.5
        assert ingest(asgi_server, world.token, batch).json()["status"] == "accepted"
        seen_steps: list[list[Any]] = []
        seen_gpus: list[list[Any]] = []
        def new_gpu() -> bool:
            return any(g[1] == 0 and g[GPU_ROW.index("util_gpu_pct")] == 7.5 for g in seen_gpus)

        # Deltas may repeat what the snapshot held (at least once, never a gap); the new rows must come.
        while not ([r for r in seen_steps if r[0] == 2] and new_gpu()) and time.monotonic() - t0 < 10:
            frame = recv_json(ws)
            assert frame["type"] == "delta"
            seen_steps += frame.get("steps", [])
            seen_gpus += frame.get("gpus", [])
        step2 = [r for r in seen_steps if r[:2] == [2, 0]]
        assert step2 and step2[0][STEP_ROW.index("data_wait_s")] == 0.42
        assert new_gpu() and all(g[0] == "node-000" for g in seen_gpus)


def test_frames_are_throttled_and_merge_deltas(asgi_server: AsgiServer, world: World, client: Any, settings: Any) -> None:
    assert ingest(asgi_server, world.token, make_batch(seq=0)).status_code == 200
    run = Run.objects.get(name="run-1")
    with ws_connect(asgi_server, f"/ws/live/?run={run.id}", session_cookie(client, world.owner)) as ws:
        recv_json(ws)
        for seq in range(1, 21):  # 20 batches as fast as possible
            assert ingest(asgi_server, world.token, make_batch(seq=seq)).status_code == 200
        expected = {(seq + 1, rank) for seq in range(1, 21) for rank in (0, 1)}
        frames, steps, deadline = 0, set(), time.monotonic() + 10
        while not expected <= steps and time.monotonic() < deadline:
            frame = recv_json(ws)
            frames += 1
            steps |= {(row[0], row[1]) for row in frame.get("steps", [])}
        assert expected <= steps, "every step reaches the browser"
        assert frames < 20, f"{frames} frames for 20 batches: deltas must be merged per client"


def test_it_refuses_anonymous_sockets_and_outsiders(asgi_server: AsgiServer, world: World, client: Any) -> None:
    assert ingest(asgi_server, world.token, make_batch(seq=0)).status_code == 200
    run = Run.objects.get(name="run-1")
    for cookie in (None, session_cookie(client, world.outsider), "sessionid=forged"):
        # Closed before accept: the handshake itself is refused, so nothing about the run is ever sent.
        with pytest.raises(InvalidStatus) as exc:
            ws_connect(asgi_server, f"/ws/live/?run={run.id}", cookie)
        assert exc.value.response.status_code == 403
    for bad in ("?run=abc", "?run=999999", "", "?cluster=-1"):
        with pytest.raises(InvalidStatus):
            ws_connect(asgi_server, f"/ws/live/{bad}", session_cookie(client, world.owner))
    # A teammate may watch the run; another cluster's member may not watch this cluster either.
    with ws_connect(asgi_server, f"/ws/live/?cluster={world.cluster.id}", session_cookie(client, world.teammate)) as ws:
        assert recv_json(ws)["type"] == "snapshot"


def test_a_cluster_socket_gets_gpu_updates_and_severe_events(asgi_server: AsgiServer, world: World, client: Any) -> None:
    with ws_connect(asgi_server, f"/ws/live/?cluster={world.cluster.id}", session_cookie(client, world.owner)) as ws:
        assert recv_json(ws)["type"] == "snapshot"
        xid = {"ts": time.time(), "kind": "xid", "severity": "critical", "code": 79, "gpu_index": 3,
               "message": "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus. <b>hostile</b>"}
        assert ingest(asgi_server, world.token, make_batch(seq=0, events=[xid])).status_code == 200
        events: list[dict[str, Any]] = []
        deadline = time.monotonic() + 10
        while not events and time.monotonic() < deadline:
            events += recv_json(ws).get("events", [])
        assert events[0]["code"] == 79 and events[0]["host"] == "node-000"
        assert "<b>hostile</b>" in events[0]["message"], "text travels verbatim; the page escapes it"


def test_a_reload_keeps_the_events_and_a_node_stream_carries_only_that_node(
        asgi_server: AsgiServer, world: World, client: Any) -> None:
    xid = {"ts": time.time(), "kind": "xid", "severity": "critical", "code": 79, "gpu_index": 3,
           "message": "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."}
    assert ingest(asgi_server, world.token, make_batch(seq=0, host="node-000", events=[xid])).status_code == 200
    assert ingest(asgi_server, world.token, make_batch(seq=0, host="node-001")).status_code == 200
    cookie = session_cookie(client, world.owner)
    # A new connection (a reload) gets the event from the database, not only from later deltas.
    with ws_connect(asgi_server, f"/ws/live/?cluster={world.cluster.id}", cookie) as ws:
        snap = recv_json(ws)
        assert [(e["host"], e["code"]) for e in snap["events"]] == [("node-000", 79)]
        assert {g[0] for g in snap["gpus"]} == {"node-000", "node-001"}
    with ws_connect(asgi_server, f"/ws/live/?cluster={world.cluster.id}&node=node-001", cookie) as ws:
        snap = recv_json(ws)
        assert snap["events"] == [] and {g[0] for g in snap["gpus"]} == {"node-001"}
        for seq in (1, 2):
            for host in ("node-000", "node-001"):
                assert ingest(asgi_server, world.token, make_batch(seq=seq, host=host)).status_code == 200
        hosts: set[str] = set()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(hosts) == 0:
            hosts |= {g[0] for g in recv_json(ws).get("gpus", [])}
        assert hosts == {"node-001"}
    with ws_connect(asgi_server, f"/ws/live/?cluster={world.cluster.id}&only=findings", cookie) as ws:
        snap = recv_json(ws)
        assert set(snap) == {"type", "seq", "columns", "findings"}
        assert ingest(asgi_server, world.token, make_batch(seq=3, host="node-001")).status_code == 200
        kinds: set[str] = set()
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # findings may come (the embedded diagnosis runs); GPU deltas may not
            try:
                kinds |= set(recv_json(ws, timeout=max(0.05, deadline - time.monotonic()))) - {"type", "seq"}
            except TimeoutError:
                break
        assert kinds <= {"findings"}, kinds


def test_a_run_socket_carries_only_the_run_nodes_gpus(asgi_server: AsgiServer, world: World, client: Any) -> None:
    """A run page draws its own nodes: the other nodes' GPU rows (16,384 at 2,048 nodes) are not sent to it."""
    assert ingest(asgi_server, world.token, with_ranks(make_batch(seq=0, host="node-000"))).status_code == 200
    other = make_batch(seq=0, host="node-009", steps=[])  # no rank of run-1 on this node
    assert ingest(asgi_server, world.token, other).status_code == 200
    run = Run.objects.get(name="run-1")
    with ws_connect(asgi_server, f"/ws/live/?run={run.id}", session_cookie(client, world.owner)) as ws:
        assert {g[0] for g in recv_json(ws)["gpus"]} == {"node-000"}
        hosts: set[str] = set()
        for seq in (1, 2, 3):
            assert ingest(asgi_server, world.token, make_batch(seq=seq, host="node-009", steps=[])).status_code == 200
            assert ingest(asgi_server, world.token, make_batch(seq=seq, host="node-000")).status_code == 200
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and "node-000" not in hosts:
            hosts |= {g[0] for g in recv_json(ws).get("gpus", [])}
        assert hosts == {"node-000"}
    # The cluster's own socket still carries every node.
    with ws_connect(asgi_server, f"/ws/live/?cluster={world.cluster.id}", session_cookie(client, world.owner)) as ws:
        assert {g[0] for g in recv_json(ws)["gpus"]} == {"node-000", "node-009"}


def test_a_runs_steps_are_sent_only_while_a_run_page_watches_it(asgi_server: AsgiServer, world: World, client: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """At 16,384 ranks a run brings 16,384 step rows a second: the publisher makes them deltas only while a run page
    is open on the run (the live state's watched runs), and a page that opens sees every step from its snapshot on."""
    from dashboard.live import publish
    from dashboard.live.state import get_state

    sent: list[str] = []
    add = publish.coalescer.add
    monkeypatch.setattr(publish.coalescer, "add", lambda messages: (sent.extend(g for g, _ in messages), add(messages)))

    def posted(seq: int) -> list[str]:
        publish.publisher.drain()  # what an earlier post published is not this one's (CI saw the seq 0 group here)
        sent.clear()
        assert ingest(asgi_server, world.token, make_batch(seq=seq)).status_code == 200
        publish.publisher.drain()
        return list(sent)

    assert ingest(asgi_server, world.token, with_ranks(make_batch(seq=0))).status_code == 200
    run = Run.objects.get(name="run-1")
    cookie = session_cookie(client, world.owner)
    assert posted(1) == [f"cluster-{world.cluster.id}"], "nobody watches the run: its steps are not made deltas"
    with ws_connect(asgi_server, f"/ws/live/?cluster={world.cluster.id}", cookie) as ws, \
            ws_connect(asgi_server, f"/ws/live/?run={run.id}&only=findings", cookie) as findings_only:
        recv_json(ws), recv_json(findings_only)
        assert get_state().watched_runs() == set(), "a cluster page and a findings-only run page draw no steps"
        assert posted(2) == [f"cluster-{world.cluster.id}"]
    with ws_connect(asgi_server, f"/ws/live/?run={run.id}", cookie) as ws:
        snap = recv_json(ws)
        assert get_state().watched_runs() == {run.id}
        assert f"run-{run.id}" in posted(3)
        seen = {(r[0], r[1]) for r in snap["steps"]}
        deadline = time.monotonic() + 10
        while not {(4, 0), (4, 1)} <= seen and time.monotonic() < deadline:
            seen |= {(r[0], r[1]) for r in recv_json(ws).get("steps", [])}
        assert {(3, 0), (3, 1), (4, 0), (4, 1)} <= seen, "the step before the page opened and the one after"
    deadline = time.monotonic() + 10
    while get_state().watched_runs() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert get_state().watched_runs() == set(), "the page closed: its watch ends with it"
    assert posted(4) == [f"cluster-{world.cluster.id}"]
