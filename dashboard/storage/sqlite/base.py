"""The embedded default's database backend: Django's SQLite backend, with the process's write transactions taking
turns on a first-come, first-served lock before SQLite's own.

SQLite lets one connection write at a time. A connection that finds the lock taken waits in SQLite's busy handler,
which polls: it sleeps 1, 2, 5, 10 ... then 100 ms between tries and never queues. Under ingest the group writer
holds the lock almost back to back (one transaction per group, tens to hundreds of ms each) and takes it again at
once, so a poller rarely finds it free: findings' reconciliation, alert deliveries, rollups and retention, which run
in the server's other thread, waited seconds each (``benchmarks/sqlite_turns.py``: against a 30 ms writer back to
back, a 10 ms transaction every 50 ms got 1 in 5 s, after 5.0 s; 69 with this lock, waiting 22 ms). The writer in turn
sleeps through whole polling intervals after the other thread is done. Here a thread that begins a write transaction
queues on a fair in-process lock first and is handed the lock when the holder commits or rolls back, so SQLite's
lock is free by the time it asks (other processes, the CLI say, still meet SQLite's busy handler).

With ``CLUSTERDX_INGEST_WRITER=process`` the ingest writer runs in a process of its own (:mod:`dashboard.ingest.remote`);
the two processes take turns the same way through :class:`ProcessTurns`, which the server creates and hands to that
process: the head of each process's queue waits for the other process's transaction to end, and is handed the turn
when it does.

Only write transactions queue: the settings begin every transaction IMMEDIATE (they all may write), and a deferred
one (``transaction_mode`` unset) is left to SQLite.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from django.db import OperationalError
from django.db.backends.sqlite3 import base

from dashboard.metrics import WRITE_TURN_SECONDS


class ProcessTurns:
    """Write turns between two processes on one database file, handed over at release like :class:`FairLock`'s.

    Made by the parent before it starts the other process (its primitives travel to a spawned child only as the
    child's start arguments). Party 1 is the server, party 2 its ingest writer process. Shared: who holds the turn (0:
    nobody) and whether each party waits; a party that waits sleeps on its own semaphore until the holder hands the
    turn over. A process that dies holding the turn is released by the survivor (:meth:`forfeit`)."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._guard = ctx.Lock()
        self._state = ctx.RawArray("i", 3)  # [holder, party 1 waits, party 2 waits]
        self._wake = (ctx.Semaphore(0), ctx.Semaphore(0))

    def acquire(self, party: int, timeout: float) -> bool:
        state = self._state
        with self._guard:
            if state[0] == 0:
                state[0] = party
                return True
            state[party] = 1
        if self._wake[party - 1].acquire(timeout=timeout):
            return True  # handed over: held, in this party's name
        with self._guard:
            if state[0] == party:  # handed over between the timeout and the guard: take the wake-up it left
                self._wake[party - 1].acquire(timeout=0)
                return True
            state[party] = 0
            return False

    def release(self, party: int) -> None:
        with self._guard:
            if self._state[0] == party:
                self._hand_on(party)

    def forfeit(self, party: int) -> None:
        """``party``'s process is gone: give up whatever it held or waited for, and drain its wake-ups (a new
        process for that party starts with none)."""
        with self._guard:
            self._state[party] = 0
            if self._state[0] == party:
                self._hand_on(party)
            while self._wake[party - 1].acquire(timeout=0):
                pass

    def holder(self) -> int:
        return int(self._state[0])

    def _hand_on(self, party: int) -> None:
        other = 3 - party
        if self._state[other]:
            self._state[other] = 0
            self._state[0] = other
            self._wake[other - 1].release()
        else:
            self._state[0] = 0


class FairLock:
    """A mutex handed to its waiters in arrival order (``threading.Lock`` lets the releasing thread take it again
    before a woken waiter runs, which under the GIL is most of the time). With ``turns`` (:meth:`share`), whoever
    holds it then waits for this process's turn with the other process."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._queue: deque[threading.Lock] = deque()
        self._held = False
        self._turns: tuple[ProcessTurns, int] | None = None

    def share(self, turns: ProcessTurns | None, party: int = 1) -> None:
        self._turns = None if turns is None else (turns, party)

    def acquire(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        if not self._acquire_here(timeout):
            return False
        shared = self._turns
        if shared is None or shared[0].acquire(shared[1], max(0.0, deadline - time.monotonic())):
            return True
        self._release_here()
        return False

    def _acquire_here(self, timeout: float) -> bool:
        with self._guard:
            if not self._held:
                self._held = True
                return True
            ticket = threading.Lock()
            ticket.acquire()
            self._queue.append(ticket)
        if ticket.acquire(timeout=timeout):
            return True  # handed over by release(): held, in our name
        with self._guard:
            try:
                self._queue.remove(ticket)
            except ValueError:
                return True  # handed over between the timeout and the guard
            return False

    def release(self) -> None:
        shared = self._turns
        if shared is not None:  # the other process first: this process's next in line queues behind it
            shared[0].release(shared[1])
        self._release_here()

    def _release_here(self) -> None:
        with self._guard:
            if self._queue:
                self._queue.popleft().release()  # stays held: the next in line owns it now
            else:
                self._held = False


_locks: dict[str, FairLock] = {}
_locks_guard = threading.Lock()


def write_lock(name: str) -> FairLock:
    """The lock of one database file, shared by every connection of this process to it."""
    with _locks_guard:
        return _locks.setdefault(name, FairLock())


# How long each write transaction waited for its turn (on /metrics): the ingest writer process replaces it with one
# that keeps the waits for the server to observe.
observe_turn: Callable[[float], None] = WRITE_TURN_SECONDS.observe


class DatabaseWrapper(base.DatabaseWrapper):
    _held: FairLock | None = None  # the write lock this connection's open transaction holds

    def _start_transaction_under_autocommit(self) -> None:
        if self.transaction_mode is None or self.transaction_mode == "DEFERRED":
            return super()._start_transaction_under_autocommit()
        lock = write_lock(self.settings_dict["NAME"])
        timeout = float(self.settings_dict["OPTIONS"].get("timeout", 5))
        t0 = time.monotonic()
        got = lock.acquire(timeout)
        observe_turn(time.monotonic() - t0)  # on /metrics: how long the server's writers queue
        if not got:
            raise OperationalError(f"database is locked: another thread of this process (or its ingest writer "
                                   f"process) held its write transaction for over {timeout:g} s")
        self._held = lock
        try:
            super()._start_transaction_under_autocommit()
        except BaseException:
            self._release_write_lock()
            raise

    @property
    def _holds_write_lock(self) -> bool:
        return self._held is not None

    def _release_write_lock(self) -> None:
        lock, self._held = self._held, None
        if lock is not None:
            lock.release()

    # Every way a transaction ends hands the lock on, whatever SQLite answered (a failed COMMIT is rolled back next,
    # which needs no lock; a closed connection has rolled back).
    def _commit(self) -> Any:
        try:
            return super()._commit()
        finally:
            self._release_write_lock()

    def _rollback(self) -> Any:
        try:
            return super()._rollback()
        finally:
            self._release_write_lock()

    def _close(self) -> Any:
        try:
            return super()._close()
        finally:
            self._release_write_lock()
