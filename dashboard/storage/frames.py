"""Frames: the GPU samples, training steps and probes of one post, one node and a few seconds, as one database row.

A node-second used to be ~25 rows of these three kinds (8 GPUs, 8 ranks' steps, ~9 probes), and the server paid for
each: a Python object per value, a row to bind, an index entry per index. A frame holds a group of them whose numeric
fields travel as one float64 matrix (a row per sample, a column per field, null as NaN, the column order of the wire's
version 2 blocks) and whose few other values (a GPU's throttle reasons, a step's metrics, a probe's peer) as one JSON
list per field, compressed together with LZ4 (``data``). docs/scaling.md ("The columnar path") has the measurements.

Which samples share a frame, so that every query a page, the diagnosis pass, the rollups or retention makes selects
whole frames by indexed columns and then filters rows, never scans:

* the same post, node and kind;
* the same aligned ``FRAME_S``-second window of sample time (``ts``): a frame's ``ts`` column is its oldest sample's,
  so the frames holding samples in [t0, t1] are those with ``window_start(t0) <= ts <= t1``, a rollup window (10 s,
  1 min) is a whole number of frame windows, and a day partition or a retention cut never splits a frame;
* for steps, the same run, the same group of ``RANK_GROUP`` ranks (a node's eight, usually: a rank's history is one
  index range of ``(run, rank_group, step_hi)``) and the same aligned ``STEP_BUCKET`` of step numbers (a step's
  frames are ``step_bucket_start(lo) <= step_hi <= step_bucket_end(hi)`` for steps ``lo..hi``).

Numbers are float64: a whole number past 2**53 (a counter no GPU reaches; the wire allows 2**63) is kept to float64's
precision, which every reader already read it at (the pages, the detectors and the rollups compute in floats).

Layouts: ``Kind.layouts`` lists every column order a frame was ever written in, oldest first; a frame names its own
(``layout``) and is read into today's, a column it lacks being null. A field added to the wire is a new layout here
(tests/server/test_frames.py fails until it is), never a silent reinterpretation of stored frames.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from typing import Any

import lz4.block
import msgspec
import numpy as np
from django.db import models

from dashboard.telemetry import models as m

FRAME_S = 10  # seconds: a frame's samples lie in one aligned window this long (the finest rollup's)
STEP_BUCKET = 64  # a step frame's steps lie in one aligned bucket of this many step numbers
RANK_GROUP = m.RANK_GROUP  # a step frame's ranks lie in one aligned group of this many

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


@functools.cache
def _tail_decoder(fields: tuple[str, ...]) -> Callable[[bytes], Any]:
    """A decoder of a frame's object texts that builds only ``fields`` (as attributes, None where absent) and skips
    the rest unbuilt: a step frame's texts are mostly its samples' metrics (a dict per sample), which the diagnosis
    pass's step series, asking for the groups only, decoded into ~16 dicts a frame and dropped (half of a step
    frame's decoding)."""
    return msgspec.json.Decoder(msgspec.defstruct("Tail", [(f, Any, None) for f in fields])).decode


@dataclass(frozen=True)
class Kind:
    """One kind of framed sample: its wire list (``name``), its table, its matrix columns and its other fields."""

    name: str
    model: type[models.Model]
    layouts: tuple[tuple[str, ...], ...]  # every column order ever written, oldest first; the last is written now
    objects: tuple[str, ...]  # the non-numeric fields kept per sample (the wire's others less the inventory's)
    index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "index", {c: i for i, c in enumerate(self.numbers)})

    @property
    def numbers(self) -> tuple[str, ...]:
        return self.layouts[-1]

    @property
    def layout(self) -> int:
        return len(self.layouts) - 1

    def col(self, name: str) -> int:
        return self.index[name]

    @cached_property
    def _maps(self) -> list[np.ndarray | None]:
        """Per stored layout, where each of today's columns is in it (-1: not there), or None for today's own."""
        out: list[np.ndarray | None] = []
        for lay in self.layouts:
            if lay == self.numbers:
                out.append(None)
            else:
                at = {c: i for i, c in enumerate(lay)}
                out.append(np.array([at.get(c, -1) for c in self.numbers]))
        return out


