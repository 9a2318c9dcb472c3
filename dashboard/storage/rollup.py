"""The rollup pass: raw GPU and host samples become 10 s and 1 min windows (min / mean / max / last of each field).

Which windows a pass computes: those of every node that had a batch received since the last pass (from the earliest
``sent_at`` of those batches, less ``SLACK``: the agents send each second what they measured in it). A window is
recomputed whole from the raw samples and *replaces* its rollup row (an upsert), so running a pass twice, or over a
window it already did, changes nothing: no double counting, and no bookkeeping of which samples were counted. A window
whose sample count and newest sample are those already stored is not rewritten.

GPU samples are read from their frames (:mod:`dashboard.storage.frames`; a frame lies in one aligned 10 s window, so
a span aligned to the minute selects whole frames along ``(node, ts)``), ``NODES_PER_READ`` nodes and ``FRAME_SPAN``
at a time, and grouped in numpy (``_gpu_windows``): one sort by (node, GPU, time, frame id, position in the frame),
the 10 s windows reduced from the samples with exact per-field sums and counts, the 1 min windows from those (6x
fewer rows, means still exact). The windows go to the database in one binary COPY on PostgreSQL (a temporary table
feeding each tier's upsert), by ``executemany`` on SQLite. Host samples are rows and are grouped in SQL
(``_replace``), an hour per statement. docs/scaling-storage.md has the measured cost.

Late batches: a batch that arrives hours late (an agent that spooled through an outage) marks its node's windows from
its ``sent_at`` on, and the next pass recomputes them from raw, the late samples included. A window whose raw samples
retention has already purged (older than ``raw_purged_through``) cannot be recomputed; there the late samples are
*merged* into the rollup (min of mins, max of maxes, means weighted by sample counts, the last by time) and deleted
from raw in the same transaction (``DELETE ... RETURNING`` feeding the merge: the frames or rows deleted are exactly
those merged), so they are counted exactly once however often a pass runs.

The first pass (no state yet) rolls up everything raw still holds, skipping the spans without samples.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import numpy as np
from django.conf import settings
from django.db import connection, models, transaction
from django.db.models import Min
from django.db.models.functions import Coalesce
from django.utils import timezone

from dashboard.storage import frames as fr
from dashboard.storage.models import GPU_FIELDS, GPU_TIERS, ROLLUPS, RollupState
from dashboard.storage.steps import roll_up_steps
from dashboard.telemetry.models import AgentBatch, Cluster, GpuFrame, Node

log = logging.getLogger(__name__)

SLACK = timedelta(seconds=30)  # a sample is at most this much older than its batch's sent_at
MARGIN = timedelta(seconds=30)  # a batch is committed within this of its received_at (so the next pass sees it)
CHUNK = timedelta(hours=1)  # raw time per statement: a backfill never becomes one giant statement
NODES_PER_STATEMENT = 500
# GPU samples are grouped in numpy, in memory: at most this many nodes' and minutes' at once (32 nodes x 8 GPUs x
# 10 min at 1 Hz: 154,000 samples, ~130 MB while grouped).
NODES_PER_READ = 32
FRAME_SPAN = timedelta(minutes=10)
ALIGN = 60  # every tier's window divides it: chunks start on it, so none splits a window (or a frame)
LOCK_KEY = 0x636478_5354  # "cdx" "ST": the PostgreSQL advisory lock of rollup passes and raw purges


@contextmanager
def exclusive() -> Iterator[None]:
    """One rollup pass or raw purge at a time across workers: a pass that recomputed a window while retention was
    purging its raw samples would replace the window's rollup with a part of it. (SQLite: the embedded scheduler runs
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
        # The first pass: everything raw holds (a server upgraded with days of raw samples keeps their history).
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


Work = Callable[[datetime, datetime | None], int]  # over [start, end) (end None: open); returns rollup rows written


