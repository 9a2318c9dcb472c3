"""A run's settings as its ranks reported them (wire ``RunMeta``), with what differs from the majority, and the NCCL
panel (each rank's transports since the run began, from the NCCL log events; per node; warnings).

NCCL drift is the diagnosis's own rule (:func:`dashboard.diagnosis.detectors.nccl._drift`), so the settings table
and the ``nccl_config`` finding always name the same ranks.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Max, Q, QuerySet
from django.utils import timezone

from dashboard.diagnosis.detectors.nccl import IGNORED, _drift
from dashboard.diagnosis.detectors.window import RankInfo, RunInfo
from dashboard.telemetry import interconnect
from dashboard.telemetry.models import Event, Rank, Run
from dashboard.web.links import gpu_url, node_url, rank_url

RUN_WIDE = ("world_size", "dtype", "params", "flops_per_token", "peak_flops", "gpu_name", "last_checkpoint_step",
            "last_checkpoint_ts")
MAX_DEVIATIONS = 200  # rows of "rank N differs"; a run where half the ranks differ says so with a count


def _ranks(run: Run) -> list[dict[str, Any]]:
    return list(Rank.objects.filter(run=run).order_by("rank").values("rank", "node_id", "node__hostname", "local_rank",
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
#
# What NCCL set up is said once, at communicator init: the agent sends each process's transports once (with the rank
# that printed them), so the panel reads every fact since the run began, never a recent window. The facts are
# aggregated in SQL to their distinct (node, rank, log file, transport, network, GDR) rows: a few per rank however
# long the run, and the same few on PostgreSQL and SQLite.

PRE_START = timedelta(minutes=10)  # NCCL may init before the hooks' first report creates the run
POST_END = timedelta(minutes=10)  # after the run's last step, the node's next job is someone else's
MAX_WARNINGS = 100
MAX_LISTED = 200  # ranks on sockets listed with their links; more are counted
STATE_FACTS = ("transport", "network", "fallback")
# The inter-node transport class of a rank, worst first where a rank has several (one socket connection is enough
# to slow every ring through it).
CLASSES = {"socket": "TCP sockets", "ib": "IB / RoCE without GPUDirect RDMA", "net": "another network plugin",
           "ib_gdr": "IB / RoCE with GPUDirect RDMA", "intra": "intra-node only (P2P, SHM, NVLS)",
           "unknown": "no NCCL connection lines"}
_WORST = list(CLASSES)
_INTRA = ("P2P", "SHM", "NVLS")


def _window(run: Run) -> tuple[datetime, datetime | None]:
    """The run's life, with slack at both ends; a run still stepping (or never stepped) has no end yet."""
    end = run.last_step_at
    if end is not None and timezone.now() - end < POST_END:
        end = None
    return run.created_at - PRE_START, (end + POST_END) if end is not None else None


def _events(run: Run) -> QuerySet[Event]:
    since, until = _window(run)
    qs = Event.objects.filter(cluster_id=run.cluster_id, kind="nccl", ts__gte=since)
    if until is not None:
        qs = qs.filter(ts__lte=until)
    return qs.filter(Q(run=run) | Q(node_id__in=Rank.objects.filter(run=run).values("node_id")))


def _state_rows(run: Run) -> list[dict[str, Any]]:
    """The distinct state facts of the run's NCCL logs: the agent sends each fact once per process, so grouping by
    the whole ``data`` (fact, transport, GDR, network, the log file...) folds what a re-read or a resend repeated,
    and decodes one small JSON per row rather than one per key (SQLite decodes each extracted key on its own)."""
    rows = (_events(run).filter(data__fact__in=STATE_FACTS).values("node_id", "rank", "data")
            .annotate(last=Max("ts")))
    return [{"node_id": r["node_id"], "rank": r["rank"], "last": r["last"],
             **{f"data__{k}": _text((r["data"] or {}).get(k)) for k in _DATA_KEYS}} for r in rows]


_DATA_KEYS = ("fact", "transport", "network", "gdr", "nranks", "file", "reason")


def _text(v: Any) -> str | None:
    return v if v is None or isinstance(v, str) else str(v)


def _label(transport: str, gdr: str | None) -> str:
    if transport == "Socket":  # NCCL calls every NET connection without GPUDirect "no GDR"; sockets never have it
        return transport
    return f"{transport} (GDR)" if gdr == "true" else f"{transport} (no GDR)" if gdr == "false" else transport


