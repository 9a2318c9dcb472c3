"""A run's steps for the run and rank pages: the whole run downsampled by step, and rank x step heatmaps.

Whatever the run's length, the answer is at most ``points`` buckets of steps (min / mean / max over every rank-step
in a bucket: settled steps from the step rollup, the live tail grouped from raw rows) and a heatmap of at most ~600
columns. MFU and goodput are the diagnosis's own formula (:func:`efficiency_of`), applied to every bucket at once,
never derived a second time here.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dashboard.diagnosis.detectors.base import rnd
from dashboard.diagnosis.detectors.steps import efficiency_figures, efficiency_of
from dashboard.diagnosis.detectors.window import GPU_NUM, PORT_NUM, PROBE_NUM, STEP_NUM, RunInfo, Table, Window
from dashboard.diagnosis.models import Finding, StepEfficiency
from dashboard.storage import step_samples
from dashboard.storage.models import STEP_SPLIT
from dashboard.storage.steps import COLUMNS, per_step
from dashboard.telemetry.models import Rank, Run
from dashboard.web.links import finding_url, node_url, rank_url

SPLIT = STEP_SPLIT
HEATMAP_METRICS = ("compute_s", "data_wait_s", "comm_arrive_s", "step_time_s")
MAX_HEATMAP_COLS = 600
MAX_HEATMAP_ROWS = 2048  # beyond this a row is a node (the max over its ranks, so one slow rank still shows)
EFFICIENCY_STEPS = 16  # efficiency_figures looks at a run's last 16 steps: per bucket, its last 16


def step_bounds(run: Run, rank: int | None = None) -> tuple[int, int] | None:
    return step_samples.bounds(run.id, rank)


def clamp(bounds: tuple[int, int], lo: int | None, hi: int | None) -> tuple[int, int]:
    a, b = bounds
    lo = a if lo is None else max(a, lo)
    hi = b if hi is None else min(b, hi)
    return (lo, hi) if lo <= hi else (lo, lo)


def _per_step(run: Run, lo: int, hi: int, rank: int | None) -> dict[str, np.ndarray]:
    """One row per step (aggregated over ranks: from the step rollup for settled steps, grouped in SQL from raw for
    the live tail, :func:`dashboard.storage.steps.per_step`), as float columns."""
    rows = per_step(run.id, lo, hi, rank)
    cols: dict[str, np.ndarray] = {"step": np.array([r["step"] for r in rows], dtype=float),
                                   "ts": np.array([r["ts"].timestamp() for r in rows], dtype=float)}
    for key in [k for k in COLUMNS if k != "ts"]:
        cols[key] = np.array([r[key] for r in rows], dtype=float)  # None -> nan
    return cols


def _efficiency(run: Run, s: dict[str, np.ndarray], starts: np.ndarray, ends: np.ndarray,
                world: int) -> tuple[np.ndarray, np.ndarray]:
    """MFU and goodput of each bucket (rows ``starts[i]:ends[i]``, steps ascending), over its last
    EFFICIENCY_STEPS steps, as a pass over those steps figures them (:func:`efficiency_of`, which
    :func:`efficiency_figures` applies to a pass's window): one value per step, the mean step time over ranks and
    every rank's tokens; as in a pass, only steps within EFFICIENCY_STEPS of the newest and with a step time.
    All buckets at once: a call per bucket was 2 ms each, seconds for a whole run's 1,400 buckets."""
    k = EFFICIENCY_STEPS
    idx = ends[:, None] - k + np.arange(k)[None, :]
    inside = idx >= starts[:, None]
    idx = np.where(inside, idx, 0)
    step, ts, tokens = s["step"][idx], s["ts"][idx], np.nan_to_num(s["tokens"])[idx]
    with np.errstate(all="ignore"):
        step_time = (s["step_time_s__sum"] / s["step_time_s__n"])[idx]
        now = np.nanmax(np.where(inside, ts, np.nan), axis=1)
    use = inside & (step > step[:, -1:] - k - 1) & ~np.isnan(step_time)

    def only(v: np.ndarray) -> np.ndarray:
        return np.where(use, v, np.nan)

    _, mfu, goodput = efficiency_of(only(step_time), only(tokens), only(ts - step_time), only(ts), now,
                                    run.meta or {}, world)
    return mfu, goodput


def _r(v: float, d: int = 5) -> float | None:
    return None if v is None or not math.isfinite(v) else round(float(v), d)


def step_series(run: Run, lo: int, hi: int, points: int, rank: int | None = None) -> dict[str, Any]:
    """Steps ``lo..hi`` in buckets of ``ceil((hi-lo+1)/points)`` steps: min / mean / max over every rank-step of a
    bucket for the split and tokens/s, the mean loss and grad norm, MFU and goodput, and each bucket's slowest step
    (what a click explains)."""
    width = max(1, math.ceil((hi - lo + 1) / points))
    s = _per_step(run, lo, hi, rank)
    world = run.world_size or max(1, Rank.objects.filter(run=run).count())
    out: dict[str, Any] = {"run": run.id, "rank": rank, "from_step": lo, "to_step": hi, "bucket_steps": width,
                           "step": [], "step_end": [], "slowest_step": [], "ts": [], "ranks": []}
    for f in (*SPLIT, "tokens_per_s"):
        out[f] = {"min": [], "mean": [], "max": []}
    for key in ("loss", "grad_norm", "mfu", "goodput", "mfu_step"):
        out[key] = []
    if len(s["step"]) == 0:
        return out
    with np.errstate(all="ignore"):
        step_mean = s["step_time_s__sum"] / s["step_time_s__n"]
        # tokens/s of a step: every rank's tokens over the step's time (under DDP all ranks share one step time)
        tps = s["tokens"] / step_mean
    stored = _stored_mfu(run, lo, hi) if rank is None else {}
    bucket = ((s["step"] - lo) // width).astype(int)
    starts = np.flatnonzero(np.r_[True, np.diff(bucket) != 0])
    ends = np.r_[starts[1:], len(bucket)]
    per_rank = rank is not None
    # A rank's view has no MFU or goodput of its own: worked out for the run's buckets only.
    mfu, goodput = (None, None) if per_rank else _efficiency(run, s, starts, ends, world)
    for i, (a, b) in enumerate(zip(starts, ends, strict=True)):
        sl = slice(a, b)
        out["step"].append(int(s["step"][a]))
        out["step_end"].append(int(s["step"][b - 1]))
        out["slowest_step"].append(int(s["step"][a + int(np.nanargmax(np.nan_to_num(step_mean[sl], nan=-1)))]))
        out["ts"].append(_r(s["ts"][b - 1], 3))
        out["ranks"].append(int(np.max(s["n"][sl])))
        for f in SPLIT:
            n = np.nansum(s[f"{f}__n"][sl])
            out[f]["mean"].append(_r(np.nansum(s[f"{f}__sum"][sl]) / n) if n else None)
            out[f]["min"].append(_r(np.nanmin(s[f"{f}__min"][sl])) if n else None)
            out[f]["max"].append(_r(np.nanmax(s[f"{f}__max"][sl])) if n else None)
        t = tps[sl][np.isfinite(tps[sl])]
        for stat, fn in (("min", np.min), ("mean", np.mean), ("max", np.max)):
            out["tokens_per_s"][stat].append(_r(fn(t), 1) if len(t) else None)
        for key in ("loss", "grad_norm"):
            v = s[key][sl]
            out[key].append(_r(np.nanmean(v)) if np.any(np.isfinite(v)) else None)
        out["mfu"].append(None if mfu is None else rnd(mfu[i], 4))
        v = [stored[k] for k in s["step"][sl] if k in stored]
        out["mfu_step"].append(_r(float(np.mean(v)), 5) if v else None)
        out["goodput"].append(None if goodput is None else rnd(goodput[i], 3))
    return out


def _stored_mfu(run: Run, lo: int, hi: int) -> dict[float, float]:
    """step -> MFU the diagnosis pass stored for it (StepEfficiency)."""
    return {float(s): v for s, v in StepEfficiency.objects.filter(run=run, step__gte=lo, step__lte=hi,
                                                                  mfu__isnull=False).values_list("step", "mfu")}


def loss_spikes(run: Run, lo: int, hi: int) -> list[dict[str, Any]]:
    """The loss spikes the diagnosis found in steps lo..hi (open or resolved), for marking on the loss chart."""
    out = []
    for f in (Finding.objects.filter(run=run, kind="loss_spike").order_by("-opened_at")
              .values("id", "severity", "title", "evidence")[:200]):
        m = (f["evidence"] or {}).get("metrics") or {}
        if m.get("step") is not None and lo <= m["step"] <= hi:
            out.append({"step": m["step"], "loss": m.get("loss"), "severity": f["severity"], "title": f["title"],
                        "url": finding_url(f["id"])})
    return sorted(out, key=lambda x: x["step"])


def current_efficiency(run: Run) -> dict[str, Any] | None:
    """tokens/s, MFU and goodput over the run's last 16 steps: the figures the diagnosis pass reports."""
    bounds = step_bounds(run)
    if bounds is None:
        return None
    s = _per_step(run, max(bounds[0], bounds[1] - EFFICIENCY_STEPS), bounds[1], None)
    if not len(s["step"]):
        return None
    world = run.world_size or max(1, Rank.objects.filter(run=run).count())
    with np.errstate(all="ignore"):
        step_time = s["step_time_s__sum"] / s["step_time_s__n"]
    n = len(s["step"])
    num = {c: np.full(n, np.nan) for c in STEP_NUM}
    num |= {"run": np.zeros(n), "rank": np.zeros(n), "step": s["step"], "ts": s["ts"], "step_time_s": step_time,
            "tokens": s["tokens"]}
    empty = {cols: Table({c: np.empty(0) for c in cols}) for cols in (GPU_NUM, PORT_NUM, PROBE_NUM)}
    # A Window of one row per step (the mean step time over ranks, every rank's tokens), as a pass would see it.
    w = Window(float(np.nanmax(s["ts"])), [], Table(num), empty[GPU_NUM], empty[PORT_NUM], empty[PROBE_NUM], [], {},
               [RunInfo(run.name, world, run.meta or {}, {})], {})
    return efficiency_figures(w, 0)


# -- rank x step heatmaps ----------------------------------------------------------------------------------------

def rank_order(run: Run) -> list[dict[str, Any]]:
    """Every rank of the run, ordered by node then local rank (a sick node is a band of adjacent rows)."""
    known = {r["rank"]: r for r in Rank.objects.filter(run=run).values("rank", "node__hostname", "local_rank",
                                                                       "gpu_index")}
    stepped = step_samples.ranks_at(run.id, run.last_step) if run.last_step is not None else set()
    for r in stepped - set(known):  # a rank that steps but never sent its RunMeta
        known[r] = {"rank": r, "node__hostname": None, "local_rank": None, "gpu_index": None}
    return sorted(known.values(), key=lambda r: (r["node__hostname"] is None, r["node__hostname"] or "",
                                                 r["local_rank"] if r["local_rank"] is not None else r["rank"],
                                                 r["rank"]))


def heatmap(run: Run, metric: str, lo: int, hi: int, cols: int = MAX_HEATMAP_COLS) -> dict[str, Any]:
    width = max(1, math.ceil((hi - lo + 1) / cols))
    ranks = rank_order(run)
    cluster = run.cluster.name
    by_node = len(ranks) > MAX_HEATMAP_ROWS
    if by_node:
        hosts = sorted({r["node__hostname"] or "?" for r in ranks})
        row_of = {r["rank"]: hosts.index(r["node__hostname"] or "?") for r in ranks}
        rows = [{"label": h, "url": node_url(cluster, h) if h != "?" else None} for h in hosts]
    else:
        row_of = {r["rank"]: i for i, r in enumerate(ranks)}
        rows = [{"label": f"rank {r['rank']}", "rank": r["rank"], "host": r["node__hostname"],
                 "url": rank_url(run.id, r["rank"])} for r in ranks]
    nodes: list[dict[str, Any]] = []
    for i, r in enumerate(ranks if not by_node else [{"node__hostname": row["label"]} for row in rows]):
        host = r["node__hostname"]
        if nodes and nodes[-1]["host"] == host:
            nodes[-1]["rows"] += 1
        else:
            nodes.append({"host": host, "url": node_url(cluster, host) if host and host != "?" else None,
                          "first_row": i, "rows": 1})
    n_cols = (hi - lo) // width + 1
    z = np.full((len(rows), n_cols), np.nan)
    if metric not in HEATMAP_METRICS:
        raise ValueError(metric)
    # One (rank, bucket) mean per cell, placed with numpy.
    got = step_samples.bucket_means(run.id, metric, lo, hi, width)
    lut = np.full(int(max([*row_of, *got[:, 0].tolist(), 0])) + 1, -1)
    lut[list(row_of)] = list(row_of.values())
    at, b, v = lut[got[:, 0].astype(int)], got[:, 1].astype(int), got[:, 2]
    ok = (at >= 0) & ~np.isnan(v)
    if by_node:  # a node's cell: the slowest of its ranks
        np.fmax.at(z, (at[ok], b[ok]), v[ok])
    else:
        z[at[ok], b[ok]] = v[ok]
    finite = z[np.isfinite(z)]
    return {"run": run.id, "metric": metric, "from_step": lo, "to_step": hi, "bucket_steps": width,
            "steps": [lo + k * width for k in range(n_cols)], "row_kind": "node" if by_node else "rank",
            "rows": rows, "nodes": nodes,
            "z": [[None if v != v else v for v in row] for row in np.round(z, 4).tolist()],  # NaN -> null
            "scale": {"p5": _r(np.percentile(finite, 5)) if len(finite) else None,
                      "median": _r(np.median(finite)) if len(finite) else None,
                      "p99": _r(np.percentile(finite, 99)) if len(finite) else None}}
