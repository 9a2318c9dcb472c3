"""Retention: time series older than RETENTION_HOURS are deleted in bounded chunks."""

from __future__ import annotations

from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from dashboard.telemetry import models as m

SERIES = (m.GpuSample, m.HostSample, m.PortSample, m.StepSample, m.Event, m.Probe)


@shared_task(name="dashboard.telemetry.tasks.purge_old_samples")
def purge_old_samples(chunk: int = 50_000) -> int:
    cutoff = timezone.now() - timedelta(hours=settings.CLUSTERDX["RETENTION_HOURS"])
    deleted = 0
    for model in SERIES:
        # Chunked so a long outage of the task never turns into one giant, lock-holding DELETE.
        while True:
            ids = list(model.objects.filter(ts__lt=cutoff).values_list("id", flat=True)[:chunk])
            if not ids:
                break
            deleted += model.objects.filter(id__in=ids).delete()[0]
    m.AgentBatch.objects.filter(received_at__lt=cutoff).delete()
    return deleted
