"""The rollup pass: raw GPU and host rows become 10 s and 1 min windows (min / mean / max / last per column).

Which windows a pass computes: those of every node that had a batch received since the last pass (from the earliest
``sent_at`` of those batches, less ``SLACK``: the agents send each second what they measured in it). A window is
recomputed whole from the raw rows and *replaces* its rollup row (an upsert), so running a pass twice, or over a
window it already did, changes nothing: no double counting, and no bookkeeping of which rows were counted.

How (``_replace``): the raw rows are read and grouped once, into 10 s windows with exact per-column sums and counts;
the 1 min windows are grouped from those (6x fewer rows, means still exact); a window whose row count and newest row
are unchanged is not rewritten. docs/scaling-storage.md has the measured cost of each part.

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
from dashboard.storage.steps import roll_up_steps
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
    return written + roll_up_steps(now)


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
        t: datetime | None = lo
        while t is not None:
            hi = t + CHUNK if t + CHUNK < now else None  # the last chunk is open: clocks may run a bit ahead
            n = _replace(raw, tiers, keys, fields, nodes, [_adapt(t), *([_adapt(hi)] if hi else [])])
            written += n
            if hi is not None and n == 0:
                # Nothing new in this hour: on to the hour of the next raw row (a first pass over days with gaps).
                nxt = raw._default_manager.filter(node_id__in=nodes, ts__gte=hi).aggregate(t=Min("ts"))["t"]
                hi = max(hi, floor_to(nxt, max(tiers))) if nxt is not None else None
            t = hi
    return written


def _replace(raw: type[models.Model], tiers: dict[int, type[models.Model]], keys: tuple[str, ...],
             fields: tuple[str, ...], nodes: list[int], bounds: list[Any]) -> int:
    """Recompute every tier's windows of ``nodes`` in ``bounds`` (start, optional end; aligned to the coarsest tier).

    The raw rows are read and grouped once, into the finest tier's windows with exact partial sums (sum and count of
    each column's values, not only their mean); each coarser tier is grouped from those, 6x fewer rows than raw, and
    its mean is still the exact mean of the raw values (sums of sums over sums of counts), NULLs included."""
    fine = min(tiers)
    source = f"{raw._meta.db_table} WHERE {_where(len(nodes), len(bounds) == 2)}"
    windows = _windows_sql(keys, fields, fine, source)
    params = [*nodes, *bounds]
    if connection.vendor == "postgresql":
        # One statement: the windows are computed once (a materialised CTE) and feed every tier's upsert.
        ctes = [f"w AS MATERIALIZED ({windows})"]
        ctes += [f"t{width} AS ({_upsert_sql(target, keys, fields, _tier_sql(keys, fields, width, fine, 'w'))} RETURNING 1)"
                 for width, target in tiers.items()]
        count = " + ".join(f"(SELECT count(*) FROM t{width})" for width in tiers)
        with connection.cursor() as cursor:
            cursor.execute(f"WITH {', '.join(ctes)} SELECT {count}", params)
            return int(cursor.fetchone()[0])
    # SQLite has no data-modifying CTEs: the windows go to a temporary table of this connection, in one transaction.
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("DROP TABLE IF EXISTS temp.rollup_windows")
        cursor.execute(f"CREATE TEMP TABLE rollup_windows AS {windows}", params)
        written = 0
        for width, target in tiers.items():
            cursor.execute(_upsert_sql(target, keys, fields, _tier_sql(keys, fields, width, fine, "temp.rollup_windows")))
            written += max(cursor.rowcount, 0)
        cursor.execute("DROP TABLE temp.rollup_windows")
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
                last = _merge_sql(target, keys, fields, width, "gone")
            return _execute(f"WITH {', '.join(ctes)} {last}", params)
        # SQLite has one writer: no batch can commit between these statements of one transaction.
        n = 0
        for width, target in tiers.items():
            n += _execute(_merge_sql(target, keys, fields, width, f"{table} WHERE {_where(len(nodes), True)}"), params)
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


def _bucket(width: int, ts: str = "ts") -> str:
    """The window of a raw row's ``ts``: PostgreSQL its start (``date_bin``, integer arithmetic on the timestamp;
    ``extract(epoch ...)`` is numeric, and dividing it cost a microsecond a row, an eighth of the pass), SQLite its
    number (seconds since 1970 // width)."""
    if connection.vendor == "postgresql":
        return f"date_bin('{width} seconds', {ts}, TIMESTAMPTZ 'epoch')"
    # Seconds since 1970 of the whole-second part of Django's text timestamp: SQLite's date functions round to the
    # millisecond, which would put a row at hh:mm:09.9996 in the next window. ('%%s': Django's cursor makes %s a
    # parameter.)
    return f"(CAST(strftime('%%s', substr(ts, 1, 19)) AS INTEGER) / {width})"


def _real() -> str:
    return "float8" if connection.vendor == "postgresql" else "REAL"


def _windows_sql(keys: tuple[str, ...], fields: tuple[str, ...], width: int, source: str) -> str:
    """``source``'s raw rows grouped into windows of ``width`` s: (cluster_id, node_id, *keys, b, n, last_ts, and per
    column f_min, f_sum, f_cnt, f_max, f_last), b being the window (``_bucket``).

    "last" is the value of the window's newest row (by ts, then id): one ``row_number()`` marks that row, and a
    filtered MAX takes its value (NULL if it is NULL), the same sort feeding the window function and the grouping.
    (A FIRST_VALUE per column, or an ordered aggregate per column, costs a window function or a sort per column.)
    The raw values pass through untouched; only the windows' statistics are fitted to ``real`` (``_single``): per
    window, not per row. Their sums cannot overflow a double: the wire bounds every column (at most 2**63)."""
    k = "".join(f", {c}" for c in keys)
    fit = _single if connection.vendor == "postgresql" else str
    inner = "".join(f", {f}" for f in fields)
    outer = "".join(f", {fit(f'MIN({f})')} AS {f}_min, SUM(CAST({f} AS {_real()})) AS {f}_sum, "
                    f"CAST(COUNT({f}) AS {_real()}) AS {f}_cnt, {fit(f'MAX({f})')} AS {f}_max, "
                    f"{fit(f'MAX({f}) FILTER (WHERE r = 1)')} AS {f}_last" for f in fields)
    bucket = _bucket(width)
    return (f"SELECT MIN(cluster_id) AS cluster_id, node_id{k}, b, COUNT(*) AS n, MAX(ts_) AS last_ts{outer} FROM ("
            f"SELECT cluster_id, node_id{k}, ts AS ts_, {bucket} AS b{inner}, "
            f"row_number() OVER (PARTITION BY node_id{k}, {bucket} ORDER BY ts DESC, id DESC) AS r FROM {source}) s "
            f"WHERE true GROUP BY node_id{k}, b")


def _tier_sql(keys: tuple[str, ...], fields: tuple[str, ...], width: int, fine: int, windows: str) -> str:
    """The rollup rows of the ``width`` s tier (``_columns`` order) from ``windows``, the rows of ``_windows_sql`` at
    ``fine`` s: as they are when ``width == fine``, else grouped ``width // fine`` windows to one, "last" being the
    last of the newest of them."""
    k = "".join(f", {c}" for c in keys)
    def start(b: str) -> str:  # the window's start time from ``_bucket``'s value
        return b if connection.vendor == "postgresql" else f"datetime({b} * {width}, 'unixepoch')"

    fit = _single if connection.vendor == "postgresql" else str
    if width == fine:
        stats = "".join(f", {f}_min, {fit(f'{f}_sum / {f}_cnt')}, {f}_max, {f}_last" for f in fields)
        return f"SELECT cluster_id, node_id{k}, {start('b')}, n, last_ts{stats} FROM {windows} WHERE true"
    assert width % fine == 0, (width, fine)
    coarse = _bucket(width, "b") if connection.vendor == "postgresql" else f"(b / {width // fine})"
    stats = "".join(f", MIN({f}_min), {fit(f'SUM({f}_sum) / SUM({f}_cnt)')}, MAX({f}_max), "
                    f"MAX({f}_last) FILTER (WHERE r = 1)" for f in fields)
    return (f"SELECT MIN(cluster_id), node_id{k}, {start('c')}, SUM(n), MAX(last_ts){stats} FROM ("
            f"SELECT *, {coarse} AS c, row_number() OVER (PARTITION BY node_id{k}, {coarse} ORDER BY b DESC) AS r "
            f"FROM {windows}) s WHERE true GROUP BY node_id{k}, c")


def _aggregate_sql(keys: tuple[str, ...], fields: tuple[str, ...], width: int, source: str) -> str:
    """The rollup rows of ``source``'s raw rows in windows of ``width`` s, straight from raw (late rows merged)."""
    return _tier_sql(keys, fields, width, width, f"({_windows_sql(keys, fields, width, source)}) w")


def _single(e: str) -> str:
    """A statistic within single precision's range (the rollups' ``real`` columns), as float8: a value ``real`` cannot
    hold would make PostgreSQL refuse the window on every pass. Magnitudes below 1.2e-38 become 0, above 3.4e38 the
    largest value. (LEAST and GREATEST skip NULLs, hence the first branch.)"""
    v = f"CAST({e} AS float8)"
    return (f"CASE WHEN {e} IS NULL THEN NULL WHEN abs({v}) < 1.2e-38 THEN CAST(0 AS float8) "
            f"ELSE LEAST(GREATEST({v}, CAST(-3.4e38 AS float8)), CAST(3.4e38 AS float8)) END")


def _columns(keys: tuple[str, ...], fields: tuple[str, ...]) -> list[str]:
    return ["cluster_id", "node_id", *keys, "ts", "n", "last_ts",
            *[f"{f}_{s}" for f in fields for s in ("min", "mean", "max", "last")]]


def _upsert_sql(target: type[models.Model], keys: tuple[str, ...], fields: tuple[str, ...], select: str) -> str:
    """Insert ``select``'s rows into ``target``, each replacing the window's row if there is one."""
    t, cols = target._meta.db_table, _columns(keys, fields)
    updates = ", ".join(f"{c} = excluded.{c}" for c in cols[len(keys) + 3:])
    # A window whose row count and newest row are those already stored summarises the same raw rows (raw rows are
    # only ever added, and purged a whole window at a time), so it is left alone: a pass re-reads the minute or two
    # before its new data (margins), and rewriting those wide rows unchanged cost as much as computing them.
    differs = "IS DISTINCT FROM" if connection.vendor == "postgresql" else "IS NOT"
    return (f"INSERT INTO {t} ({', '.join(cols)}) {select} "
            f"ON CONFLICT (node_id, ts{''.join(f', {c}' for c in keys)}) DO UPDATE SET cluster_id = excluded.cluster_id, "
            f"{updates} WHERE {t}.n {differs} excluded.n OR {t}.last_ts {differs} excluded.last_ts")


def _merge_sql(target: type[models.Model], keys: tuple[str, ...], fields: tuple[str, ...], width: int,
               source: str) -> str:
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
    return (f"INSERT INTO {t} ({', '.join(cols)}) {_aggregate_sql(keys, fields, width, source)} "
            f"ON CONFLICT (node_id, ts{''.join(f', {c}' for c in keys)}) DO UPDATE SET {', '.join(sets)}")
