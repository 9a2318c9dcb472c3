"""The embedded stand-in for Celery beat: runs the same periodic tasks, with the same schedule, inside the server's
event loop (so the tasks' broadcasts reach the in-process channel layer). In production (REDIS_URL set) it does
nothing: beat and the workers do this work."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections

log = logging.getLogger(__name__)

# The embedded scheduler's jobs run on a thread of their own, one at a time. Not on asgiref's thread-sensitive thread:
# every sync Django view and every websocket consumer's query waits for that one thread, and a job queued for its
# turn at the write lock behind the ingest writer (alert planning: one transaction per finding, each behind a group
# of hundreds of batches) held the pages and the live frames with it (the ingest benchmark's watcher at 2,048 nodes
# got no frame for 20 s). Writers still take turns: dashboard.storage.sqlite queues the process's write transactions.
JOBS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scheduler")


def _job(fn: Callable[..., Any], *args: Any) -> Any:
    close_old_connections()  # as Django does around a request: a connection that broke or expired is replaced
    try:
        return fn(*args)
    finally:
        close_old_connections()


def in_jobs_thread(fn: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    """``fn`` as a coroutine function run on the scheduler's thread (its broadcasts reach this event loop)."""
    run = sync_to_async(_job, thread_sensitive=False, executor=JOBS)
    return lambda *args: run(fn, *args)


# Tasks with an embedded runner of their own: an async function the loop awaits instead of running the task in the
# database thread. The diagnosis pass reads and computes in a child process, so it never holds the GIL or the thread
# that ingest needs (dashboard.diagnosis.offload).
EMBEDDED_RUNNERS = {"dashboard.diagnosis.tasks.diagnose": "dashboard.diagnosis.offload.diagnose"}


def _resolve(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


async def run_schedule(schedule: dict[str, tuple[str, float]]) -> None:
    due = {name: time.monotonic() + min(every, 2.0) for name, (_, every) in schedule.items()}
    while True:
        name = min(due, key=due.__getitem__)
        await asyncio.sleep(max(0.0, due[name] - time.monotonic()))
        path, every = schedule[name]
        try:
            if path in EMBEDDED_RUNNERS:
                await _resolve(EMBEDDED_RUNNERS[path])()
            else:
                await in_jobs_thread(_resolve(path))()
        except Exception:  # a task that raises is logged and rescheduled, never kills the loop
            log.exception("embedded scheduler: %s failed", name)
        due[name] += every
        if due[name] < time.monotonic():  # fell behind (a slow pass): skip, do not pile up
            due[name] = time.monotonic() + every


def _pin_worker() -> None:
    """A web worker of ``clusterdx server`` on a CPU of its own, before its writer and publisher threads start (they
    inherit it)."""
    from dashboard.cli.server import WEB_WORKER_ENV

    if os.environ.get(WEB_WORKER_ENV):
        from dashboard import affinity

        affinity.claim("web worker", settings.CLUSTERDX["PIN_CPU"])


async def lifespan(scope: dict[str, Any], receive: Any, send: Any) -> None:
    from dashboard.ingest import listening
    from dashboard.live.publish import flush_forever

    tasks: list[asyncio.Task[None]] = []
    beating = None
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            _pin_worker()
            tasks.append(asyncio.create_task(flush_forever()))  # every web worker merges its live updates
            beating = listening.keep_beating()  # ... and says it listens (a silence counts from then)
            if not settings.REDIS_URL:
                from dashboard.celery import SCHEDULE

                tasks.append(asyncio.create_task(run_schedule(SCHEDULE)))
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            if beating is not None:
                beating.set()
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if not settings.REDIS_URL:
                from dashboard.diagnosis.offload import shutdown

                shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return
