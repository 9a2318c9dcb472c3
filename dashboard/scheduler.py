"""The embedded stand-in for Celery beat: runs the same periodic tasks, with the same schedule, inside the server's
event loop (so the tasks' broadcasts reach the in-process channel layer). In production (REDIS_URL set) it does
nothing: beat and the workers do this work."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings

log = logging.getLogger(__name__)


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
            else:  # thread_sensitive: one thread for all DB work, like the ingest views, so SQLite sees one writer.
                await sync_to_async(_resolve(path), thread_sensitive=True)()
        except Exception:  # a task that raises is logged and rescheduled, never kills the loop
            log.exception("embedded scheduler: %s failed", name)
        due[name] += every
        if due[name] < time.monotonic():  # fell behind (a slow pass): skip, do not pile up
            due[name] = time.monotonic() + every


async def lifespan(scope: dict[str, Any], receive: Any, send: Any) -> None:
    from dashboard.live.publish import flush_forever

    tasks: list[asyncio.Task[None]] = []
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            tasks.append(asyncio.create_task(flush_forever()))  # every web worker merges its live updates
            if not settings.REDIS_URL:
                from dashboard.celery import SCHEDULE

                tasks.append(asyncio.create_task(run_schedule(SCHEDULE)))
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if not settings.REDIS_URL:
                from dashboard.diagnosis.offload import shutdown

                shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return