# The layouts are written out, not derived from clusterdx.wire: a derived one would change under stored frames when
# the wire gains a field. Layout 0 is wire version 2's block order of 2026-12 (clusterdx.blocks.LAYOUTS).
GPUS = Kind("gpus", m.GpuFrame, ((
    "ts", "index", "util_gpu_pct", "util_mem_pct", "mem_used_bytes", "mem_total_bytes", "temp_c", "power_w",
    "power_limit_w", "sm_clock_mhz", "sm_clock_max_mhz", "mem_clock_mhz", "mem_clock_max_mhz", "ecc_sbe_volatile",
    "ecc_dbe_volatile", "ecc_sbe_aggregate", "ecc_dbe_aggregate", "retired_pages_sbe", "retired_pages_dbe",
    "retired_pages_pending", "remap_correctable", "remap_uncorrectable", "remap_pending", "remap_failure",
    "pcie_replay_total", "pcie_gen", "pcie_gen_max", "pcie_width", "pcie_width_max", "nvlink_links_up",
    "nvlink_links_total", "nvlink_crc_errors_total", "nvlink_replay_errors_total", "nvlink_recovery_errors_total"),),
    # uuid, name and pci_bus_id are the GPU inventory's (telemetry.Gpu), not a sample's
    ("throttle_reasons", "unavailable"))
STEPS = Kind("steps", m.StepFrame, ((
    "rank", "step", "ts", "step_time_s", "data_wait_s", "compute_s", "comm_s", "comm_arrive_s", "tokens", "samples",
    "mem_allocated_bytes", "mem_reserved_bytes", "mem_total_bytes"),),
    ("phases", "metrics", "groups"))  # the run is the frame's own column
PROBES = Kind("probes", m.ProbeFrame, (("ts", "sent", "lost", "rtt_ms", "rtt_p99_ms", "bw_gbps"),), ("peer",))
KINDS = {k.name: k for k in (GPUS, STEPS, PROBES)}


def window_start(ts: float) -> float:
    """The start of the aligned frame window holding ``ts``: the oldest a frame's ``ts`` can be and still hold it."""
    return math.floor(ts / FRAME_S) * FRAME_S


def step_bucket_start(step: int) -> int:
    return step // STEP_BUCKET * STEP_BUCKET


def step_bucket_end(step: int) -> int:
    return step_bucket_start(step) + STEP_BUCKET - 1


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


# -- the codec -----------------------------------------------------------------------------------------------------


def pack(mat: np.ndarray, objs: dict[str, list[Any]] | None = None) -> bytes:
    """A frame's ``data``: its matrix (row-major little-endian float64) followed by the JSON of ``objs`` (the fields
    with any non-null value; none at all is nothing), LZ4-compressed as one block. LZ4 rather than zlib: a GPU frame in
    4 us instead of 48, for 8 % more bytes (measured on the simulator's frames, docs/scaling.md)."""
    raw = np.ascontiguousarray(mat, dtype="<f8").tobytes()
    if objs:
        raw += _encode(objs)
    return lz4.block.compress(raw, store_size=True)


def unpack(kind: Kind, layout: int, n: int, data: bytes | memoryview) -> tuple[np.ndarray, dict[str, list[Any]]]:
    """A frame's matrix in today's layout (``n`` rows) and its object fields (those it has)."""
    raw = lz4.block.decompress(data)
    width = len(kind.layouts[layout])
    size = 8 * n * width
    mat = np.frombuffer(raw, dtype="<f8", count=n * width).reshape(n, width)
    objs = _decode(memoryview(raw)[size:]) if len(raw) > size else {}
    return _to_today(kind, layout, mat), objs


def _to_today(kind: Kind, layout: int, mat: np.ndarray) -> np.ndarray:
    where = kind._maps[layout]
    if where is None:
        return mat
    out = np.full((len(mat), len(kind.numbers)), np.nan)
    have = where >= 0
    out[:, have] = mat[:, where[have]]
    return out


