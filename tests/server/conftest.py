"""Fixtures for server tests: users with and without access, a cluster with a token, and a real ASGI server
(uvicorn, in a thread of the test process, on the test database) for websocket and browser tests."""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from django.conf import settings


@pytest.fixture(autouse=True)
def _fresh_caches() -> Iterator[None]:
    """The ingest writer caches ids and the live state keeps the latest samples; tests roll the DB back under them."""
    from django.core.cache import cache

    from dashboard.ingest import listening
    from dashboard.ingest.writer import clear_caches
    from dashboard.live import publish, state
    from dashboard.telemetry import interconnect, tokens

    publish.publisher.drain()  # the previous test's committed groups reach the live layer before it is cleared
    clear_caches()
    cache.delete(listening.KEY)  # a previous test's server listened; this test's has not yet
    tokens.clear_cache()
    interconnect.clear_cache()
    publish.coalescer.take()  # live deltas left over from the previous test
    state.get_state.cache_clear()
    live = state.get_state()
    if hasattr(live, "clear"):
        live.clear()
    yield
    clear_caches()
    from dashboard.ingest import commit

    commit.reset()  # its thread's connection would keep the test database from being dropped


@dataclass
class World:
    cluster: Any
    other_cluster: Any
    token: str
    other_token: str
    owner: Any
    teammate: Any
    outsider: Any
    password: str = "correct horse battery staple"


@pytest.fixture
def world(django_user_model: Any, settings: Any) -> World:
    from dashboard.telemetry import tokens
    from dashboard.telemetry.models import Cluster

    # PBKDF2 costs ~0.3–1 s per account and most server tests make three: the accounts made here hash with MD5
    # (in-process only; a server a test starts as a subprocess keeps the real hashers, so log in there with an
    # account that subprocess made).
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher", *settings.PASSWORD_HASHERS]

    cluster = Cluster.objects.create(name="prod-a")
    other = Cluster.objects.create(name="prod-b")
    pw = World.password
    owner = django_user_model.objects.create_user("alice", password=pw)
    teammate = django_user_model.objects.create_user("bob", password=pw)
    outsider = django_user_model.objects.create_user("mallory", password=pw)
    # Roles (dashboard.web.access.require_role): alice owns prod-a, bob is a member, mallory sees only prod-b.
    cluster.members.add(owner, through_defaults={"role": "owner"})
    cluster.members.add(teammate)
    other.members.add(outsider)
    _, token = tokens.create_token(cluster, "agents")
    _, other_token = tokens.create_token(other, "agents")
    return World(cluster, other, token, other_token, owner, teammate, outsider)


def make_batch(seq: int = 0, host: str = "node-000", agent_id: str | None = None, **extra: Any) -> dict[str, Any]:
    now = time.time()
    batch: dict[str, Any] = {
        "v": 1, "agent_id": agent_id or f"agent-{host}", "seq": seq, "host": host, "sent_at": now,
        "gpus": [{"ts": now, "index": i, "util_gpu_pct": 50.0 + i, "mem_used_bytes": 10**9, "power_w": 300.0,
                  "temp_c": 60.0, "uuid": f"GPU-{host}-{i}"} for i in range(2)],
        "steps": [{"run": "run-1", "rank": r, "step": seq + 1, "ts": now, "step_time_s": 1.0, "data_wait_s": 0.1,
                   "compute_s": 0.7, "comm_s": 0.2, "tokens": 4096} for r in range(2)],
    }
    batch.update(extra)
    return batch


def post(client: Any, body: Any, token: str | None, *, gz: bool = False, content_type: str = "application/json",
         **headers: str) -> Any:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    if gz:
        data = gzip.compress(data)
        headers["HTTP_CONTENT_ENCODING"] = "gzip"
    if token is not None:
        headers["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    return client.generic("POST", "/api/v1/ingest", data, content_type=content_type, **headers)


class AsgiServer:
    """uvicorn serving dashboard.asgi in a background thread (its own event loop), like production does.

    ``host``: where to listen; the network-namespace testbed binds the bridge's address."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        import uvicorn

        with socket.socket() as s:
            s.bind((host, 0))
            self.port = int(s.getsockname()[1])
        self.url = f"http://{host}:{self.port}"
        # timeout_graceful_shutdown: a socket a test left open (a client that never answers the close) held uvicorn's
        # shutdown until stop() gave up after 10 s, and the server's lifespan shutdown never ran: its beat went on
        # saying it listened (dashboard.ingest.listening), into the next tests, and its scheduler with it.
        config = uvicorn.Config("dashboard.asgi:application", host=host, port=self.port, lifespan="on",
                                log_level="warning", ws="websockets-sansio", timeout_graceful_shutdown=3)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> AsgiServer:
        # A process normally has one event loop; here each test's server brings its own. A Redis channel layer
        # belongs to the loop that first received on it (a receive still blocked in the last server's loop would
        # make this one fail with "Two event loops are trying to receive()"): give every server a fresh layer.
        from channels.layers import channel_layers

        channel_layers.backends.clear()
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def asgi_server(transactional_db: None) -> Iterator[AsgiServer]:
    server = AsgiServer().start()
    try:
        yield server
    finally:
        server.stop()


def listened_for(seconds: float) -> None:
    """This test's server as if it had listened ``seconds`` already (dashboard.ingest.listening): for a test whose
    data is stamped before its server started, and whose pass must judge the nodes' silence by it alone. The server's
    next beats keep the stretch."""
    from django.core.cache import cache

    from dashboard.ingest import listening

    now = time.time()
    cache.set(listening.KEY, (now - seconds, now), timeout=None)


def session_cookie(client: Any, user: Any) -> str:
    client.force_login(user)
    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"


@pytest.fixture
def page(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A Chromium page (Debian's chromium through Playwright); skipped with the reason where it is missing."""
    from tests.server.browser import launch_page

    yield from launch_page(monkeypatch)


def off_site_assets(html: str) -> list[str]:
    """The scripts, styles and links a page loads from another origin (a CDN): none may be. Checked on the
    attributes, not by searching the page for "cdn", which a random CSRF token spells now and then."""
    import re

    return re.findall(r'(?:src|href)\s*=\s*["\']((?:https?:)?//[^"\']*)', html, flags=re.IGNORECASE)
