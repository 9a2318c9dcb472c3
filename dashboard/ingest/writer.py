"""Stores one validated batch: the idempotency row, the inventory it implies, and the time series (bulk inserts).

Everything happens in one transaction, so a batch is either stored whole or not at all; the live update is sent only
after the commit (``transaction.on_commit``), so a browser never sees data the database does not have.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import IntegrityError, connection, models, transaction
from django.db.models import Q

from clusterdx import wire
from dashboard.live.publish import publish_batch
from dashboard.telemetry import models as m
from dashboard.telemetry.tasks import purged_through

log = logging.getLogger(__name__)

# Wire field -> column copies. Wire fields handled elsewhere (inventory, ids, timestamps) are listed as exceptions;
# tests/server/test_wire_columns.py fails when a wire field has neither a column nor an exception, so a field added
# to the wire format can never be silently dropped here.
WIRE_NOT_COLUMNS: dict[type[wire.Record], set[str]] = {
    wire.GpuSample: {"ts", "index", "uuid", "name", "pci_bus_id"},
    wire.HostSample: {"ts"},
    wire.PortSample: {"ts"},
    wire.Step: {"ts", "run"},
    wire.Event: {"ts", "run"},
    wire.Probe: {"ts"},
}


def _columns(record: type[wire.Record]) -> list[str]:
    return [f for f in wire.field_names(record) if f not in WIRE_NOT_COLUMNS[record]]


GPU_FIELDS = _columns(wire.GpuSample)
HOST_FIELDS = _columns(wire.HostSample)
PORT_FIELDS = _columns(wire.PortSample)
STEP_FIELDS = _columns(wire.Step)
EVENT_FIELDS = _columns(wire.Event)
PROBE_FIELDS = _columns(wire.Probe)
LAST_SEEN_EVERY_S = 5.0
RUN_ADVANCE_EVERY_S = 1.0


@dataclass(frozen=True)
class Stored:
    status: str  # "accepted" | "duplicate" | "seq_reused" (the seq is stored with other content: nothing written)
    records: int

def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


class _Inventory:
    """Per-process cache of ids for nodes, GPUs and runs: the hot path does no lookups for things it has seen.

    Requests are stored concurrently (one thread each), so an id is cached only once the transaction that created
    or found it has committed: another request must never use a row it cannot see yet, or one that was rolled back.
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.nodes: dict[tuple[int, str], int] = {}
        self.gpus: set[tuple[int, int, str | None]] = set()
        self.runs: dict[tuple[int, str], int] = {}
        self.node_seen: dict[int, float] = {}
        self.run_meta: dict[tuple[int, int], dict[str, Any]] = {}
        self.run_advanced: dict[int, tuple[int, float]] = {}
        self.places: dict[int, dict[str, str]] = {}  # node id -> the rack/switch last stored from its batches

    @staticmethod
    def after_commit(cache: dict[Any, Any] | set[Any], key: Any, value: Any = None) -> None:
        if isinstance(cache, set):
            transaction.on_commit(lambda: cache.add(key))
        else:
            transaction.on_commit(lambda: cache.__setitem__(key, value))

    def node_id(self, cluster: m.Cluster, host: str, agent_id: str) -> int:
        key = (cluster.id, host)
        node_id = self.nodes.get(key)
        if node_id is None:
            node, _ = m.Node.objects.get_or_create(cluster=cluster, hostname=host, defaults={"agent_id": agent_id})
            node_id = node.id
            self.after_commit(self.nodes, key, node_id)
        return node_id

    def touch_node(self, node_id: int, when: datetime) -> None:
        now = time.monotonic()
        if now - self.node_seen.get(node_id, 0.0) >= LAST_SEEN_EVERY_S:
            m.Node.objects.filter(id=node_id).update(last_seen=when)
            self.node_seen[node_id] = now

    def place_node(self, node_id: int, topology: dict[str, Any] | None) -> None:
        """Store the node's rack and switch when its agent reports new ones; unchanged costs a dict lookup.

        A field the batch leaves out (null) keeps what the server had: an agent that knows only its rack must not
        erase a switch set by another source. The spine has no column yet; it travels and is validated."""
        if topology is None:
            return
        place = {k: topology[k] for k in ("rack", "switch") if topology[k] is not None}
        if not place or self.places.get(node_id) == place:
            return
        # The filter skips the write when the row already holds these values (a restarted server, a second worker).
        m.Node.objects.filter(~Q(**place), id=node_id).update(**place)
        self.after_commit(self.places, node_id, place)

    def note_gpu(self, node_id: int, sample: dict[str, Any]) -> None:
        key = (node_id, sample["index"], sample["uuid"])
        if key in self.gpus:
            return
        m.Gpu.objects.update_or_create(
            node_id=node_id, index=sample["index"],
            defaults={"uuid": sample["uuid"] or "", "name": sample["name"] or "", "pci_bus_id": sample["pci_bus_id"] or ""},
        )
        self.after_commit(self.gpus, key)

    def run_id(self, cluster: m.Cluster, name: str) -> int:
        key = (cluster.id, name)
        run_id = self.runs.get(key)
        if run_id is None:
            run, _ = m.Run.objects.get_or_create(cluster=cluster, name=name)
            run_id = run.id
            self.after_commit(self.runs, key, run_id)
        return run_id


