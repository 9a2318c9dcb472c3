"""GPU detectors: failing GPU (ECC, remaps, Xid, PCIe, NVLink, fallen off the bus) and thermal / power throttling."""

from __future__ import annotations

from typing import Any

import numpy as np

from collectors.xid import describe_xid
from dashboard.diagnosis.detectors.base import SEVERITY_RANK, Detection, Thresholds, rnd
from dashboard.diagnosis.detectors.window import Table, Window, bus_key

SLOWDOWN = {"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
XID_IGNORED_CLASSES = {"info"}  # severities of Xids that are traces of something else (45: a process was stopped)


def gpu_subject(host: str, gpu: int) -> str:
    return f"{host}/gpu{gpu}"


def _per_gpu(g: Table, only: np.ndarray | None = None) -> dict[float, np.ndarray]:
    """(node * 4096 + gpu) -> row indices sorted by time (only the GPUs with a key in ``only``, when given)."""
    key = g["node"] * 4096 + g["gpu"]
    # Only the wanted GPUs' rows are sorted (a handful of suspects, not 340,000 rows at 2,048 nodes); the sort is
    # stable, so the order is the one sorting every row and keeping theirs gave.
    rows = np.arange(len(key)) if only is None else np.nonzero(np.isin(key, only))[0]
    order = rows[np.lexsort((g["ts"][rows], key[rows]))]
    ks = key[order]
    cuts = np.nonzero(np.diff(ks))[0] + 1
    return {float(k[0]): part for k, part in zip(np.split(ks, cuts), np.split(order, cuts), strict=True) if len(k)}


def _suspects(g: Table, t: Thresholds) -> np.ndarray:
    """Keys of GPUs with any sign of trouble, found with a few vectorised group reductions, so the detailed checks
    run on a handful of GPUs instead of thousands."""
    if not len(g):
        return np.empty(0)
    key = g["node"] * 4096 + g["gpu"]
    order = np.lexsort((g["ts"], key))
    ks = key[order]
    starts = np.r_[0, np.nonzero(np.diff(ks))[0] + 1]

    def spread(col: str) -> np.ndarray:
        v = g[col][order]
        with np.errstate(all="ignore"):
            return np.nan_to_num(np.fmax.reduceat(v, starts) - np.fmin.reduceat(v, starts), nan=0)

    def top(col: str) -> np.ndarray:
        return np.nan_to_num(np.fmax.reduceat(g[col][order], starts), nan=0)

    with np.errstate(all="ignore"):
        rowflag = ((g["nvlink_links_up"] < g["nvlink_links_total"]) | (g["pcie_gen"] < g["pcie_gen_max"])
                   | (g["pcie_width"] < g["pcie_width_max"]) | np.isnan(g["util_gpu_pct"])
                   | np.not_equal(g["unavailable"], None).astype(bool))[order]
    suspect = (spread("ecc_sbe_volatile") > 0) | (top("ecc_dbe_volatile") > 0) | (top("remap_failure") > 0) \
        | (top("remap_pending") > 0) | (top("retired_pages_pending") > 0) \
        | (spread("pcie_replay_total") >= t.pcie_replay_min) | (spread("nvlink_crc_errors_total") > 0) \
        | (spread("nvlink_replay_errors_total") > 0) | (spread("nvlink_recovery_errors_total") > 0) \
        | (np.maximum.reduceat(rowflag.astype(int), starts) > 0)
    return ks[starts][suspect]


def gpu_state(w: Window, host: str, gpu: int) -> dict[str, Any] | None:
    """The newest sample of one GPU, as evidence: clocks vs max, throttle reasons, temperature, power."""
    if host not in w.nodes:
        return None
    g = w.gpus
    rows = np.nonzero((g["node"] == w.nodes.index(host)) & (g["gpu"] == gpu))[0]
    if len(rows) == 0:
        return None
    i = rows[np.argmax(g["ts"][rows])]
    clock, top = g["sm_clock_mhz"][i], g["sm_clock_max_mhz"][i]
    reasons = [r for r in (g["throttle_reasons"][i] or []) if r in SLOWDOWN]
    return {"sm_clock_mhz": rnd(clock, 0), "sm_clock_max_mhz": rnd(top, 0),
            "clock_ratio": rnd(clock / top if top and top > 0 else None), "reasons": reasons,
            "temp_c": rnd(g["temp_c"][i], 1), "power_w": rnd(g["power_w"][i], 0),
            "power_limit_w": rnd(g["power_limit_w"][i], 0), "util_gpu_pct": rnd(g["util_gpu_pct"][i], 0)}


def _delta(v: np.ndarray) -> tuple[float, int]:
    """(increase over the window, how many samples increased) of a cumulative counter (NaN rows skipped)."""
    v = v[~np.isnan(v)]
    if len(v) < 2:
        return 0.0, 0
    d = np.diff(v)
    return float(np.sum(d[d > 0])), int(np.sum(d > 0))


def _last(v: np.ndarray) -> float:
    v = v[~np.isnan(v)]
    return float(v[-1]) if len(v) else float("nan")


# -- failing GPU ---------------------------------------------------------------------------------------------------

def failing_gpus(w: Window, t: Thresholds) -> list[Detection]:
    problems: dict[tuple[str, int], list[tuple[str, str, str, dict[str, Any]]]] = {}  # -> (severity, what, action, m)
    g = w.gpus
    for key, idx in _per_gpu(g, _suspects(g, t)).items():
        host, gpu = w.nodes[int(key // 4096)], int(key % 4096)
        for p in _counter_problems(g, idx, t):
            problems.setdefault((host, gpu), []).append(p)
    for host, gpu, p in _xid_problems(w):
        problems.setdefault((host, gpu), []).append(p)
    out = []
    for (host, gpu), found in problems.items():
        found.sort(key=lambda p: -SEVERITY_RANK[p[0]])
        sev, what, action, _ = found[0]
        metrics: dict[str, Any] = {}
        for p in found:
            metrics.update(p[3])
        out.append(Detection(
            "failing_gpu", "gpu", gpu_subject(host, gpu), sev, f"{host} GPU {gpu}: {what}",
            action + (" Also: " + "; ".join(p[1] for p in found[1:]) + "." if len(found) > 1 else ""),
            {"metrics": metrics, "window": [rnd(w.now - w.span.get("gpus", 0)), rnd(w.now)],
             "problems": [p[1] for p in found]},
            0.97, node=host, gpu_index=gpu))
    return out


def _counter_problems(g: Table, idx: np.ndarray, t: Thresholds) -> list[tuple[str, str, str, dict[str, Any]]]:
    out = []
    sbe, sbe_n = _delta(g["ecc_sbe_volatile"][idx])
    dbe = _last(g["ecc_dbe_volatile"][idx])
    if dbe > 0:
        out.append(("critical", f"{dbe:.0f} uncorrectable (double-bit) ECC error(s)",
                    "Stop the GPU's jobs and reset it so the bad row is remapped; RMA it if errors recur.",
                    {"ecc_dbe_volatile": dbe}))
    if sbe >= t.sbe_min and sbe_n >= t.sbe_samples:
        span = float(np.nanmax(g["ts"][idx]) - np.nanmin(g["ts"][idx])) or 1.0
        out.append(("warning", f"corrected ECC errors climbing ({sbe:.0f} in {span:.0f} s)",
                    "The GPU's memory is degrading: drain it at the next checkpoint and run the vendor memory test; "
                    "expect an uncorrectable error next.", {"ecc_sbe_delta": sbe, "ecc_sbe_per_s": rnd(sbe / span, 2)}))
    if _last(g["remap_failure"][idx]) == 1:
        out.append(("critical", "row remapping failed", "The GPU has no spare rows left: RMA it.",
                    {"remap_failure": True}))
    if _last(g["remap_pending"][idx]) == 1 or _last(g["retired_pages_pending"][idx]) == 1:
        out.append(("error", "a memory row remap / page retirement is pending",
                    "Reset the GPU at the next safe point (nvidia-smi -r) so the pending remap takes effect.",
                    {"remap_pending": True}))
    replay, _ = _delta(g["pcie_replay_total"][idx])
    if replay >= t.pcie_replay_min:
        out.append(("warning", f"{replay:.0f} PCIe replays", "Reseat the GPU or its riser and check the slot; "
                    "PCIe replays slow host-device copies and precede the GPU falling off the bus.",
                    {"pcie_replays": replay}))
    out += _link_problems(g, idx, t)
    lost = _lost(g, idx)
    if lost:
        out.append(("critical", lost, "Drain the node and reboot it; if the GPU does not come back, check PCIe "
                    "seating, power and cooling, then RMA.", {"lost": True}))
    return out


def _link_problems(g: Table, idx: np.ndarray, t: Thresholds) -> list[tuple[str, str, str, dict[str, Any]]]:
    out = []
    busy = g["util_gpu_pct"][idx] >= t.busy_util_pct
    narrow = busy & ((g["pcie_gen"][idx] < g["pcie_gen_max"][idx]) | (g["pcie_width"][idx] < g["pcie_width_max"][idx]))
    if narrow.sum() >= 3:  # links drop speed at idle to save power; only a busy GPU's link speed means anything
        i = idx[np.nonzero(narrow)[0][-1]]
        out.append(("warning", f"PCIe link downtrained to Gen{g['pcie_gen'][i]:.0f} x{g['pcie_width'][i]:.0f} "
                    f"(max Gen{g['pcie_gen_max'][i]:.0f} x{g['pcie_width_max'][i]:.0f})",
                    "Reseat the GPU / riser and check the slot and BIOS PCIe settings.",
                    {"pcie_gen": g["pcie_gen"][i], "pcie_width": g["pcie_width"][i]}))
    up, total = g["nvlink_links_up"][idx], g["nvlink_links_total"][idx]
    down = (up < total)
    if down.sum() >= 3:
        i = idx[np.nonzero(down)[0][-1]]
        out.append(("error", f"{total[np.nonzero(down)[0][-1]] - up[np.nonzero(down)[0][-1]]:.0f} NVLink link(s) down",
                    "Reset the GPU (or the node with its NVSwitches) and run the fabric diagnostics; RMA the "
                    "baseboard if the link stays down.", {"nvlink_links_up": g["nvlink_links_up"][i]}))
    errs = sum(_delta(g[c][idx])[0] for c in ("nvlink_crc_errors_total", "nvlink_replay_errors_total",
                                              "nvlink_recovery_errors_total"))
    if errs >= t.nvlink_errors_min:
        out.append(("warning", f"{errs:.0f} NVLink errors", "Watch the link; repeated NVLink errors on the same link "
                    "mean a bad link or baseboard: run the fabric diagnostics.", {"nvlink_errors": errs}))
    return out


def _lost(g: Table, idx: np.ndarray) -> str | None:
    last = idx[-1]
    why = g["unavailable"][last] or {}
    if any("lost" in str(v).lower() or "fallen off" in str(v).lower() for v in why.values()):
        return "fallen off the bus (the driver lost it)"
    util = g["util_gpu_pct"][idx]
    if np.isnan(util[-3:]).all() and len(util) >= 6 and (~np.isnan(util[:-3])).sum() >= 3:
        return "stopped reporting (NVML returns nothing for it)"
    return None


def _xid_problems(w: Window) -> list[tuple[str, int, tuple[str, str, str, dict[str, Any]]]]:
    out = []
    for e in w.events:
        if e["kind"] != "xid" or e.get("code") is None or not e.get("node"):
            continue
        gpu = e.get("gpu_index")
        if gpu is None:
            gpu = w.gpu_bus.get((e["node"], bus_key(e.get("pci_bus_id")) or ""))
        if gpu is None:
            continue
        info = describe_xid(int(e["code"]))
        if info.severity in XID_IGNORED_CLASSES:
            continue
        what = f"Xid {info.code} ({info.meaning})"
        if info.cls == "app":
            what += "; usually the program, not the GPU"
        out.append((e["node"], int(gpu), (info.severity, what, info.action,
                                          {"xid": info.code, "xid_name": info.name, "xid_class": info.cls,
                                           "xid_ts": rnd(e["ts"])})))
    return out


# -- throttling ----------------------------------------------------------------------------------------------------

def throttling(w: Window, t: Thresholds, rank_gpus: set[tuple[str, int]]) -> list[Detection]:
    """A GPU held under clock_ratio of its max SM clock by a thermal or power reason, for throttle_s (longer when
    a rank runs on it, so the straggler detector names the slow rank first)."""
    g = w.gpus
    out = []
    with np.errstate(all="ignore"):
        slow = g["sm_clock_mhz"] < t.clock_ratio * g["sm_clock_max_mhz"]
    for key, idx in _per_gpu(g, np.unique((g["node"] * 4096 + g["gpu"])[slow])).items():
        host, gpu = w.nodes[int(key // 4096)], int(key % 4096)
        need = t.throttle_with_rank_s if (host, gpu) in rank_gpus else t.throttle_s
        ts = g["ts"][idx]
        rec = idx[ts >= ts[-1] - need]
        if len(rec) < 3 or g["ts"][rec[0]] > ts[-1] - need + 1.5:
            continue
        ratio = g["sm_clock_mhz"][rec] / g["sm_clock_max_mhz"][rec]
        reasons = [set(r or []) & SLOWDOWN for r in g["throttle_reasons"][rec]]
        hot = g["temp_c"][rec] >= 87
        ok = (ratio < t.clock_ratio) & (g["util_gpu_pct"][rec] >= t.busy_util_pct) & (
            np.array([bool(r) for r in reasons]) | hot)
        if not ok.all():
            continue
        out.append(_throttle_detection(w, host, gpu, rec, ratio, reasons))
    return out


def _throttle_detection(w: Window, host: str, gpu: int, rec: np.ndarray, ratio: np.ndarray,
                        reasons: list[set[str]]) -> Detection:
    g = w.gpus
    why = sorted(set().union(*reasons)) or ["temperature"]
    temp, power, limit = _last(g["temp_c"][rec]), _last(g["power_w"][rec]), _last(g["power_limit_w"][rec])
    thermal = any("thermal" in r for r in why) or temp >= 87
    fix = ("check the node's cooling: fans, inlet temperature, airflow, a failed fan; drain the node if it stays hot"
           if thermal else "check the power cap (nvidia-smi -q -d POWER) and the rack's power budget")
    return Detection(
        "throttling", "gpu", gpu_subject(host, gpu), "warning",
        f"{host} GPU {gpu} throttled to {float(np.median(ratio)):.0%} of its max SM clock ({', '.join(why)})",
        f"{'Thermal' if thermal else 'Power'} throttling at {temp:.0f} °C, {power:.0f}/{limit:.0f} W → {fix}.",
        {"metrics": {"clock_ratio": rnd(np.median(ratio)), "temp_c": rnd(temp, 1), "power_w": rnd(power, 0),
                     "power_limit_w": rnd(limit, 0), "reasons": why},
         "window": [rnd(g["ts"][rec[0]]), rnd(g["ts"][rec[-1]])],
         "series": {"ts": [rnd(v) for v in g["ts"][rec]], "clock_ratio": [rnd(v) for v in ratio]}},
        0.9, node=host, gpu_index=gpu)
