"""Every read of GPU samples that a page, an API, the evidence or "why was step N slow" makes.

The one module outside the writer, the rollup SQL and the diagnosis pass's held window that knows a GPU sample is a
row of :class:`~dashboard.telemetry.models.GpuSample`. What callers get are plain values (epoch seconds, floats,
lists of reasons), never querysets, so the samples' storage can change here (docs/scaling.md: a node-second's GPU
numbers kept as one frame per post) without a page noticing. Derived values (the clock ratio, a throttle reason's
flag) are worked out here from the stored columns for the same reason: SQL expressions over row columns would tie the
callers to rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import Any

from django.db.models import Case, CharField, F, FloatField, QuerySet, Value, When
from django.db.models.functions import Cast, NullIf

from dashboard.telemetry.models import GpuSample
from dashboard.web.series import TimeRange, downsample, downsample_tiered, in_range

MAX_REASONS = 64  # distinct throttle-reason lists looked at per range: NVML defines about a dozen reasons


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def _of(node_id: int, gpu: int | None) -> dict[str, Any]:
    return {"node_id": node_id} if gpu is None else {"node_id": node_id, "gpu_index": gpu}


def latest(node_id: int, indexes: Iterable[int], fields: list[str]) -> dict[int, dict[str, Any]]:
    """The newest sample of each GPU in ``indexes``, as ``{index: {field: value}}`` with ``ts`` in epoch seconds; a
    GPU that never sent one is absent. One lookup per GPU, backwards along the (node, ts) index from the node's newest
    row (a GPU that still reports is among its node's newest few rows)."""
    out: dict[int, dict[str, Any]] = {}
    cols = ["ts", *(f for f in fields if f != "ts")]
    for index in indexes:
        row = (GpuSample.objects.filter(node_id=node_id, gpu_index=index).order_by("-ts").values(*cols).first())
        if row is not None:
            row["ts"] = row["ts"].timestamp()
            out[index] = row
    return out


def buckets(node_id: int, tr: TimeRange, fields: list[str], gpu: int | None = None,
            keep: dict[str, tuple[str, ...]] | None = None) -> dict[str, dict[str, Any]]:
    """Min / mean / max per bucket of ``tr`` for each GPU of the node (or ``gpu`` alone), keyed by the GPU's index as
    text: ``downsample``'s shape, from the tier ``tr`` names (raw rows, or the rollups beyond the hot window)."""
    return downsample_tiered(GpuSample, _of(node_id, gpu), tr, fields, by=["gpu_index"], keep=keep)


def ratio_buckets(node_id: int, gpu: int, tr: TimeRange, num: str, den: str, also: list[str]
                  ) -> dict[str, Any] | None:
    """One GPU's buckets of ``num / den`` (as ``"ratio"``) beside ``also``'s. From raw rows the ratio is each sample's,
    averaged per bucket (what a detector judged sample by sample); from the rollups, which keep each column's
    statistics and not the ratio's, it is the ratio of the bucket's means. A zero or missing ``den`` gives no ratio
    for that sample. None when the range holds no sample of the GPU."""
    if tr.tier:
        got = downsample_tiered(GpuSample, _of(node_id, gpu), tr, [num, den, *also]).get("")
        if got:
            got["ratio"] = {"mean": [a / b if a is not None and b else None
                                     for a, b in zip(got[num]["mean"], got[den]["mean"], strict=True)]}
        return got
    qs = GpuSample.objects.filter(**_of(node_id, gpu)).annotate(ratio=F(num) / NullIf(F(den), 0.0))
    return downsample(qs, tr, ["ratio", *also]).get("")


def flag_buckets(node_id: int, tr: TimeRange, gpu: int | None = None) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Which throttle reasons were active, per bucket of ``tr`` and GPU: the reasons seen in the range (sorted) and
    ``{gpu: {"t": [...], reason: [1.0 where it was set in the bucket, else 0.0 ...]}}``. The reasons are a JSON list
    per sample; its text form is searched, which SQLite and PostgreSQL both do."""
    qs: QuerySet[Any] = in_range(GpuSample.objects.filter(**_of(node_id, gpu)), tr).exclude(throttle_reasons=None)
    qs = qs.annotate(reasons_text=Cast("throttle_reasons", CharField()))
    reasons: set[str] = set()
    for value in qs.values_list("throttle_reasons", flat=True).distinct()[:MAX_REASONS]:
        if isinstance(value, list):
            reasons.update(str(r) for r in value)
    if not reasons:
        return [], {}
    names = sorted(reasons)
    flags = {f"r{i}": Case(When(reasons_text__contains=f'"{r}"', then=Value(1.0)), default=Value(0.0),
                           output_field=FloatField()) for i, r in enumerate(names)}
    raw = downsample(qs.annotate(**flags), tr, list(flags), by=["gpu_index"], keep={f: ("max",) for f in flags})
    return names, {key: {"t": s["t"], **{name: s[f"r{i}"]["max"] for i, name in enumerate(names)}}
                   for key, s in raw.items()}


def heard(node_id: int, gpu: int, t0: float, t1: float, limit: int = 20_000) -> list[float]:
    """When the GPU's samples were taken in [t0, t1], oldest first, at most ``limit`` of them (a node's heartbeat:
    its first GPU reports every second it is up)."""
    qs = GpuSample.objects.filter(node_id=node_id, gpu_index=gpu, ts__gte=_dt(t0), ts__lte=_dt(t1))
    return [ts.timestamp() for ts in qs.order_by("ts").values_list("ts", flat=True)[:limit]]


def around(cluster_id: int, hosts: set[str], t0: float, t1: float, fields: tuple[str, ...]
           ) -> Iterator[tuple[Any, ...]]:
    """The cluster's GPU samples in [t0, t1] on ``hosts``, as ``(hostname, gpu index, *fields)`` tuples in no set
    order: what every GPU did in one step's window."""
    qs = GpuSample.objects.filter(cluster_id=cluster_id, ts__gte=_dt(t0), ts__lte=_dt(t1), node__hostname__in=hosts)
    yield from qs.values_list("node__hostname", "gpu_index", *fields)


def any_heard(cluster_id: int) -> bool:
    """Whether any agent of the cluster has sent a GPU sample that is still kept."""
    return GpuSample.objects.filter(cluster_id=cluster_id).exists()