def _roll(nodes: list[int], start: datetime, now: datetime, purged: datetime | None) -> int:
    written = 0
    for raw, (keys, fields, tiers) in ROLLUPS.items():
        lo = floor_to(start, max(tiers))  # aligned to every tier's windows (and so to the frames' 10 s windows)
        rest = purged if purged is not None and lo < purged else lo  # before it: merged, not recomputed
        if raw is not GpuFrame:
            if rest > lo:
                written += _merge(raw, tiers, keys, fields, nodes, lo, rest)
            written += _spans(raw, nodes, rest, now, CHUNK, partial(_replace_rows, raw, tiers, keys, fields, nodes),
                              open_end=True)
            continue
        # The GPU samples are grouped in this process: NODES_PER_READ nodes and FRAME_SPAN at a time bound its memory.
        for i in range(0, len(nodes), NODES_PER_READ):
            part = nodes[i:i + NODES_PER_READ]
            if rest > lo:
                written += _spans(raw, part, lo, rest, FRAME_SPAN, partial(_merge_frames, part))
            written += _spans(raw, part, rest, now, FRAME_SPAN, partial(_replace_frames, part), open_end=True)
    return written


def _spans(raw: type[models.Model], nodes: list[int], lo: datetime, until: datetime, span: timedelta, work: Work,
           open_end: bool = False) -> int:
    """``work`` over [lo, until) a ``span`` at a time, skipping the spans without raw samples of ``nodes``.
    ``open_end``: ``until`` is now, and the last span is left open (clocks may run a bit ahead)."""
    written = 0
    t: datetime | None = lo
    while t is not None and (open_end or t < until):
        hi: datetime | None = t + span
        if hi is not None and hi >= until:
            hi = None if open_end else until
        n = work(t, hi)
        written += n
        if hi is not None and n == 0 and hi < until:
            # Nothing new in this span: on to the span of the next raw sample (a first pass over days with gaps).
            later = raw._default_manager.filter(node_id__in=nodes, ts__gte=hi)
            nxt = (later if open_end else later.filter(ts__lt=until)).aggregate(t=Min("ts"))["t"]
            hi = max(hi, floor_to(nxt, ALIGN)) if nxt is not None else None
        t = hi
    return written


# -- GPU samples: from their frames, in numpy ---------------------------------------------------------------------

_GPU_KEYS = ("gpu_index",)
_GPU_COLS = np.array([fr.GPUS.col(f) for f in GPU_FIELDS])  # the rolled-up fields' columns in a frame's matrix
_FRAME_COLS = ("cluster_id", "node_id", "id")
_WINDOWS = "rollup_gpu_windows"  # PostgreSQL: the temporary table a chunk's windows are copied into
_PG_EPOCH = 946_684_800  # 2000-01-01 UTC in Unix seconds: PostgreSQL's binary timestamps count microseconds from it


