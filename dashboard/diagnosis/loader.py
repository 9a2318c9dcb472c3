"""Builds a detector :class:`Window` from the database: one bounded index range scan per series.

Every query is ``WHERE cluster_id = ? AND ts >= ?`` (the (cluster, ts) indexes) or, for steps, ``run_id = ? AND
step > ?`` (the (run, step) index), so a pass reads the same amount of data whatever the retention. Rows are read
with raw SQL returning epoch seconds: the ORM's datetime objects would cost more than everything else together.

The big series (GPU, port and probe samples, steps) and the ranks' metas are kept by the pass's process from one
pass to the next (:mod:`dashboard.diagnosis.held`): after the first pass, each reads only the rows written since
(by id, from the primary key), which at 2,048 nodes is a few seconds' worth instead of the whole window.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any, overload

import msgspec
import numpy as np
from django.db import connection
from django.db.models import Max, Min

from dashboard.diagnosis import held
from dashboard.diagnosis.detectors.nccl import share_env
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
    HeldRanks,
    RankInfo,
    RunInfo,
    Table,
    Window,
    bus_key,
    of_ranks,
    port_suspect,
)
from dashboard.live.state import get_state
from dashboard.storage import frames as fr
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


_decode = msgspec.json.Decoder().decode


def _json(v: Any) -> Any:
    """A JSON column's text decoded (a value the driver decoded already is returned as it is). msgspec decodes a
    rank's ~1 KB meta in a third of json's time (a run's first minute re-reads thousands a pass); json takes what
    msgspec refuses (a number past float64's range, which json reads as infinity), so the values are json's."""
    if not isinstance(v, str):
        return v
    try:
        return _decode(v)
    except msgspec.DecodeError:
        return json.loads(v)


def _text(col: str) -> str:
    """A JSON column as its text: :func:`_cursor` reads PostgreSQL in binary, where the driver would decode every
    jsonb cell itself (row by row); the pass decodes each distinct text once (:func:`_objs`)."""
    return f"({col})::text" if connection.vendor == "postgresql" else col


_binary_cursor: type | None = None


def _cursor() -> Any:
    """A cursor for the pass's reads. On PostgreSQL, one that asks for binary results: the driver then takes floats
    and integers as they are instead of parsing their text (the GPU rows' read at 2,048 nodes in a third of the CPU).
    It binds on the server (psycopg's client-side cursors, Django's default, cannot return binary) and never
    prepares (a statement pooler may sit in between), and is wrapped as Django wraps its own (query logging, error
    translation). JSON columns are read as text (:func:`_text`)."""
    global _binary_cursor
    if connection.vendor != "postgresql":
        return connection.cursor()
    if _binary_cursor is None:
        import psycopg

        class BinaryCursor(psycopg.Cursor):  # type: ignore[type-arg]
            def execute(self, query: Any, params: Any = None, **_: Any) -> Any:
                return super().execute(query, params, prepare=False, binary=True)

        _binary_cursor = BinaryCursor
    connection.ensure_connection()
    connection.validate_thread_sharing()
    raw = _binary_cursor(connection.connection)
    return connection.make_debug_cursor(raw) if connection.queries_logged else connection.make_cursor(raw)


def _rows(model: type, columns: list[str], where: str, params: list[Any]) -> list[tuple[Any, ...]]:
    sql = f"SELECT {', '.join(columns)} FROM {connection.ops.quote_name(model._meta.db_table)} WHERE {where}"
    with _cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


def _cells(rows: list[tuple[Any, ...]], width: int) -> np.ndarray:
    """The cursor's rows as one [row x column] object array, the cells laid out in one C-level pass: its numeric
    columns go to floats with ``astype`` (None -> NaN) and its object columns are slices of it, where slicing each
    row and gathering each column in Python cost a third more at 2,048 nodes."""
    return np.fromiter(itertools.chain.from_iterable(rows), dtype=object, count=len(rows) * width) \
        .reshape(len(rows), width)


def _read(model: type, num: list[str], obj: list[str], where: str,
          params: list[Any]) -> tuple[np.ndarray, list[np.ndarray]]:
    """(numeric columns as one float matrix, one row per column; the object columns). The numeric part goes from
    the cursor's rows to floats in one C-level conversion (None -> NaN): no per-column Python pass. The matrix is the
    transposed view, not a copy: at 2,048 nodes a copy of the GPU window cost a third of a second, and columns are
    only read whole or by fancy indexing, which strides cost nothing to."""
    rows = _rows(model, [*num, *obj], where, params)
    k = len(num)
    if not rows:
        return np.empty((k, 0)), [np.empty(0, dtype=object) for _ in obj]
    cells = _cells(rows, k + len(obj))
    return cells[:, :k].astype(float).T, [cells[:, j] for j in range(k, k + len(obj))]


def _objs(col: list[Any] | np.ndarray, decode: bool = True) -> np.ndarray:
    """JSON cells decoded once per distinct text: most rows repeat a handful of values ("[]", null, the same
    counters). Equal cells share one decoded object; the detectors only read them."""
    if not decode:
        return np.fromiter(col, dtype=object, count=len(col))
    try:  # the distinct cells in one C-level pass, then a lookup per row (no Python call per row)
        distinct = dict.fromkeys(col)
    except TypeError:  # cells the driver decoded already (unhashable dicts, lists)
        distinct = None
    if distinct is not None:
        for v in distinct:
            distinct[v] = json.loads(v) if isinstance(v, str) else v
        return np.fromiter(map(distinct.__getitem__, col), dtype=object, count=len(col))
    memo: dict[Any, Any] = {}

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


def _known(mat: np.ndarray, objs: list[np.ndarray], lut: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Only the rows of nodes in this pass's inventory: a node that ingest created after the inventory was read (a
    new agent at scale) waits for the next pass instead of failing this one (its rows stay held for that one)."""
    if not mat.shape[1]:
        return mat, objs
    ids = mat[0].astype(np.int64)
    ok = ids < len(lut)
    ok[ok] = lut[ids[ok]] >= 0
    if ok.all():
        return mat, objs
    return mat[:, ok], [col[ok] for col in objs]


def _table(mat: np.ndarray, objs: list[np.ndarray], num: tuple[str, ...], obj: tuple[str, ...],
           lut: np.ndarray) -> Table:
    """``mat`` rows in ``num`` order, the first one a node id (mapped to the node's index); ``objs``: the ``obj``
    columns, decoded."""
    out = {num[0]: lut[mat[0].astype(np.int64)]}
    out.update({c: mat[i] for i, c in enumerate(num) if i})
    return Table(out, dict(zip(obj, objs, strict=True)))


def _since(cluster_id: int, now: float, span: float) -> tuple[str, list[Any]]:
    return "cluster_id = %s AND ts >= %s", [cluster_id, connection.ops.adapt_datetimefield_value(_dt(now - span))]


def load_window(cluster: m.Cluster, now: float, beats: list[dict[str, Any]] | None = None,
                listening_since: float | None = None) -> Window:
    """``beats``: the ranks' latest beats when the caller has them (the pass's own process cannot see the embedded
    server's in-memory live state); by default read from the live state. ``listening_since``: when this server's
    ingest began listening without a break (:mod:`dashboard.ingest.listening`); None: as far as it knows, always."""
    held.scope(cluster.id, cluster.created_at)
    # Raw, with last_seen in epoch seconds: the ORM parsed 2,048 timestamps into datetimes a pass (~3 % of it).
    nodes_rows = _rows(m.Node, ["id", "hostname", "agent_id", _epoch("last_seen")], "cluster_id = %s", [cluster.id])
    hostnames = sorted(h for _, h, _, _ in nodes_rows)
    index = {h: i for i, h in enumerate(hostnames)}
    by_id = {nid: index[h] for nid, h, _, _ in nodes_rows}
    lut = _node_lut(by_id)
    gpus = _gpus(cluster.id, now, lut)
    ports = _ports(cluster.id, now, lut)
    probes = _probes(cluster.id, now, lut, hostnames, index)
    runs, steps, losses = _runs(cluster, now)
    gpu_bus, with_gpus = _gpu_bus(cluster)
    w = Window(now=now, nodes=hostnames, steps=steps, gpus=gpus, ports=ports, probes=probes,
               events=_events(cluster.id, now), hosts=_hosts(cluster.id, now, by_id, hostnames, runs), runs=runs,
               last_heard={}, interconnect=cluster.nccl_interconnect(), gpu_bus=gpu_bus, span=dict(SPANS))
    w.ingest_delay, w.ingest_lag_s, agents, w.post_interval = _ingest_delays(cluster.id, now, len(nodes_rows))
    w.arrivals = _arrivals(cluster.id, now, w.ingest_delay, w.ingest_lag_s, agents)
    w.last_heard = _last_heard(w, nodes_rows, index, now, with_gpus)
    w.beats = Beats(lambda: get_state().beats(cluster.id)) if beats is None else beats
    w.nccl_state = _nccl_state(cluster.id, runs)
    w.losses = losses
    if listening_since is not None:
        w.listening_since = listening_since
    w.places, w.fabric = _places(cluster), interconnect.effective(cluster)
    return w


class Beats(Sequence[dict[str, Any]]):
    """The ranks' latest beats, read from the live state the first time a detector looks. Only a run that stopped
    stepping is asked about (the hang detector's verdict), and every pass reading and decoding all of them (16,384
    at 2,048 nodes, from Redis) was ~8 % of its CPU to be thrown away while every run steps."""

    __slots__ = ("_fetch", "_rows")

    def __init__(self, fetch: Callable[[], list[dict[str, Any]]]) -> None:
        self._fetch: Callable[[], list[dict[str, Any]]] | None = fetch
        self._rows: list[dict[str, Any]] = []

    def _read(self) -> list[dict[str, Any]]:
        if self._fetch is not None:
            self._rows, self._fetch = list(self._fetch()), None
        return self._rows

    @property
    def read(self) -> bool:
        """Whether a detector has looked (tests: a pass over stepping runs leaves them unread)."""
        return self._fetch is None

    def __len__(self) -> int:
        return len(self._read())

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, i: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        return self._read()[i]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self._read())


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


def _held(model: type, key: str, cluster_id: int, now: float, num: list[str], obj: tuple[str, ...],
          text: tuple[str, ...] = (), at: int = 1,
          derive: Callable[[list[np.ndarray]], np.ndarray] | None = None,
          reader: Callable[..., tuple[np.ndarray, list[np.ndarray]]] | None = None) -> held.Series:
    """``cluster_id``'s rows of ``model`` in its ``SPANS[key]`` window, with an id column first: the rows the pass
    process held from its last pass plus those written since (:mod:`dashboard.diagnosis.held`). ``at``: the index
    of the ts column in ``num``. ``derive``: one more numeric column from the object columns, worked out only for
    the rows read now (held rows keep theirs). ``reader``: what reads them (:func:`_read`'s signature)."""
    bound = _bound_epoch(now, SPANS[key])
    bound_params = [connection.ops.adapt_datetimefield_value(_dt(now - SPANS[key]))]

    def fetch(cond: str, extra: list[Any], fresh: bool) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        scope = "cluster_id = %s" if fresh else "cluster_id + 0 = %s"  # see held.read
        mat, objs = (reader or _read)(model, ["id", *num], [c if c in text else _text(c) for c in obj], f"{scope} AND {cond}",
                          [cluster_id, *extra])
        cols = [_objs(v, c not in text) for c, v in zip(obj, objs, strict=True)]
        rest = mat[1:] if derive is None else np.vstack([mat[1:], derive(cols)[None, :]])
        return mat[0].astype(np.int64), rest, cols

    return held.read((key, cluster_id), at, bound, "ts >= %s", bound_params, fetch)


_bounds: dict[tuple[Any, ...], dict[float, float]] = {}


def _bound_epoch(now: float, span: float) -> float:
    """The window's lower bound ``now - span`` as the database converts it to epoch seconds: the held rows are
    trimmed with it, and must be what ``ts >= bound`` selects. SQLite's julianday() rounds to the millisecond, so a
    sample stamped a few microseconds after the bound reads as ``bound - 0.0000x`` there: compared with the exact
    float it would be dropped, where SQL keeps it. Asked once per pass for every span (one query; exact on
    PostgreSQL without asking)."""
    if connection.vendor == "postgresql":
        return _dt(now - span).timestamp()
    key = (connection.alias, connection.settings_dict["NAME"], now)
    if key not in _bounds:
        spans = sorted(set(SPANS.values()))
        with connection.cursor() as cur:
            cur.execute(f"SELECT {', '.join(_epoch('%s') for _ in spans)}",
                        [connection.ops.adapt_datetimefield_value(_dt(now - s)) for s in spans])
            got = cur.fetchone()
        _bounds.clear()  # one pass's
        _bounds[key] = dict(zip(spans, got, strict=True))
    return _bounds[key][span]


def _framed(kind: fr.Kind, key: tuple[Any, ...], scope: str, scope_id: int, at: int, bound: float,
            bound_sql: str, bound_params: list[Any], num: tuple[str, ...], obj: tuple[str, ...] = (),
            strict: bool = False, also: tuple[str, list[Any], Callable[[list[Any]], None]] | None = None,
            derive: tuple[str, Callable[[list[Any]], np.ndarray]] | None = None) -> held.Series:
    """The held series ``key`` of ``kind``'s samples: those whose column ``at`` of ``num`` is at or past ``bound``
    (past it when ``strict``), from the frames matching ``scope = scope_id`` and ``bound_sql`` (which must select
    every frame that can hold such a sample: frames are chosen whole, their samples filtered as they are merged).
    ``num``: the numeric rows the series keeps (the kind's fields, and "node_id" for the frame's node); ``obj``: its
    object fields. One query a pass, reading the frames written since the last (held.read). ``also``: (condition,
    params, receiver) of more frames the same query reads, handed to the receiver as read (not held). ``derive``:
    (an object field, a function of its values) giving one more numeric row, worked out for the rows read now only."""
    table = connection.ops.quote_name(kind.model._meta.db_table)

    def fetch(cond: str, params: list[Any], fresh: bool) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        where = f"{scope} = %s" if fresh else f"{scope} + 0 = %s"  # see held.read
        sql = f"SELECT id, node_id, n, layout, data, 0 FROM {table} WHERE {where} AND {cond}"
        if also is not None:
            sql += f" UNION ALL SELECT id, node_id, n, layout, data, 1 FROM {table} WHERE {also[0]}"
        with _cursor() as cur:
            cur.execute(sql, [scope_id, *params, *(also[1] if also else ())])
            got = cur.fetchall()
        if also is not None:
            also[2]([f for f in got if f[5]])
            got = [f for f in got if not f[5]]
        wanted = obj if derive is None or derive[0] in obj else (*obj, derive[0])
        rows = fr.decode(kind, got, ("id", "node_id"), wanted)
        # Built a row per sample (the decoded frames' own order), then seen a row per field through a transposed
        # view: the held series takes its columns in one copy. Gathering each field's column out of the samples'
        # rows instead strode through the whole delta once per field (~200,000 GPU samples of 34 fields a pass at
        # 2,048 nodes, the pass's largest single cost under ingest).
        lead = int(num[0] == "node_id")  # the frame's node, where asked for, comes first
        out = np.empty((len(rows), len(num) + (derive is not None)))
        out[:, lead:len(num)] = rows.mat.take([kind.col(c) for c in num[lead:]], axis=1)
        if lead:
            out[:, 0] = rows["node_id"]
        if derive is not None:
            out[:, -1] = derive[1](rows.objs[derive[0]])
        mat = out.T
        objs = [np.fromiter(rows.objs[f], dtype=object, count=len(rows)) for f in obj]
        return rows["id"].astype(np.int64), mat, objs

    return held.read(key, at, bound, bound_sql, bound_params, fetch, strict=strict)


def _since_frames(now: float, span: float) -> tuple[float, str, list[Any]]:
    """A window's bound, and the SQL that selects every frame that can hold a sample at or past it."""
    bound = now - span
    return bound, "ts >= %s", [connection.ops.adapt_datetimefield_value(_dt(fr.window_start(bound)))]


def _gpus(cluster_id: int, now: float, lut: np.ndarray) -> Table:
    bound, sql, params = _since_frames(now, SPANS["gpus"])
    s = _framed(fr.GPUS, ("gpus", cluster_id), "cluster_id", cluster_id, 2, bound, sql, params,
                ("node_id", "index", *GPU_NUM[2:]), GPU_OBJ)
    return _table(*_known(s.mat, s.objs, lut), GPU_NUM, GPU_OBJ, lut)


def _ports(cluster_id: int, now: float, lut: np.ndarray) -> Table:
    s = _held(m.PortSample, "ports", cluster_id, now, ["node_id", _epoch(), "port", "rate_gbps"], PORT_OBJ,
              text=("device", "state"), derive=_port_suspects)
    return _table(*_known(s.mat, s.objs, lut), PORT_NUM, PORT_OBJ, lut)


def _port_suspects(objs: list[np.ndarray]) -> np.ndarray:
    states, counters = objs[PORT_OBJ.index("state")], objs[PORT_OBJ.index("counters")]
    return np.fromiter(map(port_suspect, states, counters), dtype=float, count=len(states))


def _probes(cluster_id: int, now: float, lut: np.ndarray, hostnames: list[str], index: dict[str, int]) -> Table:
    bound, sql, params = _since_frames(now, SPANS["probes"])
    # The peer is held as its code (_peer_code), worked out once per row as it is read, not as a name mapped again
    # for every row of the window at every pass (a dict lookup per row: ~20 ms of a pass at 2,048 nodes).
    s = _framed(fr.PROBES, ("probes", cluster_id), "cluster_id", cluster_id, 1, bound, sql, params,
                ("node_id", "ts", "sent", "lost", "rtt_ms", "bw_gbps"), derive=("peer", _peer_codes))
    mat, _ = _known(s.mat, [], lut)
    codes = mat[-1].astype(np.int64)
    # The codes are small (one per peer name this process met): counted rather than sorted (np.unique sorted the
    # window's ~100,000 probe rows at every pass, 2 % of a pass at 2,048 nodes). Ascending, as unique's.
    present = np.flatnonzero(np.bincount(codes, minlength=len(_peer_names)))
    for name in sorted(_peer_names[c] for c in present):
        if name not in index:  # a peer without an agent (an address, or a host we have not heard from)
            index[name] = len(hostnames)
            hostnames.append(name)
    peer_lut = np.full(len(_peer_names), -1.0)
    peer_lut[present] = [index[_peer_names[c]] for c in present]
    table = _table(mat[:-1], [], ("node", "ts", "sent", "lost", "rtt_ms", "bw_gbps"), (), lut)
    table.num = {"node": table.num["node"], "peer": peer_lut[codes], **{c: table.num[c] for c in PROBE_NUM[2:]}}
    return table


# Every peer name a probe named, in this process, by a code that never changes (the held probe rows keep codes).
# A cluster's peers are its hosts and a few addresses: bounded by what the agents probe, like the hosts themselves.
_peer_index: dict[Any, int] = {}
_peer_names: list[Any] = []


def _peer_code(name: Any) -> int:
    code = _peer_index.get(name)
    if code is None:
        code = _peer_index[name] = len(_peer_names)
        _peer_names.append(name)
    return code


_peer_lock = threading.Lock()  # two passes in threads of one process (tests) must not hand out one code twice


def _peer_codes(peers: list[Any]) -> np.ndarray:
    with _peer_lock:
        return np.fromiter(map(_peer_code, peers), dtype=float, count=len(peers))


def _hosts(cluster_id: int, now: float, by_id: dict[int, int], hostnames: list[str],
           runs: list[RunInfo]) -> dict[str, dict[str, Any]]:
    where, params = _since(cluster_id, now, SPANS["hosts"])
    out: dict[str, dict[str, Any]] = {}
    # Each node's newest sample only, picked by the database: the window's every row (20,480 at 2,048 nodes) made
    # into a tuple and compared in Python was ~60 ms of a pass. PostgreSQL: DISTINCT ON; SQLite: a bare column
    # beside max() is taken from the row holding the max.
    if connection.vendor == "postgresql":
        columns, tail = ["DISTINCT ON (node_id) node_id", _epoch(), "cpu_pct", _text("nfs")], \
            " ORDER BY node_id, ts DESC"
    else:
        columns, tail = ["node_id", f"MAX({_epoch()})", "cpu_pct", "nfs"], " GROUP BY node_id"
    for node_id, ts, cpu, nfs in _rows(m.HostSample, columns, where + tail, params):
        if node_id not in by_id:  # created after this pass read the inventory (see _known)
            continue
        out[hostnames[by_id[node_id]]] = {"ts": ts, "cpu_pct": cpu, "nfs": nfs}
    for h in out.values():  # only the newest sample's mounts are decoded
        h["nfs"] = _json(h["nfs"])
    # The interface lists answer one question (what NCCL_SOCKET_IFNAME can select on a node), asked only where a
    # rank of an active run sets it.
    wanted = set().union(*(of_ranks(run.ranks, "ifname_nodes", lambda run=run: {
        i.node for i in run.ranks.values() if "NCCL_SOCKET_IFNAME" in (i.meta.get("env") or {})}) for run in runs))
    for node_id, interfaces in _interfaces(cluster_id, now) if wanted else []:
        host = hostnames[by_id[node_id]] if node_id in by_id else None
        if host in out:  # a node without a recent sample is down: its interfaces are not the question
            out[host]["interfaces"] = interfaces
    return out


# Agents send their interface list when it changes and at least every 5 minutes (collectors.sources.host); a list
# older than this is from an agent that stopped sending one, and is not the node's any more.
INTERFACES_SPAN = 3600.0


def _interfaces(cluster_id: int, now: float) -> list[tuple[int, Any]]:
    """(node id, its newest interface list): kept on the Node row by the ingest writer, so one small read (a row per
    node) rather than a search of the 1 Hz host samples for the rare ones that carry a list. Read as text and
    decoded by msgspec: the ORM's per-row JSON decoding was most of this read's time at 2,048 nodes."""
    col = "interfaces::text" if connection.vendor == "postgresql" else "interfaces"
    rows = _rows(m.Node, ["id", col], "cluster_id = %s AND interfaces_at >= %s AND interfaces IS NOT NULL",
                 [cluster_id, connection.ops.adapt_datetimefield_value(_dt(now - INTERFACES_SPAN))])
    if len(_interface_lists) > 4 * len(rows) + 1024:  # the lists of nodes gone or changed since
        _interface_lists.clear()
    # A node's list changes rarely: each text is decoded once and its list kept (2,048 decoded every pass were ~25 ms).
    out = []
    for node_id, text in rows:
        got = _interface_lists.get(text)
        if got is None:
            got = _interface_lists[text] = _decode(text)
        out.append((node_id, got))
    return out


_interface_lists: dict[Any, Any] = {}  # an interface list's text as read -> the list (the detectors only read it)


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
    for run_id, ranks in _ranks(cluster.id, list(by_run)).items():
        by_run[run_id].ranks = ranks
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
        s, loss = _steps_and_losses(cluster.id, r.id, r.last_step, min(infos[i].ranks, default=0))
        part = {"run": np.full(s.mat.shape[1], float(i)), **{c: s.mat[k] for k, c in enumerate(STEP_NUM[1:])}}
        _newest_step(infos[i], part)
        parts.append(part)
        objs.append(s.objs[0])
        if len(loss):
            losses[r.name] = loss
    if not parts:
        return infos, Table.from_rows(STEP_NUM, STEP_OBJ, []), losses
    return infos, Table({c: np.concatenate([p[c] for p in parts]) for c in STEP_NUM},
                        {"groups": np.concatenate(objs) if objs else np.empty(0, dtype=object)}), losses


def _newest_step(info: RunInfo, part: dict[str, np.ndarray]) -> None:
    """The run's last step from the step rows just read, when newer than its row says: ingest moves the run row at
    most once a second (``writer.RUN_ADVANCE_EVERY_S``), so that row may be a second behind, and a run would look
    stalled a second longer than it is (a frozen rank's run was named hung before the rank's beats went quiet)."""
    ts = part["ts"]
    if not len(ts):
        return
    top = int(np.argmax(ts))
    if info.last_step_ts is None or ts[top] > info.last_step_ts:
        info.last_step, info.last_step_ts = int(part["step"][top]), float(ts[top])


# (database, cluster) -> rank id -> (updated_at, the meta's text as read, the meta)
_rank_meta: dict[tuple[Any, ...], dict[int, tuple[float, Any, dict[str, Any]]]] = {}
_envs: dict[Any, Any] = {}  # the ranks' environments, one dict each (detectors.nccl.share_env)
RANK_META_CHUNK = 4096  # ids per query for the metas to read again (SQLite binds at most 32,766 values)
# (database, cluster, run id) -> (the run's rank rows as read, its ranks as handed to the detectors)
_held_ranks: dict[tuple[Any, ...], tuple[list[tuple[Any, ...]], HeldRanks]] = {}


def _ranks(cluster_id: int, run_ids: list[int]) -> dict[int, HeldRanks]:
    """Each run's ranks (rank -> host, GPU, meta). A big run has a rank row per GPU and each meta is ~1 KB of JSON:
    the metas are read only for the ranks whose ``updated_at`` is not the one this process holds (every change of a
    meta stamps it: the writer sets it with the meta, the ORM's ``auto_now`` on save), and only a changed text is
    decoded; the others are kept in this process, with the text they were decoded from. A row committed late
    (another web worker's group) differs from what is held, or is not held at all, and is read then.

    A run whose rank rows read exactly as at the last pass (hosts, GPUs and ``updated_at`` alike, so every meta too)
    gets the same :class:`HeldRanks` object again, with what the detectors worked out of it (its memo): 16,384
    RankInfo built, and the same facts taken out of them, at every pass were ~8 % of a pass at 2,048 nodes."""
    if not run_ids:
        return {}
    key = (connection.alias, connection.settings_dict["NAME"], cluster_id)
    held_meta = _rank_meta.get(key, {})
    q = connection.ops.quote_name
    sql = (f"SELECT r.id, r.run_id, r.rank, n.hostname, r.gpu_index, {_epoch('r.updated_at')} "
           f"FROM {q(m.Rank._meta.db_table)} r LEFT JOIN {q(m.Node._meta.db_table)} n ON n.id = r.node_id "
           f"WHERE r.run_id IN ({', '.join(['%s'] * len(run_ids))})")
    with _cursor() as cur:
        cur.execute(sql, run_ids)
        rows = cur.fetchall()
    metas: dict[int, tuple[float, Any, dict[str, Any]]] = {}
    changed = []
    by_run: dict[int, list[tuple[Any, ...]]] = {run_id: [] for run_id in run_ids}  # each run's rows, as read
    for row in rows:
        rid, run_id, updated = row[0], row[1], row[5]
        by_run[run_id].append(row)
        was = held_meta.get(rid)
        if was is not None and was[0] == updated:
            metas[rid] = was
        else:
            changed.append(rid)
    # Re-reading every meta of a run for a minute after its ranks appeared (16 MB a pass at 16,384 ranks) was a
    # tenth of a pass under ingest at 2,048 nodes: a run's first minute is most of a 60 s benchmark.
    for at in range(0, len(changed), RANK_META_CHUNK):
        part = changed[at:at + RANK_META_CHUNK]
        for rid, updated, text in _rows(m.Rank, ["id", _epoch("updated_at"), _text("meta")],
                                         f"id IN ({', '.join(['%s'] * len(part))})", part):
            was = held_meta.get(rid)
            metas[rid] = (updated, text, was[2] if was is not None and was[1] == text else
                          share_env(_json(text), _envs))
    _rank_meta[key] = metas
    for k in [k for k in _held_ranks if k[:3] == key and k[3] not in by_run]:  # runs no longer active
        del _held_ranks[k]
    out = {}
    for run_id, run_rows in by_run.items():
        was = _held_ranks.get((*key, run_id))
        if was is None or was[0] != run_rows:
            was = _held_ranks[(*key, run_id)] = (run_rows, HeldRanks(
                (rank, RankInfo(host, gpu, metas[rid][2] if rid in metas else {}))
                for rid, _, rank, host, gpu, _ in run_rows))
        out[run_id] = was[1]
    return out


def _steps_and_losses(cluster_id: int, run_id: int, last_step: int,
                      loss_rank: int) -> tuple[held.Series, np.ndarray]:
    """Every rank's last STEP_SPAN steps (the frames with ``step_hi`` past them, along (run, step_hi); those this
    process does not hold yet, :mod:`dashboard.diagnosis.held`) and the loss of ``loss_rank``'s last LOSS_SPAN steps
    (its rank group's frames, along (run, rank_group, step_hi): the training loop's loss is the same on every rank, or
    logged on rank 0 only). Returns the steps (numeric rows STEP_NUM[1:], the groups cells) and the (step, ts, loss)
    rows."""
    bound, since = last_step - STEP_SPAN, last_step - LOSS_SPAN
    losses: list[np.ndarray] = []

    def loss(frames: list[Any]) -> None:
        rows = fr.decode(fr.STEPS, [f[2:5] for f in frames], (), ("metrics",))
        mine = (rows["rank"] == loss_rank) & (rows["step"] > since)
        losses.append(_losses(rows.mat[mine][:, [fr.STEPS.col("step"), fr.STEPS.col("ts")]].T,
                              [v for v, ok in zip(rows.objs["metrics"], mine, strict=True) if ok]))

    # One query: the loss's frames ride along with the steps' (the read the held series makes anyway).
    s = _framed(fr.STEPS, ("steps", cluster_id, run_id), "run_id", run_id, 1, bound, "step_hi > %s", [bound],
                STEP_NUM[1:], ("groups",), strict=True,
                also=("run_id = %s AND rank_group = %s AND step_hi > %s", [run_id, loss_rank // fr.RANK_GROUP, since],
                      loss))
    return s, losses[-1]


def _losses(mat: np.ndarray, metrics: list[Any]) -> np.ndarray:
    """(step, ts, loss) rows, by step: ``mat`` the samples' step and ts rows, ``metrics`` their metrics."""
    out = []
    for j, cell in enumerate(metrics):
        loss = (cell or {}).get("loss")
        if isinstance(loss, int | float) and not isinstance(loss, bool):
            out.append((mat[0][j], mat[1][j], float(loss)))
    return np.array(sorted(out), dtype=float).reshape(-1, 3)


def _gpu_bus(cluster: m.Cluster) -> tuple[dict[tuple[str, str], int], set[str]]:
    """(host, "bb:dd") -> GPU index, and the hosts with GPUs in the inventory (:func:`_last_heard` asks)."""
    out = {}
    hosts: set[str] = set()
    keys: dict[str | None, str | None] = {}  # every node has the same few bus ids: each is parsed once
    q = connection.ops.quote_name
    # Raw SQL, not the ORM's values_list: 16,384 rows at 2,048 nodes, read every pass.
    with _cursor() as cur:
        cur.execute(f"SELECT n.hostname, g.{q('index')}, g.pci_bus_id FROM {q(m.Gpu._meta.db_table)} g "
                    f"JOIN {q(m.Node._meta.db_table)} n ON n.id = g.node_id WHERE n.cluster_id = %s", [cluster.id])
        rows = cur.fetchall()
    for host, index, bus in rows:
        hosts.add(host)
        key = keys[bus] if bus in keys else keys.setdefault(bus, bus_key(bus))
        if key:
            out[(host, key)] = index
    return out, hosts


INGEST_DELAY_SPAN_S = 60.0  # the batches received this long before the pass say how late each node's arrive
INGEST_LAG_RECENT_S = 5.0  # the nodes heard from within this of the freshest arrival say how late batches arrive now


def _ingest_delays(cluster_id: int, now: float, nodes: int
                   ) -> tuple[dict[str, float], float, dict[str, str], dict[str, float]]:
    """host -> seconds from ``sent_at`` to arrival of its newest batch among the cluster's latest arrivals; how far
    behind this server receives now (see ``network.arrival_slack``); host -> the agent id that sent that batch
    (:func:`_arrivals` follows it); and host -> seconds between the ``sent_at`` of its two newest batches, where
    both are among them (``Window.post_interval``).

    The newest two batches a node, at most, along the (cluster, received_at) index, backwards: a few thousand rows
    at 2,048 nodes. A node whose last batch is older than those gets the cluster's lag; a node replaying its spool
    (hours-old ``sent_at``) lifts only its own delay. Negative delays (a clock a little ahead) count as 0.

    The lag is the median delay of the nodes whose newest batch arrived within INGEST_LAG_RECENT_S of the freshest
    arrival: how late batches arrive *now*. A node not heard from since says nothing about that, and counting its
    older, prompt batch diluted the lag exactly when it mattered: a server falling behind at the start of a
    2,048-node run had ~700 nodes whose first batch still waited at its door, their newest the registration batch
    received at once, and the median of all nodes put the lag at a third of the real one; 661-814 healthy nodes
    were named down a run."""
    adapt = connection.ops.adapt_datetimefield_value
    # The delay in SQL, as epoch seconds: two datetimes a row through the ORM's converters cost ~70 ms at 2,048 nodes.
    received = _epoch("received_at")
    rows = _rows(m.AgentBatch, ["host", "agent_id", received, f"{received} - {_epoch('sent_at')}"],
                 "cluster_id = %s AND received_at > %s AND received_at <= %s AND sent_at IS NOT NULL "
                 "ORDER BY received_at DESC LIMIT %s",
                 [cluster_id, adapt(_dt(now - INGEST_DELAY_SPAN_S)), adapt(_dt(now)), max(64, 2 * nodes)])
    delays: dict[str, float] = {}
    agents: dict[str, str] = {}
    sent: dict[str, float] = {}  # host -> its newest batch's sent_at
    posts: dict[str, float] = {}
    current: list[float] = []  # the delays of the nodes heard from lately
    since = float(rows[0][2]) - INGEST_LAG_RECENT_S if rows else 0.0
    for host, agent_id, at, delay in rows:  # newest first: a host's first row is its newest batch
        sent_at = float(at) - float(delay)
        if host not in delays:
            delays[host], agents[host], sent[host] = max(0.0, float(delay)), agent_id, sent_at
            if float(at) >= since:
                current.append(delays[host])
        elif host not in posts and agent_id == agents[host] and sent[host] > sent_at:
            posts[host] = sent[host] - sent_at
    return delays, float(np.median(current)) if current else 0.0, agents, posts


ARRIVALS_EXCESS_S = 10.0  # a node whose newest batch is this much later than the cluster's gets its recent arrivals
ARRIVALS_BATCHES = 12  # ... this many of its newest batches
ARRIVALS_MAX_NODES = 64  # ... for at most this many nodes a pass (the latest first): a handful is the usual case


def _arrivals(cluster_id: int, now: float, delays: dict[str, float], lag: float,
              agents: dict[str, str]) -> dict[str, np.ndarray]:
    """host -> [n x 2] (arrival on this server's clock, seconds after its ``sent_at``), oldest first, of the newest
    ARRIVALS_BATCHES batches of each node whose newest batch arrived ARRIVALS_EXCESS_S later than the cluster's: a
    steady delay is a clock behind, a falling one a spool replay (``network.clock_behind`` tells which). Usually no
    node qualifies and this reads nothing; each that does is one short scan of the (cluster, agent, seq) index."""
    late = sorted((h for h, d in delays.items() if d - lag >= ARRIVALS_EXCESS_S), key=lambda h: -delays[h])
    adapt = connection.ops.adapt_datetimefield_value
    out = {}
    for host in late[:ARRIVALS_MAX_NODES]:
        rows = _rows(m.AgentBatch, [_epoch("received_at"), f"{_epoch('received_at')} - {_epoch('sent_at')}"],
                     "cluster_id = %s AND agent_id = %s AND received_at <= %s AND sent_at IS NOT NULL "
                     "ORDER BY seq DESC LIMIT %s", [cluster_id, agents[host], adapt(_dt(now)), ARRIVALS_BATCHES])
        out[host] = np.array(rows[::-1], dtype=float).reshape(-1, 2)
    return out


def _last_heard(w: Window, nodes_rows: list[tuple[Any, ...]], index: dict[str, int], now: float,
                with_gpus: set[str]) -> dict[str, float]:
    """host -> newest timestamp it sent, for every node with an agent heard from in the last day (``with_gpus``: the
    hosts with GPUs in the inventory; ``nodes_rows``: (id, hostname, agent id, last_seen in epoch seconds))."""
    newest = np.full(len(w.nodes), -np.inf)
    for table in (w.gpus, w.ports):
        if len(table):
            np.maximum.at(newest, table["node"].astype(int), table["ts"])
    if len(w.probes):
        np.maximum.at(newest, w.probes["node"].astype(int), w.probes["ts"])
    if w.hosts:  # one ufunc call, not a numpy scalar compared per host (2,048 a pass)
        np.maximum.at(newest, np.fromiter((index[h] for h in w.hosts), dtype=np.intp, count=len(w.hosts)),
                      np.fromiter((h["ts"] for h in w.hosts.values()), dtype=float, count=len(w.hosts)))
    heard_at = newest.tolist()
    out = {}
    for _, host, agent_id, last_seen in nodes_rows:
        heard = heard_at[index[host]]
        if not math.isfinite(heard):
            # Nothing in the window: silent for at least the window. Only nodes with an agent are expected to
            # report; a training process posting directly ("hook-..." agent ids) sends steps, which name no node.
            if not agent_id or agent_id.startswith("hook-") or last_seen is None or \
                    last_seen < now - EXPECTED_NODE_S:
                continue
            # How long it has sent nothing, the window says by the span of what it sends: a node with GPUs their
            # rows every second (read for 20 s), one without only host samples (read for 10 s). Every such node put
            # at the GPU span named down, 8 s early, a node whose newest word was a 12 s old host sample (a CPU-only
            # node; at a 2,048-node benchmark's start, 165 nodes whose registration was all they had sent yet).
            span = SPANS["gpus"] if host in with_gpus else SPANS["hosts"]
            # last_seen is when its last batch arrived (this server's clock): as of the node's own clock, that
            # batch's delay earlier, as the silence of the nodes heard in the window is measured.
            heard = min(last_seen - w.arrival_delay(host), now - span)
        out[host] = heard
    return out
