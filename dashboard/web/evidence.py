"""A finding's evidence as charts: the series and the window its detector decided on, with the detector's threshold.

:func:`chart` reads the database around the finding's evidence window (falling back on the series the finding stored
when the rows are gone) and returns panels a page draws as they are::

    {"kind", "range": [t0, t1], "window": [t0, t1], "panels": [panel, ...], "numbers": [{name, value}, ...],
     "thresholds": {name: value}}
    panel = {"id", "title", "x": "time" | "step" | "category", "y_title", "type": "line" | "bar",
             "direction": "above" | "below",       # which side of the threshold is bad
             "series": [{"name", "role": "subject" | "baseline" | "context", "x", "y"}],
             "thresholds": [{"name", "x", "y", "value"?}],  # the first one decides; "value" when constant
             "window": [x0, x1] | None,            # the detector's window, in the panel's x units
             "markers": [{"x", "text"}],           # Xid events, checkpoints...
             "breach": {"x", "y", "threshold", "over"} | None}   # the subject's worst point vs the threshold

Every kind in :data:`dashboard.diagnosis.detectors.KINDS` has a builder here; :func:`headline` is the one line of
evidence that matters, for lists and alerts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import numpy as np
from django.conf import settings
from django.db.models import Q

from dashboard.diagnosis.detectors import KINDS
from dashboard.diagnosis.detectors.base import Thresholds
from dashboard.diagnosis.detectors.network import PORT_ERRORS
from dashboard.diagnosis.detectors.window import SPANS
from dashboard.diagnosis.models import Finding
from dashboard.storage import gpu_samples, probe_samples, step_samples
from dashboard.telemetry.models import AgentBatch, Event, Gpu, HostSample, PortSample, Rank
from dashboard.web import evidence_math as em
from dashboard.web.evidence_headline import headline
from dashboard.web.series import TimeRange, tiered

__all__ = ["KINDS", "chart", "context_range", "headline", "thresholds"]

MAX_STEPS = 200
MAX_CELLS = 200_000  # ranks x steps read for a per-step chart: a 1,024-rank run gets ~200 steps
MAX_RANGE_S = 6 * 3600.0
POINTS = 600


def thresholds() -> Thresholds:
    from dashboard.diagnosis.tasks import thresholds as pass_thresholds

    return pass_thresholds()  # the ones the pass runs with (settings override the defaults)


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def evidence_window(f: Finding) -> list[float] | None:
    w = (f.evidence or {}).get("window")
    if isinstance(w, list) and len(w) == 2 and all(isinstance(v, int | float) for v in w):
        return [float(w[0]), float(w[1])]
    return None


def context_range(f: Finding, now: float | None = None) -> tuple[float, float]:
    """The time shown around a finding: from before it opened (the healthy past the fault stands out of) to its
    resolve or its last sighting, a little after; never into the future, at most MAX_RANGE_S."""
    now = time.time() if now is None else now
    w = evidence_window(f) or [f.opened_at.timestamp(), f.last_seen_at.timestamp()]
    start = min(w[0], f.opened_at.timestamp())
    end = max(w[1], (f.resolved_at or f.last_seen_at).timestamp())
    span = max(10.0, end - start)
    t1 = min(now, end + max(15.0, 0.25 * span))
    t0 = max(start - max(60.0, span), t1 - MAX_RANGE_S)
    return t0, t1


def panel(pid: str, title: str, x: str, y_title: str, series: list[dict[str, Any]],
          lines: list[dict[str, Any]], direction: str = "above", window: list[Any] | None = None,
          markers: list[dict[str, Any]] | None = None, kind: str = "line") -> dict[str, Any]:
    subject = next((s for s in series if s["role"] == "subject"), None)
    decide = lines[0] if lines else None
    crossing = None
    if subject is not None and decide is not None:
        line = decide.get("value") if "value" in decide else (
            decide["y"] if len(decide["y"]) == len(subject["y"]) else None)
        crossing = em.breach(subject["x"], subject["y"], line, direction, window)
    return {"id": pid, "title": title, "x": x, "y_title": y_title, "type": kind, "direction": direction,
            "series": series, "thresholds": lines, "window": window, "markers": markers or [], "breach": crossing}


def const(name: str, value: float | None, xs: list[Any]) -> list[dict[str, Any]]:
    """A constant threshold across the panel (nothing when unknown)."""
    if value is None or not xs:
        return []
    return [{"name": name, "x": [xs[0], xs[-1]], "y": [value, value], "value": round(float(value), 6)}]


def line(name: str, role: str, xs: list[Any], ys: list[Any]) -> dict[str, Any]:
    return {"name": name, "role": role, "x": xs, "y": ys}


# -- steps: late ranks, memory, efficiency, checkpoints ----------------------------------------------------------

def _steps_in_range(run_id: int, t0: float, t1: float, ranks: int) -> list[tuple[int, float]]:
    """(step, time its last rank finished) of the run's steps in the range, newest MAX_STEPS (fewer for wide runs)."""
    cap = max(20, min(MAX_STEPS, MAX_CELLS // max(1, ranks)))
    return step_samples.step_ends(run_id, t0, t1, cap)


def step_matrix(f: Finding, t0: float, t1: float, cols: tuple[str, ...], rank: int | None = None
                ) -> tuple[list[int], list[float], np.ndarray, dict[str, np.ndarray]] | None:
    """[rank x step] matrices of ``cols`` for the finding's run (one row when ``rank`` is given): (steps, their end
    times, ranks, {col: matrix}) — the layout ``steps.run_steps`` gives the detector."""
    if f.run_id is None:
        return None
    n_ranks = 1 if rank is not None else (f.run.world_size or Rank.objects.filter(run_id=f.run_id).count() or 1)
    steps_ts = _steps_in_range(f.run_id, t0, t1, n_ranks)
    if not steps_ts:
        return None
    steps = [s for s, _ in steps_ts]
    rows = step_samples.cells(f.run_id, steps[0], steps[-1], ("step_time_s", *cols), rank)
    if not rows:
        return None
    ranks = np.unique([r[0] for r in rows])
    r_idx = np.searchsorted(ranks, [r[0] for r in rows])
    s_idx = np.searchsorted(np.array(steps), [r[1] for r in rows])
    keep = s_idx < len(steps)
    mats = {}
    for j, c in enumerate(("step_time_s", *cols)):
        mat = np.full((len(ranks), len(steps)), np.nan)
        vals = np.array([np.nan if r[2 + j] is None else r[2 + j] for r in rows], dtype=float)
        mat[r_idx[keep], s_idx[keep]] = vals[keep]
        mats[c] = mat
    return steps, [ts for _, ts in steps_ts], ranks, mats


def _stored_steps(f: Finding, name: str) -> tuple[list[int], list[Any], list[Any]] | None:
    s = ((f.evidence or {}).get("series") or {}).get(name)
    if isinstance(s, dict) and s.get("step"):
        return s["step"], s.get("rank") or [None] * len(s["step"]), s.get("median") or [None] * len(s["step"])
    return None


def _step_window(f: Finding, steps: list[int], step_ts: list[float]) -> list[int] | None:
    """The detector's steps: those it stored with the evidence, else those ending inside its time window."""
    for s in ((f.evidence or {}).get("series") or {}).values():
        if isinstance(s, dict) and s.get("step"):
            return [min(s["step"]), max(s["step"])]
    return em.step_window(steps, step_ts, evidence_window(f))


def _late_panels(f: Finding, t: Thresholds, t0: float, t1: float) -> list[dict[str, Any]]:
    data = step_matrix(f, t0, t1, ("data_wait_s", "compute_s", "comm_arrive_s"))
    if data is None or f.rank is None:
        return _stored_late(f, t)
    steps, step_ts, ranks, m = data
    rows = np.nonzero(ranks == f.rank)[0]
    if not len(rows):
        return _stored_late(f, t)
    i, win, who = int(rows[0]), _step_window(f, steps, step_ts), f"rank {f.rank}"
    out = []
    if f.kind == "data_starvation":
        shares = em.share(m["data_wait_s"], m["step_time_s"])
        with np.errstate(all="ignore"):
            med_share = np.nanmedian(shares, axis=0)
        out.append(panel("data_share", f"Share of each step {who} waits for data, vs the run's median", "step",
                         "data wait / step time", [line(who, "subject", steps, em.clean(shares[i])),
                                                   line("median of all ranks", "baseline", steps, em.clean(med_share))],
                         const(f"data_share_min {t.data_share_min:g}", t.data_share_min, steps), window=win))
        med, thr = em.data_wait_threshold(m["data_wait_s"], m["step_time_s"], t)
        out.append(panel("data_wait", f"Data wait of {who} vs the cross-rank median", "step", "data wait (s)",
                         [line(who, "subject", steps, em.clean(m["data_wait_s"][i])),
                          line("median of all ranks", "baseline", steps, em.clean(med))],
                         [{"name": f"median + {t.z:g}σ (z threshold)", "x": steps, "y": em.clean(thr)}], window=win))
        return out
    med, thr = em.compute_threshold(m["compute_s"], t)
    out.append(panel("compute", f"Compute time of {who} vs the cross-rank median", "step", "compute (s)",
                     [line(who, "subject", steps, em.clean(m["compute_s"][i])),
                      line("median of all ranks", "baseline", steps, em.clean(med))],
                     [{"name": f"max(median + {t.z:g}σ, {t.compute_ratio_min:g}× median, median + "
                               f"{t.compute_min_s * 1e3:g} ms)", "x": steps,
                       "y": em.clean(thr)}], window=win))
    arrive = m["comm_arrive_s"]
    if np.any(~np.isnan(arrive)):
        amed, athr = em.arrival_threshold(arrive, m["step_time_s"], t)
        out.append(panel("arrival", f"When {who} reaches the first collective", "step", "arrival (s into step)",
                         [line(who, "subject", steps, em.clean(arrive[i])),
                          line("median of all ranks", "baseline", steps, em.clean(amed))],
                         [{"name": f"median + {t.z:g}σ", "x": steps, "y": em.clean(athr)}], window=win))
    return out


def _stored_late(f: Finding, t: Thresholds) -> list[dict[str, Any]]:
    """The rows are gone (retention): draw the series the detector stored, against the ratio threshold."""
    name = "data_wait_s" if f.kind == "data_starvation" else "compute_s"
    stored = _stored_steps(f, name)
    if stored is None:
        return _run_starved(f, t)
    steps, mine, med = stored
    ratio = 1.0 if f.kind == "data_starvation" else t.compute_ratio_min
    thr = [None if v is None else round(v * ratio, 6) for v in med]
    return [panel(name, f"{name} of {f.subject} (stored with the finding) vs the median", "step", name,
                  [line(f.subject, "subject", steps, mine), line("median of all ranks", "baseline", steps, med)],
                  [{"name": f"{ratio:g}× median", "x": steps, "y": thr}], window=[min(steps), max(steps)])]


def _run_starved(f: Finding, t: Thresholds) -> list[dict[str, Any]]:
    s = ((f.evidence or {}).get("series") or {}).get("data_wait_share")
    if not isinstance(s, dict) or not s.get("step"):
        return []
    steps = s["step"]
    return [panel("data_share", "Median share of each step the ranks wait for data", "step", "data wait / step",
                  [line("median of all ranks", "subject", steps, s.get("median") or [])],
                  const(f"run_starved_share {t.run_starved_share:g}", t.run_starved_share, steps),
                  window=[min(steps), max(steps)])]


def _starvation(f: Finding, t: Thresholds, t0: float, t1: float) -> list[dict[str, Any]]:
    if f.subject_type != "rank":
        data = step_matrix(f, t0, t1, ("data_wait_s",))
        if data is None:
            return _run_starved(f, t)
        steps, step_ts, _, m = data
        with np.errstate(all="ignore"):
            med = np.nanmedian(em.share(m["data_wait_s"], m["step_time_s"]), axis=0)
        return [panel("data_share", "Median share of each step the ranks wait for data", "step", "data wait / step",
                      [line("median of all ranks", "subject", steps, em.clean(med))],
                      const(f"run_starved_share {t.run_starved_share:g}", t.run_starved_share, steps),
                      window=_step_window(f, steps, step_ts))]
    return _late_panels(f, t, t0, t1)


def _memory(f: Finding, t: Thresholds, t0: float, t1: float) -> list[dict[str, Any]]:
    data = step_matrix(f, t0, t1, ("mem_allocated_bytes", "mem_reserved_bytes", "mem_total_bytes"), rank=f.rank)
    if data is None:
        s = ((f.evidence or {}).get("series") or {}).get("allocated_frac") or {}
        steps, ys, win = s.get("step") or [], s.get("rank") or [], None
        reserved: list[Any] = []
    else:
        steps, step_ts, _, m = data
        ys = em.clean(em.share(m["mem_allocated_bytes"], m["mem_total_bytes"])[0])
        reserved = em.clean(em.share(m["mem_reserved_bytes"], m["mem_total_bytes"])[0])
        win = _step_window(f, steps, step_ts)
    if not steps:
        return []
    series = [line("allocated", "subject", steps, ys)] + ([line("reserved", "context", steps, reserved)]
                                                          if reserved else [])
    return [panel("memory", f"GPU memory held by {f.subject} (fraction of the GPU's)", "step", "fraction",
                  series, const(f"mem_warn {t.mem_warn:g}", t.mem_warn, steps)
                  + const(f"mem_error {t.mem_error:g}", t.mem_error, steps), window=win)]


def _efficiency(f: Finding, t: Thresholds, t0: float, t1: float) -> list[dict[str, Any]]:
    run = f.run
    meta = (run.meta or {}) if run else {}
    fpt, peak = meta.get("flops_per_token"), meta.get("peak_flops")
    data = step_matrix(f, t0, t1, ("tokens",)) if run else None
    if data is None or not fpt or not peak:
        return []
    steps, step_ts, ranks, m = data
    gpus = run.world_size or len(ranks)
    with np.errstate(all="ignore"):
        mfu = np.nansum(m["tokens"], axis=0) / np.nanmedian(m["step_time_s"], axis=0) * fpt / (peak * gpus)
    return [panel("mfu", f"MFU of {run.name} per step", "step", "MFU", [line("MFU", "subject", steps, em.clean(mfu))],
                  const(f"mfu_floor {t.mfu_floor:g}", t.mfu_floor, steps), direction="below",
                  window=_step_window(f, steps, step_ts))]


def _exposed_comm(f: Finding, t: Thresholds, t0: float, t1: float) -> list[dict[str, Any]]:
    """The exposed share of the step per process-group role, as the detector measured it, against its line."""
    from dashboard.diagnosis.detectors.groups import EXPOSED_WARN

    roles = ((f.evidence or {}).get("metrics") or {}).get("by_role") or {}
    names = sorted(roles, key=lambda r: -(roles[r] or 0))
    if not names:
        return []
    return [panel("exposed", f"Share of each step {f.subject} sits blocked in communication, by process group",
                  "category", "exposed / step", [line("exposed share", "subject", names, [roles[r] for r in names])],
                  [{"name": f"exposed {EXPOSED_WARN:g} (run total)", "x": names, "y": [EXPOSED_WARN] * len(names),
                    "value": EXPOSED_WARN}], kind="bar")]


def _loss_spike(f: Finding, t: Thresholds, t0: float, t1: float) -> list[dict[str, Any]]:
    """The run's loss the spike was judged against (stored with the finding), the spike marked with its cause."""
    s = ((f.evidence or {}).get("series") or {}).get("loss") or {}
    steps, ys = s.get("step") or [], s.get("loss") or []
    if not steps:
        return []
    m = (f.evidence or {}).get("metrics") or {}
    causes = m.get("causes") or []
    text = f"spike: {causes[0]['what']} on {causes[0]['host']}/gpu{causes[0]['gpu']}" if causes else "spike"
    return [panel("loss", f"Loss of {f.run.name if f.run else 'the run'} before the spike", "step", "loss",
                  [line("loss", "subject", steps, ys)],
                  const(f"median {m.get('median_loss')}", m.get("median_loss"), steps),
                  window=[s.get("spike_step"), s.get("spike_step")],
                  markers=[{"x": s.get("spike_step"), "text": text}])]


def _checkpoint(f: Finding, t: Thresholds, t0: float, t1: float) -> list[dict[str, Any]]:
    if f.run_id is None:
        return []
    steps_ts = _steps_in_range(f.run_id, t0, t1, 1)
    ckpts = sorted(set(Event.objects.filter(run_id=f.run_id, kind="checkpoint", step__isnull=False)
                       .values_list("step", flat=True)))
    if not steps_ts or not ckpts:
        return []
    steps = [s for s, _ in steps_ts]
    pos = np.searchsorted(np.array(ckpts), steps, side="right") - 1
    since = [int(s - ckpts[p]) if p >= 0 else None for s, p in zip(steps, pos, strict=True)]
    cadence = ((f.evidence or {}).get("metrics") or {}).get("cadence_steps")
    limit = cadence + max(t.ckpt_slack_steps, t.ckpt_slack_frac * cadence) if cadence else None
    return [panel("since_checkpoint", "Steps since the last checkpoint", "step", "steps",
                  [line("steps since checkpoint", "subject", steps, since)],
                  const("cadence + slack", limit, steps), window=_step_window(f, steps, [ts for _, ts in steps_ts]),
                  markers=[{"x": c, "text": "checkpoint"} for c in ckpts if steps[0] <= c <= steps[-1]])]


# -- stalls: hang, rank down ------------------------------------------------------------------------------------

def _stall(f: Finding, t: Thresholds, t0: float, t1: float) -> list[dict[str, Any]]:
    if f.run_id is None:
        return []
    steps_ts = _steps_in_range(f.run_id, t0, t1, 1)
    if not steps_ts:
        return []
    metrics = (f.evidence or {}).get("metrics") or {}
    gaps = np.diff([ts for _, ts in steps_ts])
    med = metrics.get("median_step_s") or (float(np.median(gaps)) if len(gaps) else 1.0)
    if f.kind == "hang":
        limit, name = max(t.hang_steps * med, t.hang_min_s), f"max({t.hang_steps:g}× median step, {t.hang_min_s:g} s)"
    else:
        limit, name = max(2.0 * med, t.beat_suspect_s), f"max(2× median step, {t.beat_suspect_s:g} s)"
    xs = em.ticks(t0, t1, POINTS)
    stall = em.silence([ts for _, ts in steps_ts], xs)
    xl = em.clean(xs, 3)
    out = [panel("stall", f"Seconds since {f.run.name} last completed a step", "time", "no step for (s)",
                 [line("time since the last step", "subject", xl, stall)], const(name, limit, xl),
                 window=evidence_window(f))]
    progress = [line("step (all ranks)", "context", [round(ts, 3) for _, ts in steps_ts], [s for s, _ in steps_ts])]
    if f.rank is not None:
        # The steps' bounds as well as the time's: by time alone SQLite reads every rank's rows in the range.
        shown = [s for s, _ in steps_ts]
        mine = step_samples.rank_progress(f.run_id, f.rank, t0, t1, min(shown), max(shown))
        progress.insert(0, line(f"rank {f.rank}", "subject", [ts for _, ts in mine], [s for s, _ in mine]))
    out.append(panel("progress", "Step progress", "time", "step", progress, [], window=evidence_window(f)))
    return out


# -- GPUs: throttling, failing GPU -------------------------------------------------------------------------------

def _gpu_range(t0: float, t1: float, points: int) -> TimeRange:
    """Raw rows while the range is inside the hot window (the values the detector judged, at full resolution); beyond
    it, where the raw rows are gone (a finding from last week), the rollup tier that holds the range."""
    tr = TimeRange(t0, t1, points)
    return tiered(tr) if t0 < time.time() - settings.CLUSTERDX["RAW_RETENTION_HOURS"] * 3600 else tr


def _throttling(f: Finding, t: Thresholds, t0: float, t1: float) -> list[dict[str, Any]]:
    if f.node_id is None or f.gpu_index is None:
        return []
    tr = _gpu_range(t0, t1, POINTS)
    got = gpu_samples.ratio_buckets(f.node_id, f.gpu_index, tr, "sm_clock_mhz", "sm_clock_max_mhz", ["temp_c"])
    if not got:
        s = ((f.evidence or {}).get("series") or {})
        if not s.get("ts"):
            return []
        got = {"t": s["ts"], "ratio": {"mean": s["clock_ratio"]}, "temp_c": {"mean": []}}
    xs = got["t"]
    out = [panel("clock", f"SM clock of {f.subject} as a share of its max", "time", "SM clock / max",
                 [line("SM clock / max", "subject", xs, em.clean(got["ratio"]["mean"]))],
                 const(f"clock_ratio {t.clock_ratio:g}", t.clock_ratio, xs), direction="below",
                 window=evidence_window(f))]
    if any(v is not None for v in got["temp_c"]["mean"]):
        out.append(panel("temp", "Temperature", "time", "°C", [line("temperature", "subject", xs,
                                                                    em.clean(got["temp_c"]["mean"], 1))],
                         const("87 °C (hot)", 87.0, xs), window=evidence_window(f)))
    return out


COUNTERS = (  # (columns summed, title, threshold attribute, "increase" over the pass's window or "level")
    (("ecc_sbe_volatile",), "Corrected ECC errors (SBE) in the last 20 s", "sbe_min", "increase"),
    (("ecc_dbe_volatile",), "Uncorrectable ECC errors (DBE, volatile)", None, "level"),
    (("pcie_replay_total",), "PCIe replays in the last 20 s", "pcie_replay_min", "increase"),
    (("nvlink_crc_errors_total", "nvlink_replay_errors_total", "nvlink_recovery_errors_total"),
     "NVLink errors in the last 20 s", "nvlink_errors_min", "increase"),
)


def _failing_gpu(f: Finding, t: Thresholds, t0: float, t1: float) -> list[dict[str, Any]]:
    if f.node_id is None or f.gpu_index is None:
        return []
    cols = sorted({c for cs, *_ in COUNTERS for c in cs} | {"util_gpu_pct"})
    # Counters read at the pass's resolution (1 s buckets, the newest value of each), so the rolling increase is
    # the one the detector summed; the range is capped to keep it to a few thousand points. Beyond the hot window the
    # buckets are the rollups' (10 s, max of each window): the increase over a span is the same up to a window.
    tr = _gpu_range(max(t0, t1 - 3600), t1, 5000)
    got = gpu_samples.buckets(f.node_id, tr, cols, f.gpu_index).get(str(f.gpu_index))
    events = list(Event.objects.filter(node_id=f.node_id, kind="xid", ts__gte=_dt(t0), ts__lte=_dt(t1))
                  .filter(Q(gpu_index=f.gpu_index) | Q(gpu_index__isnull=True)).values_list("ts", "code"))
    markers = [{"x": round(ts.timestamp(), 3), "text": f"Xid {code}"} for ts, code in events]
    if not got:
        return []
    xs, win, out = got["t"], evidence_window(f), []
    for cs, title, attr, how in COUNTERS:
        vals = [sum(v for v in vs if v is not None) if any(v is not None for v in vs) else None
                for vs in zip(*(got[c]["max"] for c in cs), strict=True)]
        known = [v for v in vals if v is not None]
        if not known or (max(known) - min(known) <= 0 and (how == "increase" or max(known) <= 0)):
            continue  # only the counters that moved
        ys = em.rolling_increase(xs, vals, SPANS["gpus"]) if how == "increase" else vals
        limit = getattr(t, attr) if attr else 0.0
        out.append(panel(cs[0], f"{title} on {f.subject}", "time", "errors", [line(title, "subject", xs, ys)],
                         const(f"{attr} {limit:g}" if attr else "> 0", limit, xs), window=win, markers=markers))
    if not out:  # nothing counted: an Xid or a lost GPU; its utilisation shows when it stopped working
        out.append(panel("util", f"Utilisation of {f.subject}", "time", "%", [
            line("GPU utilisation", "subject", xs, em.clean(got["util_gpu_pct"]["mean"], 1))], [], window=win,
            markers=markers))
    return out


# -- network: slow link, node down -------------------------------------------------------------------------------

def _pair_probes(f: Finding, tr: TimeRange, fields: list[str]) -> dict[str, Any] | None:
    """Both directions of the finding's pair, or every probe its node sent or was sent when only one end is known."""
    if f.peer_node_id:
        return probe_samples.of_pair((f.node_id, f.node.hostname), (f.peer_node_id, f.peer_node.hostname), tr, fields)
    return probe_samples.of_node(f.cluster_id, f.node_id, f.node.hostname, tr, fields)


def _slow_link(f: Finding, t: Thresholds, t0: float, t1: float) -> list[dict[str, Any]]:
    if f.subject_type == "switch":
        return _switch(f, t, t0, t1)
    if f.node_id is None:
        return []
    metrics, win, out = (f.evidence or {}).get("metrics") or {}, evidence_window(f), []
    got = _pair_probes(f, TimeRange(t0, t1, POINTS), ["rtt_ms", "bw_gbps"])
    if got and metrics.get("rtt_ms") is not None:
        xs, base = got["t"], metrics.get("baseline_rtt_ms")
        out.append(panel("rtt", f"Probe RTT of {f.subject}'s pairs vs the cluster's quiet RTT", "time", "RTT (ms)",
                         [line(f"{f.subject} pairs", "subject", xs, em.clean(got["rtt_ms"]["mean"])),
                          line("cluster quiet RTT", "baseline", [xs[0], xs[-1]], [base, base])],
                         const(f"max({t.rtt_ratio:g}× quiet, quiet + {t.rtt_abs_ms:g} ms)",
                               em.rtt_threshold(base, t), xs), window=win))
        if any(v is not None for v in got["bw_gbps"]["mean"]) and metrics.get("baseline_bw_gbps"):
            bw = metrics["baseline_bw_gbps"]
            keep = [i for i, v in enumerate(got["bw_gbps"]["mean"]) if v is not None]
            bx = [xs[i] for i in keep]
            out.append(panel("bw", f"Bulk bandwidth of {f.subject}'s pairs", "time", "Gb/s",
                             [line(f"{f.subject} pairs", "subject", bx,
                                   em.clean([got["bw_gbps"]["mean"][i] for i in keep]))],
                             const(f"{t.bw_ratio:g}× cluster ({bw:g} Gb/s)", t.bw_ratio * bw, bx), direction="below",
                             window=win))
    if "port" in metrics or "ports" in (f.evidence or {}):
        out += _ports(f, t0, t1, win)
    return out


def _switch(f: Finding, t: Thresholds, t0: float, t1: float) -> list[dict[str, Any]]:
    """A leaf switch / uplink: the RTT of the pairs that leave its nodes next to the pairs inside, and the bar."""
    metrics = (f.evidence or {}).get("metrics") or {}
    hosts = list(metrics.get("nodes") or [])[:256]
    if not hosts:
        return []
    cross, inside = probe_samples.across(f.cluster_id, hosts, TimeRange(t0, t1, POINTS), ["rtt_ms"])
    if not cross:
        return []
    xs, base = cross["t"], metrics.get("baseline_rtt_ms")
    series = [line(f"pairs leaving {f.subject}", "subject", xs, em.clean(cross["rtt_ms"]["mean"]))]
    if inside:
        series.append(line(f"pairs inside {f.subject}", "context", inside["t"], em.clean(inside["rtt_ms"]["mean"])))
    return [panel("rtt", f"Probe RTT of {f.subject}'s nodes: leaving it vs inside it", "time", "RTT (ms)", series,
                  const(f"max({t.rtt_ratio:g}× quiet, quiet + {t.rtt_abs_ms:g} ms)", em.rtt_threshold(base, t), xs),
                  window=evidence_window(f))]


def _congestion(f: Finding, t: Thresholds, t0: float, t1: float) -> list[dict[str, Any]]:
    """The first congested port's counter classes per second (deltas over each sample's interval), and the limit
    of the class that decided."""
    from dashboard.diagnosis.detectors.congestion import CLASSES

    metrics = (f.evidence or {}).get("metrics") or {}
    ports, worst = metrics.get("ports") or [], metrics.get("worst")
    if not ports or worst not in CLASSES:
        return []
    device, _, num = str(ports[0].get("port", "")).rpartition(":")
    if not num.isdigit():
        return []
    rows = list(PortSample.objects.filter(cluster_id=f.cluster_id, node__hostname=ports[0].get("host"),
                                          device=device, port=int(num), ts__gte=_dt(t0), ts__lte=_dt(t1))
                .order_by("ts").values_list("ts", "counters", "interval_s")[:5000])
    rows = [r for r in rows if isinstance(r[1], dict) and r[2]]
    if not rows:
        return []
    xs = [round(ts.timestamp(), 3) for ts, _, _ in rows]
    classes = [worst] + [c for c in metrics.get("classes") or [] if c != worst and c in CLASSES]
    series = [line(cls, "subject" if cls == worst else "context", xs,
                   [round(sum(int(c.get(n) or 0) for n in CLASSES[cls]) / dt, 3) for _, c, dt in rows])
              for cls in classes]
    where = f"{ports[0].get('host')} {ports[0].get('port')}"
    return [panel("congestion", f"RDMA congestion counters of {where} per second", "time", "events / s", series,
                  const(f"{worst} limit {metrics.get('limit_per_s')}/s", metrics.get("limit_per_s"), xs),
                  window=evidence_window(f))]


def _ports(f: Finding, t0: float, t1: float, win: list[float] | None) -> list[dict[str, Any]]:
    rows = list(PortSample.objects.filter(node_id=f.node_id, ts__gte=_dt(t0), ts__lte=_dt(t1)).order_by("ts")
                .values_list("ts", "counters", "state")[:5000])
    if not rows:
        return []
    xs = [round(ts.timestamp(), 3) for ts, _, _ in rows]
    errs = [sum(int((c or {}).get(k, 0) or 0) for k in PORT_ERRORS) for _, c, _ in rows]
    down = [{"x": x, "text": str(s)} for x, (_, _, s) in zip(xs, rows, strict=True)
            if s and not str(s).upper().endswith("ACTIVE")]
    return [panel("port_errors", f"IB port errors on {f.node.hostname} per sample", "time", "errors",
                  [line("link errors", "subject", xs, errs)], const("> 0", 0.0, xs), window=win, markers=down[:50])]


def _heard_from_rollups(f: Finding, gpu: int | None, t0: float, t1: float) -> tuple[list[float], str]:
    """When the node was heard, from the finest rollup tier that still holds [t0, t1]: each window's ``n`` samples
    spread evenly up to its ``last_ts``. Within a window that is an estimate; the gaps between windows, which are
    what a silence is, are exact to the window. Returns (times, a note for the panel's title)."""
    from dashboard.storage.models import GpuRollup1m, GpuRollup10s, HostRollup1m, HostRollup10s

    tiers = ((GpuRollup10s, 10), (GpuRollup1m, 60)) if gpu is not None else ((HostRollup10s, 10), (HostRollup1m, 60))
    for model, seconds in tiers:
        qs = model.objects.filter(node_id=f.node_id, ts__gte=_dt(t0 - seconds), ts__lte=_dt(t1))
        if gpu is not None:
            qs = qs.filter(gpu_index=gpu)
        rows = list(qs.order_by("ts").values_list("ts", "n", "last_ts")[:5000])
        if not rows:
            continue
        heard: list[float] = []
        for start, n, last in rows:
            a, b = start.timestamp(), last.timestamp()
            heard += np.linspace(a + (b - a) / max(n, 1), b, max(n, 1)).tolist() if n > 1 else [b]
        return heard, f" (from the {seconds} s rollups: the raw samples are past retention)"
    return [], ""


def _node_down(f: Finding, t: Thresholds, t0: float, t1: float) -> list[dict[str, Any]]:
    if f.node_id is None:
        return []
    # The node's first GPU from its inventory (every GPU that ever sent a sample is in it): the samples are indexed by
    # (node, ts), so asking them for their least gpu_index would read all of the node's rows.
    first = Gpu.objects.filter(node_id=f.node_id).order_by("index").values_list("index", flat=True)[:1]
    if first:
        heard = gpu_samples.heard(f.node_id, first[0], t0 - 120, t1)
    else:
        heard = [ts.timestamp() for ts in HostSample.objects.filter(node_id=f.node_id, ts__gte=_dt(t0 - 120),
                                                                   ts__lte=_dt(t1))
                 .order_by("ts").values_list("ts", flat=True)[:20000]]
    source = ""
    if not heard:  # past the raw window (CLUSTERDX_RAW_RETENTION_HOURS): the rollups still say when it was heard
        heard, source = _heard_from_rollups(f, first[0] if first else None, t0 - 120, t1)
    if not heard:
        return []
    xs = em.ticks(t0, t1, POINTS)
    xl, win = em.clean(xs, 3), evidence_window(f)
    limit = max(t.silent_min_s, t.silent_intervals * em.median_interval(heard))
    # The heartbeat line as the detector drew it: plus the seconds its batches took to arrive, when they were late.
    metrics = (f.evidence or {}).get("metrics") or {}
    late = float(metrics.get("ingest_delay_s") or 0.0)
    beat = f"heartbeat_s {t.heartbeat_s:g}" + (f" + {late:g} s arrival delay" if late >= 1.0 else "")
    lines = const(f"silent limit {limit:g} s (with probe loss)", limit, xl) + const(beat, t.heartbeat_s + late, xl)
    if metrics.get("probe_loss") is None:  # named on silence alone: the heartbeat line decided, so it comes first
        lines.reverse()
    out = [panel("silence", f"Seconds since {f.node.hostname} was last heard from{source}", "time", "silent for (s)",
                 [line("heartbeat gap", "subject", xl, em.silence(heard, xs))], lines, window=win)]
    got = probe_samples.to_node(f.cluster_id, f.node.hostname, TimeRange(t0, t1, POINTS), ["loss"])
    if got:
        out.append(panel("probe_loss", f"Probe loss of the peers' probes to {f.node.hostname}", "time", "loss",
                         [line("probe loss", "subject", got["t"], em.clean(got["loss"]["mean"]))],
                         const(f"probe_loss_frac {t.probe_loss_frac:g}", t.probe_loss_frac, got["t"]), window=win))
    return out


def _cluster_silent(f: Finding, t: Thresholds, t0: float, t1: float) -> list[dict[str, Any]]:
    """From the evidence alone: how many of the cluster's nodes were still heard, second by second, up to the pass
    that named the silence (when the data stops, there is nothing newer to read)."""
    heard = ((f.evidence or {}).get("series") or {}).get("heard") or {}
    xs, ys = heard.get("t") or [], heard.get("nodes") or []
    if not xs or len(xs) != len(ys):
        return []
    nodes = ((f.evidence or {}).get("metrics") or {}).get("nodes")
    return [panel("heard", "Nodes of the cluster heard from since each second", "time", "nodes",
                  [line("nodes heard", "subject", em.clean(xs, 3), ys)],
                  const(f"all {nodes} nodes", nodes, xs), direction="below", window=evidence_window(f))]


def _clock_skew(f: Finding, t: Thresholds, t0: float, t1: float) -> list[dict[str, Any]]:
    """How late each of the node's recent batches arrived (received_at − the sent_at it stamped), by arrival: a
    flat line far above the limit is a clock behind; an agent replaying its spool draws a falling one."""
    if f.node_id is None or not f.node.agent_id:
        return []
    # Its newest batches along the (cluster, agent, seq) index: the ledger's time index holds every node's batches.
    rows = (AgentBatch.objects.filter(cluster_id=f.cluster_id, agent_id=f.node.agent_id, sent_at__isnull=False,
                                      received_at__gte=_dt(t0), received_at__lte=_dt(t1))
            .order_by("-seq").values_list("received_at", "sent_at")[:MAX_POINTS_LEDGER])
    pts = sorted((r.timestamp(), (r - s).total_seconds()) for r, s in rows)
    if not pts:
        return []
    xs = em.clean([p[0] for p in pts], 3)
    metrics = (f.evidence or {}).get("metrics") or {}
    lag = float(metrics.get("ingest_lag_s") or 0.0)
    lines = const(f"the cluster's {lag:g} s + clock_behind_s {t.clock_behind_s:g}", lag + t.clock_behind_s, xs)
    return [panel("arrival_delay", f"Seconds from {f.node.hostname}'s sent_at to this server's receipt, per batch",
                  "time", "arrived after (s)", [line("arrival delay", "subject", xs, em.clean([p[1] for p in pts], 2))],
                  lines, window=evidence_window(f))]


MAX_POINTS_LEDGER = 2000  # the node's newest batches a clock_skew chart draws


# -- NCCL --------------------------------------------------------------------------------------------------------

def _nccl(f: Finding, t: Thresholds, t0: float, t1: float) -> list[dict[str, Any]]:
    metrics = (f.evidence or {}).get("metrics") or {}
    if "NCCL_IB_TIMEOUT" in metrics:
        v = metrics["NCCL_IB_TIMEOUT"]
        return [panel("ib_timeout", f"NCCL_IB_TIMEOUT at {metrics.get('world_size')} ranks", "category", "value",
                      [line("NCCL_IB_TIMEOUT", "subject", ["NCCL_IB_TIMEOUT"], [v])],
                      const(f"ib_timeout_min {t.ib_timeout_min}", t.ib_timeout_min, ["NCCL_IB_TIMEOUT"]),
                      direction="below", kind="bar")]
    diffs = metrics.get("differences") or {}
    if not diffs or f.run_id is None:
        return []
    envs = [((m or {}).get("env") or {}) for m in Rank.objects.filter(run_id=f.run_id).values_list("meta", flat=True)]
    out = []
    for var in sorted(diffs)[:4]:
        counts: dict[str, int] = {}
        for env in envs:
            key = str(env.get(var, "(unset)"))
            counts[key] = counts.get(key, 0) + 1
        xs = sorted(counts, key=lambda k: -counts[k])
        out.append(panel(f"drift_{var}", f"Ranks per value of {var}", "category", "ranks",
                         [line(var, "subject", xs, [counts[k] for k in xs])], [], kind="bar"))
    return out


# The Thresholds fields each kind's detector compares against (shown with the numbers).
PARAMS: dict[str, tuple[str, ...]] = {
    "data_starvation": ("z", "data_share_min", "data_min_s", "persist_steps", "recent_steps", "run_starved_share"),
    "straggler": ("z", "compute_ratio_min", "compute_min_s", "late_min_frac", "persist_steps", "recent_steps"),
    "slow_link": ("rtt_ratio", "rtt_abs_ms", "loss_frac", "bw_ratio", "node_bad_frac", "port_error_samples"),
    "failing_gpu": ("sbe_min", "sbe_samples", "pcie_replay_min", "nvlink_errors_min"),
    "throttling": ("clock_ratio", "throttle_s", "throttle_with_rank_s", "busy_util_pct"),
    "node_down": ("silent_min_s", "silent_intervals", "heartbeat_s", "ingest_lag_max_s", "probe_loss_frac",
                  "probe_lost_rounds"),
    "cluster_silent": ("silent_min_s", "silent_intervals", "heartbeat_s"),
    "clock_skew": ("clock_behind_s", "clock_spread_s", "clock_batches", "heartbeat_s"),
    "rank_down": ("beat_silent_s", "beat_suspect_s"), "hang": ("hang_steps", "hang_min_s"),
    "nccl_config": ("ib_timeout_min", "ib_timeout_scale_ranks"), "congestion": (),
    "checkpoint_overdue": ("ckpt_slack_steps", "ckpt_slack_frac", "ckpt_max_age_s", "gpu_hour_usd"),
    "memory_pressure": ("mem_warn", "mem_error", "persist_steps"), "efficiency": ("mfu_floor",),
}

BUILDERS: dict[str, Callable[[Finding, Thresholds, float, float], list[dict[str, Any]]]] = {
    "data_starvation": _starvation, "straggler": _late_panels, "slow_link": _slow_link,
    "failing_gpu": _failing_gpu, "throttling": _throttling, "node_down": _node_down,
    "cluster_silent": _cluster_silent, "clock_skew": _clock_skew, "rank_down": _stall,
    "hang": _stall, "nccl_config": _nccl, "checkpoint_overdue": _checkpoint, "memory_pressure": _memory,
    "efficiency": _efficiency, "congestion": _congestion,
}


# The parallel-layout kinds (detectors.groups, detectors.loss).
PARAMS |= {"exposed_comm": ("persist_steps", "recent_steps"), "loss_spike": ()}
BUILDERS |= {"exposed_comm": _exposed_comm, "loss_spike": _loss_spike}


def chart(f: Finding, t: Thresholds | None = None, now: float | None = None) -> dict[str, Any]:
    """Everything a page needs to draw the finding's evidence (see the module docstring)."""
    t = t or thresholds()
    t0, t1 = context_range(f, now)
    build = BUILDERS.get(f.kind)
    panels = build(f, t, t0, t1) if build else []
    metrics = (f.evidence or {}).get("metrics") or {}
    used = {name: getattr(t, name) for name in PARAMS.get(f.kind, ())}
    return {"kind": f.kind, "range": [round(t0, 3), round(t1, 3)], "window": evidence_window(f), "panels": panels,
            "numbers": em.flatten(metrics if isinstance(metrics, dict) else {}), "thresholds": used,
            "problems": (f.evidence or {}).get("problems") or []}
