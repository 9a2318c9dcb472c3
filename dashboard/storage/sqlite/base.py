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

Only write transactions queue: the settings begin every transaction IMMEDIATE (they all may write), and a deferred
one (``transaction_mode`` unset) is left to SQLite.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from django.db import OperationalError
from django.db.backends.sqlite3 import base

from dashboard.metrics import WRITE_TURN_SECONDS


class FairLock:
    """A mutex handed to its waiters in arrival order (``threading.Lock`` lets the releasing thread take it again
    before a woken waiter runs, which under the GIL is most of the time)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._queue: deque[threading.Lock] = deque()
        self._held = False

    def acquire(self, timeout: float) -> bool:
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


class DatabaseWrapper(base.DatabaseWrapper):
    _held: FairLock | None = None  # the write lock this connection's open transaction holds

    def _start_transaction_under_autocommit(self) -> None:
        if self.transaction_mode is None or self.transaction_mode == "DEFERRED":
            return super()._start_transaction_under_autocommit()
        lock = write_lock(self.settings_dict["NAME"])
        timeout = float(self.settings_dict["OPTIONS"].get("timeout", 5))
        t0 = time.monotonic()
        got = lock.acquire(timeout)
        WRITE_TURN_SECONDS.observe(time.monotonic() - t0)  # on /metrics: how long the server's writers queue
        if not got:
            raise OperationalError(f"database is locked: another thread of this process held its write transaction "
                                   f"for over {timeout:g} s")
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
