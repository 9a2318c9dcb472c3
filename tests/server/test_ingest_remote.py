"""The group writer in a process of its own (``CLUSTERDX_INGEST_WRITER=process``): the same
answers as the thread writer, the live view fed from it, a killed writer process costing a retry and never a second
copy, and the two processes taking turns at SQLite's write lock first come, first served.

Real child processes (spawned, as the server does), a real uvicorn in a thread of the test process on the test
database, real database locks, on both backends."""

from __future__ import annotations

import contextlib
import gzip
import json
import multiprocessing
import os
import pickle
import signal
import sqlite3
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from dashboard.ingest import commit
from dashboard.ingest.errors import ERRORS
from dashboard.live import publish
from dashboard.live.state import get_state
from dashboard.storage import frames as fr
from dashboard.storage.sqlite.base import ProcessTurns
from dashboard.telemetry import models as m
from tests.server import framed
from tests.server.conftest import AsgiServer, World, make_batch
from tests.server.turns_children import hold_then_ask_again, take_and_die


# -- the turns between two processes --------------------------------------------------------------------------------
def test_a_released_turn_goes_to_the_other_process_that_waits_not_back_to_its_holder() -> None:
    ctx = multiprocessing.get_context("spawn")
    turns = ProcessTurns()
    holding, log = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=hold_then_ask_again, args=(turns, holding, log))
    child.start()
    try:
        assert holding.wait(30)
        assert not turns.acquire(1, 0.05), "held by the other process"
        t0 = time.monotonic()
        assert turns.acquire(1, 10), "handed over at its release"
        waited = time.monotonic() - t0
        time.sleep(0.4)  # the child asked again meanwhile: it waits for this process, first come, first served
        assert turns.holder() == 1
        turns.release(1)
        what, child_waited = log.get(timeout=10)
        child.join(10)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
    assert waited < 0.5
    assert what == "again" and child_waited >= 0.35, "the releasing process did not take the turn straight back"
    assert turns.holder() == 0


def test_a_turn_held_by_a_dead_process_is_given_up_by_forfeit() -> None:
    ctx = multiprocessing.get_context("spawn")
    turns = ProcessTurns()
    holding = ctx.Event()
    child = ctx.Process(target=take_and_die, args=(turns, holding))
    child.start()
    assert holding.wait(30)
    child.join(10)
    assert turns.holder() == 2
    assert not turns.acquire(1, 0.05)
    turns.forfeit(2)
    assert turns.acquire(1, 0.05)
    turns.release(1)
    assert turns.holder() == 0


# -- the server with its writer process ------------------------------------------------------------------------------
@pytest.fixture
def remote_server(transactional_db: None, settings: Any) -> Iterator[AsgiServer]:
    settings.CLUSTERDX = {**settings.CLUSTERDX, "INGEST_WRITER": "process"}
    commit.reset()
    server = AsgiServer().start()
    try:
        yield server
    finally:
        server.stop()
        commit.reset()  # waits for the child to exit: its connection must close before the database is dropped


def _post(server: AsgiServer, token: str, data: bytes, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}/api/v1/ingest", content=data, timeout=60,
                      headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json", **headers})


def _stored(world: World) -> list[tuple[str, int]]:
    return sorted(m.AgentBatch.objects.filter(cluster=world.cluster).values_list("agent_id", "seq"))


