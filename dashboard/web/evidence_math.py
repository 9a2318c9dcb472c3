"""The arithmetic of the evidence charts, with no database: the detectors' thresholds recomputed per step or per
instant, so a page draws the line a detector compared against, not an approximation of it.

Each function mirrors one detector condition in :mod:`dashboard.diagnosis.detectors` (named in its docstring); the
thresholds come from the same :class:`~dashboard.diagnosis.detectors.base.Thresholds` the pass ran with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dashboard.diagnosis.detectors.base import Thresholds, rnd


def clean(values: Sequence[Any] | np.ndarray, nd: int = 4) -> list[float | None]:
    """Floats rounded for JSON; NaN and None become null (a gap in the chart)."""
    return [rnd(v, nd) for v in values]


def robust(mat: np.ndarray, floor: float | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column (step) of a [rank x step] matrix: (median, MAD scaled to a standard deviation, floored) — what
    :func:`~dashboard.diagnosis.detectors.base.robust_z` divides by."""
    with np.errstate(all="ignore"):
        med = np.nanmedian(mat, axis=0)
        mad = np.nanmedian(np.abs(mat - med), axis=0) * 1.4826
    return med, np.maximum(np.nan_to_num(mad, nan=0.0), floor)


def compute_threshold(comp: np.ndarray, t: Thresholds) -> tuple[np.ndarray, np.ndarray]:
    """Straggler (``steps._late_in_run`` "slow"): a rank's compute is flagged above
    max(median + z·σ, compute_ratio_min·median, median + compute_min_s), σ floored at 1% of the overall median
    compute. -> (median, line)."""
    with np.errstate(all="ignore"):
        floor = 0.01 * float(np.nanmedian(comp)) if np.any(~np.isnan(comp)) else 0.0
    med, scale = robust(comp, floor)
    return med, np.fmax(np.fmax(med + t.z * scale, t.compute_ratio_min * med), med + t.compute_min_s)


def data_wait_threshold(data: np.ndarray, step_time: np.ndarray, t: Thresholds) -> tuple[np.ndarray, np.ndarray]:
    """Data starvation ("starved"): data wait above median + z·σ, σ floored at 0.5% of the median step."""
    with np.errstate(all="ignore"):
        med_step = float(np.nanmedian(step_time)) if np.any(~np.isnan(step_time)) else 0.0
    med, scale = robust(data, 0.005 * med_step)
    return med, med + t.z * scale


def arrival_threshold(arrive: np.ndarray, step_time: np.ndarray, t: Thresholds) -> tuple[np.ndarray, np.ndarray]:
    """Late arrival at the first collective ("late"): above median + z·σ and median + late_min_frac·median step."""
    with np.errstate(all="ignore"):
        med_step = float(np.nanmedian(step_time)) if np.any(~np.isnan(step_time)) else 0.0
    med, scale = robust(arrive, 0.005 * med_step)
    return med, np.fmax(med + t.z * scale, med + t.late_min_frac * med_step)


def share(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.where(den > 0, num / den, np.nan)


def rtt_threshold(base_rtt: float | None, t: Thresholds) -> float | None:
    """Slow link (``network._bad_pairs``): RTT above max(rtt_ratio x quiet RTT, quiet RTT + rtt_abs_ms)."""
    if base_rtt is None or not math.isfinite(base_rtt):
        return None
    return max(t.rtt_ratio * base_rtt, base_rtt + t.rtt_abs_ms)


def silence(heard: Sequence[float] | np.ndarray, ticks: np.ndarray) -> list[float | None]:
    """Seconds since the newest of ``heard`` at or before each tick (None before the first): a node's heartbeat
    gap, or a run's time since its last step, as the detectors see it at every instant."""
    h = np.sort(np.asarray(heard, dtype=float))
    if len(h) == 0:
        return [None] * len(ticks)
    pos = np.searchsorted(h, ticks, side="right") - 1
    return [round(float(tk - h[p]), 3) if p >= 0 else None for tk, p in zip(ticks, pos, strict=True)]


def ticks(t0: float, t1: float, points: int = 400) -> np.ndarray:
    step = max(1.0, (t1 - t0) / points)
    return np.arange(t0, t1 + step / 2, step)


def median_interval(ts: Sequence[float] | np.ndarray) -> float:
    """A node's reporting interval: the median gap between its samples (1 s when unknown), as
    ``network.report_intervals`` reads it."""
    gaps = np.diff(np.sort(np.asarray(ts, dtype=float)))
    gaps = gaps[gaps > 0]
    return float(np.median(gaps)) if len(gaps) >= 2 else 1.0


def rolling_increase(ts: Sequence[float], values: Sequence[float | None], span: float) -> list[float | None]:
    """Increase of a cumulative counter over the ``span`` seconds before each sample: what ``gpu._delta`` sums over
    the pass's window (only increases count; a reset is not a negative rate)."""
    t = np.asarray(ts, dtype=float)
    v = np.array([np.nan if x is None else x for x in values], dtype=float)
    ok = ~np.isnan(v)
    t, v = t[ok], v[ok]
    if len(v) == 0:
        return []
    ups = np.concatenate([[0.0], np.cumsum(np.clip(np.diff(v), 0, None))])
    start = np.searchsorted(t, t - span, side="left")
    out = ups - ups[start]
    full = np.full(len(ok), np.nan)
    full[np.nonzero(ok)[0]] = out
    return clean(full, 3)


def step_window(steps: Sequence[int], step_ts: Sequence[float], window: Sequence[float] | None) -> list[int] | None:
    """The steps whose end falls in a time window [t0, t1] -> [first, last] step (None when none does)."""
    if not window or len(window) != 2 or window[0] is None or window[1] is None:
        return None
    inside = [s for s, ts in zip(steps, step_ts, strict=True) if ts is not None and window[0] <= ts <= window[1]]
    return [min(inside), max(inside)] if inside else None


def breach(xs: Sequence[Any], ys: Sequence[float | None], line: Sequence[float | None] | float | None,
           direction: str, window: Sequence[Any] | None) -> dict[str, Any] | None:
    """The subject's worst point against the threshold: inside the detector's window when any point is there,
    else anywhere. ``line``: a constant or one threshold per x. -> {x, y, threshold, over} or None."""
    if line is None:
        return None
    sign = 1.0 if direction == "above" else -1.0
    best: dict[str, Any] | None = None
    candidates = [i for i, x in enumerate(xs) if window and window[0] <= x <= window[1]] or range(len(xs))
    for i in candidates:
        y = ys[i]
        thr = line if isinstance(line, int | float) else line[i]
        if y is None or thr is None or not math.isfinite(y) or not math.isfinite(thr):
            continue
        margin = sign * (y - thr)
        if best is None or margin > best["margin"]:
            best = {"x": xs[i], "y": y, "threshold": round(float(thr), 4), "over": margin > 0, "margin": margin}
    if best is not None:
        best.pop("margin")
    return best


def flatten(metrics: dict[str, Any], prefix: str = "") -> list[dict[str, Any]]:
    """Evidence metrics as table rows: nested dicts become dotted names; lists stay lists (shown joined)."""
    rows: list[dict[str, Any]] = []
    for name, value in metrics.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            rows += flatten(value, key + ".")
        else:
            rows.append({"name": key, "value": value})
    return rows