@dataclass
class Windows:
    """Per (node, GPU, window) in that order, sorted by time: the window's start (epoch seconds), samples (``n``), newest
    sample's time, and per GPU_FIELDS column (a matrix column each) its min, sum and count of non-null values, max,
    and the newest sample's value (NaN: null). A sample is a window of its own of one sample, starting at its time."""

    cluster: np.ndarray
    node: np.ndarray
    gpu: np.ndarray
    start: np.ndarray
    n: np.ndarray
    last_ts: np.ndarray
    min: np.ndarray
    sum: np.ndarray
    cnt: np.ndarray
    max: np.ndarray
    last: np.ndarray

    def coarsen(self, width: int) -> Windows:
        """These windows grouped by ``width`` s: min of mins, sums of sums and counts, max of maxes, the last of the
        newest (the rows are in time order within a GPU, so a group's last row holds its newest sample)."""
        b = np.floor(self.start / width)
        edge = np.ones(len(b), dtype=bool)
        edge[1:] = (self.node[1:] != self.node[:-1]) | (self.gpu[1:] != self.gpu[:-1]) | (b[1:] != b[:-1])
        first = np.flatnonzero(edge)
        last = np.append(first[1:], len(b)) - 1
        return Windows(self.cluster[first], self.node[first], self.gpu[first], b[first] * width,
                       np.add.reduceat(self.n, first), self.last_ts[last], np.fmin.reduceat(self.min, first, axis=0),
                       np.add.reduceat(self.sum, first, axis=0), np.add.reduceat(self.cnt, first, axis=0),
                       np.fmax.reduceat(self.max, first, axis=0), self.last[last])

    def stats(self) -> np.ndarray:
        """The rollup columns' statistics, a row per window: per field min, mean, max, last (``_columns``' order)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(self.cnt > 0, self.sum / self.cnt, np.nan)
        out = np.stack([self.min, mean, self.max, self.last], axis=2).reshape(len(self.n), -1)
        return _fit(out) if connection.vendor == "postgresql" else out


def _gpu_windows(rows: fr.Rows) -> dict[int, Windows]:
    """Each tier's windows of ``rows`` (GPU samples read with the frame columns ``_FRAME_COLS``).

    "last" is the newest sample's value: by time, then by the order the samples were written (frame id, then
    position in the frame), which one sort puts last in each window."""
    ts, index = rows["ts"], rows["index"]
    order = np.lexsort((np.arange(len(ts)), rows["id"], ts, index, rows["node_id"]))
    ts = ts[order]
    vals = rows.mat[np.ix_(order, _GPU_COLS)]
    ok = ~np.isnan(vals)
    w = Windows(rows["cluster_id"][order], rows["node_id"][order], index[order], ts, np.ones(len(ts), np.int64),
                ts, vals, np.where(ok, vals, 0.0), ok.astype(np.int32), vals, vals)
    out = {}
    for width in sorted(GPU_TIERS):  # each tier from the finer one: 10 s from samples, 1 min from 10 s windows
        w = out[width] = w.coarsen(width)
    return out


def _fit(v: np.ndarray) -> np.ndarray:
    """:func:`_single` in numpy: statistics within ``real``'s range (NaN, a null, stays NaN)."""
    out = np.clip(v, -3.4e38, 3.4e38)
    out[np.abs(out) < 1.2e-38] = 0.0
    return out


def _replace_frames(nodes: list[int], start: datetime, end: datetime | None) -> int:
    """Recompute every tier's GPU windows of ``nodes`` in [start, end) from their frames (``start`` and ``end``
    aligned to the minute: the frames with ``ts`` in the range hold exactly its samples)."""
    bound = {"ts__lt": end} if end is not None else {}
    rows = fr.read(fr.GPUS, t0=start.timestamp(), cols=_FRAME_COLS, node_id__in=nodes, **bound)
    if end is not None:
        rows = rows.where(rows["ts"] < end.timestamp())
    if not len(rows):
        return 0
    return _store_windows(_gpu_windows(rows), merge=False)


def _merge_frames(nodes: list[int], lo: datetime, hi: datetime | None) -> int:
    """Late GPU frames in [lo, hi), windows retention already purged: deleted, and the samples the DELETE returned
    merged into every tier, in one transaction (a batch committing meanwhile is in both or in neither)."""
    table = GpuFrame._meta.db_table
    bounds = [_adapt(lo), *([_adapt(hi)] if hi is not None else [])]
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(f"DELETE FROM {table} WHERE {_where(len(nodes), hi is not None)} RETURNING "
                           f"{', '.join(_FRAME_COLS)}, n, layout, data", [*nodes, *bounds])
            gone = cursor.fetchall()
        if not gone:
            return 0
        return _store_windows(_gpu_windows(fr.decode(fr.GPUS, gone, _FRAME_COLS)), merge=True)


def _store_windows(tiers: dict[int, Windows], merge: bool) -> int:
    """Upsert (or, ``merge``, merge) each tier's windows into its table; returns the rollup rows written."""
    fields = GPU_FIELDS
    written = 0
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            _copy_windows(cursor, tiers)
        for width, w in tiers.items():
            target = GPU_TIERS[width]
            if connection.vendor == "postgresql":
                stats = ", ".join(f"NULLIF({c}, 'NaN')" for c in _columns(_GPU_KEYS, fields)[6:])
                select = (f"SELECT cluster_id, node_id, gpu_index, ts, n, last_ts, {stats} FROM {_WINDOWS} "
                          f"WHERE width = {width}")
            else:
                select = f"VALUES ({', '.join(['%s'] * len(_columns(_GPU_KEYS, fields)))})"
            sql = (_merge_into if merge else _upsert_sql)(target, _GPU_KEYS, fields, select)
            if connection.vendor == "postgresql":
                cursor.execute(sql)
            else:
                cursor.executemany(sql, _sqlite_rows(w))
            written += max(cursor.rowcount, 0)
    return written


