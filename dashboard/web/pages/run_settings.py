"""A run's settings as its ranks reported them (wire ``RunMeta``), with what differs from the majority, and the NCCL
panel (transport per node from the NCCL log events, warnings).

NCCL drift is the diagnosis's own rule (:func:`dashboard.diagnosis.detectors.nccl._drift`), so the settings table
and the ``nccl_config`` finding always name the same ranks.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from django.db.models import Q

from dashboard.diagnosis.detectors.nccl import IGNORED, _drift
from dashboard.diagnosis.detectors.window import RankInfo, RunInfo
from dashboard.telemetry import interconnect
from dashboard.telemetry.models import Event, Rank, Run
from dashboard.web.links import gpu_url, node_url, rank_url

RUN_WIDE = ("world_size", "dtype", "params", "flops_per_token", "peak_flops", "gpu_name", "last_checkpoint_step",
            "last_checkpoint_ts")
MAX_DEVIATIONS = 200  # rows of "rank N differs"; a run where half the ranks differ says so with a count
MAX_NCCL_EVENTS = 5000


def _ranks(run: Run) -> list[dict[str, Any]]:
    return list(Rank.objects.filter(run=run).order_by("rank").values("rank", "node__hostname", "local_rank",
                                                                     "gpu_index", "meta"))


def rank_links(run: Run, rank: int, host: str | None, gpu: int | None) -> dict[str, Any]:
    cluster = run.cluster.name
    return {"rank": rank, "url": rank_url(run.id, rank), "host": host,
            "node_url": node_url(cluster, host) if host else None, "gpu": gpu,
            "gpu_url": gpu_url(cluster, host, gpu) if host and gpu is not None else None}


def _majority(run: Run, ranks: list[dict[str, Any]], section: str) -> dict[str, Any]:
    """A dict section of RunMeta (dataloader, versions, parallel): the majority's value of each key and the ranks
    whose value differs (a rank with 2 DataLoader workers among ranks with 8)."""
    per = {r["rank"]: (r["meta"] or {}).get(section) for r in ranks}
    per = {k: v for k, v in per.items() if isinstance(v, dict)}
    keys = sorted(set().union(*per.values())) if per else []
    values: dict[str, Any] = {}
    deviations: list[dict[str, Any]] = []
    where = {r["rank"]: r for r in ranks}
    for key in keys:
        counts = Counter(_hashable(v.get(key)) for v in per.values())
        common, n = counts.most_common(1)[0]
        values[key] = {"value": common, "ranks": n, "distinct": len(counts)}
        for rank, v in per.items():
            if _hashable(v.get(key)) != common:
                deviations.append({**rank_links(run, rank, where[rank]["node__hostname"], where[rank]["gpu_index"]),
                                   "key": key, "value": v.get(key), "majority": common})
    return {"values": values, "ranks": len(per), "deviations": deviations[:MAX_DEVIATIONS],
            "deviating": len(deviations)}


def _hashable(v: Any) -> Any:
    return repr(v) if isinstance(v, dict | list) else v


def _env(run: Run, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The majority's NCCL / torch.distributed environment, and each rank that differs (the detector's rule)."""
    info = RunInfo(run.name, run.world_size, run.meta or {},
                   {r["rank"]: RankInfo(r["node__hostname"], r["gpu_index"], r["meta"] or {}) for r in ranks})
    drift = _drift(info)
    envs = [(r["meta"] or {}).get("env") for r in ranks]
    envs = [e for e in envs if isinstance(e, dict)]
    values = {}
    for key in sorted(set().union(*envs)) if envs else []:
        counts = Counter(e.get(key) for e in envs)
        common, n = counts.most_common(1)[0]
        values[key] = {"value": common, "ranks": n, "distinct": len(counts), "ignored": key in IGNORED,
                       "drift": any(key in d for d in drift.values())}
    where = {r["rank"]: r for r in ranks}
    rows = [{**rank_links(run, rank, where[rank]["node__hostname"], where[rank]["gpu_index"]), "key": key,
             "value": v, "majority": c}
            for rank, diff in sorted(drift.items()) for key, (v, c) in sorted(diff.items())]
    return {"values": values, "ranks": len(envs), "drift": rows[:MAX_DEVIATIONS], "drifting_ranks": len(drift)}