# -- building frames (the ingest writer) ------------------------------------------------------------------------------


def matrix(kind: Kind, rows: list[tuple[Any, ...]]) -> np.ndarray:
    """``rows`` (tuples of the kind's numeric fields in today's order, as ``wire.Fields(*kind.numbers)`` reads them
    from records) as the float64 matrix: None is NaN, a bool 0 or 1."""
    if not rows:
        return np.empty((0, len(kind.numbers)))
    return np.array(rows, dtype=np.float64).reshape(len(rows), len(kind.numbers))


def objects(kind: Kind, columns: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """The object fields worth storing: those with a value in any row (an all-null field costs no bytes)."""
    return {f: v for f, v in columns.items() if f in kind.objects and _has_value(v)}


def _has_value(values: list[Any]) -> bool:
    # list.count runs in C: a generator over each post's object fields was 8 us a post in the writer
    return values.count(None) < len(values)


@dataclass(frozen=True, slots=True)
class Built:
    """One frame to insert: its rows' oldest sample time and step range, and its packed data."""

    ts: float
    n: int
    data: bytes
    run_id: int | None = None
    rank_group: int | None = None
    step_lo: int | None = None
    step_hi: int | None = None
    peers: str | None = None


Part = tuple[np.ndarray, dict[str, list[Any]], Sequence[int] | None]  # one post's (matrix, object fields, run ids)


def build(kind: Kind, mat: np.ndarray, objs: dict[str, list[Any]], run_ids: Sequence[int] | None = None
          ) -> list[Built]:
    """One post's samples of ``kind`` (``mat`` in today's layout, ``objs`` the object fields' lists, and for steps
    each row's run id) as the frames they make: one, unless they spread over frame windows (or runs, rank groups, step
    buckets). Row order within a frame is the post's."""
    return [b for _, b in build_group(kind, [(mat, objs, run_ids)])]


def build_group(kind: Kind, parts: list[Part]) -> list[tuple[int, Built]]:
    """:func:`build` of several posts at once, as ``(post's index in parts, frame)`` in posts' order: the group
    writer's whole group of a kind in a few numpy operations (a post's eight rows made numpy's cost per call the
    writer's largest at 2,048 nodes: a dozen calls a post). Frames never mix posts."""
    index = [i for i, p in enumerate(parts) if len(p[0])]  # posts without samples of the kind make no frame
    if len(index) < len(parts):
        parts = [parts[i] for i in index]
    if not parts:
        return []
    sizes = np.fromiter((len(p[0]) for p in parts), dtype=np.int64, count=len(parts))
    mat = parts[0][0] if len(parts) == 1 else np.concatenate([p[0] for p in parts])
    post = np.repeat(np.arange(len(parts)), sizes)
    keys = [post, np.floor(mat[:, kind.col("ts")] / FRAME_S)]
    if kind is STEPS:
        keys += [np.concatenate([np.asarray(p[2], dtype=np.float64) for p in parts]),
                 mat[:, kind.col("rank")] // RANK_GROUP, mat[:, kind.col("step")] // STEP_BUCKET]
    order = np.lexsort(keys[::-1])  # stable: a frame's rows keep their order in the post
    cols = [k[order] for k in keys]
    edge = np.ones(len(order), dtype=bool)
    edge[1:] = np.logical_or.reduce([c[1:] != c[:-1] for c in cols])
    starts = np.flatnonzero(edge)
    sorted_mat = mat if (order == np.arange(len(order))).all() else mat[order]
    bounds = np.append(starts, len(order)).tolist()
    ts_min = np.minimum.reduceat(sorted_mat[:, kind.col("ts")], starts).tolist()
    if kind is STEPS:
        step = sorted_mat[:, kind.col("step")]
        lo, hi = np.minimum.reduceat(step, starts).tolist(), np.maximum.reduceat(step, starts).tolist()
        first = sorted_mat[starts]
        run = cols[2][starts].tolist()
        group = (first[:, kind.col("rank")] // RANK_GROUP).tolist()
    objs = _sorted_objects(kind, parts, order)
    posts = [index[i] for i in cols[0][starts].tolist()]
    out = []
    for f, (a, b) in enumerate(itertools.pairwise(bounds)):
        sub = {name: v[a:b] for name, v in objs.items()}
        sub = {name: v for name, v in sub.items() if _has_value(v)}
        extra: dict[str, Any] = {}
        if kind is STEPS:
            extra = {"run_id": int(run[f]), "rank_group": int(group[f]), "step_lo": _int64(lo[f]),
                     "step_hi": _int64(hi[f])}
        elif kind is PROBES:
            extra = {"peers": peers_text(sub.get("peer", ()))}
        out.append((posts[f], Built(ts_min[f], b - a, pack(sorted_mat[a:b], sub), **extra)))
    return out


def _sorted_objects(kind: Kind, parts: list[Part], order: np.ndarray) -> dict[str, list[Any]]:
    """The posts' object fields as one list each, in ``order`` (a field a post lacks is None in its rows)."""
    names = {name for p in parts for name in p[1] if name in kind.objects}
    out = {}
    for name in sorted(names):
        values: list[Any] = []
        for mat, objs, _ in parts:
            values.extend(objs.get(name) or [None] * len(mat))
        out[name] = [values[i] for i in order.tolist()]
    return out


def _int64(x: float) -> int:
    """A step bound as a BIGINT column holds it: the wire's largest step (2**63 - 1) is 2**63 as a float64."""
    return max(-(2**63), min(2**63 - 1, int(x)))


def peers_text(peers: Iterable[str | None]) -> str:
    """A probe frame's ``peers`` column: its distinct peers between spaces (" a b "), so the frames with probes to a
    host are found by a substring match on " host " (a host name has no space)."""
    return " " + " ".join(sorted({p for p in peers if p})) + " "


# -- reading frames ---------------------------------------------------------------------------------------------------


@dataclass
class Rows:
    """The samples of some frames: ``mat`` (a row per sample, today's layout of ``kind``), the frame columns asked for
    (``cols``: one value per sample, e.g. its frame's ``node_id``) and the object fields asked for (``objs``)."""

    kind: Kind
    mat: np.ndarray
    cols: dict[str, np.ndarray]
    objs: dict[str, list[Any]]

    def __len__(self) -> int:
        return len(self.mat)

    def __getitem__(self, name: str) -> np.ndarray:
        """A numeric field's column, or a frame column's per-sample values."""
        if name in self.cols:
            return self.cols[name]
        return self.mat[:, self.kind.col(name)]

    def where(self, keep: np.ndarray) -> Rows:
        """Only the samples where ``keep`` (a boolean mask or indexes) holds."""
        idx = np.flatnonzero(keep) if keep.dtype == bool else keep
        return Rows(self.kind, self.mat[idx], {c: v[idx] for c, v in self.cols.items()},
                    {f: [v[i] for i in idx] for f, v in self.objs.items()})

    def between(self, t0: float | None, t1: float | None) -> Rows:
        """The samples taken in [t0, t1] (an open end where None)."""
        ts = self["ts"]
        keep = np.ones(len(ts), dtype=bool)
        if t0 is not None:
            keep &= ts >= t0
        if t1 is not None:
            keep &= ts <= t1
        return self if keep.all() else self.where(keep)


def decode(kind: Kind, frames: Iterable[Sequence[Any]], cols: Sequence[str] = (), objects: Sequence[str] = ()
           ) -> Rows:
    """``frames``: rows of (*cols, n, layout, data), as read from a frame table; their samples in one :class:`Rows`.
    The matrices are joined as bytes and read by one ``np.frombuffer`` (a page reads thousands of frames)."""
    k = len(cols)
    width = len(kind.numbers)
    today = kind.layout
    row_bytes = [8 * len(lay) for lay in kind.layouts]  # looked up, not worked out, per frame (~20,000 a pass)
    chunks: list[Any] = []
    counts: list[int] = []
    leads: list[Sequence[Any]] = []  # each frame's ``cols`` values, taken apart once after the loop
    wanted: dict[str, list[Any]] = {f: [] for f in objects}
    odd: list[tuple[int, np.ndarray]] = []  # (position in chunks, matrix) of frames in an older layout
    seen: dict[bytes, Any] = {}
    decode_tail = _tail_decoder(tuple(objects))
    decompress = lz4.block.decompress
    for frame in frames:
        n, layout, data = frame[k], frame[k + 1], frame[k + 2]
        raw = decompress(data)
        size = n * row_bytes[layout]
        if layout == today:
            chunks.append(memoryview(raw)[:size])
        else:
            odd.append((len(chunks), _to_today(kind, layout, np.frombuffer(raw, "<f8", n * len(kind.layouts[layout]))
                                               .reshape(n, -1))))
            chunks.append(b"")
        counts.append(n)
        if k:
            leads.append(frame[:k])  # not the frame: its compressed data is freed as the read goes on
        if wanted:
            tail = raw[size:]
            got = seen.get(tail)
            if got is None:
                # Most frames repeat a few object texts (no throttle reason, the same unavailable fields): each is
                # decoded once per read, and equal values are shared (callers only read them).
                got = seen[tail] = decode_tail(tail or b"{}")
            for f, into in wanted.items():
                v = getattr(got, f)
                into.extend(v if v is not None else [None] * n)
    per = [[f[j] for f in leads] for j in range(k)]
    if odd:
        parts = [np.frombuffer(c, "<f8").reshape(-1, width) for c in chunks]
        for at, mat in odd:
            parts[at] = mat
        mat = np.concatenate(parts) if parts else np.empty((0, width))
    else:
        mat = np.frombuffer(b"".join(chunks), dtype="<f8").reshape(-1, width)
    reps = np.asarray(counts, dtype=np.int64)
    return Rows(kind, mat, {c: np.repeat(np.asarray(per[j]), reps) for j, c in enumerate(cols)}, wanted)


def read(kind: Kind, where: models.Q | None = None, *, t0: float | None = None, t1: float | None = None,
         cols: Sequence[str] = (), objects: Sequence[str] = (), order: Sequence[str] = (), **filters: Any) -> Rows:
    """The samples of ``kind`` in the frames matching ``where`` / ``filters`` (the frame table's columns), taken in
    [t0, t1] when given (the frames are chosen by their ``ts`` index, the samples by their own time)."""
    qs = kind.model._default_manager.filter(**filters)
    if where is not None:
        qs = qs.filter(where)
    if t0 is not None:
        qs = qs.filter(ts__gte=_dt(window_start(t0)))
    if t1 is not None:
        qs = qs.filter(ts__lte=_dt(t1))
    if order:
        qs = qs.order_by(*order)
    rows = decode(kind, qs.values_list(*cols, "n", "layout", "data").iterator(chunk_size=2000), cols, objects)
    return rows.between(t0, t1)


def newest(kind: Kind, **filters: Any) -> float | None:
    """The newest sample time in the frames matching ``filters``; None when there are none. A frame's ``ts`` is its
    oldest sample's and its samples lie within FRAME_S of it: only the frames from the newest ``ts`` less FRAME_S on
    can hold the newest sample."""
    from django.db.models import Max

    qs = kind.model._default_manager.filter(**filters)
    top = qs.aggregate(t=Max("ts"))["t"]
    if top is None:
        return None
    rows = read(kind, t0=top.timestamp() - FRAME_S, **filters)
    return float(rows["ts"].max())


def concat(kind: Kind, parts: list[Rows]) -> Rows:
    """One :class:`Rows` of several reads' (the same frame columns and object fields asked of each)."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return Rows(kind, np.empty((0, len(kind.numbers))), {}, {})
    return Rows(kind, np.concatenate([p.mat for p in parts]),
                {c: np.concatenate([p.cols[c] for p in parts]) for c in parts[0].cols},
                {f: [v for p in parts for v in p.objs[f]] for f in parts[0].objs})
