"""Periodic work of the storage tiers (scheduled in dashboard.celery.SCHEDULE; retention runs from
dashboard.telemetry.tasks.purge_old_samples)."""

from __future__ import annotations

from celery import shared_task

from dashboard.storage import probe_index, rollup


@shared_task(name="dashboard.storage.tasks.roll_up")
def roll_up() -> int:
    return rollup.roll_up()


@shared_task(name="dashboard.storage.tasks.index_probes")
def index_probes() -> int:
    return probe_index.update()
