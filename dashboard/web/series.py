"""Time ranges and downsampled series for every time-series page and API.

Whatever range a page asks for (15 min or 24 h), the database groups the rows into at most ``points`` buckets and
returns min / mean / max per bucket, so a day costs the browser what a quarter of an hour does. The grouping runs in
SQL (an index range scan on (owner, ts) and one GROUP BY), on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from django.db.models import Avg, F, FloatField, Func, Max, Min, QuerySet
from django.db.models.functions import Floor
from django.http import HttpRequest

from dashboard.web.access import BadRequest

RANGES = {"5m": 300, "15m": 900, "1h": 3600, "6h": 6 * 3600, "24h": 86400, "72h": 3 * 86400, "7d": 7 * 86400}
DEFAULT_POINTS = 1500
MAX_POINTS = 5000


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

    @property
    def bucket_s(self) -> float:
        """Bucket width: 1 s (the agents' rate) up to whatever keeps the series under ``points``."""
        return max(1.0, math.ceil((self.t1 - self.t0) / self.points))

    @property
    def first_bucket_t(self) -> float:
        """Where the first bucket starts. Buckets are aligned to the epoch (a refresh and a live append land on the
        same buckets), so a range touches up to ``points + 1`` of them; the oldest, partial one is left out."""
        width = self.bucket_s
        return max(self.t0, (math.floor(self.t1 / width) - self.points + 1) * width)

    def as_dict(self) -> dict[str, Any]:
        return {"from": self.t0, "to": self.t1, "bucket_s": self.bucket_s}


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
    from datetime import UTC, datetime

    return qs.filter(**{f"{field}__gte": datetime.fromtimestamp(tr.t0, UTC),
                        f"{field}__lte": datetime.fromtimestamp(tr.t1, UTC)})


def downsample(qs: QuerySet[Any], tr: TimeRange, fields: list[str], by: list[str] | None = None,
               ts: str = "ts") -> dict[str, dict[str, Any]]:
    """Rows of ``qs`` in ``tr`` grouped into buckets of ``tr.bucket_s`` (per value of the ``by`` columns).

    Returns ``{group: {"t": [bucket start...], field: {"min": [...], "mean": [...], "max": [...]}}}`` where group is
    the ``by`` values joined by "|" ("" without ``by``). Empty buckets are absent: the charts draw a gap there."""
    by = by or []
    width = tr.bucket_s
    aggs: dict[str, Any] = {}
    for f in fields:
        aggs[f"{f}__min"] = Min(f)
        aggs[f"{f}__mean"] = Avg(f)
        aggs[f"{f}__max"] = Max(f)
    # Rows from the first whole bucket on: at most ``points`` buckets, whatever the range's ragged edges.
    rows = (in_range(qs, TimeRange(tr.first_bucket_t, tr.t1, tr.points), ts).annotate(bucket=Floor(Epoch(F(ts)) / width))
            .values(*by, "bucket").annotate(**aggs).order_by(*by, "bucket"))
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        key = "|".join(str(row[b]) for b in by)
        series = out.get(key)
        if series is None:
            series = out[key] = {"t": [], **{f: {"min": [], "mean": [], "max": []} for f in fields}}
        series["t"].append(row["bucket"] * width)
        for f in fields:
            for stat in ("min", "mean", "max"):
                v = row[f"{f}__{stat}"]
                series[f][stat].append(float(v) if v is not None else None)
    return out