inventory = _Inventory()


# (cluster id, agent id) -> the highest seq this process committed for it. An agent's seqs grow, and retention's
# purged mark is an old record of the same agent, so a seq above one committed here is above the mark: the purged
# check (a query) runs only for the first batch of an agent in this process and for retries, not for every batch.
_committed_seq: dict[tuple[int, str], int] = {}


def clear_caches() -> None:
    """Forget cached ids (tests roll the database back under the cache's feet)."""
    inventory.clear()
    _committed_seq.clear()


def _late_retry(cluster_id: int, agent_id: str, seq: int) -> bool:
    newest = _committed_seq.get((cluster_id, agent_id))
    return (newest is None or seq <= newest) and purged_through(cluster_id, agent_id, seq)


def _committed(cluster_id: int, agent_id: str, seq: int) -> None:
    key = (cluster_id, agent_id)
    if seq > _committed_seq.get(key, -1):
        _committed_seq[key] = seq


def store_batch(cluster: m.Cluster, batch: dict[str, Any], digest: str = "") -> Stored:
    """Store a validated batch once per (agent_id, seq). ``digest`` identifies its content (the ingest view passes
    a SHA-256 of the JSON body): the seq again with another digest is ``seq_reused``, not a duplicate."""
    try:
        return _store(cluster, batch, digest)
    except IntegrityError:
        # A cached id may point at a row deleted meanwhile (a node or run removed): forget and try once more.
        clear_caches()
        return _store(cluster, batch, digest)


def _store(cluster: m.Cluster, batch: dict[str, Any], digest: str) -> Stored:
    received = datetime.now(tz=UTC)
    with transaction.atomic():
        records = _count(batch)
        if _late_retry(cluster.id, batch["agent_id"], batch["seq"]):
            return Stored("duplicate", 0)  # a late retry whose record retention has purged: never stored twice
        try:
            with transaction.atomic():
                m.AgentBatch.objects.create(
                    cluster=cluster, agent_id=batch["agent_id"], seq=batch["seq"], host=batch["host"],
                    received_at=received, sent_at=_dt(batch["sent_at"]), dropped=batch["dropped"], records=records,
                    digest=digest,
                )
        except IntegrityError:
            same_seq = m.AgentBatch.objects.filter(cluster=cluster, agent_id=batch["agent_id"], seq=batch["seq"])
            stored = same_seq.values_list("digest", flat=True).first()
            if stored is None:
                raise
            # Another content under a stored seq: the producer's counter went back (an OS crash rolled its spool
            # back). Answering "duplicate" would make it delete real data; without both digests ("": a row from
            # before migration 0004, an in-process caller) nothing can be told, and a repeat stays a duplicate.
            return Stored("seq_reused" if stored and digest and stored != digest else "duplicate", 0)
        batch = _with_gap_event(batch, received)
        node_id = inventory.node_id(cluster, batch["host"], batch["agent_id"])
        inventory.touch_node(node_id, received)
        inventory.place_node(node_id, batch["topology"])
        runs = _run_ids(cluster, batch)
        _store_run_meta(cluster, node_id, batch["runs"], runs)
        _store_series(cluster, node_id, batch, runs)
        _advance_runs(batch["steps"], runs)
        transaction.on_commit(lambda: _committed(cluster.id, batch["agent_id"], batch["seq"]))
        transaction.on_commit(lambda: _publish(cluster.id, batch["host"], batch, runs))
    return Stored("accepted", records)


