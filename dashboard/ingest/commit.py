"""Group commit: one writer thread per process stores the batches that arrive within a few milliseconds in one
transaction, on a database connection it keeps; each request waits for the commit that decides its batch.

A transaction per batch (and a connection per request) was most of the server's cost at 1 Hz per node. Here the
request threads only validate; they hand the batch to the writer's bounded queue and the answer is sent after the
commit, so an acknowledged batch is on disk and an unacknowledged one is the agent's to retry. A full queue is
refused at once (429 ``busy``) instead of growing a backlog whose answers would come too late to be of use.

A caller already inside a transaction (a test's, an in-process import) stores inline in it: the writer's own
connection could not see that transaction's rows.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.db import DatabaseError, connection

from dashboard import metrics
from dashboard.ingest.writer import Job, Outcome, Stored, store_batch, store_group
from dashboard.telemetry import models as m

log = logging.getLogger(__name__)

# Test-only: while the file at this path exists, the writer stops before each commit and says so by creating
# ``<path>.paused``; a test can then SIGKILL the server between receiving a batch and committing it, or fill the
# queue and release the writer by removing the file. Read when the writer is created.
PAUSE_ENV = "CLUSTERDX_TEST_PAUSE_BEFORE_COMMIT"


IDLE_CLOSE_S = 0.25  # a writer without batches for this long closes its connection; busy, it keeps it


Unchecked = tuple[Any, bytes, bool, int]  # (views.Poster, the body as received, gzip-encoded, size limit)


class Busy(Exception):
    """The write queue is full: refuse the batch now (429) rather than queue it past any useful answer time."""


@dataclass
class _Pending:
    job: Job | None  # a checked batch; None: ``raw`` for the writer's process to check
    raw: Unchecked | None = None
    future: Future[Any] = field(default_factory=Future)


def _config() -> dict[str, Any]:
    from django.conf import settings

    c = settings.CLUSTERDX
    return {"capacity": int(c["INGEST_QUEUE_BATCHES"]), "max_group": int(c["INGEST_COMMIT_MAX_BATCHES"]),
            "window_s": float(c["INGEST_COMMIT_WINDOW_MS"]) / 1e3,
            "busy_window_s": float(c["INGEST_COMMIT_BUSY_WINDOW_MS"]) / 1e3,
            "remote": c["INGEST_WRITER"] == "process"}  # a child process checks and stores (.remote)


class GroupWriter:
    """``window_s``: how long a group waits for more batches when the writer found none waiting (a quiet server:
    commit now); ``busy_window_s``: when batches were already queued as the group began. A commit's cost is mostly
    per commit, not per batch (on SQLite each rewrites the tables' and indexes' newest pages: ~54 pages for a group
    of 8 posts), so a busy server gathers a little longer and commits fewer, larger groups."""

    def __init__(self, capacity: int, max_group: int, window_s: float, busy_window_s: float | None = None,
                 remote: bool = False) -> None:
        from dashboard.ingest.remote import RemoteWriter

        self.queue: queue.Queue[_Pending | None] = queue.Queue(maxsize=capacity)
        self.max_group = max_group
        self.window_s = window_s
        self.busy_window_s = window_s if busy_window_s is None else busy_window_s
        self.remote = RemoteWriter() if remote else None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pause = os.environ.get(PAUSE_ENV, "")
        self._last = False  # the stop sentinel was taken with the group being written

    def submit(self, job: Job) -> Future[Stored]:
        """Queue a checked batch for the next group; the future resolves after the commit (an exception: not
        stored)."""
        if self.remote is not None:
            raise ValueError("the writer's process checks the bodies itself: submit_unchecked")
        return self._queue(_Pending(job))

    def submit_unchecked(self, poster: Any, body: bytes, gzipped: bool, limit: int) -> Future[Stored | Any]:
        """Queue a post's body, as received, for the writer's process to check and store: the future resolves to
        its refusal (an answer tuple) or, after the commit, to its Stored."""
        return self._queue(_Pending(None, (poster, body, gzipped, limit)))

    def _queue(self, pending: _Pending) -> Future[Any]:
        self._start()
        try:
            self.queue.put_nowait(pending)
        except queue.Full:
            raise Busy from None
        metrics.QUEUE_DEPTH.set(self.queue.qsize())
        return pending.future

    def _start(self) -> None:
        # Lazily, in the process that serves (uvicorn forks its workers after importing the app).
        if self._thread is None or not self._thread.is_alive():
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._run, name="ingest-writer", daemon=True)
                    self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Store what is queued, then close the connection and end the thread (tests: the test database can only
        be dropped once no thread holds a connection to it)."""
        if self._thread is None:
            return
        try:
            self.queue.put(None, timeout=timeout)  # the sentinel, after what is queued
        except queue.Full:
            return
        self._thread.join(timeout)
        if self.remote is not None:
            self.remote.shutdown()

    def _run(self) -> None:
        while True:
            group = self._gather()
            if not group:
                _close_connection()
                return
            try:
                self._write(group)
            except BaseException as exc:  # a bug: these batches fail (the agents retry them), the writer goes on
                log.exception("ingest writer failed on a group of %d batches", len(group))
                for p in group:
                    if not p.future.done():
                        p.future.set_exception(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))

    def _gather(self) -> list[_Pending]:
        """What is waiting, plus what arrives within the window while the group is not full."""
        if self._last:
            return []
        busy = not self.queue.empty()  # batches came while the last group was written
        try:
            first = self.queue.get(timeout=IDLE_CLOSE_S)
        except queue.Empty:
            _close_connection()  # idle: give it back (to PostgreSQL's pool; a test database can then be dropped)
            first = self.queue.get()
        if first is None:
            return []
        group = [first]
        deadline = time.monotonic() + (self.busy_window_s if busy else self.window_s)
        while len(group) < self.max_group:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    item = self.queue.get(timeout=left)
                except queue.Empty:
                    break
            if item is None:  # stop: this group is the last
                self._last = True
                break
            group.append(item)
        metrics.QUEUE_DEPTH.set(self.queue.qsize())
        return group

    def _write(self, group: list[_Pending]) -> None:
        # A request cancelled meanwhile (its server shutting down) was never answered: skip its batch, the agent
        # sends it again. The others can no longer be cancelled, so setting their results cannot fail.
        group = [p for p in group if p.future.set_running_or_notify_cancel()]
        if not group:
            return
        if self._pause:
            _pause_here(self._pause)
        started = time.perf_counter()
        if self.remote is not None:  # answered on the remote's thread, while this one gathers the next group
            self.remote.store([p.raw for p in group], lambda outcomes: _settle(group, outcomes, started, self.queue))
            return
        _drop_broken_connection()
        _settle(group, store_group([p.job for p in group]), started, self.queue)  # type: ignore[misc]


