""""Why was step N slow?": one step's window, what every layer did in it, and the most likely cause.

Bounded like the pass: one step's rows (the (run, step) index), and the cluster's samples in a few seconds around
it (the (cluster, ts) indexes).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import numpy as np
from django.db.models import Q

from collectors.xid import describe_xid
from dashboard.diagnosis.detectors.base import SEVERITY_RANK, rnd, robust_z
from dashboard.diagnosis.detectors.network import PORT_ERRORS
from dashboard.diagnosis.live import finding_row
from dashboard.diagnosis.models import Finding
from dashboard.storage import gpu_samples, probe_samples, step_samples
from dashboard.telemetry import models as m

PAD_S = 2.0
STEP_COLS = ("rank", "node__hostname", "ts", "step_time_s", "data_wait_s", "compute_s", "comm_s", "comm_arrive_s",
             "tokens")


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def explain_step(run: m.Run, step: int) -> dict[str, Any] | None:
    rows = step_samples.at_step(run.id, step, STEP_COLS)
    if not rows:
        return None
    t0 = min(r["ts"] - r["step_time_s"] for r in rows)
    t1 = max(r["ts"] for r in rows)
    ranks = {r: (h, g) for r, h, g in m.Rank.objects.filter(run=run).values_list("rank", "node__hostname", "gpu_index")}
    hosts = {h for h, _ in ranks.values() if h} | {r["node__hostname"] for r in rows if r["node__hostname"]}
    gpus = _gpus(run.cluster_id, hosts, t0, t1)
    layers = {"gpus": _gpu_summary(gpus), "nccl": [], "xid": [], "other_events": [],
              "ib": _ports(run.cluster_id, hosts, t0, t1), "probes": _probes(run.cluster_id, t0, t1)}
    _events(run, hosts, t0, t1, layers)
    out_ranks = [_rank_row(r, ranks.get(r["rank"]), gpus) for r in rows]
    findings = _findings(run, hosts, t0, t1)
    baseline = _baseline(run, step)
    return {
        "run": run.id, "step": step, "window": [rnd(t0), rnd(t1)],
        "step_time_s": rnd(float(np.median([r["step_time_s"] for r in rows]))),
        "baseline_step_time_s": rnd(baseline.get("step_time_s")),
        "ranks": out_ranks, "layers": layers, "findings": findings,
        "cause": _cause(run.name, out_ranks, findings, layers, baseline),
    }


def _gpus(cluster_id: int, hosts: set[str], t0: float, t1: float) -> dict[tuple[str, int], dict[str, Any]]:
    acc: dict[tuple[str, int], dict[str, Any]] = {}
    for host, idx, util, clock, cmax, temp, reasons in gpu_samples.around(
            cluster_id, hosts, t0 - PAD_S, t1 + PAD_S,
            ("util_gpu_pct", "sm_clock_mhz", "sm_clock_max_mhz", "temp_c", "throttle_reasons")):
        a = acc.setdefault((host, idx), {"util": [], "clock": [], "max": [], "temp": [], "reasons": set()})
        for key, v in (("util", util), ("clock", clock), ("max", cmax), ("temp", temp)):
            if v is not None:
                a[key].append(v)
        a["reasons"].update(r for r in (reasons or []) if r != "gpu_idle")
    return {k: {"util_gpu_pct": rnd(np.mean(a["util"]), 1) if a["util"] else None,
                "sm_clock_mhz": rnd(min(a["clock"]), 0) if a["clock"] else None,
                "sm_clock_max_mhz": rnd(max(a["max"]), 0) if a["max"] else None,
                "temp_c": rnd(max(a["temp"]), 1) if a["temp"] else None, "throttle_reasons": sorted(a["reasons"])}
            for k, a in acc.items()}


def _gpu_summary(gpus: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    util = [g["util_gpu_pct"] for g in gpus.values() if g["util_gpu_pct"] is not None]
    throttled = sorted(f"{h}/gpu{i}" for (h, i), g in gpus.items() if g["throttle_reasons"])
    return {"gpus": len(gpus), "util_gpu_pct_median": rnd(np.median(util), 1) if util else None,
            "util_gpu_pct_min": rnd(min(util), 1) if util else None, "throttled": throttled[:64]}


def _rank_row(r: dict[str, Any], where: tuple[str | None, int | None] | None,
              gpus: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    host, gpu = where if where else (r["node__hostname"], None)
    row = {"rank": r["rank"], "host": host, "gpu": gpu, "step_time_s": rnd(r["step_time_s"], 4),
           "data_wait_s": rnd(r["data_wait_s"], 4), "compute_s": rnd(r["compute_s"], 4), "comm_s": rnd(r["comm_s"], 4),
           "comm_arrive_s": rnd(r["comm_arrive_s"], 4)}
    row.update(gpus.get((host, gpu), {}) if host is not None and gpu is not None else {})
    return row


def _events(run: m.Run, hosts: set[str], t0: float, t1: float, layers: dict[str, Any]) -> None:
    qs = m.Event.objects.filter(cluster_id=run.cluster_id, ts__gte=_dt(t0 - 5 * PAD_S), ts__lte=_dt(t1 + PAD_S)).filter(
        Q(node__hostname__in=hosts) | Q(run=run)).exclude(kind="checkpoint").order_by("ts")[:500]
    for e in qs.values("ts", "node__hostname", "kind", "severity", "code", "gpu_index", "rank", "message"):
        row = {"ts": e["ts"].timestamp(), "host": e["node__hostname"], "severity": e["severity"], "rank": e["rank"],
               "message": e["message"][:500]}
        if e["kind"] == "xid" and e["code"] is not None:
            info = describe_xid(e["code"])
            layers["xid"].append({**row, "code": e["code"], "gpu": e["gpu_index"], "meaning": info.meaning,
                                  "action": info.action})
        elif e["kind"] == "nccl":
            if e["severity"] != "info":
                layers["nccl"].append(row)
        elif e["severity"] != "info":
            layers["other_events"].append({**row, "kind": e["kind"]})


def _ports(cluster_id: int, hosts: set[str], t0: float, t1: float) -> list[dict[str, Any]]:
    qs = m.PortSample.objects.filter(cluster_id=cluster_id, ts__gte=_dt(t0 - PAD_S), ts__lte=_dt(t1 + PAD_S),
                                     node__hostname__in=hosts)
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for host, dev, port, state, counters in qs.values_list("node__hostname", "device", "port", "state", "counters"):
        errs = {k: v for k, v in (counters or {}).items() if k in PORT_ERRORS and v}
        bad_state = state is not None and not state.upper().endswith("ACTIVE")
        if errs or bad_state:
            o = out.setdefault((host, f"{dev}:{port}"), {"host": host, "port": f"{dev}:{port}", "errors": {},
                                                          "states": set()})
            for k, v in errs.items():
                o["errors"][k] = o["errors"].get(k, 0) + v
            if state:
                o["states"].add(state)
    return [{**o, "states": sorted(o["states"])} for o in out.values()]


def _probes(cluster_id: int, t0: float, t1: float) -> dict[str, Any]:
    pairs = probe_samples.around(cluster_id, t0 - 3 * PAD_S, t1 + PAD_S, ("rtt_ms", "lost", "sent", "bw_gbps"), 20000)
    rtts = [p[2] for p in pairs if p[2] is not None]
    worst = sorted((p for p in pairs if p[2] is not None or p[3]), key=lambda p: (-(p[3] / max(p[4], 1)),
                                                                                   -(p[2] or 0)))[:10]
    return {"pairs": len(pairs), "rtt_ms_median": rnd(np.median(rtts)) if rtts else None,
            "worst": [{"from": a, "to": b, "rtt_ms": rnd(r), "lost": lost, "sent": sent, "bw_gbps": rnd(bw)}
                      for a, b, r, lost, sent, bw in worst]}


def _findings(run: m.Run, hosts: set[str], t0: float, t1: float) -> list[dict[str, Any]]:
    """Findings that held during the step and concern this run, its nodes, or the cluster."""
    qs = Finding.objects.filter(cluster_id=run.cluster_id, opened_at__lte=_dt(t1 + 10)).filter(
        Q(resolved_at__isnull=True) | Q(resolved_at__gte=_dt(t0))).filter(
        Q(run=run) | Q(node__hostname__in=hosts) | Q(subject_type="cluster")).order_by("-opened_at")[:50]
    return [{**finding_row(f), "evidence": f.evidence} for f in qs]


def _baseline(run: m.Run, step: int) -> dict[str, float]:
    qs = step_samples.before(run.id, step, 20, ("step_time_s", "comm_s"))
    vals = np.array([(a, b if b is not None else np.nan) for a, b in qs], dtype=float)
    if not len(vals):
        return {}
    return {"step_time_s": float(np.median(vals[:, 0])), "comm_s": float(np.nanmedian(vals[:, 1]))
            if np.any(~np.isnan(vals[:, 1])) else float("nan")}


def _cause(run_name: str, ranks: list[dict[str, Any]], findings: list[dict[str, Any]], layers: dict[str, Any],
           baseline: dict[str, float]) -> dict[str, Any]:
    if findings:
        best = max(findings, key=lambda f: (SEVERITY_RANK.get(f["severity"], 0), f["confidence"]))
        return {"summary": best["title"], "kind": best["kind"], "subject": best["subject"],
                "confidence": round(float(best["confidence"]), 2)}
    late = _late_rank(run_name, ranks)
    if late is not None:
        return late
    if layers["xid"]:
        x = layers["xid"][-1]
        return {"summary": f"Xid {x['code']} on {x['host']} GPU {x['gpu']}: {x['meaning']}", "kind": "failing_gpu",
                "subject": f"{x['host']}/gpu{x['gpu']}", "confidence": 0.7}
    comm = np.array([r["comm_s"] for r in ranks if r["comm_s"] is not None], dtype=float)
    base = baseline.get("comm_s", float("nan"))
    if len(comm) and np.isfinite(base) and base > 0 and float(np.min(comm)) > 1.5 * base:
        worst = (layers["probes"]["worst"] or [{}])[0]
        subject = worst.get("from") or "cluster"
        return {"summary": f"Every rank spent {np.min(comm):.3f} s or more in communication (usually {base:.3f} s): "
                f"the network; worst probe pair {worst.get('from')}→{worst.get('to')} {worst.get('rtt_ms')} ms",
                "kind": "slow_link", "subject": subject, "confidence": 0.6}
    return {"summary": "Nothing stands out: the ranks' data wait, compute and communication are alike"
            + (f" and the step is within its usual {baseline['step_time_s']:.3f} s" if baseline else ""),
            "kind": "none", "subject": "", "confidence": 0.5}


def _late_rank(run_name: str, ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    if len(ranks) < 3:
        return None
    data = np.array([r["data_wait_s"] if r["data_wait_s"] is not None else np.nan for r in ranks], dtype=float)
    comp = np.array([r["compute_s"] if r["compute_s"] is not None else np.nan for r in ranks], dtype=float)
    arrive = np.array([r["comm_arrive_s"] if r["comm_arrive_s"] is not None else np.nan for r in ranks], dtype=float)
    arrive = np.where(np.isnan(arrive), data + comp, arrive)
    step = float(np.median([r["step_time_s"] for r in ranks]))
    z, med = robust_z(arrive, 0, floor=0.005 * step)
    if np.all(np.isnan(z)):
        return None
    i = int(np.nanargmax(z))
    if not (z[i] > 5 and arrive[i] - med[0] > 0.02 * step):
        return None
    r = ranks[i]
    d_data, d_comp = data[i] - np.nanmedian(data), comp[i] - np.nanmedian(comp)
    conf = round(min(0.95, 0.5 + 0.05 * min(float(z[i]), 9)), 2)
    if np.nan_to_num(d_data) >= np.nan_to_num(d_comp):
        return {"summary": f"Rank {r['rank']} on {r['host']} waited {data[i]:.3f} s for data (others "
                f"{np.nanmedian(data):.3f} s); every other rank waited for it in the all-reduce",
                "kind": "data_starvation", "subject": f"{run_name}/rank{r['rank']}", "confidence": conf}
    clocks = f", SM clock {r.get('sm_clock_mhz')}/{r.get('sm_clock_max_mhz')} MHz" if r.get("sm_clock_mhz") else ""
    return {"summary": f"Rank {r['rank']} on {r['host']} computed {comp[i]:.3f} s (others {np.nanmedian(comp):.3f} s)"
            f"{clocks}; every other rank waited for it", "kind": "straggler", "subject": f"{run_name}/rank{r['rank']}",
            "confidence": conf}