def _publish(cluster_id: int, host: str, batch: dict[str, Any], runs: dict[str, int]) -> None:
    """The live view after the commit. The batch is stored by now: a live layer that is down (Redis restarting) costs
    the browsers this batch's deltas, never the agent an error for data the server keeps (a 500 here made it retry
    into a "duplicate" and the live view never showed the batch; the chaos suite found it)."""
    try:
        publish_batch(cluster_id, host, batch, runs)
    except Exception:
        log.warning("live update of %s's batch failed; the batch is stored", host, exc_info=True)


# Drop reasons that count whole batches the agent could not keep (the rest count records): each report of them
# becomes a warning event of the node, so a gap in its data is explained on its pages and in the events stream.
BATCH_LOSSES = {"disk_full": "disk full", "spool_full": "spool full", "spool_overflow": "spool full",
                "spool_error": "spool error", "server_rejected": "rejected by the server"}


def _with_gap_event(batch: dict[str, Any], received: datetime) -> dict[str, Any]:
    lost = {r: n for r, n in (batch["dropped"] or {}).items() if r in BATCH_LOSSES and n > 0}
    if not lost:
        return batch
    by_label: dict[str, int] = {}
    for reason, n in lost.items():
        by_label[BATCH_LOSSES[reason]] = by_label.get(BATCH_LOSSES[reason], 0) + n
    total = sum(lost.values())
    why = next(iter(by_label)) if len(by_label) == 1 else ", ".join(f"{k} {n}" for k, n in sorted(by_label.items()))
    event = wire.validate(wire.Event, {
        "ts": received.timestamp(), "kind": "agent", "severity": "warning",
        "message": f"agent {batch['host']} dropped {total} batch{'es' if total != 1 else ''}: {why}",
        "data": {r: str(n) for r, n in lost.items()}})
    return {**batch, "events": [*batch["events"], event]}


def _run_ids(cluster: m.Cluster, batch: dict[str, Any]) -> dict[str, int]:
    names = {s["run"] for s in batch["steps"]} | {r["run"] for r in batch["runs"]}
    names |= {e["run"] for e in batch["events"] if e["run"]}
    return {name: inventory.run_id(cluster, name) for name in names}


def _store_run_meta(cluster: m.Cluster, node_id: int, metas: list[dict[str, Any]], runs: dict[str, int]) -> None:
    for meta in metas:
        run_id = runs[meta["run"]]
        key = (run_id, meta["rank"])
        stable = {k: v for k, v in meta.items() if k != "ts"}
        if inventory.run_meta.get(key) == stable:
            continue  # hooks resend metadata on change and now and then; unchanged costs nothing
        rank_node = node_id
        if meta["host"] and meta["host"] != "":
            rank_node = inventory.node_id(cluster, meta["host"], "")
        m.Rank.objects.update_or_create(
            run_id=run_id, rank=meta["rank"],
            defaults={"node_id": rank_node, "local_rank": meta["local_rank"], "gpu_index": meta["gpu_index"],
                      "meta": stable},
        )
        run_wide = {k: meta[k] for k in ("versions", "parallel", "flops_per_token", "peak_flops", "dtype", "params",
                                         "gpu_name", "last_checkpoint_step", "last_checkpoint_ts") if meta[k] is not None}
        run = m.Run.objects.select_for_update().get(id=run_id)
        run.world_size = meta["world_size"]
        run.meta = {**run.meta, **run_wide}
        run.save(update_fields=["world_size", "meta"])
        inventory.after_commit(inventory.run_meta, key, stable)


