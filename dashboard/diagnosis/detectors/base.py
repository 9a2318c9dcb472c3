"""What a detector returns, the thresholds it uses, and the robust statistics they share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

SEVERITY_RANK = {"info": 0, "warning": 1, "error": 2, "critical": 3}


@dataclass
class Detection:
    """One true statement about the cluster: kind, exact subject, how bad, the numbers, and what to do."""

    kind: str
    subject_type: str  # "cluster", "node", "gpu", "rank", "link", "run"
    subject: str
    severity: str
    title: str
    action: str
    evidence: dict[str, Any]
    confidence: float = 0.9
    node: str | None = None
    peer_node: str | None = None
    gpu_index: int | None = None
    rank: int | None = None
    run: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.subject


@dataclass(frozen=True)
class Thresholds:
    """Every tunable of the detectors in one place (the server can override them from settings)."""

    # Late ranks (data starvation / straggler): robust z against the cross-rank median, in >= persist of recent steps.
    z: float = 5.0
    recent_steps: int = 5
    persist_steps: int = 3
    late_min_frac: float = 0.02  # lateness must also be >= this share of the median step time
    data_share_min: float = 0.05  # a starved rank waits at least this share of its step for data
    # ... and at least this long: a few ms is a busy host's scheduler, not a loader (the rate-limited testbed's rank
    # waited 4 ms, 6 % of its 70 ms step, and was named starved next to the link that slowed it)
    data_min_s: float = 0.01
    compute_ratio_min: float = 1.04
    # ... and slower by at least this long: a rank whose 50 ms of compute took 3 ms more on the testbed's busy two
    # cores (its timer slept late; z 7.6 against a tiny spread) was named a straggler of a healthy job
    compute_min_s: float = 0.01
    run_starved_share: float = 0.15  # every rank waits this share: the whole run is starved
    run_wide_frac: float = 0.9  # "every rank": this share of the ranks; fewer culprits are each named
    # Hang: no step for this many median steps (and at least min_s) while every agent of the run is alive.
    hang_steps: float = 5.0
    hang_min_s: float = 3.0
    # Beats: a rank whose beats (about one a second) stopped this long is silent (frozen or dead); one quiet for
    # beat_suspect_s may be going silent, so the run is not named hung yet.
    beat_silent_s: float = 4.0
    beat_suspect_s: float = 2.0
    # Node down: silent this long *and* peers lose their probes to it; or silent heartbeat_s alone.
    silent_min_s: float = 3.0
    silent_intervals: float = 3.0  # ... or this many of the node's own reporting intervals, if longer
    heartbeat_s: float = 15.0
    # ... plus how late its batches reach this server (its own newest batch's delay, or the cluster's median), up
    # to this: a server behind on ingest, or a node whose clock runs behind, is not a node down.
    ingest_lag_max_s: float = 120.0
    # Clock behind: a node whose newest batches all arrive at least clock_behind_s later than the cluster's, at a
    # steady delay (all within clock_spread_s), the newest within heartbeat_s: its clock runs that far
    # behind (an agent replaying its spool catches up, so its delays fall). Such a node is silent only once its
    # batches stop arriving.
    clock_behind_s: float = 30.0
    clock_spread_s: float = 5.0
    clock_batches: int = 3
    probe_loss_frac: float = 0.8
    # ... in the newest probes to it: at least this many rounds (one peer's, or several peers') since the last that
    # reached it, so one peer's lost round alone (a loaded prober) never names a node down.
    probe_lost_rounds: int = 2
    # Links: a pair is bad when its RTT is rtt_ratio x the cluster's quiet RTT (and rtt_abs_ms above it), it loses
    # loss_frac of its pings, or its bulk bandwidth is under bw_ratio of the cluster's.
    rtt_ratio: float = 3.0
    # A user-space ping's own noise on a loaded host is tenths of a millisecond: with 0.15 ms a healthy testbed node
    # whose agent waited for the CPU three rounds running (0.45 ms against a quiet 0.08 ms, the machine ~80 % busy)
    # was named slow. Latency that hurts a collective is milliseconds; a narrow link shows in the bulk transfers.
    rtt_abs_ms: float = 0.5
    # ... or, when either end's CPU is busy_cpu_pct busy, rtt_busy_abs_ms above it (user-space pings wait for the
    # scheduler: the testbed saw a healthy node at 1.6 ms vs 0.04 ms on a saturated machine).
    busy_cpu_pct: float = 90.0
    rtt_busy_abs_ms: float = 5.0
    # ... and one path alone (detectors/paths.py) only this far above the quiet RTT (or with probe loss).
    path_abs_ms: float = 5.0
    loss_frac: float = 0.4
    bw_ratio: float = 0.7
    node_bad_frac: float = 0.75
    link_buckets: int = 3
    port_error_samples: int = 3
    # GPU health.
    sbe_min: int = 10
    sbe_samples: int = 3
    pcie_replay_min: int = 100
    nvlink_errors_min: int = 10
    # Throttling: SM clock under clock_ratio of max for throttle_s (longer when a rank runs on it: a straggler is
    # named first when the throttle slows the run).
    clock_ratio: float = 0.85
    throttle_s: float = 5.0
    throttle_with_rank_s: float = 15.0
    busy_util_pct: float = 50.0
    # Memory.
    mem_warn: float = 0.90
    mem_error: float = 0.95
    mem_reserved_full: float = 0.98  # reserved by the caching allocator: near-OOM even if less is allocated
    # Checkpoints: overdue past the learned cadence by max(slack_steps, slack_frac x cadence); without a cadence,
    # after max_age_s.
    ckpt_slack_steps: int = 5
    ckpt_slack_frac: float = 0.05
    ckpt_max_age_s: float = 3600.0
    gpu_hour_usd: float = 2.5
    # NCCL.
    ib_timeout_min: int = 18
    ib_timeout_scale_ranks: int = 512
    # Efficiency: a finding only when MFU is known and below this floor (0 disables).
    mfu_floor: float = 0.02
    extra: dict[str, Any] = field(default_factory=dict)


class SortedColumns:
    """A [rank x step] matrix's columns sorted once (NaN last), each read at its own count of values: numpy's
    ``nanmedian`` and ``nanpercentile`` (its default, linear method) down axis 0, the same values to the bit, from one
    sort. numpy takes such a matrix's columns one at a time (``apply_along_axis``: the NaNs taken out and a partition,
    per column, per statistic); at 16,384 ranks x 11 steps one sort is ~1.8 ms where ``np.nanmedian`` takes ~2.7 and
    ``np.nanpercentile`` more, and the late-rank detectors ask a dozen times a pass at 2,048 nodes. An all-NaN column
    gives NaN, as numpy's (without its warning)."""

    def __init__(self, x: np.ndarray) -> None:
        self.s = np.sort(x, axis=0)
        self.n = x.shape[0] - np.count_nonzero(np.isnan(self.s), axis=0)
        self._cols = np.arange(x.shape[1])

    def median(self) -> np.ndarray:
        s, n, cols = self.s, self.n, self._cols
        if not len(s):
            return np.full(len(cols), np.nan)
        lo, hi = s[np.maximum(n - 1, 0) // 2, cols], s[n // 2, cols]  # an all-NaN column reads row 0, then NaN below
        with np.errstate(over="ignore"):  # as numpy's: the middle value, or the mean of the two middle ones
            return np.where(n % 2 == 1, lo, np.where(n > 0, (lo + hi) / 2, np.nan))

    def percentile(self, p: float) -> np.ndarray:
        """numpy's steps: the index ``(n - 1) q`` between two values, the last value past the end, and its two-sided
        interpolation (from below under half way, from above at or past it)."""
        q = np.true_divide(p, 100)
        s, n, cols = self.s, self.n, self._cols
        if not len(s):
            return np.full(len(cols), np.nan)
        virtual = (n - 1) * q
        above = virtual >= n - 1
        below = np.floor(virtual)
        at = np.maximum(np.where(above, n - 1, below), 0).astype(np.intp)
        a = s[at, cols]
        b = s[np.maximum(np.where(above, n - 1, below + 1), 0).astype(np.intp), cols]
        gamma = virtual - np.where(above, -1.0, below)  # numpy takes the fraction from its index moved to -1 there
        with np.errstate(all="ignore"):
            diff = b - a
            out = np.where(gamma >= 0.5, b - diff * (1 - gamma), a + diff * gamma)
        return np.where(n > 0, out, np.nan)


def nanmedian(x: np.ndarray, axis: int | None = None, keepdims: bool = False) -> np.ndarray | float:
    """``np.nanmedian``, the same values, faster down the columns of a [rank x step] matrix (:class:`SortedColumns`).
    Other shapes and axes go to numpy."""
    if axis != 0 or x.ndim != 2 or x.shape[0] == 0:
        return np.nanmedian(x, axis=axis, keepdims=keepdims)
    med = SortedColumns(x).median()
    return med[np.newaxis, :] if keepdims else med


def robust_z(x: np.ndarray, axis: int = 0, floor: float | np.ndarray = 0.0,
             cols: SortedColumns | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(z, median) along ``axis`` with the MAD scaled to a standard deviation and floored (a MAD of 0 when every
    rank is identical would make any difference infinite). ``cols``: ``x``'s columns already sorted (axis 0)."""
    with np.errstate(all="ignore"):
        med = cols.median()[np.newaxis, :] if cols is not None else nanmedian(x, axis=axis, keepdims=True)
        mad = nanmedian(np.abs(x - med), axis=axis, keepdims=True) * 1.4826
        scale = np.maximum(mad, floor)
        scale = np.where(scale > 0, scale, np.nan)
        return (x - med) / scale, med


def rnd(x: Any, nd: int = 3) -> Any:
    """Round for evidence (JSON-safe: NaN becomes None)."""
    if x is None:
        return None
    try:
        f = float(x)
    except (TypeError, ValueError):
        return x
    return None if not np.isfinite(f) else round(f, nd)


def group_last(keys: np.ndarray, ts: np.ndarray) -> dict[float, int]:
    """key -> row index of its newest row."""
    order = np.lexsort((ts, keys))
    last = {}
    k_sorted = keys[order]
    ends = np.r_[np.nonzero(np.diff(k_sorted))[0], len(order) - 1] if len(order) else []
    for e in ends:
        last[float(k_sorted[e])] = int(order[e])
    return last


def groups(keys: np.ndarray) -> dict[float, np.ndarray]:
    """key -> row indices, in one sort instead of one mask per key."""
    if len(keys) == 0:
        return {}
    order = np.argsort(keys, kind="stable")
    ks = keys[order]
    cuts = np.nonzero(np.diff(ks))[0] + 1
    return {float(k[0]): part for k, part in zip(np.split(ks, cuts), np.split(order, cuts), strict=True)}
