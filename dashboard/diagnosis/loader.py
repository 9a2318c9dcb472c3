"""Builds a detector :class:`Window` from the database: one bounded index range scan per series.

Every query is ``WHERE cluster_id = ? AND ts >= ?`` (the (cluster, ts) indexes) or, for steps, ``run_id = ? AND
step > ?`` (the (run, step) index), so a pass reads the same amount of data whatever the retention. Rows are read
with raw SQL returning epoch seconds: the ORM's datetime objects would cost more than everything else together.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
from django.db import connection
from django.db.models import Max, Min

from dashboard.diagnosis.detectors.window import (
    GPU_NUM,
    GPU_OBJ,
    LOSS_SPAN,
    PORT_NUM,
    PORT_OBJ,
    PROBE_NUM,
    SPANS,
    STEP_NUM,
    STEP_OBJ,
    STEP_SPAN,
    RankInfo,
    RunInfo,
    Table,
    Window,
    bus_key,
)
from dashboard.live.state import get_state
from dashboard.telemetry import interconnect
from dashboard.telemetry import models as m

ACTIVE_RUN_S = 3600.0  # runs that stepped within this long are examined (a longer stall is not a hang any more)
EXPECTED_NODE_S = 86400.0  # nodes heard from within this long are expected to keep reporting
MAX_EVENTS = 5000


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def _epoch(col: str = "ts") -> str:
    if connection.vendor == "postgresql":
        return f"EXTRACT(EPOCH FROM {col})::float8"
    return f"(julianday({col}) - 2440587.5) * 86400.0"


def _json(v: Any) -> Any:
    return json.loads(v) if isinstance(v, str) else v


def _rows(model: type, columns: list[str], where: str, params: list[Any]) -> list[tuple[Any, ...]]:
    sql = f"SELECT {', '.join(columns)} FROM {connection.ops.quote_name(model._meta.db_table)} WHERE {where}"
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


def _read(model: type, num: list[str], obj: list[str], where: str,
          params: list[Any]) -> tuple[np.ndarray, list[list[Any]]]:
    """(numeric columns as one float matrix, one row per column; the object columns as lists). The numeric part
    goes from the cursor's rows to floats in one C-level conversion (None -> NaN): no per-column Python pass. The
    matrix is the transposed view, not a copy: at 2,048 nodes a copy of the GPU window cost a third of a second, and
    columns are only read whole or by fancy indexing, which strides cost nothing to."""
    rows = _rows(model, [*num, *obj], where, params)
    k = len(num)
    if not rows:
        return np.empty((k, 0)), [[] for _ in obj]
    mat = np.array([r[:k] for r in rows] if obj else rows, dtype=float).T
    return mat, [[r[j] for r in rows] for j in range(k, k + len(obj))]


def _objs(col: list[Any], decode: bool = True) -> np.ndarray:
    """JSON cells decoded once per distinct text: most rows repeat a handful of values ("[]", null, the same
    counters). Equal cells share one decoded object; the detectors only read them."""
    memo: dict[Any, Any] = {}
    if not decode:
        return np.fromiter(col, dtype=object, count=len(col))

    def dec(v: Any) -> Any:
        if not isinstance(v, str):
            return v
        got = memo.get(v)
        if got is None:
            got = memo[v] = json.loads(v)
        return got

    return np.fromiter(map(dec, col), dtype=object, count=len(col))


def _node_lut(by_id: dict[int, int]) -> np.ndarray:
    lut = np.full(max(by_id, default=0) + 1, -1.0)
    lut[list(by_id)] = list(by_id.values())
    return lut


def _known(mat: np.ndarray, objs: list[list[Any]], lut: np.ndarray) -> tuple[np.ndarray, list[list[Any]]]:
    """Only the rows of nodes in this pass's inventory: a node that ingest created after the inventory was read (a
    new agent at scale) waits for the next pass instead of failing this one."""
    if not mat.shape[1]:
        return mat, objs
    ids = mat[0].astype(np.int64)
    ok = ids < len(lut)
    ok[ok] = lut[ids[ok]] >= 0
    if ok.all():
        return mat, objs
    keep = np.nonzero(ok)[0]
    return mat[:, ok], [[col[i] for i in keep] for col in objs]


def _table(mat: np.ndarray, objs: list[list[Any]], num: tuple[str, ...], obj: tuple[str, ...], lut: np.ndarray,
           text: tuple[str, ...] = ()) -> Table:
    """``mat`` rows in ``num`` order, the first one a node id (mapped to the node's index); the ``obj`` columns are
    JSON, except those named in ``text``."""
    out = {num[0]: lut[mat[0].astype(np.int64)]}
    out.update({c: mat[i] for i, c in enumerate(num) if i})
    return Table(out, {c: _objs(v, c not in text) for c, v in zip(obj, objs, strict=True)})


def _since(cluster_id: int, now: float, span: float) -> tuple[str, list[Any]]:
    return "cluster_id = %s AND ts >= %s", [cluster_id, connection.ops.adapt_datetimefield_value(_dt(now - span))]


def load_window(cluster: m.Cluster, now: float, beats: list[dict[str, Any]] | None = None) -> Window:
    """``beats``: the ranks' latest beats when the caller has them (the pass's own process cannot see the embedded
    server's in-memory live state); by default read from the live state."""
    nodes_rows = list(m.Node.objects.filter(cluster=cluster).values_list("id", "hostname", "agent_id", "last_seen"))
    hostnames = sorted(h for _, h, _, _ in nodes_rows)
    index = {h: i for i, h in enumerate(hostnames)}
    by_id = {nid: index[h] for nid, h, _, _ in nodes_rows}
    lut = _node_lut(by_id)
    gpus = _gpus(cluster.id, now, lut)
    ports = _ports(cluster.id, now, lut)
    probes = _probes(cluster.id, now, lut, hostnames, index)
    runs, steps, losses = _runs(cluster, now)
    w = Window(now=now, nodes=hostnames, steps=steps, gpus=gpus, ports=ports, probes=probes,
               events=_events(cluster.id, now), hosts=_hosts(cluster.id, now, by_id, hostnames), runs=runs,
               last_heard={}, interconnect=cluster.nccl_interconnect(), gpu_bus=_gpu_bus(cluster), span=dict(SPANS))
    w.last_heard = _last_heard(w, nodes_rows, index, now)
    w.beats = get_state().beats(cluster.id) if beats is None else beats
    w.nccl_state = _nccl_state(cluster.id, runs)
    w.losses = losses
    w.places, w.fabric = _places(cluster), interconnect.effective(cluster)
    return w


def _places(cluster: m.Cluster) -> dict[str, tuple[str, str]]:
    """host -> (rack, switch) of the nodes whose place is known (a separate small read: most clusters know none)."""
    rows = m.Node.objects.filter(cluster=cluster).exclude(rack="", switch="").values_list("hostname", "rack", "switch")
    return {h: (r, s) for h, r, s in rows}


NCCL_STATE_FACTS = ["transport", "network", "fallback", "net_devices", "interfaces"]
MAX_NCCL_STATE = 2000


def _nccl_state(cluster_id: int, runs: list[RunInfo]) -> list[dict[str, Any]]:
    """The NCCL transport facts since the oldest active run began (the agent sends each once per log file, so
    these are few): the detector holds a socket fallback for the run's life, not the 120 s event window."""
    if not runs:
        return []
    began = m.Run.objects.filter(id__in=[r.id for r in runs]).aggregate(t=Min("created_at"))["t"]
    if began is None:
        return []
    qs = (m.Event.objects.filter(cluster_id=cluster_id, kind="nccl", ts__gte=began, data__fact__in=NCCL_STATE_FACTS)
          .order_by("-ts")[:MAX_NCCL_STATE])
    return [{"ts": e["ts"].timestamp(), "node": e["node__hostname"], "kind": "nccl", "data": e["data"]}
            for e in qs.values("ts", "node__hostname", "data")]


def _gpus(cluster_id: int, now: float, lut: np.ndarray) -> Table:
    where, params = _since(cluster_id, now, SPANS["gpus"])
    mat, objs = _known(*_read(m.GpuSample, ["node_id", "gpu_index", _epoch(), *GPU_NUM[3:]], list(GPU_OBJ), where,
                              params), lut)
    return _table(mat, objs, GPU_NUM, GPU_OBJ, lut)


def _ports(cluster_id: int, now: float, lut: np.ndarray) -> Table:
    where, params = _since(cluster_id, now, SPANS["ports"])
    mat, objs = _known(*_read(m.PortSample, ["node_id", _epoch(), "port", "rate_gbps"], list(PORT_OBJ), where, params),
                       lut)
    return _table(mat, objs, PORT_NUM, PORT_OBJ, lut, text=("device", "state"))


def _probes(cluster_id: int, now: float, lut: np.ndarray, hostnames: list[str], index: dict[str, int]) -> Table:
    where, params = _since(cluster_id, now, SPANS["probes"])
    mat, (peer,) = _known(*_read(m.Probe, ["node_id", _epoch(), "sent", "lost", "rtt_ms", "bw_gbps"], ["peer"], where,
                                 params), lut)
    names = sorted(set(peer))
    for name in names:
        if name not in index:  # a peer without an agent (an address, or a host we have not heard from)
            index[name] = len(hostnames)
            hostnames.append(name)
    # Peer names map through their few distinct values, not row by row.
    codes = {name: i for i, name in enumerate(names)}
    peer_lut = np.array([index[n] for n in names], dtype=float)
    peers = peer_lut[np.fromiter(map(codes.__getitem__, peer), dtype=np.int64, count=len(peer))] \
        if names else np.empty(0)
    table = _table(mat, [], ("node", "ts", "sent", "lost", "rtt_ms", "bw_gbps"), (), lut)
    table.num = {"node": table.num["node"], "peer": peers, **{c: table.num[c] for c in PROBE_NUM[2:]}}
    return table


def _hosts(cluster_id: int, now: float, by_id: dict[int, int], hostnames: list[str]) -> dict[str, dict[str, Any]]:
    where, params = _since(cluster_id, now, SPANS["hosts"])
    out: dict[str, dict[str, Any]] = {}
    for node_id, ts, cpu, nfs in _rows(m.HostSample, ["node_id", _epoch(), "cpu_pct", "nfs"], where, params):
        if node_id not in by_id:  # created after this pass read the inventory (see _known)
            continue
        host = hostnames[by_id[node_id]]
        if host not in out or ts > out[host]["ts"]:
            out[host] = {"ts": ts, "cpu_pct": cpu, "nfs": nfs}
    for h in out.values():  # only the newest sample's mounts are decoded
        h["nfs"] = _json(h["nfs"])
    return out


def _events(cluster_id: int, now: float) -> list[dict[str, Any]]:
    qs = (m.Event.objects.filter(cluster_id=cluster_id, ts__gte=_dt(now - SPANS["events"])).exclude(kind="checkpoint")
          .order_by("-ts")[:MAX_EVENTS])
    out = []
    for e in qs.values("ts", "node__hostname", "kind", "severity", "code", "gpu_index", "pci_bus_id", "run__name",
                       "rank", "step", "message", "data"):
        out.append({"ts": e["ts"].timestamp(), "node": e["node__hostname"], "kind": e["kind"],
                    "severity": e["severity"], "code": e["code"], "gpu_index": e["gpu_index"],
                    "pci_bus_id": e["pci_bus_id"], "run": e["run__name"], "rank": e["rank"], "step": e["step"],
                    "message": e["message"], "data": e["data"]})
    out.reverse()
    return out


def _runs(cluster: m.Cluster, now: float) -> tuple[list[RunInfo], Table, dict[str, np.ndarray]]:
    runs = list(m.Run.objects.filter(cluster=cluster, last_step_at__gte=_dt(now - ACTIVE_RUN_S)).order_by("id"))
    infos = [RunInfo(r.name, r.world_size, dict(r.meta), {}, r.last_step,
                     r.last_step_at.timestamp() if r.last_step_at else None, id=r.id) for r in runs]
    by_run = {r.id: info for r, info in zip(runs, infos, strict=True)}
    for run_id, rank, host, gpu, meta in m.Rank.objects.filter(run__in=runs).values_list(
            "run_id", "rank", "node__hostname", "gpu_index", "meta"):
        by_run[run_id].ranks[rank] = RankInfo(host, gpu, meta or {})
    ckpts = (m.Event.objects.filter(cluster=cluster, kind="checkpoint", run__in=runs, step__isnull=False,
                                    ts__gte=_dt(now - SPANS["checkpoints"]))
             .values("run_id", "step").annotate(last=Max("ts")).order_by("run_id", "step"))
    for c in ckpts:
        by_run[c["run_id"]].checkpoints.append((c["last"].timestamp(), c["step"]))
    parts: list[dict[str, np.ndarray]] = []
    objs: list[np.ndarray] = []
    losses: dict[str, np.ndarray] = {}
    for i, r in enumerate(runs):
        if r.last_step is None:
            continue
        mat, groups, metrics = _steps_and_losses(r.id, r.last_step, min(infos[i].ranks, default=0))
        steps = mat[-1] == 0
        part = {c: mat[k][steps] for k, c in enumerate(STEP_NUM[1:])}
        parts.append({"run": np.full(len(part["rank"]), float(i)), **part})
        objs.append(_objs([g for g, keep in zip(groups, steps, strict=True) if keep]))
        loss = _losses(mat, metrics, ~steps)
        if len(loss):
            losses[r.name] = loss
    if not parts:
        return infos, Table.from_rows(STEP_NUM, STEP_OBJ, []), losses
    return infos, Table({c: np.concatenate([p[c] for p in parts]) for c in STEP_NUM},
                        {"groups": np.concatenate(objs) if objs else np.empty(0, dtype=object)}), losses


def _steps_and_losses(run_id: int, last_step: int, loss_rank: int) -> tuple[np.ndarray, list[Any], list[Any]]:
    """One query per run, two index range scans: every rank's last STEP_SPAN steps ((run, step); part 0) and the
    loss of ``loss_rank``'s last LOSS_SPAN steps ((run, rank, step); part 1: the training loop's loss is the same on
    every rank, or logged on rank 0 only). Returns the numeric rows (STEP_NUM[1:] then the part) and the groups and
    metrics cells."""
    table = connection.ops.quote_name(m.StepSample._meta.db_table)
    nums = ["rank", "step", _epoch(), *STEP_NUM[4:]]
    blank = ", ".join(["NULL"] * len(STEP_NUM[4:]))
    sql = (f"SELECT {', '.join(nums)}, 0, groups, NULL FROM {table} WHERE run_id = %s AND step > %s "
           f"UNION ALL SELECT rank, step, {_epoch()}, {blank}, 1, NULL, metrics FROM {table} "
           "WHERE run_id = %s AND rank = %s AND step > %s")
    with connection.cursor() as cur:
        cur.execute(sql, [run_id, last_step - STEP_SPAN, run_id, loss_rank, last_step - LOSS_SPAN])
        rows = cur.fetchall()
    k = len(nums) + 1
    if not rows:
        return np.empty((k, 0)), [], []
    return np.array([r[:k] for r in rows], dtype=float).T, [r[k] for r in rows], [r[k + 1] for r in rows]


def _losses(mat: np.ndarray, metrics: list[Any], rows: np.ndarray) -> np.ndarray:
    """(step, ts, loss) rows, by step, from the loss part of :func:`_steps_and_losses`."""
    out = []
    for j in np.nonzero(rows)[0]:
        loss = (_json(metrics[j]) or {}).get("loss")
        if isinstance(loss, int | float) and not isinstance(loss, bool):
            out.append((mat[1][j], mat[2][j], float(loss)))
    return np.array(sorted(out), dtype=float).reshape(-1, 3)


def _gpu_bus(cluster: m.Cluster) -> dict[tuple[str, str], int]:
    out = {}
    for host, index, bus in m.Gpu.objects.filter(node__cluster=cluster).values_list("node__hostname", "index",
                                                                                   "pci_bus_id"):
        key = bus_key(bus)
        if key:
            out[(host, key)] = index
    return out


def _last_heard(w: Window, nodes_rows: list[tuple[Any, ...]], index: dict[str, int], now: float) -> dict[str, float]:
    """host -> newest timestamp it sent, for every node with an agent heard from in the last day."""
    newest = np.full(len(w.nodes), -np.inf)
    for table in (w.gpus, w.ports):
        if len(table):
            np.maximum.at(newest, table["node"].astype(int), table["ts"])
    if len(w.probes):
        np.maximum.at(newest, w.probes["node"].astype(int), w.probes["ts"])
    for host, h in w.hosts.items():
        newest[index[host]] = max(newest[index[host]], h["ts"])
    out = {}
    for _, host, agent_id, last_seen in nodes_rows:
        heard = float(newest[index[host]])
        if not np.isfinite(heard):
            # Nothing in the window: silent for at least the window. Only nodes with an agent are expected to
            # report; a training process posting directly ("hook-..." agent ids) sends steps, which name no node.
            if not agent_id or agent_id.startswith("hook-") or last_seen is None or \
                    last_seen < _dt(now) - timedelta(seconds=EXPECTED_NODE_S):
                continue
            heard = min(last_seen.timestamp(), now - SPANS["gpus"])
        out[host] = heard
    return out