def _class(transports: set[tuple[str, str | None]], networks: set[str]) -> str:
    found = {"unknown"}
    for name, gdr in transports:
        if name.startswith(_INTRA):
            found.add("intra")
        elif name == "Socket":
            found.add("socket")
        elif name == "IB":
            found.add("ib_gdr" if gdr == "true" else "ib")
        else:
            found.add("net")
    if "Socket" in networks and not transports:
        found.add("socket")  # "Using network Socket" without connection lines (NCCL_DEBUG_SUBSYS without GRAPH)
    return next(c for c in _WORST if c in found)


def _per_rank(run: Run, ranks: list[dict[str, Any]], rows: list[dict[str, Any]],
              node_ids: dict[int, str]) -> dict[int, dict[str, Any]]:
    """Each rank's transports and networks from its newest NCCL log (a restarted process writes a new one). A fact
    counts for a rank only where the run's rank runs on the fact's node, and not when it came from a smaller
    communicator than the world (a subgroup numbers its ranks from 0)."""
    where = {r["rank"]: r["node__hostname"] for r in ranks}
    world = run.world_size
    newest: dict[int, tuple[Any, Any]] = {}  # rank -> (file, its newest fact)
    mine: list[tuple[int, dict[str, Any]]] = []
    for row in rows:
        rank = row["rank"]
        if rank is None or where.get(rank) is None or where[rank] != node_ids.get(row["node_id"]):
            continue
        if world and row["data__nranks"] and row["data__nranks"] != str(world):
            continue
        mine.append((rank, row))
        have = newest.get(rank)
        if have is None or row["last"] > have[1]:
            newest[rank] = (row["data__file"], row["last"])
    out: dict[int, dict[str, Any]] = {}
    for rank, row in mine:
        if row["data__file"] != newest[rank][0]:
            continue
        got = out.setdefault(rank, {"transports": set(), "networks": set()})
        if row["data__fact"] == "transport" and row["data__transport"]:
            got["transports"].add((row["data__transport"], row["data__gdr"]))
        elif row["data__fact"] == "network" and row["data__network"]:
            got["networks"].add(row["data__network"])
    return out


def _rank_strip(run: Run, ranks: list[dict[str, Any]], per: dict[int, dict[str, Any]], urls: dict[str, str],
                socket_expected: bool) -> dict[str, Any]:
    """The ranks in node order (then local rank), each with its class and its transports as an index into
    ``combos``: compact columns for a strip of thousands of cells, plus the ranks on sockets, linked."""
    ordered = sorted(ranks, key=lambda r: (r["node__hostname"] or "~", r["local_rank"] if r["local_rank"] is not None
                                           else r["rank"], r["rank"]))
    combos: dict[str, int] = {}
    order, cls, combo, nodes, on_socket = [], [], [], [], []
    counts = Counter[str]()
    by_transport = Counter[str]()
    for r in ordered:
        got = per.get(r["rank"], {"transports": set(), "networks": set()})
        c = _class(got["transports"], got["networks"])
        text = " · ".join(sorted(_label(t, g) for t, g in got["transports"])) or (
            "network " + ", ".join(sorted(got["networks"])) if got["networks"] else "–")
        host = r["node__hostname"]
        if not nodes or nodes[-1]["host"] != host:
            nodes.append({"host": host, "url": urls.get(host), "first": len(order),
                          "count": 0})
        nodes[-1]["count"] += 1
        order.append(r["rank"])
        cls.append(_WORST.index(c))
        combo.append(combos.setdefault(text, len(combos)))
        counts[c] += 1
        by_transport.update({t for t, _ in got["transports"]})
        if c == "socket":
            on_socket.append(r)
    listed = [{**rank_links(run, r["rank"], r["node__hostname"], r["gpu_index"]),
               "transports": sorted(_label(t, g) for t, g in per.get(r["rank"], {}).get("transports", ()))}
              for r in on_socket[:MAX_LISTED]]
    return {"classes": [{"key": k, "label": v, "ranks": counts[k], "suspect": k == "socket" and socket_expected}
                        for k, v in CLASSES.items()],
            "transports": dict(by_transport.most_common()), "order": order, "cls": cls, "combo": combo,
            "combos": list(combos), "nodes": nodes, "socket": listed, "socket_count": len(on_socket),
            # rank N's page is this prefix + N + "/" (no directory of thousands of links)
            "rank_url_prefix": rank_url(run.id, 0).rsplit("/0/", 1)[0] + "/"}