def _sqlite_rows(w: Windows) -> list[tuple[Any, ...]]:
    """The windows as parameters (NaN binds as NULL in SQLite; times as Django writes them)."""
    def when(ts: np.ndarray) -> list[Any]:
        return [_adapt(datetime.fromtimestamp(t, UTC)) for t in ts.tolist()]

    heads = zip(w.cluster.tolist(), w.node.tolist(), w.gpu.astype(np.int64).tolist(), when(w.start),
                w.n.tolist(), when(w.last_ts), strict=True)
    return [(*h, *s) for h, s in zip(heads, w.stats().tolist(), strict=True)]


def _copy_windows(cursor: Any, tiers: dict[int, Windows]) -> None:
    """Every tier's windows into the session's temporary table, by one binary COPY built in numpy (no Python object
    per value: a steady pass at 2,048 nodes writes some 700,000 windows of 116 statistics)."""
    stats = _columns(_GPU_KEYS, GPU_FIELDS)[6:]
    cursor.execute(f"CREATE TEMP TABLE IF NOT EXISTS {_WINDOWS} (width int8, cluster_id int8, node_id int8, "
                   f"gpu_index int8, ts timestamptz, n int8, last_ts timestamptz, "
                   f"{', '.join(f'{c} float8' for c in stats)}) ON COMMIT DELETE ROWS")
    cursor.execute(f"TRUNCATE {_WINDOWS}")  # a pass inside an outer transaction commits nothing between chunks

    def micros(ts: np.ndarray) -> np.ndarray:
        return np.round((ts - _PG_EPOCH) * 1e6).astype(np.int64)

    parts = []
    for width, w in tiers.items():
        cols = [np.full(len(w.n), width, np.int64), w.cluster.astype(np.int64), w.node.astype(np.int64),
                w.gpu.astype(np.int64), micros(w.start), w.n.astype(np.int64), micros(w.last_ts)]
        parts.append(_binary_rows(cols, w.stats()))
    with cursor.copy(f"COPY {_WINDOWS} FROM STDIN (FORMAT BINARY)") as copy:
        copy.write(b"PGCOPY\n\xff\r\n\x00" + bytes(8) + b"".join(parts) + b"\xff\xff")


def _binary_rows(ints: list[np.ndarray], floats: np.ndarray) -> bytes:
    """Rows of ``ints`` (int8 or timestamptz columns) then ``floats``' columns in PostgreSQL's binary COPY format:
    per row the field count, then per field its length (always 8: NaN stands for null) and big-endian value."""
    width = len(ints) + floats.shape[1]
    layout = [("k", ">i2")]
    for i in range(width):
        layout += [(f"l{i}", ">i4"), (f"v{i}", ">i8" if i < len(ints) else ">f8")]
    buf = np.empty(len(floats), dtype=np.dtype(layout))
    buf["k"] = width
    for i in range(width):
        buf[f"l{i}"] = 8
        buf[f"v{i}"] = ints[i] if i < len(ints) else floats[:, i - len(ints)]
    return buf.tobytes()


# -- host samples: rows, in SQL ---------------------------------------------------------------------------------------


def _replace_rows(raw: type[models.Model], tiers: dict[int, type[models.Model]], keys: tuple[str, ...],
                  fields: tuple[str, ...], nodes: list[int], start: datetime, end: datetime | None) -> int:
    return _replace(raw, tiers, keys, fields, nodes, [_adapt(start), *([_adapt(end)] if end else [])])


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
    return _merge_into(target, keys, fields, _aggregate_sql(keys, fields, width, source))


def _merge_into(target: type[models.Model], keys: tuple[str, ...], fields: tuple[str, ...], select: str) -> str:
    """Insert ``select``'s rows (the windows of late samples) into ``target``, each merged into the window's row if
    there is one."""
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
    return (f"INSERT INTO {t} ({', '.join(cols)}) {select} "
            f"ON CONFLICT (node_id, ts{''.join(f', {c}' for c in keys)}) DO UPDATE SET {', '.join(sets)}")