def _settle(group: list[_Pending], outcomes: list[Any], started: float, waiting: queue.Queue[Any]) -> None:
    """Each post's answer, once its group's commit (or refusal) decided it."""
    took = time.perf_counter() - started
    metrics.COMMIT_SECONDS.observe(took)
    log.debug("ingest: stored %d batches in %.1f ms (%d waiting)", len(group), took * 1e3, waiting.qsize())
    metrics.GROUP_BATCHES.observe(len(group))
    for p, outcome in zip(group, outcomes, strict=True):
        if isinstance(outcome, Exception):
            p.future.set_exception(outcome)
        else:
            p.future.set_result(outcome)


def _drop_broken_connection() -> None:
    """The writer keeps its connection between groups (no request cycle closes it); one that failed is replaced."""
    if connection.connection is not None and connection.errors_occurred:
        if connection.is_usable():
            connection.errors_occurred = False
        else:
            connection.close()


def _close_connection() -> None:
    try:
        connection.close()
    except DatabaseError:  # a connection the server already dropped: nothing left to give back
        log.debug("ingest writer: closing a broken connection", exc_info=True)


def _pause_here(path: str) -> None:
    gate = Path(path)
    if gate.exists():
        Path(path + ".paused").touch()
    while gate.exists():
        time.sleep(0.02)


_writer: GroupWriter | None = None
_writer_lock = threading.Lock()


def writer() -> GroupWriter:
    global _writer
    if _writer is None:
        with _writer_lock:
            if _writer is None:
                _writer = GroupWriter(**_config())
    return _writer


def reset() -> None:
    """Stop this process's writer (after what it holds) and let the next batch start a new one with the settings
    of then: tests change them, and a test database is dropped only once no writer holds a connection to it."""
    global _writer
    with _writer_lock:
        old, _writer = _writer, None
    if old is not None:
        old.stop()


def submit(cluster: m.Cluster, batch: dict[str, Any], digest: str, *, in_loop: bool = False) -> Future[Stored]:
    """Store the checked batch: through the group writer, or inline when the caller is inside a transaction already.

    ``in_loop``: called in the event loop, where no transaction is ever open. There even asking would cost: asgiref
    gives every request's task a context of its own, and Django a new database wrapper per context (~15 µs and a
    dozen objects in reference cycles, left to the cyclic collector, per post)."""
    if not in_loop and connection.in_atomic_block:
        future: Future[Stored] = Future()
        try:
            future.set_result(store_batch(cluster, batch, digest))
        except Exception as exc:
            future.set_exception(exc)
        return future
    return writer().submit((cluster, batch, digest))


__all__ = ["Busy", "GroupWriter", "Outcome", "submit", "writer"]
