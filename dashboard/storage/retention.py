"""Retention of the time-series tables: whole day partitions dropped on PostgreSQL, chunked deletes on SQLite.

The rolled-up raw tables (the GPU frames, the host rows) keep the hot window (``RAW_RETENTION_HOURS``); their cut
is aligned to the coarsest rollup window (SQLite: the minute; PostgreSQL: the day a partition holds), which a frame's
10 s window never straddles, and recorded as ``RollupState.raw_purged_through``, the line below which the rollup
pass merges late samples instead of recomputing windows. Each rollup tier keeps its own number of days.
"""

from __future__ import annotations

import logging
from datetime import UTC, date, datetime, timedelta

from django.conf import settings
from django.db import connection, models, transaction
from django.db.models import Q

from dashboard.storage import partitions
from dashboard.storage.models import ROLLUPS, RollupState, StepRollup
from dashboard.storage.rollup import exclusive, floor_to, raw_horizon, roll_up

log = logging.getLogger(__name__)

AHEAD_DAYS = 2  # partitions exist for today and the next two days: a missed maintenance run costs nothing


def partitioned(model: type[models.Model]) -> bool:
    if connection.vendor != "postgresql":
        return False
    with connection.cursor() as cursor:
        return partitions.is_partitioned(cursor, model._meta.db_table)


def ensure_ahead(models_: list[type[models.Model]], today: date | None = None) -> list[str]:
    today = today or datetime.now(UTC).date()
    made: list[str] = []
    for model in models_:
        if partitioned(model):
            with transaction.atomic(), connection.cursor() as cursor:
                made += partitions.ensure_partitions(cursor, model._meta.db_table,
                                                     [today + timedelta(days=i) for i in range(AHEAD_DAYS + 1)])
    return made


def purge(model: type[models.Model], before: datetime, chunk: int) -> tuple[datetime, int]:
    """Remove ``model``'s rows older than ``before``: returns the cut really applied (everything before it is gone,
    nothing at or after it is touched) and the rows deleted by DELETE statements (a dropped partition's rows are
    not counted: counting them would read them)."""
    if partitioned(model):
        cut = before.astimezone(UTC).date()
        with transaction.atomic(), connection.cursor() as cursor:
            dropped, deleted = partitions.drop_before(cursor, model._meta.db_table, cut, chunk)
        if dropped:
            log.info("retention: dropped %s", ", ".join(dropped))
        return datetime(cut.year, cut.month, cut.day, tzinfo=UTC), deleted
    return before, chunked_delete(model, before, chunk)


def chunked_delete(model: type[models.Model], before: datetime, chunk: int) -> int:
    """Bounded DELETEs naming their rows: a long outage of the task never turns into one giant, lock-holding DELETE."""
    rows = model._default_manager.filter(ts__lt=before)
    deleted = 0
    while True:
        ids = list(rows.values_list("id", flat=True)[:chunk])
        if not ids:
            return deleted
        deleted += model._default_manager.filter(id__in=ids).delete()[0]


def purge_tiers(now: datetime, chunk: int) -> int:
    """Roll up, then purge the rolled-up raw tables past the hot window and each rollup tier past its days."""
    with exclusive():
        return _purge_tiers(now, chunk)


def _purge_tiers(now: datetime, chunk: int) -> int:
    # Whatever is about to go is summarised first. (A batch hours late that commits between this pass and the purge
    # below loses its rows older than the cut: a window of a second or two every retention run.)
    roll_up(now)
    deleted = 0
    cut_raw = floor_to(raw_horizon(now), max(TIER_WIDTHS))
    cuts = []
    for raw, (_, _, tiers) in ROLLUPS.items():
        cut, n = purge(raw, cut_raw, chunk)
        cuts.append(cut)
        deleted += n
        for width, target in tiers.items():
            days = settings.CLUSTERDX["ROLLUP_10S_RETENTION_DAYS" if width == 10 else "ROLLUP_1M_RETENTION_DAYS"]
            deleted += purge(target, now - timedelta(days=days), chunk)[1]
    deleted += purge(StepRollup, now - timedelta(days=settings.CLUSTERDX["ROLLUP_1M_RETENTION_DAYS"]), chunk)[1]
    # The lowest cut: below it every raw table is purged (the tables share one partitioning and one cut).
    # Only forward: raising RAW_RETENTION_HOURS must not make windows already purged look recomputable.
    cut = min(cuts)
    RollupState.objects.filter(Q(raw_purged_through__isnull=True) | Q(raw_purged_through__lt=cut), pk=1).update(
        raw_purged_through=cut)
    return deleted


def rolled_tables() -> list[type[models.Model]]:
    """The raw tables that are rolled up, then the retiring row table, then the rollup tables."""
    return [*ROLLUPS, *(t for _, _, tiers in ROLLUPS.values() for t in tiers.values())]


TIER_WIDTHS = sorted({w for _, _, tiers in ROLLUPS.values() for w in tiers})
