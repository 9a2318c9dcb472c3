"""The embedded backend's write transactions take turns in arrival order (dashboard.storage.sqlite): a thread that
begins one while the group writer holds the database is next, not left polling SQLite's busy handler while the writer
takes the lock again and again (benchmarks/sqlite_turns.py measures the waits)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction
from prometheus_client import REGISTRY

from dashboard.storage.sqlite.base import FairLock, write_lock
from dashboard.telemetry.models import Cluster

pytestmark = pytest.mark.skipif(connection.vendor != "sqlite", reason="the embedded (SQLite) backend's lock")


def test_the_lock_is_handed_over_in_arrival_order_and_a_timed_out_waiter_leaves_the_queue() -> None:
    lock = FairLock()
    assert lock.acquire(1)
    order: list[str] = []
    queued = threading.Barrier(2)

    def wait(name: str) -> None:
        if name == "second":
            queued.wait()  # the first is queued (its thread started first and is blocked in acquire)
        assert lock.acquire(10)
        order.append(name)
        lock.release()

    first = threading.Thread(target=wait, args=("first",))
    first.start()
    while not lock._queue:
        threading.Event().wait(0.001)
    second = threading.Thread(target=wait, args=("second",))
    second.start()
    queued.wait()
    while len(lock._queue) < 2:
        threading.Event().wait(0.001)
    assert not lock.acquire(0.01)  # held: a third caller times out...
    assert len(lock._queue) == 2  # ...and is not left in the queue
    lock.release()
    first.join()
    second.join()
    assert order == ["first", "second"]
    assert lock.acquire(0) and not lock._queue  # free again
    lock.release()


@pytest.mark.django_db(transaction=True)
def test_a_waiting_thread_goes_before_the_writers_next_transaction_and_every_end_hands_the_lock_on() -> None:
    name = connection.settings_dict["NAME"]
    waits_before = REGISTRY.get_sample_value("clusterdx_db_write_wait_seconds_count") or 0.0
    turns: list[str] = []
    writer_in, other_queued, stop = threading.Event(), threading.Event(), threading.Event()

    def writer() -> None:
        try:
            for i in range(50):
                with transaction.atomic():
                    turns.append("writer")
                    Cluster.objects.create(name=f"w{i}")
                    writer_in.set()
                    if i == 0:
                        other_queued.wait(10)
                        deadline = time.monotonic() + 10
                        while not write_lock(name)._queue and time.monotonic() < deadline:
                            threading.Event().wait(0.001)  # until the other thread is queued behind this transaction
                if stop.is_set():
                    break
        finally:
            connections.close_all()

    def other() -> None:
        try:
            writer_in.wait(10)
            other_queued.set()
            with transaction.atomic():
                turns.append("other")
                Cluster.objects.create(name="other")
            stop.set()
        finally:
            connections.close_all()

    threads = [threading.Thread(target=writer), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # FIFO: the other thread was queued during the writer's first transaction, so it is the second one.
    assert turns[:2] == ["writer", "other"], turns[:5]
    # Every turn is timed for /metrics, the other thread's wait (the writer's whole first transaction) among them.
    waits = REGISTRY.get_sample_value("clusterdx_db_write_wait_seconds_count")
    assert waits is not None and waits >= waits_before + len(turns)

    # A rollback (an exception in the block) and a closed connection hand the lock on as a commit does.
    with pytest.raises(RuntimeError), transaction.atomic():
        Cluster.objects.create(name="rolled-back")
        raise RuntimeError
    assert write_lock(name).acquire(0)
    write_lock(name).release()
    atomic: Any = transaction.atomic()
    atomic.__enter__()
    Cluster.objects.create(name="closed")
    assert not write_lock(name).acquire(0)
    connection.close()
    assert write_lock(name).acquire(0)
    write_lock(name).release()
    atomic.__exit__(None, None, None)  # Django notes the connection closed in the block and drops it
    assert not Cluster.objects.filter(name__in=["rolled-back", "closed"]).exists()


def test_a_thread_that_cannot_get_its_turn_in_time_gets_a_clear_error(settings: Any) -> None:
    lock = write_lock("a-file-no-test-uses")
    assert lock.acquire(1)
    try:
        from dashboard.storage.sqlite.base import DatabaseWrapper

        db = DatabaseWrapper({**connection.settings_dict, "NAME": "a-file-no-test-uses",
                              "OPTIONS": {**connection.settings_dict["OPTIONS"], "timeout": 0.05}}, alias="turns")
        db.transaction_mode = "IMMEDIATE"  # as its first connection sets it from the OPTIONS
        with pytest.raises(OperationalError, match="database is locked: another thread of this process"):
            db._start_transaction_under_autocommit()
        assert not db._holds_write_lock
    finally:
        lock.release()
