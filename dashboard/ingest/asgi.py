"""The ingest endpoint as a plain ASGI app, ahead of Django's HTTP handler.

Every node posts every second: at 512 nodes Django's per-request machinery (request object, middleware stack, a
new thread-sensitive context and thread per request) cost more than storing the batch. This path reads the body
in the event loop (bounded), and runs the same checks as the Django view (:mod:`.views`) on a small fixed pool of
threads whose database connections are reused. A valid batch then waits for its group commit in the event loop,
not in a thread: hundreds of batches can wait for the same commit while the pool validates the next ones.

A request whose token is in the token cache, whose body is small and for which no query is due (the token's
last-used mark, the cluster's node count) is checked in the event loop without any trip to the pool: a trip (a
future, a thread woken, the GIL handed over twice) cost a tenth of a small batch. The others go to the pool
(``run_in_executor``: asgiref's ``sync_to_async`` copied contexts for more than the trip itself cost); a token the
cache does not hold costs a trip of its own, before the body is read, so an unknown token still costs no body.
"""

from __future__ import annotations

import asyncio
import gc
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
from django.db import DatabaseError, close_old_connections

from dashboard.ingest import views
from dashboard.ingest.views import Answer, Waiting, _limit, _refuse, begin, check_request, counted, finish, finish_failed
from dashboard.telemetry import tokens
from dashboard.telemetry.models import IngestToken

PATH = "/api/v1/ingest"
_encode = msgspec.json.Encoder().encode
# Enough threads to overlap a commit's I/O with the next request's parsing; more only contend for the GIL and for
# SQLite's single writer.
_pool = ThreadPoolExecutor(max_workers=int(os.environ.get("CLUSTERDX_INGEST_THREADS", "4")),
                           thread_name_prefix="ingest")


def _in_thread(headers: dict[str, str], body: bytes | None, limit: int) -> Answer | Waiting:
    close_old_connections()  # as Django does around each request: drop a broken or expired connection
    try:
        return begin(headers, body, limit)
    finally:
        close_old_connections()


async def _committed(waiting: Waiting) -> Answer:
    try:
        return finish(waiting, await asyncio.wrap_future(waiting.future))
    except Exception as exc:
        return finish_failed(waiting, exc)


def _token_known(headers: dict[str, str]) -> bool:
    """Checked before the body is read, so an unknown token costs no body; handle_body finds it again in the cache."""
    close_old_connections()
    try:
        return tokens.lookup(_bearer(headers)) is not None
    except DatabaseError:
        return True  # undecided: handle_body looks again and answers for the database
    finally:
        close_old_connections()


def _bearer(headers: dict[str, str]) -> str:
    return headers["authorization"][len("Bearer "):].strip()


def _token_cached(headers: dict[str, str]) -> IngestToken | bool | None:
    """What the token cache alone says, in the event loop: the row of a live token checked within its TTL, False
    (not a token at all), None (the cache does not know: the database must decide)."""
    return tokens.cached(_bearer(headers))


async def _read(receive: Any, limit: int, declared: str | None) -> bytes | None:
    if declared and declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b""
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


# A small body is checked in the event loop when no query is due (:func:`views.ready_in_loop`); a big one (a spool
# replayed in one batch) in a thread, so the loop never stalls on it.
LOOP_BODY_MAX = 64 * 1024


_gc_tuned = False


def _tune_gc() -> None:
    """Once, at the first batch: a server that takes thousands of batches a second allocates millions of short-lived
    dicts and lists, each of which counts towards CPython's next young-generation collection (every 700 by default,
    and each older collection walks every object Django and the app keep for the process's life). Everything alive
    now (modules, settings, caches) is frozen out of the collector, and the young generation is collected every
    50,000 allocations: a fifth less CPU per node-second at 256 nodes, with no effect on what refcounting frees."""
    global _gc_tuned
    _gc_tuned = True
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if not _gc_tuned:
        _tune_gc()
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    answer = check_request(scope["method"], headers)
    token: IngestToken | bool | None = None
    loop = asyncio.get_running_loop()
    if answer is None:
        token = _token_cached(headers)
        known = token if token is not None else await loop.run_in_executor(_pool, _token_known, headers)
        if not known:
            answer = _refuse("unknown_token", "the token is unknown or has been revoked")
    if answer is None:
        limit = _limit()
        body = await _read(receive, limit, headers.get("content-length"))
        small = body is not None and len(body) <= LOOP_BODY_MAX
        ready = views.ready_in_loop(token) if isinstance(token, IngestToken) and small else None
        if ready is not None:
            step = begin(headers, body, limit, ready)
        else:
            step = await loop.run_in_executor(_pool, _in_thread, headers, body, limit)
        answer = await _committed(step) if isinstance(step, Waiting) else step
    status, payload, extra = counted(answer)
    data = _encode(payload)
    out = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    out += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
    await send({"type": "http.response.start", "status": status, "headers": out})
    await send({"type": "http.response.body", "body": data})
