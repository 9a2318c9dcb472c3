"""The embedded server's group writer in a process of its own, so that ingest uses both of a machine's cores.

The embedded server is one process, and at 2,048 nodes it was bound by its GIL at about one core with the second
mostly free: the event loop (HTTP, inflating, decoding and checking each post) and the group writer's Python
(building and binding ~27 rows a node-second) took turns on the one interpreter lock. Here the server reads each
post and checks what needs no body (method, headers, size, token), and hands the group's bodies as received to a
child process, which checks each the same way the thread writer's server does
(:func:`dashboard.ingest.views.check_body`: encoding, JSON, wire format, cluster, scope, clock), stores the valid ones
in one transaction with :func:`dashboard.ingest.writer.store_group`, and answers once it has committed: a refusal, or
the stored batch with the few fields the live view shows. The server answers the agents after that (an answer waits
for the commit in either design, so moving the checks delays no refusal), so an acknowledged batch is on disk, and
publishes the stored batches to its own live layer (the browsers' websockets are the server's). A first version that
validated in the server and decoded again in the child accepted less, not more: decoding twice cost the machine's
second core what it gained (docs/scaling.md).

The two processes take turns at SQLite's one write lock first come, first served
(:class:`dashboard.storage.sqlite.base.ProcessTurns`): the server's own write transactions (findings, alerts,
rollups, retention) wait for the writer's current group, not for SQLite's polling busy handler, which under a
writer holding the lock back to back starved them for seconds.

A child that dies (killed, out of memory) fails the group it held with a database error: the agents get 503 and send
those batches again, and the (cluster, agent, seq) ledger makes a batch the child committed before dying a
``duplicate``, never a second copy. The next group starts a new child. On PostgreSQL the scale-out is web workers,
each with its writer thread. Chosen by ``CLUSTERDX_INGEST_WRITER=process`` (README); the thread stays the default
until a machine with cores to spare measures the gain (docs/scaling.md: on this 2-core one, beside the load
generator, both accepted the same share).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import DatabaseError

from clusterdx import wire
from dashboard import metrics

log = logging.getLogger(__name__)

SERVER, WRITER = 1, 2  # the parties of ProcessTurns

# What the child answers per post: ("stored", status, records, seq, agent id, what the live layer needs or None),
# ("refused", the answer) or ("db" | "bug", message).
Answer = tuple[Any, ...]


IN_FLIGHT = 2  # groups sent and not yet answered: one the child stores while it checks the next


class RemoteWriter:
    """The server's end: one child process, started at the first group and again after one dies. Groups are sent
    down one pipe and answered up another; a thread of the server's reads the answers and settles the group's
    posts, so the group writer gathers the next group while the child stores this one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(IN_FLIGHT)
        self._turns: Any = None
        self._db = ""
        self._child: _Child | None = None

    def store(self, items: list[Any], done: Callable[[list[Any]], None]) -> None:
        """Send a group of posts' bodies (``commit.Unchecked``) to the child to check and store; ``done`` is then
        called (on the answer thread) with one outcome per post, in order: its refusal (an answer tuple), its Stored
        once the child has committed, or an exception. Blocks while IN_FLIGHT groups are unanswered."""
        self._slots.acquire()
        try:
            child = self._started()
            child.send(items, done)
        except BaseException:
            self._slots.release()
            raise

    def _started(self) -> _Child:
        with self._lock:
            if self._child is None or self._child.dead:
                from django.db import connection

                from dashboard.storage.sqlite.base import ProcessTurns, write_lock

                self._db = str(connection.settings_dict["NAME"])
                if connection.vendor == "sqlite":
                    if self._turns is None:
                        self._turns = ProcessTurns()
                    write_lock(self._db).share(self._turns, SERVER)
                self._child = _Child(self._db, self._turns, self._slots)
            return self._child

    def shutdown(self) -> None:
        """Wait for the groups in flight, then for the child to exit (its connection closed: a test database can
        then be dropped)."""
        for _ in range(IN_FLIGHT):
            self._slots.acquire()
        try:
            with self._lock:
                child, self._child = self._child, None
            if child is not None:
                child.close()
            if self._turns is not None:
                from dashboard.storage.sqlite.base import write_lock

                self._turns.forfeit(WRITER)
                write_lock(self._db).share(None)
        finally:
            for _ in range(IN_FLIGHT):
                self._slots.release()

    def pid(self) -> int | None:
        """The child's process id, once it runs (tests kill it)."""
        child = self._child
        return None if child is None else child.process.pid


