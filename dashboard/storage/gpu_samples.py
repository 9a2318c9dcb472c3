"""Every read of GPU samples that a page, an API, the evidence or "why was step N slow" makes, from the GPU frames
(:class:`~dashboard.telemetry.models.GpuFrame`, :mod:`dashboard.storage.frames`): a node's GPU samples of one post
within one aligned 10 s window, as one packed matrix (a row per sample, a column per numeric field) beside the
throttle reasons and the unavailable fields.

The one module outside the writer, the rollups and the diagnosis pass's held window that knows how GPU samples are
stored. What callers get are plain values (epoch seconds, floats, ints and bools where the wire has them, lists of
reasons, the ``downsample`` dicts), never querysets or frames. Derived values (the clock ratio, a throttle reason's
flag) are worked out here, sample by sample in numpy.

Every read selects whole frames along the (node, ts) index and then filters their samples: the samples taken in
[t0, t1] are in the frames with ``window_start(t0) <= ts <= t1``. Ranges in a rollup tier read the rollup tables up
to the last rollup pass and the frames after it, split on a bucket edge so that no bucket mixes the two.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import Any

import numpy as np
from django.db.models import Q

from clusterdx.blocks import LAYOUTS
from dashboard.storage import frames as fr
from dashboard.storage.models import GPU_TIERS
from dashboard.telemetry.models import GpuFrame, Node
from dashboard.web.series import TimeRange, _rollup_stats, downsample, downsample_rows, join_series, rollup_split

K = fr.GPUS
MAX_REASONS = 64  # distinct throttle reasons drawn per range: NVML defines about a dozen
# How far back from a node's newest frame ``latest`` looks for a GPU's newest sample, round by round: a GPU that still
# reports is in the first minute; one that stopped is found further back (None: all that raw still holds).
LATEST_SPANS = (60, 3600, None)
# The wire's type of each numeric field ("float", "int", "bool"): how a matrix column is read back as values.
TYPES = {c.name: c.type for c in LAYOUTS["gpus"].numbers}
_BIG = float(np.nextafter(2.0**63, 0))  # the largest float64 an int64 holds (a counter at the wire's 2**63 - 1)


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def _of(node_id: int, gpu: int | None) -> dict[str, Any]:
    return {"node_id": node_id} if gpu is None else {"node_id": node_id, "gpu_index": gpu}


def _samples(node_id: int, gpu: int | None, t0: float, t1: float, objects: tuple[str, ...] = (),
             cols: tuple[str, ...] = ()) -> fr.Rows:
    """The node's GPU samples (``gpu``'s alone when given) taken in [t0, t1]."""
    rows = fr.read(K, t0=t0, t1=t1, cols=cols, objects=objects, node_id=node_id)
    return rows if gpu is None else rows.where(rows["index"] == gpu)


def values(rows: fr.Rows, field: str) -> list[Any]:
    """``field`` of every sample as its row column held it: None for null, ints and bools where the wire sends them,
    an object field as it was sent."""
    if field in K.objects:
        return rows.objs[field]
    col = rows[field]
    nan = np.isnan(col)
    kind = TYPES.get(field, "float")
    if kind == "bool":
        out = (col != 0).tolist()
    elif kind == "int":
        out = np.clip(np.where(nan, 0.0, col), -_BIG, _BIG).astype(np.int64).tolist()
    else:
        out = col.tolist()
    for i in np.flatnonzero(nan).tolist():
        out[i] = None
    return out


def latest(node_id: int, indexes: Iterable[int], fields: list[str]) -> dict[int, dict[str, Any]]:
    """The newest sample of each GPU in ``indexes``, as ``{index: {field: value}}`` with ``ts`` in epoch seconds; a
    GPU that never sent one is absent. The node's frames are read back from its newest along the (node, ts) index,
    a minute first (a GPU that still reports is there), then further (``LATEST_SPANS``) while a GPU is missing."""
    want = set(indexes)
    out: dict[int, dict[str, Any]] = {}
    newest = GpuFrame.objects.filter(node_id=node_id).order_by("-ts").values_list("ts", flat=True).first() \
        if want else None
    if newest is None:
        return out
    cols = ["ts", *(f for f in fields if f != "ts")]
    objects = tuple(f for f in cols if f in K.objects)
    edge = fr.window_start(newest.timestamp())
    hi: float | None = None
    for back in LATEST_SPANS:
        # Aligned to the frames' windows: the frames with ts in [lo, hi) hold every sample taken in [lo, hi).
        lo = None if back is None else edge - back
        where = Q() if hi is None else Q(ts__lt=_dt(hi))
        rows = fr.read(K, where, t0=lo, cols=("id",), objects=objects, node_id=node_id)
        out |= _newest(rows, want - out.keys(), cols)
        if lo is None or want <= out.keys():
            break
        hi = lo
    return out


def _newest(rows: fr.Rows, indexes: set[int], cols: list[str]) -> dict[int, dict[str, Any]]:
    """Of ``rows`` (read with their frame's ``id``), each GPU's newest sample: by time, then by the order samples were
    written (frame id, then position in the frame)."""
    index = rows["index"]
    order = np.lexsort((np.arange(len(index)), rows["id"], rows["ts"], index))
    last = order[np.append(index[order][1:] != index[order][:-1], True)] if len(order) else order
    last = last[np.isin(index[last], list(indexes))]
    if not len(last):
        return {}
    picked = rows.where(last)
    got = {f: values(picked, f) for f in cols}
    return {int(i): {f: got[f][k] for f in cols} for k, i in enumerate(picked["index"].tolist())}


def buckets(node_id: int, tr: TimeRange, fields: list[str], gpu: int | None = None,
            keep: dict[str, tuple[str, ...]] | None = None) -> dict[str, dict[str, Any]]:
    """Min / mean / max per bucket of ``tr`` for each GPU of the node (or ``gpu`` alone), keyed by the GPU's index as
    text: ``downsample``'s shape, from the tier ``tr`` names (raw frames, or the rollups beyond the hot window)."""
    return _tiered(node_id, gpu, tr, fields, keep, per_gpu=True)


def ratio_buckets(node_id: int, gpu: int, tr: TimeRange, num: str, den: str, also: list[str]
                  ) -> dict[str, Any] | None:
    """One GPU's buckets of ``num / den`` (as ``"ratio"``) beside ``also``'s. From raw samples the ratio is each
    sample's, averaged per bucket (what a detector judged sample by sample); from the rollups, which keep each field's
    statistics and not the ratio's, it is the ratio of the bucket's means. A zero or missing ``den`` gives no ratio
    for that sample. None when the range holds no sample of the GPU."""
    if tr.tier:
        got = _tiered(node_id, gpu, tr, [num, den, *also], None, per_gpu=False).get("")
        if got:
            got["ratio"] = {"mean": [a / b if a is not None and b else None
                                     for a, b in zip(got[num]["mean"], got[den]["mean"], strict=True)]}
        return got
    rows = _samples(node_id, gpu, tr.first_bucket_t, tr.t1)
    d = rows[den]
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(d != 0, rows[num] / np.where(d != 0, d, 1.0), np.nan)
    cols = {"ratio": ratio, **{f: rows[f] for f in also}}
    return downsample_rows(rows["ts"], cols, tr, ["ratio", *also]).get("")


def _tiered(node_id: int, gpu: int | None, tr: TimeRange, fields: list[str], keep: dict[str, tuple[str, ...]] | None,
            per_gpu: bool) -> dict[str, dict[str, Any]]:
    """``downsample`` of the GPU samples from ``tr``'s tier (keyed by GPU index, or "" unless ``per_gpu``): the rollup
    windows up to the last rollup pass, raw frames after it (the last bucket or two of a live chart), split on a
    bucket edge so that no bucket mixes the two."""
    since = None
    older: dict[str, dict[str, Any]] = {}
    if tr.tier:
        since = rollup_split(tr)
        windows = GPU_TIERS[tr.tier].objects.filter(ts__lt=_dt(since), **_of(node_id, gpu))
        older = downsample(windows, tr, fields, ["gpu_index"] if per_gpu else None, stats=_rollup_stats, keep=keep)
        if since > tr.t1:
            return older
    rows = _samples(node_id, gpu, max(tr.first_bucket_t, since if since is not None else -math.inf), tr.t1)
    newer = downsample_rows(rows["ts"], {f: rows[f] for f in fields}, tr, fields,
                            groups=[rows["index"]] if per_gpu else None, keep=keep)
    return join_series(older, newer, fields)


def flag_buckets(node_id: int, tr: TimeRange, gpu: int | None = None) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Which throttle reasons were active, per bucket of ``tr`` and GPU: the reasons seen in the range (sorted) and
    ``{gpu: {"t": [...], reason: [1.0 where it was set in the bucket, else 0.0 ...]}}``. A sample without a reasons
    list (null) counts in no bucket; an empty list counts as no reason set."""
    rows = _samples(node_id, gpu, tr.t0, tr.t1, objects=("throttle_reasons",))
    lists = rows.objs["throttle_reasons"]
    rows = rows.where(np.array([v is not None for v in lists], dtype=bool))
    # Each distinct list once (a GPU repeats its list second after second): a code per sample, a flag per list.
    distinct: dict[tuple[str, ...], int] = {}
    code = np.array([distinct.setdefault(tuple(map(str, v)) if isinstance(v, list) else (), len(distinct))
                     for v in rows.objs["throttle_reasons"]], dtype=np.int64)
    names = sorted({r for reasons in distinct for r in reasons})[:MAX_REASONS]
    if not names:
        return [], {}
    table = np.array([[name in reasons for name in names] for reasons in distinct], dtype=np.float64)
    flags = {f"r{i}": table[code, i] for i in range(len(names))}
    raw = downsample_rows(rows["ts"], flags, tr, list(flags), groups=[rows["index"]],
                          keep={f: ("max",) for f in flags})
    return names, {key: {"t": s["t"], **{name: s[f"r{i}"]["max"] for i, name in enumerate(names)}}
                   for key, s in raw.items()}


def heard(node_id: int, gpu: int, t0: float, t1: float, limit: int = 20_000) -> list[float]:
    """When the GPU's samples were taken in [t0, t1], oldest first, at most ``limit`` of them (a node's heartbeat:
    its first GPU reports every second it is up)."""
    return np.sort(_samples(node_id, gpu, t0, t1)["ts"])[:limit].tolist()


def around(cluster_id: int, hosts: set[str], t0: float, t1: float, fields: tuple[str, ...]
           ) -> Iterator[tuple[Any, ...]]:
    """The cluster's GPU samples in [t0, t1] on ``hosts``, as ``(hostname, gpu index, *fields)`` tuples in no set
    order: what every GPU did in one step's window."""
    names = dict(Node.objects.filter(cluster_id=cluster_id, hostname__in=hosts).values_list("id", "hostname"))
    if not names:
        return
    rows = fr.read(K, t0=t0, t1=t1, cols=("node_id",), objects=tuple(f for f in fields if f in K.objects),
                   node_id__in=list(names))
    hostnames = [names[n] for n in rows["node_id"].tolist()]
    yield from zip(hostnames, values(rows, "index"), *(values(rows, f) for f in fields), strict=True)


def any_heard(cluster_id: int) -> bool:
    """Whether any agent of the cluster has sent a GPU sample that is still kept."""
    return GpuFrame.objects.filter(cluster_id=cluster_id).exists()
