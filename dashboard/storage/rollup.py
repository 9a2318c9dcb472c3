"""The rollup pass: raw GPU and host rows become 10 s and 1 min windows (min / mean / max / last per column).

Which windows a pass computes: those of every node that had a batch received since the last pass (from the earliest
``sent_at`` of those batches, less ``SLACK``: the agents send each second what they measured in it). A window is
recomputed whole from the raw rows and *replaces* its rollup row (an upsert), so running a pass twice, or over a
window it already did, changes nothing: no double counting, and no bookkeeping of which rows were counted.

Late batches: a batch that arrives hours late (an agent that spooled through an outage) marks its node's windows from
its ``sent_at`` on, and the next pass recomputes them from raw, the late rows included. A window whose raw rows
retention has already purged (older than ``raw_purged_through``) cannot be recomputed; there the late rows are
*merged* into the rollup (min of mins, max of maxes, means weighted by row counts, the last by time) and deleted
from raw in the same statement (PostgreSQL: ``DELETE ... RETURNING`` feeding the upsert), so they are counted exactly
once however often a pass runs.

The first pass (no state yet) rolls up everything raw still holds, an hour per statement.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, models, transaction
from django.db.models import Min
from django.db.models.functions import Coalesce
from django.utils import timezone

from dashboard.storage.models import ROLLUPS, RollupState
from dashboard.telemetry.models import AgentBatch, Cluster, Node

log = logging.getLogger(__name__)

SLACK = timedelta(seconds=30)  # a sample is at most this much older than its batch's sent_at
MARGIN = timedelta(seconds=30)  # a batch is committed within this of its received_at (so the next pass sees it)
CHUNK = timedelta(hours=1)  # raw time per statement: a backfill never becomes one giant statement
NODES_PER_STATEMENT = 500
LOCK_KEY = 0x636478_5354  # "cdx" "ST": the PostgreSQL advisory lock of rollup passes and raw purges


@contextmanager
def exclusive() -> Iterator[None]:
    """One rollup pass or raw purge at a time across workers: a pass that recomputed a window while retention was
    purging its raw rows would replace the window's rollup with a part of it. (SQLite: the embedded scheduler runs
    one task at a time.) Re-entrant: retention runs a pass under the lock."""
    if connection.vendor != "postgresql":
        yield
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_lock(%s)", [LOCK_KEY])
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [LOCK_KEY])


def floor_to(t: datetime, seconds: int) -> datetime:
    return datetime.fromtimestamp(int(t.timestamp() // seconds) * seconds, UTC)


def raw_horizon(now: datetime) -> datetime:
    return now - timedelta(hours=settings.CLUSTERDX["RAW_RETENTION_HOURS"])


def roll_up(now: datetime | None = None) -> int:
    """One pass; returns the number of rollup rows written or merged."""
    with exclusive():
        return _pass(now or timezone.now())


def _pass(now: datetime) -> int:
    state, _ = RollupState.objects.get_or_create(pk=1)
    dirty = _dirty(state, now)
    written = 0
    by_start: dict[datetime, list[int]] = defaultdict(list)
    for node_id, start in dirty.items():
        by_start[floor_to(start, 60)].append(node_id)
    for start, nodes in sorted(by_start.items()):
        for i in range(0, len(nodes), NODES_PER_STATEMENT):
            written += _roll(sorted(nodes[i:i + NODES_PER_STATEMENT]), start, now, state.raw_purged_through)
    RollupState.objects.filter(pk=1).update(received_through=now, rolled_through=now)
    return written


def _dirty(state: RollupState, now: datetime) -> dict[int, datetime]:
    """node id -> the earliest time whose windows may have changed since the last pass."""
    if state.received_through is None:
        # The first pass: everything raw holds (a server upgraded with days of raw rows keeps their history).
        oldest = [raw._default_manager.aggregate(t=Min("ts"))["t"] for raw in ROLLUPS]
        start = max(min([t for t in oldest if t is not None], default=now), now - timedelta(days=31))
        return dict.fromkeys(Node.objects.values_list("id", flat=True), start)
    since = state.received_through - MARGIN
    out: dict[int, datetime] = {}
    for cluster_id in Cluster.objects.values_list("id", flat=True):
        # One probe of the (cluster, received_at) index per cluster: the batches received since the last pass.
        first = dict(AgentBatch.objects.filter(cluster_id=cluster_id, received_at__gt=since).values("host")
                     .annotate(first=Min(Coalesce("sent_at", "received_at"))).values_list("host", "first"))
        if not first:
            continue
        for host, node_id in Node.objects.filter(cluster_id=cluster_id, hostname__in=list(first)).values_list(
                "hostname", "id"):
            out[node_id] = first[host] - SLACK
    return out


def _roll(nodes: list[int], start: datetime, now: datetime, purged: datetime | None) -> int:
    written = 0
    for raw, (keys, fields, tiers) in ROLLUPS.items():
        lo = floor_to(start, max(tiers))  # aligned to every tier's windows
        if purged is not None and lo < purged:
            written += _merge(raw, tiers, keys, fields, nodes, lo, purged)
            lo = purged
        for width, target in tiers.items():
            t = lo
            while True:
                hi = t + CHUNK if t + CHUNK < now else None  # the last chunk is open: clocks may run a bit ahead
                written += _execute(_replace_sql(raw, target, keys, fields, width, len(nodes), hi is not None),
                                    [*nodes, _adapt(t), *([_adapt(hi)] if hi else [])])
                if hi is None:
                    break
                t = hi
    return written


def _merge(raw: type[models.Model], tiers: dict[int, type[models.Model]], keys: tuple[str, ...],
           fields: tuple[str, ...], nodes: list[int], lo: datetime, hi: datetime) -> int:
    """Late rows in [lo, hi), windows retention already purged: merged into every tier, then deleted, atomically."""
    params = [*nodes, _adapt(lo), _adapt(hi)]
    table = raw._meta.db_table
    with transaction.atomic():
        if connection.vendor == "postgresql":
            # One statement: the rows the DELETE returns are exactly the rows merged, so a batch committing
            # meanwhile is either in both or in neither.
            ctes = [f"gone AS (DELETE FROM {table} WHERE {_where(len(nodes), True)} RETURNING *)"]
            last = None
            for width, target in tiers.items():
                if last is not None:
                    ctes.append(f"t{width} AS ({last})")
                last = _merge_sql(raw, target, keys, fields, width, "gone")
            return _execute(f"WITH {', '.join(ctes)} {last}", params)
        # SQLite has one writer: no batch can commit between these statements of one transaction.
        n = 0
        for width, target in tiers.items():
            n += _execute(_merge_sql(raw, target, keys, fields, width, f"{table} WHERE {_where(len(nodes), True)}"),
                          params)
        _execute(f"DELETE FROM {table} WHERE {_where(len(nodes), True)}", params)
        return n


def _execute(sql: str, params: list[Any]) -> int:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return max(cursor.rowcount, 0)


def _adapt(t: datetime) -> Any:
    return connection.ops.adapt_datetimefield_value(t)


def _where(n_nodes: int, bounded: bool) -> str:
    return f"node_id IN ({', '.join(['%s'] * n_nodes)}) AND ts >= %s" + (" AND ts < %s" if bounded else "")


def _aggregate_sql(raw: type[models.Model], keys: tuple[str, ...], fields: tuple[str, ...], width: int,
                   source: str) -> str:
    """The windows of ``source``'s rows: (cluster_id, node_id, *keys, ts, n, last_ts, f_min, f_mean, f_max, f_last...).

    "last" is the value of the window's newest row (by ts, then id), taken with a window function since neither
    database has a portable last() aggregate."""
    if connection.vendor == "postgresql":
        bucket, start, real = f"floor(extract(epoch FROM ts) / {width})", f"to_timestamp(b * {width})", "float8"
    else:
        # Seconds since 1970 of the whole-second part of Django's text timestamp: SQLite's date functions round to the
        # millisecond, which would put a row at hh:mm:09.9996 in the next window. ('%%s': Django's cursor makes %s a
        # parameter.)
        bucket = f"(CAST(strftime('%%s', substr(ts, 1, 19)) AS INTEGER) / {width})"
        start, real = f"datetime(b * {width}, 'unixepoch')", "REAL"
    k = "".join(f", {c}" for c in keys)
    fit = _single if connection.vendor == "postgresql" else str
    inner_f = "".join(f", {fit(f)} AS {f}, FIRST_VALUE({fit(f)}) OVER w AS {f}__last" for f in fields)
    outer_f = "".join(f", MIN({f}), AVG(CAST({f} AS {real})), MAX({f}), MAX({f}__last)" for f in fields)
    return (f"SELECT cluster_id, node_id{k}, {start}, COUNT(*), MAX(ts_){outer_f} FROM ("
            f"SELECT cluster_id, node_id{k}, ts AS ts_, {bucket} AS b{inner_f} FROM {source} "
            f"WINDOW w AS (PARTITION BY node_id{k}, {bucket} ORDER BY ts DESC, id DESC)) s "
            f"WHERE true GROUP BY cluster_id, node_id{k}, b")


def _single(e: str) -> str:
    """A raw value within single precision's range (the rollups' ``real`` columns), as float8: a value ``real`` cannot
    hold would make PostgreSQL refuse the window on every pass, and so would one whose square overflows AVG's float8
    accumulator (beyond 1e154). Magnitudes below 1.2e-38 become 0, above 3.4e38 the largest value. (LEAST and
    GREATEST skip NULLs, hence the first branch.)"""
    v = f"CAST({e} AS float8)"
    return (f"CASE WHEN {e} IS NULL THEN NULL WHEN abs({v}) < 1.2e-38 THEN CAST(0 AS float8) "
            f"ELSE LEAST(GREATEST({v}, CAST(-3.4e38 AS float8)), CAST(3.4e38 AS float8)) END")


def _columns(keys: tuple[str, ...], fields: tuple[str, ...]) -> list[str]:
    return ["cluster_id", "node_id", *keys, "ts", "n", "last_ts",
            *[f"{f}_{s}" for f in fields for s in ("min", "mean", "max", "last")]]


def _replace_sql(raw: type[models.Model], target: type[models.Model], keys: tuple[str, ...], fields: tuple[str, ...],
                 width: int, n_nodes: int, bounded: bool) -> str:
    cols = _columns(keys, fields)
    source = f"{raw._meta.db_table} WHERE {_where(n_nodes, bounded)}"
    updates = ", ".join(f"{c} = excluded.{c}" for c in cols[len(keys) + 3:])
    return (f"INSERT INTO {target._meta.db_table} ({', '.join(cols)}) {_aggregate_sql(raw, keys, fields, width, source)} "
            f"ON CONFLICT (node_id, ts{''.join(f', {c}' for c in keys)}) DO UPDATE SET cluster_id = excluded.cluster_id, "
            f"{updates}")


def _merge_sql(raw: type[models.Model], target: type[models.Model], keys: tuple[str, ...], fields: tuple[str, ...],
               width: int, source: str) -> str:
    t, cols = target._meta.db_table, _columns(keys, fields)
    least, greatest = ("LEAST", "GREATEST") if connection.vendor == "postgresql" else ("min", "max")
    real = "float8" if connection.vendor == "postgresql" else "REAL"  # weight sums in double: no real overflow

    def both(fn: str, a: str, b: str) -> str:  # null-safe: SQLite's scalar min/max are NULL when an argument is
        return f"{fn}(COALESCE({a}, {b}), COALESCE({b}, {a}))"

    sets = [f"n = {t}.n + excluded.n", f"last_ts = {both(greatest, f'{t}.last_ts', 'excluded.last_ts')}"]
    for f in fields:
        mn, mean, mx, last = (f"{f}_{s}" for s in ("min", "mean", "max", "last"))
        sets += [f"{mn} = {both(least, f'{t}.{mn}', f'excluded.{mn}')}",
                 f"{mx} = {both(greatest, f'{t}.{mx}', f'excluded.{mx}')}",
                 f"{mean} = CASE WHEN {t}.{mean} IS NULL THEN excluded.{mean} WHEN excluded.{mean} IS NULL THEN {t}.{mean} "
                 f"ELSE (CAST({t}.{mean} AS {real}) * {t}.n + CAST(excluded.{mean} AS {real}) * excluded.n) "
                 f"/ ({t}.n + excluded.n) END",
                 f"{last} = CASE WHEN excluded.last_ts >= {t}.last_ts THEN excluded.{last} ELSE {t}.{last} END"]
    return (f"INSERT INTO {t} ({', '.join(cols)}) {_aggregate_sql(raw, keys, fields, width, source)} "
            f"ON CONFLICT (node_id, ts{''.join(f', {c}' for c in keys)}) DO UPDATE SET {', '.join(sets)}")