class _Child:
    def __init__(self, db: str, turns: Any, slots: threading.BoundedSemaphore) -> None:
        ctx = multiprocessing.get_context("spawn")  # not fork: the server's threads would be copied mid-flight
        down_r, self._down = ctx.Pipe(duplex=False)
        self._up, up_w = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_child_main, args=(down_r, up_w, db, turns), name="ingest-writer",
                                   daemon=True)
        self.process.start()
        down_r.close()
        up_w.close()
        self._turns = turns
        self._slots = slots
        self._waiting: dict[int, tuple[int, Callable[[list[Any]], None]]] = {}  # group -> (posts, done)
        self._next = 0
        self._guard = threading.Lock()
        self.dead = False
        self._reader = threading.Thread(target=self._read, name="ingest-writer-answers", daemon=True)
        self._reader.start()

    def send(self, items: list[Any], done: Callable[[list[Any]], None]) -> None:
        with self._guard:
            if self.dead:
                raise DatabaseError("the ingest writer process is gone")
            gid, self._next = self._next, self._next + 1
            self._waiting[gid] = (len(items), done)
        try:
            self._down.send((gid, items))
        except (OSError, ValueError):
            self._died()

    def _read(self) -> None:
        from dashboard.ingest.writer import Stored
        from dashboard.live.publish import publisher

        while True:
            try:
                gid, answers, waits = self._up.recv()
            except (EOFError, OSError):
                self._died()
                return
            with self._guard:
                _, done = self._waiting.pop(gid)
            for wait in waits:
                metrics.WRITE_TURN_SECONDS.observe(wait)
            outcomes: list[Any] = []
            published = []
            for answer in answers:
                kind = answer[0]
                if kind == "stored":
                    _, status, records, seq, agent_id, live = answer
                    outcomes.append(Stored(status, records, seq, agent_id))
                    if live is not None:
                        published.append(live)
                elif kind == "refused":
                    outcomes.append(answer[1])
                elif kind == "db":
                    outcomes.append(DatabaseError(answer[1]))
                else:  # a bug in the writer: this post's answer is a 500, the others' are theirs
                    outcomes.append(RuntimeError(f"ingest writer process: {answer[1]}"))
            if published:  # before the answers, as the thread writer publishes at its commit
                publisher.submit(published)
            self._settle(done, outcomes)

    def _settle(self, done: Callable[[list[Any]], None], outcomes: list[Any]) -> None:
        try:
            done(outcomes)
        finally:
            self._slots.release()

    def _died(self) -> None:
        with self._guard:
            if self.dead:
                return
            self.dead = True
            lost, self._waiting = list(self._waiting.values()), {}
        if lost:
            log.error("the ingest writer process died with %d group(s) of posts unanswered; they are answered 503 "
                      "and a new writer starts", len(lost))
        if self._turns is not None:
            self._turns.forfeit(WRITER)  # a turn the dead child held (or waited for) is the server's again
        for posts, done in lost:
            error = DatabaseError("the ingest writer process died; the batch may or may not be stored: send it "
                                  "again (a stored one is answered duplicate)")
            self._settle(done, [error] * posts)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._down.close()  # the child's end of the pipe reads EOF: it stores what it holds and exits
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._reader.join(5)


# -- the child ------------------------------------------------------------------------------------------------------
_published: list[Any] = []
_waits: list[float] = []
_clusters: dict[int, tuple[float, Any]] = {}
CLUSTER_CACHE_S = 30.0


def _child_init(db_name: str, turns: Any) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
    from dashboard.diagnosis.offload import exit_with_parent

    threading.Thread(target=exit_with_parent, args=(os.getppid(),), name="parent-watch", daemon=True).start()
    import django
    from django.conf import settings

    settings.DATABASES["default"]["NAME"] = db_name  # under the tests, the test database
    django.setup()
    from dashboard import affinity

    if os.environ.get(affinity.ALLOWED_ENV):  # spawned by a pinned web worker: its two threads (checking the next
        # group, storing this one) on another CPU of their own
        affinity.claim("ingest writer", settings.CLUSTERDX["PIN_CPU"])
    from dashboard.ingest import writer
    from dashboard.storage.sqlite import base

    if turns is not None:
        base.write_lock(db_name).share(turns, WRITER)
    base.observe_turn = _waits.append  # the server observes them: /metrics is the server's
    writer.published_to = _published.extend
    # As the server does at its first batch (dashboard.ingest.asgi._tune_gc): the imports frozen out of the cyclic
    # collector, which the decoded batches' millions of short-lived dicts would otherwise set off every 700.
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)


