"""The ingest endpoint as a plain ASGI app, ahead of Django's HTTP handler.

Every node posts every second: at 512 nodes Django's per-request machinery (request object, middleware stack, a
new thread-sensitive context and thread per request) cost more than storing the batch. This path reads the body
in the event loop (bounded), and runs the same checks as the Django view (:mod:`.views`) on a small fixed pool of
threads whose database connections are reused. A valid batch then waits for its group commit in the event loop,
not in a thread: hundreds of batches can wait for the same commit while the pool validates the next ones.
"""

from __future__ import annotations

import asyncio
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asgiref.sync import sync_to_async
from django.db import DatabaseError, close_old_connections

from dashboard.ingest.views import Answer, Waiting, _limit, _refuse, begin, check_request, counted, finish, finish_failed
from dashboard.telemetry import tokens

PATH = "/api/v1/ingest"
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
        return tokens.lookup(headers["authorization"][len("Bearer "):].strip()) is not None
    except DatabaseError:
        return True  # undecided: handle_body looks again and answers for the database
    finally:
        close_old_connections()


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


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    answer = check_request(scope["method"], headers)
    if answer is None and not await sync_to_async(_token_known, thread_sensitive=False, executor=_pool)(headers):
        answer = _refuse("unknown_token", "the token is unknown or has been revoked")
    if answer is None:
        limit = _limit()
        body = await _read(receive, limit, headers.get("content-length"))
        step = await sync_to_async(_in_thread, thread_sensitive=False, executor=_pool)(headers, body, limit)
        answer = await _committed(step) if isinstance(step, Waiting) else step
    status, payload, extra = counted(answer)
    data = json.dumps(payload).encode()
    out = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    out += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
    await send({"type": "http.response.start", "status": status, "headers": out})
    await send({"type": "http.response.body", "body": data})
