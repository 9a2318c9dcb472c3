"""NCCL misconfiguration: NCCL_* drift across ranks, socket transport or IB disabled on an IB cluster, GPUDirect RDMA
off, and an IB timeout too low for the scale. Facts come from each rank's environment (RunMeta.env, kept as state)
and from the NCCL log events the agents parse (transport, network, GDR)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from dashboard.diagnosis.detectors.base import SEVERITY_RANK, Detection, Thresholds
from dashboard.diagnosis.detectors.window import RunInfo, Window

# Variables that legitimately differ per rank or only change logging.
IGNORED = {"NCCL_DEBUG", "NCCL_DEBUG_FILE", "NCCL_DEBUG_SUBSYS", "NCCL_COMM_ID", "NCCL_HOSTID"}


def _nccl_env(meta: dict[str, Any]) -> dict[str, str]:
    env = meta.get("env") or {}
    return {k: v for k, v in env.items() if k.startswith(("NCCL_", "TORCH_NCCL_")) and k not in IGNORED}


def _drift(run: RunInfo) -> dict[int, dict[str, tuple[str | None, str | None]]]:
    """rank -> {var: (its value, the majority's)} for ranks that differ from the majority."""
    envs = {r: _nccl_env(info.meta) for r, info in run.ranks.items() if info.meta.get("env") is not None}
    if len(envs) < 3:
        return {}
    out: dict[int, dict[str, tuple[str | None, str | None]]] = {}
    for var in set().union(*envs.values()):
        values = Counter(e.get(var) for e in envs.values())
        common, n = values.most_common(1)[0]
        if n <= len(envs) / 2 or n == len(envs):
            continue
        for r, e in envs.items():
            if e.get(var) != common:
                out.setdefault(r, {})[var] = (e.get(var), common)
    return out


def _socket_facts(w: Window) -> dict[str, list[str]]:
    """host -> what its NCCL logs or ranks say about falling back to sockets / GDR off."""
    facts: dict[str, list[str]] = {}
    if w.interconnect != "ib":
        return facts
    for e in w.events:
        data = e.get("data") or {}
        host = e.get("node") or data.get("host")
        if e["kind"] != "nccl" or not host:
            continue
        if data.get("transport") == "Socket" or data.get("network") == "Socket":
            facts.setdefault(host, []).append("NCCL uses the socket transport (NET/Socket)")
        elif data.get("fact") == "fallback":
            facts.setdefault(host, []).append(f"NCCL found no IB device ({data.get('reason', '')})")
        elif data.get("gdr") == "false" and data.get("transport") == "IB":
            facts.setdefault(host, []).append("GPUDirect RDMA is off (IB without GDRDMA)")
    for run in w.runs:
        for info in run.ranks.values():
            env = _nccl_env(info.meta)
            if info.node and (env.get("NCCL_IB_DISABLE") == "1" or env.get("NCCL_NET", "").lower() == "socket"):
                facts.setdefault(info.node, []).append(
                    "NCCL_IB_DISABLE=1" if env.get("NCCL_IB_DISABLE") == "1" else f"NCCL_NET={env['NCCL_NET']}")
            if info.node and env.get("NCCL_NET_GDR_LEVEL") in ("0", "LOC"):
                facts.setdefault(info.node, []).append(f"NCCL_NET_GDR_LEVEL={env['NCCL_NET_GDR_LEVEL']} (GDR off)")
    return {h: sorted(set(f)) for h, f in facts.items()}


def nccl_config(w: Window, t: Thresholds) -> list[Detection]:
    out: dict[str, Detection] = {}
    for host, facts in _socket_facts(w).items():
        socket = any("socket" in f.lower() or "IB_DISABLE" in f or "no IB" in f for f in facts)
        out[host] = Detection(
            "nccl_config", "node", host, "error" if socket else "warning",
            f"NCCL on {host} " + ("falls back to sockets on an InfiniBand cluster" if socket else "runs without GDR"),
            f"{'; '.join(facts)} → unset NCCL_IB_DISABLE / NCCL_NET, check that the IB devices and drivers are "
            "visible on that node (ibv_devinfo, NCCL_IB_HCA), and that nvidia-peermem is loaded for GPUDirect RDMA; "
            "every all-reduce runs at the speed of this node's slowest path.",
            {"metrics": {"facts": facts}}, 0.95, node=host)
    for run in w.runs:
        for det in _drift_detections(run) + _timeout_detections(run, t):
            if det.subject in out:
                prev = out[det.subject]
                prev.action += " Also: " + det.title + "."
                if SEVERITY_RANK[det.severity] > SEVERITY_RANK[prev.severity]:
                    prev.severity = det.severity
            else:
                out[det.subject] = det
    return list(out.values())


def _drift_detections(run: RunInfo) -> list[Detection]:
    drift = _drift(run)
    if not drift:
        return []
    by_node: dict[str, list[int]] = {}
    for r in drift:
        node = run.ranks[r].node
        if node:
            by_node.setdefault(node, []).append(r)
    out, covered = [], set()
    for node, ranks in by_node.items():
        on_node = [r for r, i in run.ranks.items() if i.node == node]
        same = len({tuple(sorted(drift[r].items())) for r in ranks}) == 1
        if len(on_node) >= 2 and sorted(ranks) == sorted(on_node) and same:
            out.append(_drift_detection(run, "node", node, ranks, drift[ranks[0]], node=node))
            covered.update(ranks)
    for r, diff in sorted(drift.items()):
        if r not in covered:
            out.append(_drift_detection(run, "rank", f"{run.name}/rank{r}", [r], diff, node=run.ranks[r].node))
    return out


def _drift_detection(run: RunInfo, stype: str, subject: str, ranks: list[int],
                     diff: dict[str, tuple[str | None, str | None]], node: str | None) -> Detection:
    shown = ", ".join(f"{k}={v if v is not None else '(unset)'} (others: {c if c is not None else '(unset)'})"
                      for k, (v, c) in sorted(diff.items()))
    who = f"rank {ranks[0]}" if stype == "rank" else f"every rank on {subject}"
    return Detection(
        "nccl_config", stype, subject, "warning", f"NCCL settings of {who} differ from the rest of {run.name}",
        f"{who.capitalize()} runs with {shown} → launch every rank with the same NCCL_* environment (check the "
        "launcher, the node's /etc/nccl.conf and its module files); mismatched settings cause hangs or slow "
        "collectives.",
        {"metrics": {"ranks": ranks[:64], "differences": {k: {"value": v, "others": c} for k, (v, c) in diff.items()}}},
        0.95, node=node, rank=ranks[0] if stype == "rank" else None, run=run.name)


def _timeout_detections(run: RunInfo, t: Thresholds) -> list[Detection]:
    values = Counter(_nccl_env(i.meta).get("NCCL_IB_TIMEOUT") for i in run.ranks.values())
    if not values:
        return []
    common = values.most_common(1)[0][0]
    world = run.world_size or len(run.ranks)
    try:
        timeout = int(common) if common is not None else None
    except ValueError:
        return []
    if timeout is None or world < t.ib_timeout_scale_ranks or timeout >= t.ib_timeout_min:
        return []
    return [Detection(
        "nccl_config", "run", run.name, "warning",
        f"NCCL_IB_TIMEOUT={timeout} is low for {world} ranks",
        f"NCCL_IB_TIMEOUT={timeout} gives each IB retry 4.096 µs × 2^{timeout} ≈ {4.096e-6 * 2 ** timeout * 1e3:.0f} ms; "
        f"at {world} ranks congestion outlasts that and collectives fail with IB timeouts → set NCCL_IB_TIMEOUT to "
        "20-22 for every rank.", {"metrics": {"NCCL_IB_TIMEOUT": timeout, "world_size": world}}, 0.8, run=run.name)]
