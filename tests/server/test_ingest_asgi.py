"""The ingest fast path (plain ASGI, in front of Django) answers exactly as the Django view does, through a real
server: same statuses, same error codes, nothing stored when refused."""

from __future__ import annotations

import gzip
import json
import time
from typing import Any

import httpx

from dashboard.storage import frames as fr
from dashboard.telemetry import models as m
from tests.server import framed
from tests.server.conftest import AsgiServer, World, make_batch


def cases(token: str, other: str) -> list[tuple[str, dict[str, str], bytes]]:
    batch = make_batch(seq=5)
    good = json.dumps(batch).encode()
    reused = json.dumps({**batch, "gpus": batch["gpus"][:1]}).encode()  # seq 5 again, with other content
    auth = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    return [
        ("GET", auth, b""),
        ("POST", {**auth, "Content-Type": "text/plain"}, good),
        ("POST", {**auth, "Content-Encoding": "br"}, good),
        ("POST", {"Content-Type": "application/json"}, good),
        ("POST", {**auth, "Authorization": "Bearer cdx_nope_nope"}, good),
        ("POST", {**auth, "Authorization": f"Bearer {other}"}, json.dumps(make_batch(cluster="prod-a")).encode()),
        ("POST", auth, b'{"v": 1,'),
        ("POST", auth, json.dumps({**make_batch(), "seq": "7"}).encode()),
        ("POST", {**auth, "Content-Encoding": "gzip"}, b"not gzip"),
        ("POST", {**auth, "Content-Encoding": "gzip"}, gzip.compress(b'{"pad": "' + b"0" * 9_000_000 + b'"}')),
        ("POST", auth, b" " * 9_000_000),
        ("POST", {**auth, "Content-Type": "application/json; charset=utf-8"}, good),
        ("POST", auth, good),  # the same batch again: a duplicate
        ("POST", auth, reused),
        ("POST", auth, json.dumps(make_batch(seq=6, sent_at=time.time() + 86_400)).encode()),  # a clock a day ahead
    ]


def test_the_fast_path_answers_as_the_django_view(asgi_server: AsgiServer, world: World, client: Any) -> None:
    fast = []
    with httpx.Client(base_url=asgi_server.url, timeout=30) as http:
        for method, headers, body in cases(world.token, world.other_token):
            r = http.request(method, "/api/v1/ingest", headers=headers, content=body)
            fast.append((r.status_code, r.json().get("error") or r.json().get("status")))
    assert [s for s, _ in fast] == [405, 415, 415, 401, 401, 403, 400, 400, 400, 413, 413, 200, 200, 409, 400]
    assert fast[-4:] == [(200, "accepted"), (200, "duplicate"), (409, "seq_reused"), (400, "clock_skew")]
    assert m.AgentBatch.objects.count() == 1

    m.AgentBatch.objects.all().delete()
    slow = []
    for method, headers, body in cases(world.token, world.other_token):
        extra = {f"HTTP_{k.upper().replace('-', '_')}": v for k, v in headers.items() if k != "Content-Type"}
        r = client.generic(method, "/api/v1/ingest", body, content_type=headers.get("Content-Type", ""), **extra)
        slow.append((r.status_code, r.json().get("error") or r.json().get("status")))
    assert slow == fast


def test_a_post_through_the_fast_path_reaches_the_database(asgi_server: AsgiServer, world: World) -> None:
    r = httpx.post(f"{asgi_server.url}/api/v1/ingest", json=make_batch(seq=1),
                   headers={"Authorization": f"Bearer {world.token}"}, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == {"status": "accepted", "seq": 1, "records": 4, "send_interval_s": 1.0}
    assert framed.count(fr.GPUS) == 2 and framed.count(fr.STEPS) == 2


def test_a_cached_token_is_checked_in_the_event_loop_without_a_query(asgi_server: AsgiServer, world: World,
                                                                     monkeypatch: Any) -> None:
    """A token's later posts are checked in the event loop, with no trip to a thread. There no query may run: not
    even the node count falling due while the batch is parsed (it once did, and Django refused it: a 500)."""
    from dashboard.ingest import views

    def post(seq: int) -> httpx.Response:
        return httpx.post(f"{asgi_server.url}/api/v1/ingest", json=make_batch(seq=seq),
                          headers={"Authorization": f"Bearer {world.token}"}, timeout=10)

    assert post(1).status_code == 200  # in a thread: the token is looked up and marked used, the nodes counted
    assert post(2).status_code == 200  # in a thread again: post 1 created its node, so the nodes are counted again

    def counted_in_the_loop(cluster_id: int) -> float:
        raise AssertionError("the send interval was asked for in the event loop")

    monkeypatch.setattr(views, "send_interval", counted_in_the_loop)
    r = post(3)
    assert r.status_code == 200 and r.json()["send_interval_s"] == 1.0
    assert m.AgentBatch.objects.count() == 3


def test_a_post_checked_in_the_event_loop_makes_no_database_wrapper(asgi_server: AsgiServer, world: World,
                                                                     monkeypatch: Any) -> None:
    """asgiref gives each request's task a context of its own, and Django a new database wrapper per context: merely
    asking ``connection.in_atomic_block`` in the event loop built one per post (~15 µs, objects in reference cycles).
    The posts after a token's first are checked in the loop and must leave Django's connections alone."""
    import threading

    from django.db.backends.base.base import BaseDatabaseWrapper

    made: list[str] = []
    real_init = BaseDatabaseWrapper.__init__

    def counting_init(self: Any, *args: Any, **kwargs: Any) -> None:
        made.append(threading.current_thread().name)
        real_init(self, *args, **kwargs)

    def post(seq: int) -> httpx.Response:
        return httpx.post(f"{asgi_server.url}/api/v1/ingest", json=make_batch(seq=seq),
                          headers={"Authorization": f"Bearer {world.token}"}, timeout=10)

    assert post(1).status_code == 200  # in a thread: the token is looked up and cached
    monkeypatch.setattr(BaseDatabaseWrapper, "__init__", counting_init)
    answers = [post(seq).json()["status"] for seq in range(2, 12)]
    assert answers == ["accepted"] * 10
    assert m.AgentBatch.objects.count() == 11
    loop_thread = asgi_server.thread.name
    assert made.count(loop_thread) == 0, made
