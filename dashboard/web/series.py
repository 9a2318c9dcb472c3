"""Time ranges and downsampled series for every time-series page and API.

Whatever range a page asks for (15 min or 24 h), the database groups the rows into at most ``points`` buckets and
returns min / mean / max per bucket, so a day costs the browser what a quarter of an hour does. The grouping runs in
SQL (an index range scan on (owner, ts) and one GROUP BY), on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from itertools import groupby
from typing import Any

import numpy as np
from django.db import connections
from django.db.models import Avg, Case, F, FloatField, Func, Max, Min, QuerySet, Sum, When
from django.db.models.functions import Floor
from django.http import HttpRequest

from dashboard.web.access import BadRequest

RANGES = {"5m": 300, "15m": 900, "1h": 3600, "6h": 6 * 3600, "24h": 86400, "72h": 3 * 86400, "7d": 7 * 86400}
DEFAULT_POINTS = 1500
MAX_POINTS = 5000
TIER_NAMES = {0: "raw", 10: "10s", 60: "1m"}


class Epoch(Func):
    """Seconds since 1970 of a DateTimeField, as a float (SQLite keeps datetimes as text, PostgreSQL as timestamptz)."""

    output_field = FloatField()

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        # julianday() carries ~4e-5 s of rounding error at today's dates, which put half of all whole-second samples
        # in the previous bucket; rounding to the millisecond (what the agents send) makes it exact.
        template = "ROUND((julianday(%(expressions)s) - 2440587.5) * 86400.0, 3)"
        return self.as_sql(compiler, connection, template=template, **extra)

    def as_postgresql(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(compiler, connection, template="EXTRACT(EPOCH FROM %(expressions)s)::float8", **extra)


@dataclass(frozen=True)
class TimeRange:
    t0: float
    t1: float
    points: int = DEFAULT_POINTS
    tier: int = 0  # 0: raw rows; 10 or 60: the rollup windows of that many seconds (see ``tiered``)

    @property
    def bucket_s(self) -> float:
        """Bucket width: 1 s (the agents' rate) up to whatever keeps the series under ``points``; a multiple of the
        tier's window, so that no window is split between two buckets."""
        step = max(1, self.tier)
        return float(max(step, math.ceil((self.t1 - self.t0) / self.points / step) * step))

    @property
    def first_bucket_t(self) -> float:
        """Where the first bucket starts. Buckets are aligned to the epoch (a refresh and a live append land on the
        same buckets), so a range touches up to ``points + 1`` of them; the oldest, partial one is left out."""
        width = self.bucket_s
        return max(self.t0, (math.floor(self.t1 / width) - self.points + 1) * width)

    def as_dict(self) -> dict[str, Any]:
        return {"from": self.t0, "to": self.t1, "bucket_s": self.bucket_s, "tier": TIER_NAMES[self.tier]}


def parse_range(request: HttpRequest, default: str = "1h", now: float | None = None) -> TimeRange:
    """``?range=15m|1h|6h|24h|...`` (ending now) or ``?from=EPOCH&to=EPOCH`` (custom); ``?points=N`` caps the size."""
    q = request.GET
    now = time.time() if now is None else now
    try:
        points = int(q.get("points") or DEFAULT_POINTS)
    except ValueError:
        raise BadRequest("points must be an integer") from None
    if not 10 <= points <= MAX_POINTS:
        raise BadRequest(f"points must be between 10 and {MAX_POINTS}")
    if q.get("from") or q.get("to"):
        try:
            t0 = float(q.get("from") or now - RANGES[default])
            t1 = float(q.get("to") or now)
        except ValueError:
            raise BadRequest("from and to must be seconds since 1970") from None
        if not (math.isfinite(t0) and math.isfinite(t1)) or t1 <= t0:
            raise BadRequest("from must be before to")
        if t1 - t0 > 31 * 86400:
            raise BadRequest("a range is at most 31 days")
        return TimeRange(t0, t1, points)
    name = q.get("range") or default
    if name not in RANGES:
        raise BadRequest(f"range must be one of {', '.join(RANGES)} (or from/to)")
    return TimeRange(now - RANGES[name], now, points)


def in_range(qs: QuerySet[Any], tr: TimeRange, field: str = "ts") -> QuerySet[Any]:
    return qs.filter(**{f"{field}__gte": datetime.fromtimestamp(tr.t0, UTC),
                        f"{field}__lte": datetime.fromtimestamp(tr.t1, UTC)})


def _raw_stats(f: str) -> tuple[Any, Any, Any]:
    return Min(f), Avg(f), Max(f)


def _rollup_stats(f: str) -> tuple[Any, Any, Any]:
    """A bucket of rollup windows: min of mins, max of maxes, the windows' means weighted by their row counts."""
    mean, weight = f"{f}_mean", Case(When(**{f"{f}_mean__isnull": False}, then=F("n")), output_field=FloatField())
    return Min(f"{f}_min"), Sum(F(mean) * F("n"), output_field=FloatField()) / Sum(weight), Max(f"{f}_max")


STATS = ("min", "mean", "max")


def downsample(qs: QuerySet[Any], tr: TimeRange, fields: list[str], by: list[str] | None = None,
               ts: str = "ts", stats: Callable[[str], tuple[Any, Any, Any]] = _raw_stats,
               keep: dict[str, tuple[str, ...]] | None = None) -> dict[str, dict[str, Any]]:
    """Rows of ``qs`` in ``tr`` grouped into buckets of ``tr.bucket_s`` (per value of the ``by`` columns).

    Returns ``{group: {"t": [bucket start...], field: {"min": [...], "mean": [...], "max": [...]}}}`` where group is
    the ``by`` values joined by "|" ("" without ``by``). Empty buckets are absent: the charts draw a gap there.
    ``stats`` gives a field's (min, mean, max) aggregates: of raw rows by default, ``_rollup_stats`` for rollups.
    ``keep`` (field -> statistics) computes only those for a field (a counter needs its max, not three aggregates)."""
    by = by or []
    width = tr.bucket_s
    aggs: dict[str, Any] = {}
    wanted: list[tuple[str, str]] = []
    for f in fields:
        exprs = dict(zip(STATS, stats(f), strict=True))
        for stat in (keep or {}).get(f, STATS):
            aggs[f"{f}__{stat}"] = exprs[stat]
            wanted.append((f, stat))
    # Rows from the first whole bucket on: at most ``points`` buckets, whatever the range's ragged edges.
    rows = (in_range(qs, TimeRange(tr.first_bucket_t, tr.t1, tr.points), ts).annotate(bucket=Floor(Epoch(F(ts)) / width))
            .values(*by, "bucket").annotate(**aggs).order_by(*by, "bucket"))
    # The driver's rows as they come, column by column: Django's per-cell converters and one dict per row were most
    # of a node page's answer (a 15 min range is 7,200 GPU rows x 43 aggregates).
    sql, params = rows.query.sql_with_params()
    with connections[rows.db].cursor() as cursor:
        cursor.execute(sql, params)
        fetched = cursor.fetchall()
    out: dict[str, dict[str, Any]] = {}
    nb = len(by)
    for key_vals, group in groupby(fetched, key=lambda row: row[:nb]):  # ordered by the ``by`` columns
        cols = list(zip(*group, strict=True))
        series: dict[str, Any] = {"t": [float(b) * width for b in cols[nb]]}
        for c, (f, stat) in enumerate(wanted, start=nb + 1):
            series.setdefault(f, {})[stat] = [None if v is None else float(v) for v in cols[c]]
        out["|".join(str(v) for v in key_vals)] = series
    return out


def downsample_rows(ts: np.ndarray, values: dict[str, np.ndarray], tr: TimeRange, fields: list[str],
                    groups: list[np.ndarray] | None = None, keep: dict[str, tuple[str, ...]] | None = None
                    ) -> dict[str, dict[str, Any]]:
    """:func:`downsample` of samples already in memory (the frames' rows, :mod:`dashboard.storage.frames`): ``ts`` in
    epoch seconds, ``values`` a float column per field (NaN is null), ``groups`` the columns to group by (their
    values joined by "|" as the keys, whole numbers without a fraction). The same buckets (aligned to the epoch, from
    ``tr.first_bucket_t``), the same statistics over the non-null values (None where a bucket has none) and the same
    shape as the SQL grouping returns, so a page cannot tell which it got."""
    width = tr.bucket_s
    keep_in = (ts >= tr.first_bucket_t) & (ts <= tr.t1)
    if not keep_in.any():
        return {}
    ts = ts[keep_in]
    bucket = np.floor(ts / width)
    keys = [g[keep_in] for g in groups or []]
    # One sort by (group..., bucket): each run of equal keys is one output bucket.
    order = np.lexsort([bucket, *keys[::-1]])
    cols = [k[order] for k in keys] + [bucket[order]]
    edge = np.ones(len(order), dtype=bool)
    edge[1:] = np.logical_or.reduce([c[1:] != c[:-1] for c in cols])
    starts = np.flatnonzero(edge)
    out: dict[str, dict[str, Any]] = {}
    group_edge = np.zeros(len(starts), dtype=bool)
    group_edge[0] = True  # without ``groups``, one group of every bucket
    if keys:
        group_edge[1:] = np.logical_or.reduce([k[starts][1:] != k[starts][:-1] for k in cols[:-1]])
    bounds = np.append(np.flatnonzero(group_edge), len(starts))
    stats_of: dict[str, dict[str, np.ndarray]] = {}
    for f in fields:
        v = values[f][keep_in][order]
        ok = ~np.isnan(v)
        n = np.add.reduceat(ok.astype(np.float64), starts)
        want = (keep or {}).get(f, STATS)
        got: dict[str, np.ndarray] = {}
        with np.errstate(invalid="ignore", divide="ignore"):
            if "mean" in want:
                got["mean"] = np.add.reduceat(np.where(ok, v, 0.0), starts) / n
            if "min" in want:
                got["min"] = np.minimum.reduceat(np.where(ok, v, np.inf), starts)
            if "max" in want:
                got["max"] = np.maximum.reduceat(np.where(ok, v, -np.inf), starts)
        stats_of[f] = {stat: np.where(n > 0, got[stat], np.nan) for stat in want}
    for g in range(len(bounds) - 1):
        lo, hi = bounds[g], bounds[g + 1]
        first = starts[lo]
        key = "|".join(_key_text(k[first]) for k in cols[:-1])
        series: dict[str, Any] = {"t": (cols[-1][starts[lo:hi]] * width).tolist()}
        for f in fields:
            series[f] = {stat: [None if x != x else float(x) for x in arr[lo:hi].tolist()]
                         for stat, arr in stats_of[f].items()}
        out[key] = series
    return out


def _key_text(v: Any) -> str:
    """A group value as the SQL grouping's key writes it: a whole number without ".0"."""
    if isinstance(v, float | np.floating) and float(v).is_integer():
        return str(int(v))
    return str(v)


# -- tiers: raw rows for the hot window, 10 s and 1 min rollups beyond (dashboard.storage) -------------------------


def tiered(tr: TimeRange, now: float | None = None) -> TimeRange:
    """The tier a range is read from: the coarsest whose window fits in a bucket (fewest rows to group), or, for a
    range older than what a finer tier keeps, the finest tier that still holds it. Raw until a rollup pass has run
    (a new server, or one upgraded with raw rows only: the raw rows are all there is)."""
    from django.conf import settings

    from dashboard.storage.models import RollupState

    conf = settings.CLUSTERDX
    now = time.time() if now is None else now
    raw_step = math.ceil((tr.t1 - tr.t0) / tr.points)
    if raw_step < 10 and tr.t0 >= now - conf["RAW_RETENTION_HOURS"] * 3600:
        return tr
    if not RollupState.objects.filter(rolled_through__isnull=False).exists():
        return tr
    fine = replace(tr, tier=10)
    # 10 s windows unless the buckets come out whole minutes anyway (then the 1 min rollups give the same, 6x cheaper).
    if fine.bucket_s % 60 and tr.t0 >= now - conf["ROLLUP_10S_RETENTION_DAYS"] * 86400:
        return fine
    return replace(tr, tier=60)


def downsample_tiered(model: type[Any], where: dict[str, Any], tr: TimeRange, fields: list[str],
                      by: list[str] | None = None, keep: dict[str, tuple[str, ...]] | None = None
                      ) -> dict[str, dict[str, Any]]:
    """``downsample`` of ``model``'s rows matching ``where``, from the tier ``tr`` names: rollup windows up to the
    last rollup pass, raw rows after it (the last bucket or two of a live chart), split on a bucket edge so that no
    bucket mixes the two."""
    qs = model._default_manager.filter(**where)
    if tr.tier == 0:
        return downsample(qs, tr, fields, by, keep=keep)
    from dashboard.storage.models import ROLLUPS

    target = ROLLUPS[model][2][tr.tier]
    split = rollup_split(tr)
    at = datetime.fromtimestamp(split, UTC)
    older = downsample(target._default_manager.filter(ts__lt=at, **where), tr, fields, by, stats=_rollup_stats,
                       keep=keep)
    newer = downsample(qs.filter(ts__gte=at), tr, fields, by, keep=keep) if split <= tr.t1 else {}
    return join_series(older, newer, fields)


def rollup_split(tr: TimeRange) -> float:
    """Where a tiered read of ``tr`` turns from rollup windows to raw samples: the last rollup pass's line, down to
    a bucket edge (so that no bucket mixes the two); ``tr.t0`` before any pass."""
    from dashboard.storage.models import RollupState

    through = RollupState.objects.values_list("rolled_through", flat=True).first()
    return math.floor(through.timestamp() / tr.bucket_s) * tr.bucket_s if through else tr.t0


def join_series(older: dict[str, dict[str, Any]], newer: dict[str, dict[str, Any]], fields: list[str]
                ) -> dict[str, dict[str, Any]]:
    """``newer``'s buckets (raw samples) after ``older``'s (rollup windows), series by series; ``older`` is extended."""
    for key, series in newer.items():
        into = older.setdefault(key, {"t": [], **{f: {stat: [] for stat in series[f]} for f in fields}})
        into["t"] += series["t"]
        for f in fields:
            for stat in series[f]:
                into[f][stat] += series[f][stat]
    return older