def test_the_writer_process_answers_as_the_thread_writer_does(remote_server: AsgiServer, world: World) -> None:
    batch = make_batch(seq=3, host="node-007")
    data = json.dumps(batch).encode()
    first = _post(remote_server, world.token, gzip.compress(data), **{"Content-Encoding": "gzip"})
    assert first.status_code == 200, first.text
    assert first.json() | {"send_interval_s": 0} == {"status": "accepted", "seq": 3, "records": 4, "send_interval_s": 0}
    writer = commit.writer()
    assert writer.remote is not None and writer.remote.pid() not in (None, os.getpid())
    assert _post(remote_server, world.token, data).json()["status"] == "duplicate"
    reused = _post(remote_server, world.token, json.dumps({**batch, "dropped": {"queue_full": 1}}).encode())
    assert (reused.status_code, reused.json()["error"]) == (409, "seq_reused")
    # Refusals decided in the writer's process read as they always did, and store nothing.
    refusals = {
        "malformed_json": b'{"v": 1, "agent_id": ',
        "invalid_batch": json.dumps({**batch, "seq": 4, "gpus": [{"index": "zero"}]}).encode(),
        "wrong_cluster": json.dumps({**make_batch(seq=5, host="node-007"), "cluster": "prod-b"}).encode(),
        "clock_skew": json.dumps({**make_batch(seq=6, host="node-007"), "sent_at": time.time() + 86_400}).encode(),
    }
    for code, body in refusals.items():
        r = _post(remote_server, world.token, body)
        assert r.status_code == ERRORS[code][0] and r.json()["error"] == code, (code, r.text)
    bomb = _post(remote_server, world.token, gzip.compress(b" " * (9 * 1024 * 1024)), **{"Content-Encoding": "gzip"})
    assert (bomb.status_code, bomb.json()["error"]) == (413, "too_large")
    assert (_post(remote_server, world.token, b"\x1f\x8bnot", **{"Content-Encoding": "gzip"}).json()["error"]
            == "bad_encoding")
    assert _stored(world) == [("agent-node-007", 3)]
    assert framed.count(fr.GPUS, cluster=world.cluster) == 2
    # The live view is the server's: what the child stored reaches its live state.
    publish.publisher.drain()
    live = {(row[0], row[1]): row for row in get_state().gpus(world.cluster.id)}
    assert sorted(live) == [("node-007", 0), ("node-007", 1)]
    assert live[("node-007", 1)][3] == batch["gpus"][1]["util_gpu_pct"]


@contextlib.contextmanager
def _writes_blocked() -> Iterator[None]:
    """Hold the database's write lock from outside, so the child's next group waits inside its transaction: SQLite's
    one write lock, or on PostgreSQL the ledger table (the group's first INSERT)."""
    from django.db import connection

    if connection.vendor == "sqlite":
        blocker = sqlite3.connect(connection.settings_dict["NAME"], timeout=1, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        return
    import psycopg

    with psycopg.connect(**connection.get_connection_params()) as pg:
        pg.execute(f"LOCK TABLE {m.AgentBatch._meta.db_table} IN EXCLUSIVE MODE")
        try:
            yield
        finally:
            pg.rollback()


def test_a_killed_writer_process_costs_a_retry_and_never_a_second_copy(remote_server: AsgiServer,
                                                                       world: World) -> None:
    assert _post(remote_server, world.token, json.dumps(make_batch(seq=0, host="node-001")).encode()).status_code == 200
    pid = commit.writer().remote.pid()  # type: ignore[union-attr]
    assert pid is not None
    body = json.dumps(make_batch(seq=1, host="node-001")).encode()
    with _writes_blocked():
        import threading

        answers: list[httpx.Response] = []
        sending = threading.Thread(target=lambda: answers.append(_post(remote_server, world.token, body)))
        sending.start()
        time.sleep(1.0)  # the group reached the child, which now waits for the lock
        assert not answers, "answered before its commit"
        os.kill(pid, signal.SIGKILL)
        sending.join(30)
    assert answers[0].status_code == 503 and answers[0].json()["error"] == "unavailable"
    assert answers[0].headers["Retry-After"]
    again = _post(remote_server, world.token, body)  # the agent's retry starts a new writer process
    assert again.status_code == 200 and again.json()["status"] == "accepted", again.text
    assert commit.writer().remote.pid() not in (None, pid)  # type: ignore[union-attr]
    assert _post(remote_server, world.token, body).json()["status"] == "duplicate"
    assert _stored(world) == [("agent-node-001", 0), ("agent-node-001", 1)]
    assert framed.count(fr.GPUS, cluster=world.cluster) == 4


def test_the_live_part_of_a_batch_publishes_what_the_whole_batch_does() -> None:
    from clusterdx import wire

    xid = {"ts": time.time(), "kind": "xid", "severity": "critical", "code": 79, "gpu_index": 1, "message": "Xid 79"}
    info = {"ts": time.time(), "kind": "agent", "severity": "info", "message": "started"}
    batch = wire.validate_batch(make_batch(seq=0, host="node-003", events=[xid, info],
                                           beats=[{"ts": time.time(), "run": "run-1", "rank": 0, "state": "step",
                                                   "step": 1, "state_s": 0.1}]))
    runs = {"run-1": 7}

    def rows(b: dict[str, Any]) -> list[Any]:
        gpus = [["node-003", g["index"], g["ts"], g["util_gpu_pct"], g["mem_used_bytes"], g["power_w"], g["temp_c"]]
                for g in b["gpus"]]
        return [publish._messages(1, "node-003", b, runs, gpus, {7}), b["beats"]]

    part = publish.live_part(batch)
    assert rows(part) == rows(batch)
    assert len(pickle.dumps(part)) < len(pickle.dumps(batch))
