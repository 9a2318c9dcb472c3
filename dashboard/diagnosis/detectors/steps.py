"""Detectors over the training steps: late ranks (data starvation or straggler), memory pressure, hang, checkpoint
risk and the efficiency figures.

Under DDP every rank's *step time* is the same (the all-reduce levels them), so none of these compare step times
across ranks: the culprit shows in its own data wait or compute and in when it arrives at the first collective
(``comm_arrive_s``); the others show it as time waiting in the collective.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from dashboard.diagnosis.detectors import ranks
from dashboard.diagnosis.detectors.base import Detection, SortedColumns, Thresholds, nanmedian, rnd, robust_z
from dashboard.diagnosis.detectors.gpu import gpu_state
from dashboard.diagnosis.detectors.network import arrival_slack
from dashboard.diagnosis.detectors.window import RankInfo, RunInfo, Window, run_nodes

_NO_RANK = RankInfo(None, None, {})


@dataclass
class RunSteps:
    """One run's recent steps as [rank x step] matrices (NaN where a rank's row has not arrived)."""

    run: RunInfo
    ranks: np.ndarray
    steps: np.ndarray
    m: dict[str, np.ndarray]

    @property
    def step_med(self) -> float:
        return float(np.nanmedian(self.m["step_time_s"]))


def _dense(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(v, return_inverse=True)`` for whole numbers in a narrow range (ranks, step numbers) by counting
    instead of sorting: six detectors ask for each run's grid every pass, and the sorts were most of it (16,384 ranks x
    19 steps at 2,048 nodes)."""
    if not len(v):
        return np.unique(v, return_inverse=True)
    lo, hi = float(v.min()), float(v.max())
    if not (np.isfinite(lo) and np.isfinite(hi)) or hi - lo > 4 * len(v) + 1024:
        return np.unique(v, return_inverse=True)
    iv = v.astype(np.int64)
    if not np.array_equal(iv, v):
        return np.unique(v, return_inverse=True)
    iv -= int(lo)
    seen = np.zeros(int(hi - lo) + 1, dtype=bool)
    seen[iv] = True
    values = np.nonzero(seen)[0]
    where = np.cumsum(seen) - 1
    return (values + lo).astype(v.dtype), where[iv]


def run_steps(w: Window, run_index: int, cols: tuple[str, ...], last: int) -> RunSteps | None:
    """Run ``run_index``'s last ``last`` steps as [rank x step] matrices of step time, ts and ``cols``. Six detectors
    ask for a run's grid each pass, three of them for the same steps: each grid's layout and each field's matrix are
    built once per window (``Window.grids``, 16,384 ranks at 2,048 nodes) and every caller gets its own copy."""
    key = (run_index, last)
    grid = w.grids.get(key, False)
    if grid is False:
        grid = w.grids[key] = _grid(w, run_index, last)
    if grid is None:
        return None
    rows, at, shape, ranks, steps, mats = grid
    m = {}
    for c in ("step_time_s", "ts", *cols):
        mat = mats.get(c)
        if mat is None:
            mat = mats[c] = _scatter(w.steps[c][rows], at, shape)
        m[c] = mat.copy()  # the caller's own: a detector may write into its matrices
    return RunSteps(w.runs[run_index], ranks, steps, m)