def _child_main(down: Any, up: Any, db_name: str, turns: Any) -> None:
    """The child: a thread receives groups and checks their posts (decoding holds the GIL) while this one stores
    the group before (SQLite's own work runs without it), so the two overlap as the thread writer's event loop and
    writer thread did."""
    import queue

    _child_init(db_name, turns)
    checked: queue.Queue[Any] = queue.Queue(maxsize=1)

    def receive() -> None:
        while True:
            try:
                gid, items = down.recv()
            except (EOFError, OSError):  # the server closed the pipe (or died): store what was checked, then leave
                checked.put(None)
                return
            checked.put((gid, _check(items)))

    threading.Thread(target=receive, name="ingest-check", daemon=True).start()
    while (got := checked.get()) is not None:
        gid, group = got
        answers, waits = _store(*group)
        up.send((gid, answers, waits))
    from django.db import connection

    connection.close()


def _cluster(cluster_id: int) -> Any:
    from dashboard.telemetry.models import Cluster

    now = time.monotonic()
    got = _clusters.get(cluster_id)
    if got is None or now - got[0] > CLUSTER_CACHE_S:
        got = _clusters[cluster_id] = (now, Cluster.objects.get(id=cluster_id))
    return got[1]


def _check(items: list[Any]) -> tuple[list[Answer | None], list[Any], list[int]]:
    from dashboard.ingest.views import Checked, check_body

    answers: list[Answer | None] = [None] * len(items)
    jobs, where = [], []
    for i, (poster, body, gzipped, limit) in enumerate(items):
        try:
            checked = check_body(poster, body, gzipped, limit)
            if isinstance(checked, Checked):
                jobs.append((poster.cluster_id, checked.batch, checked.digest))
                where.append(i)
            else:
                answers[i] = ("refused", checked)
        except Exception as exc:
            answers[i] = ("bug", f"{type(exc).__name__}: {exc}")
    return answers, jobs, where


def _store(answers: list[Answer | None], checked: list[Any], where: list[int]) -> tuple[list[Answer], list[float]]:
    from django.core.exceptions import ObjectDoesNotExist

    from dashboard.ingest.commit import _drop_broken_connection
    from dashboard.ingest.views import _refuse
    from dashboard.ingest.writer import store_group
    from dashboard.live.publish import live_part

    _published.clear()
    _waits.clear()
    jobs, kept = [], []
    for i, (cluster_id, batch, digest) in zip(where, checked, strict=True):
        try:
            jobs.append((_cluster(cluster_id), batch, digest))
            kept.append(i)
        except (DatabaseError, ObjectDoesNotExist) as exc:  # the cluster (or the database) is gone: a 503
            answers[i] = ("db", str(exc))
    try:
        _drop_broken_connection()
        outcomes = store_group(jobs) if jobs else []
    except Exception as exc:  # store_group answers per batch; this is the database gone before it began
        outcomes = [exc] * len(jobs)
    stored = {(cid, b["agent_id"], b["seq"]): (cid, host, live_part(b), runs) for cid, host, b, runs in _published}
    for i, (cluster, batch, _), outcome in zip(kept, jobs, outcomes, strict=True):
        if isinstance(outcome, wire.WireError):  # numbers the group check refused: the post's 400
            answers[i] = ("refused", _refuse("invalid_batch", str(outcome)[:500]))
            continue
        if isinstance(outcome, Exception):
            _clusters.clear()  # a cluster deleted meanwhile is read again
            kind = "db" if isinstance(outcome, DatabaseError) else "bug"
            answers[i] = (kind, f"{type(outcome).__name__}: {outcome}"[:500])
            continue
        live = stored.get((cluster.id, batch["agent_id"], batch["seq"]))
        answers[i] = ("stored", outcome.status, outcome.records, batch["seq"], batch["agent_id"], live)
    _published.clear()
    return [a if a is not None else ("bug", "no outcome") for a in answers], list(_waits)
