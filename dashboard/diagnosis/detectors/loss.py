"""Loss spikes, correlated with what the run's GPUs did at that moment.

The seed's advice: when the loss spikes, check ECC. A spike is the loss of one step far above the run's own recent
loss (robust z: median and MAD of the preceding steps); it is judged while the step is fresh, so the GPU samples of
the same moments (the window's last ``SPANS["gpus"]`` seconds) and the events around it are still in the window
(Xid, and a rank of the run that changed node: the ingest records the move as an event).
One finding names both: "loss spike at step 8,412 coincides with 31 corrected ECC errors on node-007/gpu3". A spike
with no hardware cause in view is info (data, learning rate, numerics); it resolves once the step is history.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dashboard.diagnosis.detectors.base import Detection, Thresholds, rnd
from dashboard.diagnosis.detectors.gpu import SLOWDOWN, gpu_subject
from dashboard.diagnosis.detectors.window import RunInfo, Window

BASELINE = 128  # preceding steps the spike is judged against
MIN_HISTORY = 32
SPIKE_Z = 8.0
BEFORE_S = 15.0  # hardware events this long before the spike's step count as its cause (a flipped bit lingers)


def loss_spikes(w: Window, t: Thresholds) -> list[Detection]:
    out = []
    fresh = w.now - w.span.get("gpus", 20.0)
    for run in w.runs:
        arr = w.losses.get(run.name)
        if arr is None or len(arr) < MIN_HISTORY:
            continue
        spike = _spike(arr, fresh, float(t.extra.get("loss_z", SPIKE_Z)))
        if spike is not None:
            out.append(_detection(w, run, arr, *spike))
    return out


def _spike(arr: np.ndarray, fresh: float, z_min: float) -> tuple[int, float] | None:
    """(row, z) of the highest spike among the fresh steps, or None."""
    best = None
    for k in np.nonzero(arr[:, 1] >= fresh)[0]:
        if k < MIN_HISTORY:
            continue
        base = arr[max(0, k - BASELINE):k, 2]
        base = base[np.isfinite(base)]
        if len(base) < MIN_HISTORY:
            continue
        med = float(np.median(base))
        scale = max(1.4826 * float(np.median(np.abs(base - med))), 1e-3 * abs(med), 1e-6)
        v = arr[k, 2]
        z = float("inf") if not np.isfinite(v) else (v - med) / scale
        if z >= z_min and (best is None or z > best[1]):
            best = (int(k), z)
    return best


def _causes(w: Window, run: RunInfo, lo: float, hi: float) -> list[dict[str, Any]]:
    """What the run's GPUs reported in [lo, hi]: corrected / uncorrected ECC errors, Xid, throttling; worst first."""
    found: list[dict[str, Any]] = []
    mine = {(i.node, i.gpu): r for r, i in run.ranks.items() if i.node and i.gpu is not None}
    g = w.gpus
    index = w.node_index()
    for (host, gpu), rank in sorted(mine.items(), key=lambda x: x[1]):
        if host not in index or not len(g):
            continue
        rows = np.nonzero((g["node"] == index[host]) & (g["gpu"] == gpu) & (g["ts"] >= lo - 5) & (g["ts"] <= hi))[0]
        rows = rows[np.argsort(g["ts"][rows])]
        for col, what, sev in (("ecc_dbe_volatile", "uncorrected (double-bit) ECC errors", 3),
                               ("ecc_sbe_volatile", "corrected ECC errors", 2)):
            v = g[col][rows]
            v = v[~np.isnan(v)]
            n = float(v[-1] - v[0]) if len(v) >= 2 else 0.0
            if n > 0:
                found.append({"what": f"{n:.0f} {what}", "kind": col, "count": n, "host": host, "gpu": gpu,
                              "rank": rank, "sev": sev})
        hot = [sorted(set(r or []) & SLOWDOWN) for r in g["throttle_reasons"][rows]]
        hot = [r for r in hot if r]
        if hot:
            found.append({"what": f"throttling ({', '.join(hot[-1])})", "kind": "throttle", "host": host, "gpu": gpu,
                          "rank": rank, "sev": 1})
    for e in w.events:
        moved = (e.get("data") or {}).get("moved_to") if e["kind"] == "hook" else None
        if moved and e["run"] == run.name and lo <= e["ts"] <= hi + 5:
            # The rank restarted on another node (the ingest's event): its new GPU, or the state it resumed from.
            rank = e.get("rank")
            gpu = e.get("gpu_index")
            found.append({"what": f"rank {rank} moving from {e['data'].get('moved_from')} to {moved}",
                          "kind": "rank_moved", "host": moved, "gpu": gpu, "rank": rank, "sev": 2, "moved": True})
            continue
        if e["kind"] != "xid" or not lo <= e["ts"] <= hi + 5:
            continue
        gpu = e.get("gpu_index")
        if (e.get("node"), gpu) in mine:
            found.append({"what": f"Xid {e.get('code')}", "kind": "xid", "host": e["node"], "gpu": gpu,
                          "rank": mine[(e["node"], gpu)], "sev": 3, "message": (e.get("message") or "")[:200]})
    found.sort(key=lambda c: -c["sev"])
    return found


