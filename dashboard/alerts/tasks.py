"""Celery tasks. ``deliver`` is acks_late: a worker killed mid-request leaves the message unacknowledged, the broker
hands it out again, and :func:`delivery.claim` lets it take over the dead worker's attempt.

Embedded (tasks eager, no broker) nothing is enqueued: the embedded scheduler runs ``sweep`` every second, which
sends due rows from a background thread so a slow receiver never holds up ingest.

Either way the sweep first plans what the alerts outbox still owes (:func:`planner.drain_outbox`): finding events
whose on_commit fast path died with its process, and the alerts held back by silences that have ended
(:func:`planner.release_silences`).
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime

from celery import shared_task
from django.db import connection
from django.utils import timezone

from dashboard.alerts import conf, planner
from dashboard.alerts import delivery as attempts
from dashboard.alerts.models import Delivery
from dashboard.celery import app  # the project's app, configured from settings, whoever imports this first

log = logging.getLogger(__name__)
_sweeping = threading.Lock()


def eager() -> bool:
    return bool(app.conf.task_always_eager)


def enqueue(delivery_id: int, attempt: int, at: datetime | None) -> None:
    if eager():
        return  # the embedded sweep picks it up when due
    queue = conf.get("ALERTS_QUEUE") or None
    deliver.apply_async((delivery_id, attempt), eta=at, queue=queue)


def schedule(delivery: Delivery) -> None:
    enqueue(delivery.id, delivery.attempts + 1, delivery.next_attempt_at)


@shared_task(name="dashboard.alerts.tasks.deliver", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def deliver(delivery_id: int, attempt: int = 1) -> None:
    nxt = attempts.attempt(delivery_id, attempt)
    if nxt.at is not None:
        enqueue(delivery_id, nxt.attempt, nxt.at)


def send_due(limit: int = 100) -> int:
    """Embedded: make every due attempt now, in this thread. Returns how many rows were looked at."""
    rows = attempts.due(limit=limit)
    for delivery_id, number in rows:
        attempts.attempt(delivery_id, number)
    return len(rows)


def _sweep_in_background() -> None:
    try:
        planner.drain_outbox()  # its deliveries are pending and due: the loop below sends them
        planner.release_silences()
        for _ in range(10):  # bounded: the next sweep, a second later, carries on
            if not send_due():
                break
    except Exception:
        log.exception("alerts: embedded sweep failed")
    finally:
        connection.close()  # this thread's own connection; the thread ends here
        _sweeping.release()


@shared_task(name="dashboard.alerts.tasks.sweep", ignore_result=True)
def sweep() -> None:
    """Plan what the outbox owes, then: embedded, send what is due (at most one sweeping thread); production,
    enqueue the new rows and re-enqueue those whose message was lost (overdue by ALERTS_SWEEP_GRACE_S: a broker
    restart, a purge), harmless if it was not."""
    if eager():
        # The check is one indexed query on the scheduler's thread; a thread (and its connection) only when needed.
        if (attempts.due(limit=1) or planner.owed(limit=1) or planner.silences_due(limit=1)) and \
                _sweeping.acquire(blocking=False):
            threading.Thread(target=_sweep_in_background, name="alerts-sweep", daemon=True).start()
        return
    for delivery in planner.drain_outbox() + planner.release_silences():
        schedule(delivery)
    for delivery_id, number in attempts.due(grace_s=float(conf.get("ALERTS_SWEEP_GRACE_S"))):
        enqueue(delivery_id, number, timezone.now())
