"""The Celery app. Production: Redis broker, a worker and beat. Embedded: tasks run eagerly, and
:mod:`dashboard.scheduler` plays beat inside the server process with the same schedule."""

from __future__ import annotations

import os

from celery import Celery
from django.conf import settings

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")

app = Celery("clusterdx")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

# name -> (task path, seconds). Beat reads it in production; the embedded scheduler reads the same table.
SCHEDULE: dict[str, tuple[str, float]] = {
    "retention": ("dashboard.telemetry.tasks.purge_old_samples", 600.0),
    # 10 s / 1 min rollups of GPU and host samples. Pages read raw rows after the last pass, so a long interval
    # costs no freshness, and each pass recomputes less than a minute twice.
    "rollup": ("dashboard.storage.tasks.roll_up", 300.0),
    # Which probe frames hold probes to each host (dashboard.storage.probe_index): the pages search only the frames
    # written since the last pass by name, so it runs often (a pass at 2,048 nodes reads ~35,000 small rows).
    "probe-index": ("dashboard.storage.tasks.index_probes", 15.0),
    "alerts-sweep": ("dashboard.alerts.tasks.sweep", 1.0),
    "diagnosis": ("dashboard.diagnosis.tasks.diagnose", float(settings.CLUSTERDX["DIAGNOSIS_INTERVAL_S"])),
    # MFU per step and goodput per run (dashboard.diagnosis.efficiency): figures, not alarms; every 10 s is fresh enough.
    "efficiency": ("dashboard.diagnosis.tasks.record_efficiency", 10.0),
}


def beat_schedule() -> dict[str, dict[str, object]]:
    return {name: {"task": task, "schedule": every} for name, (task, every) in SCHEDULE.items()}


app.conf.beat_schedule = beat_schedule()