def run_settings(run: Run) -> dict[str, Any]:
    ranks = _ranks(run)
    meta = run.meta or {}
    nodes = sorted({r["node__hostname"] for r in ranks if r["node__hostname"]})
    return {
        "run": run.id, "name": run.name, "world_size": run.world_size, "ranks_reporting": len(ranks),
        "nodes": len(nodes), "run_wide": {k: meta.get(k) for k in RUN_WIDE if k != "world_size"},
        "parallel": meta.get("parallel") or {}, "versions_majority": meta.get("versions") or {},
        "env": _env(run, ranks), "dataloader": _majority(run, ranks, "dataloader"),
        "versions": _majority(run, ranks, "versions"), "parallel_ranks": _majority(run, ranks, "parallel"),
        "layout": _layout(run, ranks),
    }


def _layout(run: Run, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The parallel layout the hooks found (strategy, mesh, ZeRO stage, offload, checkpointing, batch), as the
    majority reported it; each rank's own mesh coordinates are not a drift."""
    sec = _majority(run, ranks, "layout")
    sec["values"].pop("coords", None)
    sec["deviations"] = [d for d in sec["deviations"] if d["key"] != "coords"]
    sec["deviating"] = len(sec["deviations"])
    mesh = sec["values"].get("mesh")
    if mesh:  # "dp=2 × tp=4", not a dict's repr
        real = next((r["meta"]["layout"]["mesh"] for r in ranks
                     if _hashable(((r["meta"] or {}).get("layout") or {}).get("mesh")) == mesh["value"]), None)
        if isinstance(real, dict):
            mesh["value"] = " × ".join(f"{k}={v}" for k, v in real.items())
    return sec


# -- NCCL panel --------------------------------------------------------------------------------------------------

def nccl_panel(run: Run) -> dict[str, Any]:
    """Per node: the transports, network and GDR its NCCL logs reported, the env flags that force sockets, its
    warnings; and the newest warnings with their node and rank linked."""
    ranks = _ranks(run)
    cluster = run.cluster.name
    per: dict[str, dict[str, Any]] = {}
    for r in ranks:
        host = r["node__hostname"]
        if not host:
            continue
        row = per.setdefault(host, {"host": host, "url": node_url(cluster, host), "ranks": [], "transports": set(),
                                    "networks": set(), "gdr": set(), "env": set(), "warnings": 0, "facts": set()})
        row["ranks"].append(r["rank"])
        env = (r["meta"] or {}).get("env") or {}
        for key in ("NCCL_IB_DISABLE", "NCCL_NET", "NCCL_NET_GDR_LEVEL", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"):
            if key in env:
                row["env"].add(f"{key}={env[key]}")
    qs = (Event.objects.filter(cluster_id=run.cluster_id, kind="nccl")
          .filter(Q(run=run) | Q(node__hostname__in=list(per))).order_by("-ts")[:MAX_NCCL_EVENTS])
    warnings = []
    for e in qs.values("ts", "node__hostname", "severity", "rank", "message", "data"):
        data = e["data"] or {}
        host = e["node__hostname"] or data.get("host")
        row = per.get(host) if host else None
        if row is not None:
            if data.get("transport"):
                row["transports"].add(data["transport"])
            if data.get("network"):
                row["networks"].add(data["network"])
            if data.get("gdr"):
                row["gdr"].add(data["gdr"])
            if data.get("fact") == "fallback":
                row["facts"].add(f"fallback: {data.get('reason', '')}")
        if e["severity"] != "info":
            if row is not None:
                row["warnings"] += 1
            if len(warnings) < 100:
                warnings.append({"ts": e["ts"].timestamp(), "host": host,
                                 "node_url": node_url(cluster, host) if host else None, "severity": e["severity"],
                                 "rank": e["rank"], "rank_url": rank_url(run.id, e["rank"]) if e["rank"] is not None
                                 else None, "message": e["message"][:500]})
    nodes = [{**row, "ranks": row["ranks"][:64], "n_ranks": len(row["ranks"]),
              **{k: sorted(row[k]) for k in ("transports", "networks", "gdr", "env", "facts")},
              "suspect": _suspect(row)} for row in per.values()]
    nodes.sort(key=lambda n: (not n["suspect"], -n["warnings"], n["host"]))
    return {"run": run.id, "interconnect": interconnect.effective(run.cluster), "nodes": nodes, "warnings": warnings}


def _suspect(row: dict[str, Any]) -> bool:
    """Sockets where IB was expected, GDR off, or a flag that forces either."""
    return ("Socket" in row["transports"] or "Socket" in row["networks"] or "false" in row["gdr"]
            or bool(row["facts"]) or any(f in row["env"] for f in ("NCCL_IB_DISABLE=1", "NCCL_NET=Socket",
                                                                   "NCCL_NET_GDR_LEVEL=0", "NCCL_NET_GDR_LEVEL=LOC")))