def _detection(w: Window, run: RunInfo, arr: np.ndarray, k: int, z: float) -> Detection:
    step, ts, loss = int(arr[k, 0]), float(arr[k, 1]), float(arr[k, 2])
    base = arr[max(0, k - BASELINE):k, 2]
    med = float(np.nanmedian(base))
    lo = float(arr[k - 1, 1]) - BEFORE_S
    causes = _causes(w, run, lo, ts)
    shown = f"{loss:.4g}" if np.isfinite(loss) else "not finite"
    if causes:
        c = causes[0]
        where = gpu_subject(c["host"], c["gpu"]) if c["gpu"] is not None else c["host"]
        sev = "error" if c["sev"] >= 3 else "warning"
        if c.get("moved"):
            title = f"Loss spike at step {step:,} coincides with {c['what']}"
            action = (f"The loss jumped to {shown} (median {med:.4g}, robust z {min(z, 999):.0f}) right after "
                      f"{c['what']} → check that it resumed from the latest checkpoint with its data position and "
                      f"RNG state, and run the GPU diagnostics on {where} (dcgmi diag -r 3); if the spike repeats, "
                      "roll back to the last checkpoint.")
        else:
            title = f"Loss spike at step {step:,} coincides with {c['what']} on {where}"
            action = (f"The loss jumped to {shown} (median {med:.4g}, robust z {min(z, 999):.0f}) while {where} "
                      f"(rank {c['rank']}) reported {c['what']} → treat the step as corrupted: roll back to the last "
                      f"checkpoint, drain {c['host']} and run the GPU's memory / field diagnostics (dcgmi diag -r 3) "
                      "before it trains again.")
    else:
        title = f"Loss spike at step {step:,}: {shown} against a median of {med:.4g}"
        sev = "info"
        action = ("No GPU on this run reported ECC errors, an Xid or throttling around the step → look at the batch "
                  "(a bad shard, a very long sequence), the learning-rate schedule and the gradient norm; if spikes "
                  "repeat, lower the learning rate or clip gradients.")
    lo_i = max(0, k - BASELINE)
    return Detection(
        "loss_spike", "run", f"{run.name}/step{step}", sev, title, action,
        {"metrics": {"step": step, "loss": rnd(loss, 5), "median_loss": rnd(med, 5), "z": rnd(min(z, 1e6), 1),
                     "causes": [{k2: v for k2, v in c.items() if k2 != "sev"} for c in causes[:8]]},
         "window": [rnd(lo), rnd(ts)],
         "series": {"loss": {"step": arr[lo_i:k + 1, 0].astype(int).tolist(),
                             "loss": [rnd(v, 5) for v in arr[lo_i:k + 1, 2]], "spike_step": step}}},
        0.9 if causes else 0.6, node=causes[0]["host"] if causes else None,
        gpu_index=causes[0]["gpu"] if causes else None, rank=causes[0]["rank"] if causes else None, run=run.name)