def nccl_panel(run: Run) -> dict[str, Any]:
    """Per rank: the transport class NCCL set up since the run began, ordered by node for a strip, with the ranks on
    sockets linked; per node: the transports, network and GDR its NCCL logs reported, the env flags that force
    sockets, its warnings; and the newest warnings with their node and rank linked."""
    ranks = list(Rank.objects.filter(run=run).order_by("rank").values(
        "rank", "node_id", "node__hostname", "local_rank", "gpu_index", "meta__env"))  # not the whole RunMeta
    cluster = run.cluster.name
    kind = interconnect.effective(run.cluster)
    socket_expected = kind != "eth"
    per: dict[str, dict[str, Any]] = {}
    for r in ranks:
        host = r["node__hostname"]
        if not host:
            continue
        row = per.get(host) or per.setdefault(host, {
            "host": host, "url": node_url(cluster, host), "ranks": [], "transports": set(), "networks": set(),
            "gdr": set(), "env": set(), "warnings": 0, "facts": set()})
        row["ranks"].append(r["rank"])
        env = r["meta__env"] if isinstance(r["meta__env"], dict) else {}
        for key in ("NCCL_IB_DISABLE", "NCCL_NET", "NCCL_NET_GDR_LEVEL", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"):
            if key in env:
                row["env"].add(f"{key}={env[key]}")
    rows = _state_rows(run)
    node_ids = {r["node_id"]: r["node__hostname"] for r in ranks if r["node_id"] is not None}
    for fact in rows:
        row = per.get(node_ids.get(fact["node_id"], ""))
        if row is None:
            continue
        if fact["data__transport"]:
            row["transports"].add(fact["data__transport"])
        if fact["data__network"]:
            row["networks"].add(fact["data__network"])
        if fact["data__gdr"] and fact["data__transport"] != "Socket":
            row["gdr"].add(fact["data__gdr"])
        if fact["data__fact"] == "fallback":
            row["facts"].add(f"fallback: {fact['data__reason'] or ''}")
    loud = _events(run).exclude(severity="info")
    for node_id, n in loud.values_list("node_id").annotate(n=Count("id")):
        if node_ids.get(node_id) in per:
            per[node_ids[node_id]]["warnings"] = n
    warnings = [{"ts": e["ts"].timestamp(), "host": (host := e["node__hostname"] or (e["data"] or {}).get("host")),
                 "node_url": node_url(cluster, host) if host else None, "severity": e["severity"], "rank": e["rank"],
                 "rank_url": rank_url(run.id, e["rank"]) if e["rank"] is not None else None,
                 "message": e["message"][:500]}
                for e in loud.order_by("-ts").values("ts", "node__hostname", "severity", "rank", "message",
                                                     "data")[:MAX_WARNINGS]]
    nodes = [{**row, "ranks": row["ranks"][:64], "n_ranks": len(row["ranks"]),
              **{k: sorted(row[k]) for k in ("transports", "networks", "gdr", "env", "facts")},
              "suspect": _suspect(row, socket_expected)} for row in per.values()]
    nodes.sort(key=lambda n: (not n["suspect"], -n["warnings"], n["host"]))
    strip = _rank_strip(run, ranks, _per_rank(run, ranks, rows, node_ids), {h: r["url"] for h, r in per.items()},
                        socket_expected)
    return {"run": run.id, "interconnect": kind, "socket_expected": socket_expected, "ranks": strip, "nodes": nodes,
            "warnings": warnings}


def _suspect(row: dict[str, Any], socket_expected: bool = True) -> bool:
    """Sockets where IB was expected, GDR off, or a flag that forces either."""
    sockets = "Socket" in row["transports"] or "Socket" in row["networks"] or any(
        f in row["env"] for f in ("NCCL_IB_DISABLE=1", "NCCL_NET=Socket"))
    return ((sockets and socket_expected) or "false" in row["gdr"] or bool(row["facts"])
            or any(f in row["env"] for f in ("NCCL_NET_GDR_LEVEL=0", "NCCL_NET_GDR_LEVEL=LOC")))