class _Table:
    """A prepared multi-row INSERT for one time-series table.

    The ORM's bulk_create builds a model instance and compiles SQL for every batch; at thousands of rows per second
    that is most of the ingest cost. Here the statement is built once and values are adapted only for the columns
    that need it (timestamps, JSON), through the fields' own ``get_db_prep_save`` so both backends stay correct.
    """

    def __init__(self, model: type[models.Model], names: list[str]) -> None:
        fields = [model._meta.get_field(n) for n in names]
        quote = connection.ops.quote_name
        self.sql = (f"INSERT INTO {quote(model._meta.db_table)} ({', '.join(quote(f.column) for f in fields)}) "
                    f"VALUES ({', '.join(['%s'] * len(fields))})")
        self.adapt = [f.get_db_prep_save if isinstance(f, (models.DateTimeField, models.JSONField)) else None
                      for f in fields]

    def insert(self, rows: list[list[Any]]) -> None:
        if not rows:
            return
        adapt = self.adapt
        values = [[a(v, connection) if a is not None else v for a, v in zip(adapt, row, strict=True)] for row in rows]
        with connection.cursor() as cursor:
            cursor.executemany(self.sql, values)


_tables: dict[str, _Table] = {}


def _table(model: type[models.Model], names: list[str]) -> _Table:
    key = f"{connection.alias}:{model.__name__}"
    table = _tables.get(key)
    if table is None:
        table = _tables[key] = _Table(model, names)
    return table


GPU_COLS = ["cluster", "node", "gpu_index", "ts", *GPU_FIELDS]
HOST_COLS = ["cluster", "node", "ts", *HOST_FIELDS]
PORT_COLS = ["cluster", "node", "ts", *PORT_FIELDS]
STEP_COLS = ["cluster", "node", "run", "ts", *STEP_FIELDS]
EVENT_COLS = ["cluster", "node", "run", "ts", *EVENT_FIELDS]
PROBE_COLS = ["cluster", "node", "ts", *PROBE_FIELDS]


def _store_series(cluster: m.Cluster, node_id: int, batch: dict[str, Any], runs: dict[str, int]) -> None:
    c, n = cluster.id, node_id
    for g in batch["gpus"]:
        inventory.note_gpu(node_id, g)
    _table(m.GpuSample, GPU_COLS).insert(
        [[c, n, g["index"], _dt(g["ts"]), *[g[f] for f in GPU_FIELDS]] for g in batch["gpus"]])
    _table(m.HostSample, HOST_COLS).insert([[c, n, _dt(h["ts"]), *[h[f] for f in HOST_FIELDS]] for h in batch["hosts"]])
    _table(m.PortSample, PORT_COLS).insert([[c, n, _dt(p["ts"]), *[p[f] for f in PORT_FIELDS]] for p in batch["ports"]])
    _table(m.StepSample, STEP_COLS).insert(
        [[c, n, runs[s["run"]], _dt(s["ts"]), *[s[f] for f in STEP_FIELDS]] for s in batch["steps"]])
    _table(m.Event, EVENT_COLS).insert(
        [[c, n, runs[e["run"]] if e["run"] else None, _dt(e["ts"]), *[e[f] for f in EVENT_FIELDS]]
         for e in batch["events"]])
    _table(m.Probe, PROBE_COLS).insert([[c, n, _dt(p["ts"]), *[p[f] for f in PROBE_FIELDS]] for p in batch["probes"]])


def _count(batch: dict[str, Any]) -> int:
    return sum(len(batch[k]) for k in ("gpus", "hosts", "ports", "steps", "events", "probes", "runs"))


def _advance_runs(steps: list[dict[str, Any]], runs: dict[str, int]) -> None:
    last: dict[int, tuple[int, float]] = {}
    for s in steps:
        run_id = runs[s["run"]]
        if run_id not in last or s["step"] > last[run_id][0]:
            last[run_id] = (s["step"], s["ts"])
    for run_id, (step, ts) in last.items():
        # Every node of a run reports the same steps: one UPDATE per run per second is enough, not one per batch.
        seen = inventory.run_advanced.get(run_id)
        if seen is not None and ts <= seen[1] + RUN_ADVANCE_EVERY_S:
            continue
        inventory.run_advanced[run_id] = (step, ts)
        # Batches from different nodes arrive in any order: only move forward in time (a restart from a checkpoint
        # legitimately moves the step number back, so time, not the step number, decides).
        when = _dt(ts)
        m.Run.objects.filter(Q(last_step_at__isnull=True) | Q(last_step_at__lt=when), id=run_id).update(
            last_step=step, last_step_at=when)