def _scatter(values: np.ndarray, at: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """A [rank x step] matrix with ``values`` at the flat positions ``at``, NaN elsewhere."""
    mat = np.full(shape[0] * shape[1], np.nan)
    mat[at] = values
    return mat.reshape(shape)


def _grid(w: Window, run_index: int, last: int) -> tuple[Any, ...] | None:
    """(the step rows that go in the grid, their flat positions in it, its shape, its ranks, its steps, the matrices
    built so far) of a run's last ``last`` steps; None when it has none."""
    t = w.steps
    rows = np.nonzero(t["run"] == run_index)[0]
    if len(rows) == 0:
        return None
    step = t["step"][rows]
    top = np.nanmax(step)
    keep = rows[step > top - last - 1]
    ranks, r_idx = _dense(t["rank"][keep])
    steps, s_idx = _dense(t["step"][keep])
    # The newest step is often still arriving (one node's batch is in, another's is not): keep a column only when
    # most ranks have it, so a half-reported step never decides anything. (Counted in the grid's cells: a run
    # restarted from a checkpoint reports some steps twice, and the later row is the cell's.)
    times = _scatter(t["step_time_s"][keep], r_idx * len(steps) + s_idx, (len(ranks), len(steps)))
    have = np.sum(~np.isnan(times), axis=0)
    full = have >= max(1, 0.5 * len(ranks))
    if not full.any():
        return None
    column = np.cumsum(full) - 1  # a kept step's column among the kept ones
    inside = full[s_idx]
    shape = (len(ranks), int(full.sum()))
    at = r_idx[inside] * shape[1] + column[s_idx[inside]]
    return keep[inside], at, shape, ranks, steps[full], {"step_time_s": times[:, full]}


def _persistent(flags: np.ndarray, present: np.ndarray, recent: int, persist: int) -> np.ndarray:
    """Rows flagged in >= persist of their last ``recent`` reported steps, including the newest one they reported."""
    out = np.zeros(flags.shape[0], dtype=bool)
    for i in np.nonzero(flags.any(axis=1))[0]:
        cols = np.nonzero(present[i])[0][-recent:]
        f = flags[i, cols]
        out[i] = len(cols) >= persist and f.sum() >= persist and bool(f[-1])
    return out


# -- late ranks ------------------------------------------------------------------------------------------------

def late_ranks(w: Window, t: Thresholds, named: dict[str, set[int]] | None = None) -> list[Detection]:
    """``named``: run -> ranks already named within their process group (:mod:`.groups`)."""
    out: list[Detection] = []
    for ri in range(len(w.runs)):
        rs = run_steps(w, ri, ("data_wait_s", "compute_s", "comm_arrive_s", "comm_s"), t.recent_steps + 3)
        if rs is None or len(rs.ranks) < 3:  # with two ranks there is no majority to be late against
            if rs is not None:
                out += _run_starved(w, rs, t)
            continue
        out += _late_in_run(w, rs, t, (named or {}).get(rs.run.name)) or _run_starved(w, rs, t)
    return out


def _low_ref(x: np.ndarray, floor: float | np.ndarray, cols: SortedColumns | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """(z, reference) per step against the *lower* ranks: the 25th percentile as the centre and the spread of the
    ranks at or below the median. When a quarter to a half of the ranks are slow together (the ranks of one node, a
    shard of slow files) the median and MAD sit between the two groups and no one is an outlier; the lower half is
    still the healthy majority's picture."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if cols is None:  # one sort for both; the caller's when it sorted x already
            cols = SortedColumns(x)
        ref = cols.percentile(25)[np.newaxis, :]
        low = np.where(x <= cols.median()[np.newaxis, :], x, np.nan)
        mad = nanmedian(np.abs(low - ref), axis=0, keepdims=True) * 1.4826
        scale = np.maximum(mad, floor)
        scale = np.where(scale > 0, scale, np.nan)
        return (x - ref) / scale, ref


def _late_in_run(w: Window, rs: RunSteps, t: Thresholds, skip: set[int] | None = None) -> list[Detection]:
    """Each late rank named from its own data wait / compute. Two references: the cross-rank median (one culprit
    among many) and the lower ranks (:func:`_low_ref`: several culprits at once). When nearly every rank is flagged
    (``run_wide_frac``) nobody is late against anybody: that is the run-wide finding's case, not a rank's.
    ``skip``: ranks another detector already named (within their process group)."""
    m, med_step = rs.m, rs.step_med
    data, comp = m["data_wait_s"], m["compute_s"]
    arrive = np.where(np.isnan(m["comm_arrive_s"]), data + comp, m["comm_arrive_s"])
    present = ~np.isnan(m["step_time_s"])
    with np.errstate(all="ignore"):
        # data and compute each sorted once, for the median and the lower ranks' reference both
        dcols, ccols, comp_floor = SortedColumns(data), SortedColumns(comp), 0.01 * np.nanmedian(comp)
        lz, amed = robust_z(arrive, 0, floor=0.005 * med_step)
        late = (lz > t.z) & (arrive - amed > t.late_min_frac * med_step)
        dz, dmed = robust_z(data, 0, floor=0.005 * med_step, cols=dcols)
        starved = (dz > t.z) & (data / m["step_time_s"] >= t.data_share_min) & (data >= t.data_min_s)
        cz, cmed = robust_z(comp, 0, floor=comp_floor, cols=ccols)
        slow = (cz > t.z) & (comp >= t.compute_ratio_min * cmed) & (comp - cmed >= t.compute_min_s)
        # Several at once: against the lower ranks, with the same minimum sizes (and lateness in absolute terms).
        dlz, dref = _low_ref(data, 0.005 * med_step, dcols)
        starved_low = (dlz > t.z) & (data / m["step_time_s"] >= t.data_share_min) & (data >= t.data_min_s) & \
            (data - dref > t.late_min_frac * med_step)
        clz, cref = _low_ref(comp, comp_floor, ccols)
        slow_low = (clz > t.z) & (comp >= t.compute_ratio_min * cref) & (comp - cref > t.late_min_frac * med_step) & \
            (comp - cref >= t.compute_min_s)
    flags = np.nan_to_num(late | starved | slow | starved_low | slow_low, nan=0).astype(bool) & present
    culprits = [int(i) for i in np.nonzero(_persistent(flags, present, t.recent_steps, t.persist_steps))[0]]
    if not culprits or len(culprits) >= t.run_wide_frac * len(rs.ranks):
        return []
    peers = np.setdiff1d(np.arange(len(rs.ranks)), culprits)
    out = []
    for i in culprits:
        if skip and int(rs.ranks[i]) in skip:
            continue
        # The flagged steps among the rank's recent ones: the window holds a few more (recent_steps + 3) so a
        # steps_flagged of "11/8" cannot happen, and the evidence's medians describe the steps that decided.
        recent_cols = np.nonzero(present[i])[0][-t.recent_steps:]
        cols = recent_cols[flags[i, recent_cols]]
        dbase = nanmedian(data[peers][:, cols], axis=0) if len(peers) else dmed[0, cols]
        cbase = nanmedian(comp[peers][:, cols], axis=0) if len(peers) else cmed[0, cols]
        ddata = float(np.nansum(data[i, cols] - dbase))
        dcomp = float(np.nansum(comp[i, cols] - cbase))
        z = float(np.nanmax(np.nan_to_num(np.vstack([lz[i, cols], dz[i, cols], cz[i, cols], dlz[i, cols],
                                                     clz[i, cols]]), nan=0)))
        kind = "data_starvation" if ddata >= dcomp else "straggler"
        build = _starved_rank if kind == "data_starvation" else _straggler_rank
        d = build(w, rs, i, cols, z, t, peers)
        if len(culprits) > 1:  # the set, so a person sees "the ranks of node-002" at once
            d.evidence["metrics"]["co_culprits"] = [
                {"rank": int(rs.ranks[j]), "node": (rs.run.ranks.get(int(rs.ranks[j])) or _NO_RANK).node}
                for j in culprits if j != i][:32]
            d.evidence["metrics"]["culprits"] = f"{len(culprits)}/{len(rs.ranks)}"
        out.append(d)
    return out


def _rank_subject(run: str, rank: int) -> str:
    return f"{run}/rank{rank}"


def _series(rs: RunSteps, i: int, col: str) -> dict[str, Any]:
    med = nanmedian(rs.m[col], axis=0)
    return {"step": rs.steps.astype(int).tolist(), "rank": [rnd(v) for v in rs.m[col][i]],
            "median": [rnd(v) for v in med]}


def _window(rs: RunSteps) -> list[float]:
    ts = rs.m["ts"]
    return [rnd(np.nanmin(ts - rs.m["step_time_s"]), 3), rnd(np.nanmax(ts), 3)]


def _confidence(z: float, flagged: int, recent: int) -> float:
    return round(min(0.99, 0.55 + 0.05 * min(z, 8.0)) * min(1.0, 0.6 + 0.1 * flagged), 2) if recent else 0.5


def _others(rs: RunSteps, col: str, cols: np.ndarray, peers: np.ndarray | None) -> float:
    """The median of the ranks that are not culprits (all ranks when there is no such set)."""
    mat = rs.m[col][peers] if peers is not None and len(peers) else rs.m[col]
    return float(np.nanmedian(mat[:, cols]))


def _starved_rank(w: Window, rs: RunSteps, i: int, cols: np.ndarray, z: float, t: Thresholds,
                  peers: np.ndarray | None = None) -> Detection:
    rank = int(rs.ranks[i])
    info = rs.run.ranks.get(rank)
    data, step = rs.m["data_wait_s"][i, cols], rs.m["step_time_s"][i, cols]
    share = float(np.nanmedian(data / step))
    others = _others(rs, "data_wait_s", cols, peers)
    metrics: dict[str, Any] = {"data_wait_s": rnd(np.nanmedian(data)), "data_wait_share": rnd(share),
                               "median_data_wait_s": rnd(others), "z": rnd(z, 1),
                               "steps_flagged": f"{len(cols)}/{min(t.recent_steps, rs.m['ts'].shape[1])}"}
    dl = (info.meta.get("dataloader") or {}) if info else {}
    nfs = _nfs_for(w, info.node if info else None, dl.get("dataset_path"))
    cpu = (w.hosts.get(info.node) or {}).get("cpu_pct") if info and info.node else None
    metrics.update({"dataloader": dl or None, "nfs": nfs, "host_cpu_pct": rnd(cpu, 1)})
    sev = "error" if share >= 0.25 else "warning"
    return Detection(
        "data_starvation", "rank", _rank_subject(rs.run.name, rank), sev,
        f"Rank {rank} waits {share:.0%} of each step for data ({np.nanmedian(data) * 1e3:.0f} ms; the other ranks "
        f"{others * 1e3:.0f} ms)",
        _starvation_action(rank, share, dl, nfs, cpu),
        {"metrics": metrics, "window": _window(rs), "series": {"data_wait_s": _series(rs, i, "data_wait_s")}},
        _confidence(z, len(cols), t.recent_steps), node=info.node if info else None,
        gpu_index=info.gpu if info else None, rank=rank, run=rs.run.name)


def _nfs_for(w: Window, host: str | None, path: str | None) -> dict[str, Any] | None:
    mounts = (w.hosts.get(host) or {}).get("nfs") or [] if host else []
    best = None
    for m in mounts:
        mp = m.get("mount") or ""
        if path and path.startswith(mp.rstrip("/") + "/") and (best is None or len(mp) > len(best["mount"])):
            best = m
    return {"mount": best["mount"], "rtt_ms": rnd(best.get("rtt_ms"), 2), "exe_ms": rnd(best.get("exe_ms"), 2)} \
        if best else None


def _starvation_action(rank: int, share: float, dl: dict[str, Any], nfs: dict[str, Any] | None,
                       cpu: float | None) -> str:
    facts, todo = [], []
    nw = dl.get("num_workers")
    if nw is not None:
        facts.append(f"num_workers={nw}")
        if nw < 8:
            todo.append(f"raise num_workers (now {nw}) toward the CPU cores per GPU")
    if dl.get("pin_memory") is False:
        facts.append("pin_memory=False")
        todo.append("set pin_memory=True")
    if dl.get("persistent_workers") is False and nw:
        todo.append("set persistent_workers=True so workers survive each epoch")
    if dl.get("prefetch_factor") is not None and dl["prefetch_factor"] < 4:
        facts.append(f"prefetch_factor={dl['prefetch_factor']}")
        todo.append("raise prefetch_factor")
    if nfs is not None:
        facts.append(f"dataset on NFS mount {nfs['mount']} with {nfs['rtt_ms']} ms RTT")
        if (nfs.get("rtt_ms") or 0) >= 5:
            todo.append("stage the data on local NVMe (the NFS server is slow)")
        else:
            todo.append("consider staging the data on local NVMe")
    if cpu is not None and cpu >= 90:
        facts.append(f"host CPU {cpu:.0f}% busy")
        todo.append("free CPU on the node (other processes compete with the loader workers)")
    if not todo:
        todo.append("profile the input pipeline of this rank (decode, augmentation, storage) and compare its "
                    "node with the others")
    head = f"Rank {rank} waits {share:.0%} of each step for data"
    return f"{head}; {', '.join(facts)} → {'; '.join(todo)}." if facts else f"{head} → {'; '.join(todo)}."


def _straggler_rank(w: Window, rs: RunSteps, i: int, cols: np.ndarray, z: float, t: Thresholds,
                    peers: np.ndarray | None = None) -> Detection:
    rank = int(rs.ranks[i])
    info = rs.run.ranks.get(rank)
    comp = rs.m["compute_s"][i, cols]
    med = _others(rs, "compute_s", cols, peers)
    slower = float(np.nanmedian(comp)) / med - 1 if med > 0 else float("nan")
    gpu = gpu_state(w, info.node, info.gpu) if info and info.node is not None and info.gpu is not None else None
    metrics = {"compute_s": rnd(np.nanmedian(comp)), "median_compute_s": rnd(med), "slower_frac": rnd(slower),
               "z": rnd(z, 1), "gpu": gpu, "steps_flagged": len(cols)}
    where = f" on {info.node} GPU {info.gpu}" if info and info.node is not None and info.gpu is not None else ""
    title = (f"Rank {rank}{where} computes {slower:.0%} slower than the other ranks"
             if np.isfinite(slower) and slower > 0 else f"Rank {rank}{where} arrives late at every all-reduce")
    return Detection(
        "straggler", "rank", _rank_subject(rs.run.name, rank), "error" if slower >= 0.2 else "warning", title,
        _straggler_action(rank, gpu),
        {"metrics": metrics, "window": _window(rs), "series": {"compute_s": _series(rs, i, "compute_s"),
                                                                "comm_arrive_s": _series(rs, i, "comm_arrive_s")}},
        _confidence(z, len(cols), t.recent_steps), node=info.node if info else None,
        gpu_index=info.gpu if info else None, rank=rank, run=rs.run.name)


def _straggler_action(rank: int, gpu: dict[str, Any] | None) -> str:
    if gpu and gpu.get("reasons"):
        reasons = set(gpu["reasons"])
        why = f"its GPU runs at {gpu['clock_ratio']:.0%} of max SM clock ({', '.join(sorted(reasons))}"
        why += f", {gpu['temp_c']:.0f} °C)" if gpu.get("temp_c") is not None else ")"
        if any("thermal" in r for r in reasons):
            fix = "check the node's cooling (fans, inlet temperature, blocked airflow) and drain it if it stays hot"
        elif any("power" in r for r in reasons):
            fix = "check the power cap (nvidia-smi -q -d POWER) and the PSU/rack power budget"
        else:
            fix = "check clocks and application clock settings on that GPU"
        return f"Rank {rank} is the straggler: {why} → {fix}; every other rank waits for it in each all-reduce."
    if gpu and gpu.get("clock_ratio") is not None and gpu["clock_ratio"] < 0.9:
        return (f"Rank {rank} is the straggler: its GPU runs at {gpu['clock_ratio']:.0%} of max SM clock without a "
                "throttle reason → check application clocks (nvidia-smi -q -d CLOCK) and reset them.")
    return (f"Rank {rank} is the straggler and its GPU looks healthy → look for CPU contention or another process "
            "on that GPU (nvidia-smi), an unbalanced shard of the data, or a slower GPU model on that node.")


def _run_starved(w: Window, rs: RunSteps, t: Thresholds) -> list[Detection]:
    """Run-wide only when nearly every rank starves (the share that ``run_wide_frac`` of the ranks reach): the mean
    or median of two starving and two idle ranks is a number no rank has."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # steps without a data wait: all-NaN columns
        shares = rs.m["data_wait_s"] / rs.m["step_time_s"]
        cols = SortedColumns(shares)
        share = cols.median()[np.newaxis, :]
        most = cols.percentile(100 * (1 - t.run_wide_frac))[np.newaxis, :]
    present = ~np.isnan(share)
    if not _persistent(np.nan_to_num(most >= t.run_starved_share, nan=0).astype(bool), present,
                       t.recent_steps, t.persist_steps)[0]:
        return []
    s = float(np.nanmedian(share[0, -t.recent_steps:]))
    dl = next((r.meta.get("dataloader") for r in rs.run.ranks.values() if r.meta.get("dataloader")), {}) or {}
    any_node = next((r.node for r in rs.run.ranks.values() if r.node), None)
    nfs = _nfs_for(w, any_node, dl.get("dataset_path"))
    return [Detection(
        "data_starvation", "run", rs.run.name, "error" if s >= 0.3 else "warning",
        f"Every rank of {rs.run.name} waits {s:.0%} of each step for data",
        _starvation_action(-1, s, dl, nfs, None).replace("Rank -1", "Every rank"),
        {"metrics": {"data_wait_share": rnd(s), "dataloader": dl or None, "nfs": nfs}, "window": _window(rs),
         "series": {"data_wait_share": {"step": rs.steps.astype(int).tolist(), "median": [rnd(v) for v in share[0]]}}},
        0.9, run=rs.run.name)]


# -- memory ----------------------------------------------------------------------------------------------------

def memory_pressure(w: Window, t: Thresholds) -> list[Detection]:
    out = []
    for ri, run in enumerate(w.runs):
        rs = run_steps(w, ri, ("mem_allocated_bytes", "mem_reserved_bytes", "mem_total_bytes"), t.recent_steps)
        if rs is None:
            continue
        with np.errstate(all="ignore"):
            frac = rs.m["mem_allocated_bytes"] / rs.m["mem_total_bytes"]
            reserved = rs.m["mem_reserved_bytes"] / rs.m["mem_total_bytes"]
        present = ~np.isnan(frac)
        # Reserved at the very top is near-OOM too: the next allocation that does not fit a cached block fails.
        near = (frac >= t.mem_warn) | (reserved >= t.mem_reserved_full)
        hot = _persistent(np.nan_to_num(near, nan=0).astype(bool), present, t.recent_steps, t.persist_steps)
        for i in np.nonzero(hot)[0]:
            rank = int(rs.ranks[i])
            info = run.ranks.get(rank)
            last = int(np.nonzero(present[i])[0][-1])
            f, res = float(frac[i, last]), rs.m["mem_reserved_bytes"][i, last] / rs.m["mem_total_bytes"][i, last]
            gib = rs.m["mem_total_bytes"][i, last] / 2**30
            layout = (info.meta.get("layout") if info else None) or {}
            out.append(Detection(
                "memory_pressure", "rank", _rank_subject(run.name, rank), "error" if f >= t.mem_error else "warning",
                f"Rank {rank} holds {max(f, res):.0%} of its GPU's memory ({gib:.0f} GiB): near out-of-memory",
                f"Rank {rank} has {f:.0%} allocated and {res:.0%} reserved → {memory_advice(layout)}; or set "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation; if it keeps growing step "
                "after step, look for tensors kept across steps (a leak).",
                {"metrics": {"allocated_frac": rnd(f), "reserved_frac": rnd(res), "layout": layout or None},
                 "window": _window(rs),
                 "series": {"allocated_frac": {"step": rs.steps.astype(int).tolist(),
                                               "rank": [rnd(v) for v in frac[i]]}}},
                0.95, node=info.node if info else None, gpu_index=info.gpu if info else None, rank=rank, run=run.name))
    return out


def memory_advice(layout: dict[str, Any]) -> str:
    """What frees memory that the run's layout does not use yet, cheapest first (an unknown layout gets them all)."""
    todo = []
    if not layout.get("activation_checkpointing"):
        todo.append("enable activation checkpointing (recompute activations in the backward pass)")
    mb, ga = layout.get("micro_batch"), layout.get("grad_accum") or 1
    if mb is None or mb > 1:
        todo.append(f"halve the micro-batch ({mb}→{mb // 2}) and double gradient accumulation ({ga}→{2 * ga}): "
                    "the same global batch" if mb else "a smaller micro-batch with more gradient accumulation")
    zero = layout.get("zero_stage")
    if zero is None or zero < 3:
        now = f" (now stage {zero})" if zero is not None else ""
        todo.append(f"shard parameters, gradients and optimizer state: ZeRO-3 / FSDP FULL_SHARD{now}")
    if not layout.get("offload"):
        todo.append("offload optimizer state (and parameters) to the CPU")
    return "; ".join(todo) if todo else "the layout already uses checkpointing, ZeRO-3 and offload: reduce the " \
        "sequence length or the model per GPU (more tensor / pipeline parallelism)"


# -- hang --------------------------------------------------------------------------------------------------------

def hang(w: Window, t: Thresholds, alive_within_s: float, excused: dict[str, str]) -> list[Detection]:
    """``excused``: run name -> the root cause already found for its stall (a dead node, a lost GPU). With the
    ranks' beats, the rank that stopped the run is named (``rank_down``, or a ``hang`` on a rank stuck in its
    input pipeline); without them, the run."""
    out = []
    for ri, run in enumerate(w.runs):
        if run.name in excused or run.last_step_ts is None:
            continue
        rs = run_steps(w, ri, (), 16)
        watchdog = [e for e in w.events if e["run"] == run.name and _is_watchdog(e)]
        med = rs.step_med if rs is not None else float("nan")
        stalled = w.now - run.last_step_ts
        nodes = run_nodes(run)
        # Steps are judged by their sample times, the ranks' beats by when they arrived: behind a server that receives
        # late, a run steps on while its newest stored step ages. The run's last step is as fresh as its freshest
        # node's batches, so the least of its nodes' arrival delays is time it may not have stepped in yet.
        waited = stalled - min((arrival_slack(w, t, h) for h in nodes), default=0.0)
        limit = max(t.hang_steps * med, t.hang_min_s) if np.isfinite(med) else float("inf")
        if stalled >= 3600 or (not watchdog and waited < min(limit, t.beat_suspect_s)):
            continue
        silent = [h for h in nodes if w.now - w.last_heard.get(h, -1e18) > alive_within_s]
        if silent and not watchdog:
            continue  # the node-down detector speaks for a run whose agents are not all alive
        v = ranks.verdict(w, run, t, waited, med, limit, alive_within_s)
        if v.culprits:
            out += ranks.findings(w, run, v, stalled, med)
            continue
        if v.what in ("finished", "wait") or (v.what == "none" and _finished(w, run)):
            continue
        if watchdog or waited >= limit:
            out.append(_hang_detection(w, run, rs, stalled, med, watchdog, v))
    return out


def _is_watchdog(e: dict[str, Any]) -> bool:
    return e["kind"] == "watchdog" or (e["kind"] == "error" and "watchdog" in (e.get("message") or "").lower())


def _finished(w: Window, run: RunInfo) -> bool:
    """Without beats: a run that ended cleanly stops stepping too: its GPUs go idle (a hung collective keeps them
    busy), or its hooks said so."""
    if any(e["kind"] == "hook" and e["run"] == run.name and (e.get("data") or {}).get("state") == "finished"
           for e in w.events):
        return True
    util = []
    g = w.gpus
    recent = g["ts"] >= w.now - 5
    for info in run.ranks.values():
        if info.node is None or info.gpu is None:
            continue
        util.append(g["util_gpu_pct"][recent & (g["gpu"] == info.gpu) & (g["node"] == w.nodes.index(info.node))]
                    if info.node in w.nodes else np.empty(0))
    vals = np.concatenate(util) if util else np.empty(0)
    vals = vals[~np.isnan(vals)]
    return len(vals) > 0 and float(np.median(vals)) < 10.0


def _hang_detection(w: Window, run: RunInfo, rs: RunSteps | None, stalled: float, med: float,
                    watchdog: list[dict[str, Any]], v: ranks.Verdict) -> Detection:
    behind: list[int] = []
    if rs is not None:
        last = np.array([np.nanmax(np.where(np.isnan(rs.m["ts"][i]), np.nan, rs.steps)) for i in range(len(rs.ranks))])
        top = np.nanmax(last)
        lag = rs.ranks[last < top]
        if 0 < len(lag) <= max(1, len(rs.ranks) // 2):
            behind = [int(r) for r in lag]
    subject, stype, rank = run.name, "run", None
    if len(behind) == 1 and v.what == "none":  # beats, when there are any, say every rank is alive and stuck
        subject, stype, rank = _rank_subject(run.name, behind[0]), "rank", behind[0]
    who = f"rank {behind[0]} stopped first" if rank is not None else "no rank makes progress"
    if v.beats:
        who += " (beats: " + ", ".join(f"{n} {s}" for s, n in sorted(v.states().items())) + ")"
    cause = f"; watchdog: {watchdog[-1]['message'][:200]}" if watchdog else ""
    action = (f"The run has made no step for {stalled:.0f} s ({stalled / med:.0f}× its median step) although every "
              f"agent is alive: {who}{cause} → dump the stacks of the ranks (py-spy dump --pid, or "
              "TORCH_NCCL_DUMP_ON_TIMEOUT=1), look for a rank stuck outside the collective, then restart from the "
              "last checkpoint." if np.isfinite(med) and med > 0 else f"Watchdog timeout{cause} → restart from the "
              "last checkpoint after finding the rank that did not join the collective.")
    info = run.ranks.get(rank) if rank is not None else None
    return Detection(
        "hang", stype, subject, "critical",
        f"{run.name} is hung: no step for {stalled:.0f} s" + (f" (rank {rank} behind)" if rank is not None else ""),
        action, {"metrics": {"stalled_s": rnd(stalled, 1), "median_step_s": rnd(med), "last_step": run.last_step,
                             "ranks_behind": behind[:64], "watchdog_events": len(watchdog),
                             "beats": v.states() or None},
                 "window": [rnd(run.last_step_ts), rnd(w.now)]},
        0.95 if watchdog else 0.85, node=info.node if info else None, rank=rank, run=run.name)


# -- checkpoints ---------------------------------------------------------------------------------------------------

def checkpoint_risk(w: Window, t: Thresholds) -> list[Detection]:
    out = []
    for run in w.runs:
        if run.last_step is None or run.last_step_ts is None or w.now - run.last_step_ts > 60:
            continue  # only runs that are stepping: a hung run is the hang detector's, a finished one nobody's
        ckpts = _checkpoints(run)
        if not ckpts:
            continue
        last_ts, last_step = ckpts[-1]
        steps = [s for _, s in ckpts]
        cadence = float(np.median(np.diff(steps[-4:]))) if len(steps) >= 2 else None
        if cadence is not None and cadence > 0:
            slack = max(t.ckpt_slack_steps, t.ckpt_slack_frac * cadence)
            overdue = run.last_step - last_step > cadence + slack
        else:
            overdue = w.now - last_ts > t.ckpt_max_age_s
        if overdue:
            out.append(_checkpoint_detection(w, run, last_ts, last_step, cadence, t))
    return out


def _checkpoints(run: RunInfo) -> list[tuple[float, int]]:
    seen: dict[int, float] = {}
    for ts, step in run.checkpoints:
        seen[step] = max(seen.get(step, 0.0), ts)
    step, ts = run.meta.get("last_checkpoint_step"), run.meta.get("last_checkpoint_ts")
    if step is not None and ts is not None and step > 0:
        seen[int(step)] = max(seen.get(int(step), 0.0), float(ts))
    return sorted((ts, s) for s, ts in seen.items())


def _checkpoint_detection(w: Window, run: RunInfo, last_ts: float, last_step: int, cadence: float | None,
                          t: Thresholds) -> Detection:
    gpus = run.world_size or len(run.ranks) or 1
    age = w.now - last_ts
    gpu_h = gpus * age / 3600
    usd = gpu_h * t.gpu_hour_usd
    since = (run.last_step or 0) - last_step
    sev = "error" if cadence and since > 2 * cadence else "warning"
    every = f"every {cadence:.0f} steps until now" if cadence else f"none for {age / 60:.0f} min"
    return Detection(
        "checkpoint_overdue", "run", run.name, sev,
        f"{run.name}: no checkpoint for {since} steps ({age / 60:.1f} min); {gpu_h:.1f} GPU-hours (${usd:,.0f}) at risk",
        f"The last checkpoint was at step {last_step} ({every}); a crash now loses {gpu_h:.1f} GPU-hours "
        f"(${usd:,.0f} at ${t.gpu_hour_usd}/GPU-hour) → check the checkpoint writer (disk full, permissions, a "
        "failing save that the loop swallows) and save one now.",
        {"metrics": {"last_checkpoint_step": last_step, "last_checkpoint_ts": rnd(last_ts), "steps_since": since,
                     "cadence_steps": rnd(cadence, 1), "gpu_hours_at_risk": rnd(gpu_h, 2), "usd_at_risk": rnd(usd, 2),
                     "gpus": gpus, "gpu_hour_usd": t.gpu_hour_usd},
         "window": [rnd(last_ts), rnd(w.now)]}, 0.9, run=run.name)


# -- efficiency ----------------------------------------------------------------------------------------------------

def efficiency_of(step_s: np.ndarray, tokens: np.ndarray, begin: np.ndarray, end: np.ndarray, now: np.ndarray,
                  meta: dict[str, Any], gpus: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tokens/s, MFU and goodput of windows of steps, one window per row (NaN pads a shorter one): each step's time,
    its tokens (all ranks), when it began and ended; ``now``: each window's present. MFU needs the run's
    flops_per_token and peak_flops (NaN without them); goodput is the steps' time over the wall time they span. One
    row is a pass's figure (:func:`efficiency_figures`); the run page asks for one per bucket of a whole run."""
    with np.errstate(all="ignore"):
        total_s = np.nansum(step_s, axis=1)
        tps = np.where(total_s > 0, np.nansum(tokens, axis=1) / total_s, np.nan)
        fpt, peak = meta.get("flops_per_token"), meta.get("peak_flops")
        mfu = np.where(tps > 0, tps * fpt / (peak * gpus), np.nan) if fpt and peak and gpus else np.full(len(tps), np.nan)
        span = np.fmax(now, np.nanmax(end, axis=1)) - np.nanmin(begin, axis=1)
        goodput = np.where(span > 0, np.minimum(1.0, total_s / span), np.nan)
    return tps, mfu, goodput


def efficiency_figures(w: Window, run_index: int) -> dict[str, Any] | None:
    """tokens/s, MFU (from flops_per_token and peak_flops in the run's metadata) and goodput over the window."""
    run = w.runs[run_index]
    rs = run_steps(w, run_index, ("tokens",), 16)
    if rs is None:
        return None
    with np.errstate(all="ignore"):
        per_step = (nanmedian(rs.m["step_time_s"], axis=0), np.nansum(rs.m["tokens"], axis=0),
                    np.nanmin(rs.m["ts"] - rs.m["step_time_s"], axis=0), np.nanmax(rs.m["ts"], axis=0))
    tps, mfu, goodput = efficiency_of(*(v[None, :] for v in per_step), np.array([w.now]), run.meta,
                                      run.world_size or len(rs.ranks))
    return {"tokens_per_s": rnd(tps[0], 1), "mfu": rnd(mfu[0], 4), "goodput": rnd(goodput[0], 3),
            "median_step_s": rnd(rs.step_med), "steps": len(rs.steps), "ranks": len(rs.ranks)}


def efficiency(w: Window, t: Thresholds) -> list[Detection]:
    out = []
    for ri, run in enumerate(w.runs):
        fig = efficiency_figures(w, ri)
        if not fig or fig["mfu"] is None or t.mfu_floor <= 0 or fig["mfu"] >= t.mfu_floor:
            continue
        # MFU divides the tokens of the ranks seen by the whole world's peak: while a run starts (or its nodes post
        # every few seconds and most have not yet) the window holds a fraction of the world, and that fraction is not
        # a slow run. (At 2,048 nodes a pass early in the run saw 2,167 of 16,384 ranks: "1.7% MFU" of a run at 12.7%.)
        if run.world_size and fig["ranks"] < 0.9 * run.world_size:
            continue
        out.append(Detection(
            "efficiency", "run", run.name, "info", f"{run.name} runs at {fig['mfu']:.1%} MFU",
            f"Model FLOPs utilisation is {fig['mfu']:.1%} ({fig['tokens_per_s']} tokens/s) → check the other "
            "findings first; then the micro-batch size, mixed precision, and compiled kernels (torch.compile).",
            {"metrics": fig}, 0.7, run=run.name))
    return out
