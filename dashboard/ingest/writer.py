"""Stores validated batches: the idempotency rows, the inventory they imply, and the time series (bulk inserts).

:func:`store_group` stores a group of batches in one transaction (the group commit of :mod:`.commit`);
:func:`store_batch` one batch in its own. Either way a batch is stored whole or not at all, and the live update is
sent only after the commit (``transaction.on_commit``), so a browser never sees data the database does not have.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import chain
from typing import Any

import msgspec
from django.db import DatabaseError, IntegrityError, connection, models, transaction
from django.db.models import Q

from clusterdx import wire
from dashboard.ingest.blocks import Block, check_posts, rows_of
from dashboard.ingest.statements import statement_sizes
from dashboard.live.publish import publish_batches, publisher
from dashboard.storage import frames
from dashboard.telemetry import models as m
from dashboard.telemetry.tasks import purged_among, purged_through

log = logging.getLogger(__name__)
_encode_json = msgspec.json.Encoder().encode

# Wire field -> column copies. Wire fields handled elsewhere (inventory, ids, timestamps) are listed as exceptions;
# tests/server/test_wire_columns.py fails when a wire field has neither a column nor an exception, so a field added
# to the wire format can never be silently dropped here.
# GPU samples, steps and probes are frames (dashboard.storage.frames), held to the wire by test_wire_columns too.
WIRE_NOT_COLUMNS: dict[type[wire.Record], set[str]] = {
    wire.HostSample: {"ts"},
    wire.PortSample: {"ts"},
    wire.Event: {"ts", "run"},
}


def _columns(record: type[wire.Record]) -> list[str]:
    return [f for f in wire.field_names(record) if f not in WIRE_NOT_COLUMNS[record]]


_GPU_ID = wire.Fields("index", "uuid", "name", "pci_bus_id")
HOST_FIELDS = _columns(wire.HostSample)
PORT_FIELDS = _columns(wire.PortSample)
EVENT_FIELDS = _columns(wire.Event)
LAST_SEEN_EVERY_S = 5.0
RUN_ADVANCE_EVERY_S = 1.0
# How often an unchanged interface list is stamped again on its node (the loader trusts a list for an hour).
INTERFACES_RESTAMP_S = 1800.0


@dataclass(frozen=True)
class Stored:
    status: str  # "accepted" | "duplicate" | "seq_reused" (the seq is stored with other content: nothing written)
    records: int
    seq: int = -1  # the batch's, for an answer whose batch only the writer's process decoded
    agent_id: str = ""

def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


# cluster id -> when (time.monotonic()) a node of it was last created here: the send interval's node count
# (views.send_interval) is counted again after it rather than waiting out its 30 s, or a fleet that registers in
# its first seconds would be told the interval of its first few nodes for half a minute. Only this process's own
# creations count: another web worker's, or those of a writer in a process of its own, wait out the 30 s as before.
NODE_CREATED: dict[int, float] = {}


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
        self.interfaces: dict[int, tuple[Any, float]] = {}  # node id -> the interface list last stored, its ts

    @staticmethod
    def after_commit(cache: dict[Any, Any] | set[Any], key: Any, value: Any = None) -> None:
        if isinstance(cache, set):
            transaction.on_commit(lambda: cache.add(key))
        else:
            transaction.on_commit(lambda: cache.__setitem__(key, value))

    def node_id(self, cluster: m.Cluster, host: str, agent_id: str,
                memo: dict[tuple[int, str], int] | None = None) -> int:
        """``memo``: ids this transaction found or created, for its later batches (the cache fills at commit)."""
        key = (cluster.id, host)
        node_id = self.nodes.get(key)
        if node_id is None and memo is not None:
            node_id = memo.get(key)
        if node_id is None:
            node, created = m.Node.objects.get_or_create(cluster=cluster, hostname=host,
                                                         defaults={"agent_id": agent_id})
            node_id = node.id
            self.after_commit(self.nodes, key, node_id)
            if created:
                transaction.on_commit(lambda: NODE_CREATED.__setitem__(cluster.id, time.monotonic()))
            if memo is not None:
                memo[key] = node_id
        return node_id

    def prefetch_nodes(self, hosts: list[tuple[m.Cluster, str]], memo: dict[tuple[int, str], int],
                       places: dict[int, dict[str, str] | None]) -> None:
        """The ids of a group's nodes that this process has not cached, in one read per cluster, into ``memo``, and
        the places the rows hold into ``places`` (node id -> rack/switch/spine, None: placed by a file).

        A server that restarts under 2,048 nodes meets every one of them in its first seconds: a SELECT each for its
        id and an UPDATE each to (re)place it, statements that hand the GIL back and forth while the event loop
        decodes posts, held the first groups back for seconds. New nodes are still created one by one (get_or_create:
        an uploaded topology file places them on creation, see telemetry.placement)."""
        wanted: dict[int, set[str]] = {}
        for cluster, host in hosts:
            key = (cluster.id, host)
            if key not in self.nodes and key not in memo:
                wanted.setdefault(cluster.id, set()).add(host)
        for cluster_id, names in wanted.items():
            ordered = sorted(names)
            for start in range(0, len(ordered), 1000):  # bound values per statement
                for node_id, host, *place, placed_by in m.Node.objects.filter(
                        cluster_id=cluster_id, hostname__in=ordered[start:start + 1000]).values_list(
                        "id", "hostname", "rack", "switch", "spine", "placed_by"):
                    memo[(cluster_id, host)] = node_id
                    self.after_commit(self.nodes, (cluster_id, host), node_id)
                    places[node_id] = None if placed_by == "file" else {
                        k: v for k, v in zip(("rack", "switch", "spine"), place, strict=True) if v}

    def seen_due(self, node_id: int) -> bool:
        """Whether the node's ``last_seen`` is due for a write (at most every LAST_SEEN_EVERY_S); notes it if so."""
        now = time.monotonic()
        if now - self.node_seen.get(node_id, 0.0) < LAST_SEEN_EVERY_S:
            return False
        self.node_seen[node_id] = now
        return True

    def touch_node(self, node_id: int, when: datetime) -> None:
        if self.seen_due(node_id):
            m.Node.objects.filter(id=node_id).update(last_seen=when)

    def place_node(self, node_id: int, topology: dict[str, Any] | None,
                   stored: dict[int, dict[str, str] | None] | None = None) -> None:
        """Store the node's rack, switch and spine when its agent reports new ones; unchanged costs a dict lookup.

        A field the batch leaves out (null) keeps what the server had: an agent that knows only its rack must not
        erase a switch set by another source. A node placed by an uploaded topology file keeps that place whatever
        its agent says (the file is the owner's word for the whole cluster; an agent's config is copied around).
        ``stored``: what :meth:`prefetch_nodes` read of the rows; a node whose row already says this (or that a file
        placed it) costs no UPDATE."""
        if topology is None:
            return
        place = {k: topology[k] for k in ("rack", "switch", "spine") if topology.get(k) is not None}
        if not place or self.places.get(node_id) == place:
            return
        if stored is not None and node_id in stored:
            row = stored[node_id]
            if row is None or all(row.get(k) == v for k, v in place.items()):
                self.after_commit(self.places, node_id, place)
                return
        # The filter skips the write when the row already holds these values (a restarted server, a second worker)
        # and when an upload placed the node: the database decides, so no cache can be stale about an upload.
        m.Node.objects.filter(~Q(**place), id=node_id).exclude(placed_by="file").update(**place, placed_by="agent")
        self.after_commit(self.places, node_id, place)

    def note_interfaces(self, node_id: int, hosts: list[dict[str, Any]]) -> None:
        """Keep the newest interface list of the batch's host samples on the node's row, where the diagnosis pass
        and the node page read it. Agents resend an unchanged list every few minutes: that costs a comparison with
        the list this process stored last; a write happens when it changed, once per node after a restart, and every
        INTERFACES_RESTAMP_S to say the list is still current (at 2,048 nodes about one write a second). A late batch
        (a spool drained after an outage) never replaces a newer list: the database compares times."""
        due = self.interfaces_due(node_id, hosts)
        if due is not None:
            self.store_interfaces([due])

    def interfaces_due(self, node_id: int, hosts: list[dict[str, Any]]) -> tuple[int, Any, float] | None:
        """``(node id, interfaces, ts)`` when the batch's newest interface list is due for the node's row."""
        latest = None
        for h in hosts:
            if h.get("interfaces") is not None and (latest is None or h["ts"] >= latest["ts"]):
                latest = h
        if latest is None:
            return None
        stored = self.interfaces.get(node_id)
        if stored is not None and stored[0] == latest["interfaces"] and \
                0 <= latest["ts"] - stored[1] < INTERFACES_RESTAMP_S:
            return None
        return node_id, latest["interfaces"], latest["ts"]

    def store_interfaces(self, due: list[tuple[int, Any, float]]) -> None:
        """Write the due lists, newest per node, in one UPDATE for a whole group: a server that starts under 2,048
        nodes meets every node's list in its first seconds, and on PostgreSQL a round trip each was an eighth of the
        writer's time then."""
        newest: dict[int, tuple[Any, float]] = {}
        for node_id, interfaces, ts in due:
            if node_id not in newest or ts >= newest[node_id][1]:
                newest[node_id] = (interfaces, ts)
        if connection.vendor == "postgresql" and len(newest) > 1:
            from psycopg import Cursor
            from psycopg.types.json import Jsonb

            ids = sorted(newest)  # one lock order with any other process's group
            table = connection.ops.quote_name(m.Node._meta.db_table)
            with connection.wrap_database_errors, Cursor(connection.connection) as cursor:
                cursor.execute(
                    f"UPDATE {table} AS n SET interfaces = v.interfaces, interfaces_at = v.at "
                    "FROM unnest(%s::bigint[], %s::jsonb[], %s::timestamptz[]) AS v(id, interfaces, at) "
                    "WHERE n.id = v.id AND (n.interfaces_at IS NULL OR n.interfaces_at < v.at)",
                    [ids, [Jsonb(newest[i][0], dumps=_encode_json) for i in ids], [_dt(newest[i][1]) for i in ids]])
        elif connection.vendor == "sqlite":
            # One UPDATE ... FROM (VALUES ...) per 1,000 nodes too: an ORM UPDATE each cost its compilation and a hand
            # of the GIL back and forth (at every statement), for every node in a server's first seconds.
            ids = sorted(newest)
            table = connection.ops.quote_name(m.Node._meta.db_table)
            with connection.cursor() as cursor:
                for start in range(0, len(ids), 1000):
                    part = ids[start:start + 1000]
                    values: list[Any] = []
                    for i in part:
                        values += [i, _json_text(newest[i][0]), _sqlite_datetime(_dt(newest[i][1]))]
                    cursor.execute(
                        f"UPDATE {table} SET interfaces = v.column2, interfaces_at = v.column3 "
                        f"FROM (VALUES {', '.join(['(%s, %s, %s)'] * len(part))}) AS v "
                        f"WHERE {table}.id = v.column1 AND ({table}.interfaces_at IS NULL OR "
                        f"{table}.interfaces_at < v.column3)", values)
        else:
            for node_id, (interfaces, ts) in newest.items():
                when = _dt(ts)
                m.Node.objects.filter(Q(interfaces_at=None) | Q(interfaces_at__lt=when), id=node_id).update(
                    interfaces=interfaces, interfaces_at=when)
        for node_id, (interfaces, ts) in newest.items():
            self.after_commit(self.interfaces, node_id, (interfaces, ts))

    def note_gpu(self, node_id: int, gpu: tuple[int, str | None, str | None, str | None]) -> None:
        """``gpu``: a sample's (index, uuid, name, pci_bus_id)."""
        index, uuid, name, pci = gpu
        key = (node_id, index, uuid)
        if key in self.gpus:
            return
        m.Gpu.objects.update_or_create(
            node_id=node_id, index=index, defaults={"uuid": uuid or "", "name": name or "", "pci_bus_id": pci or ""})
        self.after_commit(self.gpus, key)

    def note_gpus(self, seen: list[tuple[int, tuple[int, str | None, str | None, str | None]]]) -> None:
        """:meth:`note_gpu` for a whole group: GPUs not seen yet cost one read and one bulk INSERT, not a query
        each (a server that starts under 2,048 nodes meets 16,384 of them in its first seconds)."""
        new: dict[tuple[int, int], tuple[tuple[int, int, str | None], tuple[str, str, str]]] = {}
        for node_id, (index, uuid, name, pci) in seen:
            key = (node_id, index, uuid)
            if key not in self.gpus:
                new[(node_id, index)] = (key, (uuid or "", name or "", pci or ""))
        if not new:
            return
        have = {(n, i): (u, name, pci) for n, i, u, name, pci in m.Gpu.objects.filter(
            node_id__in={n for n, _ in new}).values_list("node_id", "index", "uuid", "name", "pci_bus_id")}
        create: list[list[Any]] = []  # GPU_INVENTORY_COLS: rows, not model instances (16,384 at a server's start)
        for (node_id, index), (key, want) in new.items():
            if (node_id, index) not in have:
                create.append([node_id, index, *want])
            elif have[(node_id, index)] != want:  # a GPU swapped in that slot: rare
                m.Gpu.objects.filter(node_id=node_id, index=index).update(uuid=want[0], name=want[1], pci_bus_id=want[2])
            self.after_commit(self.gpus, key)
        # Another process inserting the same GPU meanwhile fails this group's commit; it is then stored batch by batch.
        _copy_in(m.Gpu, GPU_INVENTORY_COLS, create)

    def run_id(self, cluster: m.Cluster, name: str, memo: dict[tuple[int, str], int] | None = None) -> int:
        key = (cluster.id, name)
        run_id = self.runs.get(key)
        if run_id is None and memo is not None:
            run_id = memo.get(key)
        if run_id is None:
            run, _ = m.Run.objects.get_or_create(cluster=cluster, name=name)
            run_id = run.id
            self.after_commit(self.runs, key, run_id)
            if memo is not None:
                memo[key] = run_id
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


def _unsure(cluster_id: int, agent_id: str, seq: int) -> bool:
    """Whether the batch may be a late retry that retention purged: not above a seq this process committed."""
    newest = _committed_seq.get((cluster_id, agent_id))
    return newest is None or seq <= newest


def _late_retry(cluster_id: int, agent_id: str, seq: int) -> bool:
    return _unsure(cluster_id, agent_id, seq) and purged_through(cluster_id, agent_id, seq)


def _committed(cluster_id: int, agent_id: str, seq: int) -> None:
    key = (cluster_id, agent_id)
    if seq > _committed_seq.get(key, -1):
        _committed_seq[key] = seq


def store_batch(cluster: m.Cluster, batch: dict[str, Any], digest: str = "") -> Stored:
    """Store a validated batch once per (agent_id, seq). ``digest`` identifies its content (the ingest view passes
    a SHA-256 of the JSON body): the seq again with another digest is ``seq_reused``, not a duplicate. Raises the
    WireError of a version 2 post whose numbers the wire refuses (checked here: :func:`check_posts`)."""
    refused = check_posts([batch])[0]
    if refused is not None:
        raise refused
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
        inventory.note_interfaces(node_id, batch["hosts"])
        runs = _run_ids(cluster, batch)
        _store_run_meta(cluster, node_id, batch["runs"], runs)
        rows = _new_rows()
        _collect_series(rows, cluster, node_id, batch, runs)
        _insert_rows(rows)
        _advance_runs(batch["steps"], runs)
        transaction.on_commit(lambda: _committed(cluster.id, batch["agent_id"], batch["seq"]))
        transaction.on_commit(lambda: _hand_over([(cluster.id, batch["host"], batch, runs)], _publish))
    return Stored("accepted", records)


Published = list[tuple[int, str, dict[str, Any], dict[str, int]]]  # (cluster id, host, stored batch, run ids)
# Where committed batches go instead of the live layer: the ingest writer process (:mod:`dashboard.ingest.remote`)
# hands them back to the server, whose live layer the browsers watch. None: this process publishes them itself.
published_to: Callable[[Published], None] | None = None


def _hand_over(items: Published, publish: Callable[[Published], None]) -> None:
    (publish if published_to is None else published_to)(items)


def _publish(items: Published) -> None:
    """The live view after the commit. The batches are stored by now: a live layer that is down (Redis restarting)
    costs the browsers these deltas, never the agent an error for data the server keeps (a 500 here made it retry
    into a "duplicate" and the live view never showed the batch; the chaos suite found it)."""
    try:
        publish_batches(items)
    except Exception:
        log.warning("live update of %d stored batch(es) failed; they are stored", len(items), exc_info=True)


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


def _run_ids(cluster: m.Cluster, batch: dict[str, Any], memo: dict[tuple[int, str], int] | None = None) -> dict[str, int]:
    names = set(rows_of(batch["steps"], _RUN)) | {r["run"] for r in batch["runs"]}
    names |= {e["run"] for e in batch["events"] if e["run"]}
    return {name: inventory.run_id(cluster, name, memo) for name in names}


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
        was = m.Rank.objects.filter(run_id=run_id, rank=meta["rank"]).values_list("node_id", flat=True).first()
        _note_moves([(cluster.id, run_id, meta, was, rank_node)])
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


RUN_WIDE = ("versions", "parallel", "flops_per_token", "peak_flops", "dtype", "params", "gpu_name",
            "last_checkpoint_step", "last_checkpoint_ts")
Meta = tuple[m.Cluster, int, dict[str, Any], int]  # cluster, the posting node, one rank's RunMeta, its run id


def _store_run_metas(metas: list[Meta], memo: dict[tuple[int, str], int]) -> None:
    """:func:`_store_run_meta` for a whole group: the ranks that changed in one read and one bulk INSERT (plus an
    UPDATE per changed existing rank), and each run's row once, not once per rank (a run's first second brings
    every rank's metadata at once)."""
    changed: dict[tuple[int, int], tuple[int, dict[str, Any], dict[str, Any]]] = {}
    clusters: dict[int, int] = {}  # run id -> its cluster's id
    for cluster, node_id, meta, run_id in metas:
        clusters[run_id] = cluster.id
        key = (run_id, meta["rank"])
        stable = {k: v for k, v in meta.items() if k != "ts"}
        if inventory.run_meta.get(key) == stable:
            continue  # hooks resend metadata on change and now and then; unchanged costs nothing
        rank_node = inventory.node_id(cluster, meta["host"], "", memo) if meta["host"] else node_id
        changed[key] = (rank_node, meta, stable)
    if not changed:
        return
    ranks = m.Rank.objects.filter(run_id__in={r for r, _ in changed})
    numbers = {k for _, k in changed}
    if len(numbers) <= RANKS_BY_NUMBER:  # the (run, rank) unique index: a group's ranks, not all 16,384 of a run
        ranks = ranks.filter(rank__in=sorted(numbers))
    have = {(r, k): (pk, was) for r, k, pk, was in ranks.values_list("run_id", "rank", "id", "node_id")
            if (r, k) in changed}
    create: list[list[Any]] = []
    now, runs = datetime.now(tz=UTC), {}
    moves: list[Move] = []
    for (run_id, rank), (node_id, meta, stable) in changed.items():
        fields = {"node_id": node_id, "local_rank": meta["local_rank"], "gpu_index": meta["gpu_index"], "meta": stable}
        if (run_id, rank) in have:
            pk, was = have[(run_id, rank)]
            moves.append((clusters[run_id], run_id, meta, was, node_id))
            m.Rank.objects.filter(id=pk).update(updated_at=now, **fields)
        else:
            create.append([run_id, rank, node_id, meta["local_rank"], meta["gpu_index"], stable, now])
        wide = runs.get(run_id, (0, {}))[1]  # the last rank's world size, every rank's run-wide fields
        runs[run_id] = (meta["world_size"], {**wide, **{k: meta[k] for k in RUN_WIDE if meta[k] is not None}})
        inventory.after_commit(inventory.run_meta, (run_id, rank), stable)
    # Not bulk_create: on PostgreSQL it binds one array per column client-side, quoting every element with a regular
    # expression, which was a quarter of the writer's CPU in the second a 16,384-rank run started.
    _copy_in(m.Rank, RANK_COLS, create)
    _note_moves(moves)
    for run_id in sorted(runs):
        world, wide = runs[run_id]
        run = m.Run.objects.select_for_update().get(id=run_id)
        run.world_size = world
        run.meta = {**run.meta, **wide}
        run.save(update_fields=["world_size", "meta"])


Move = tuple[int, int, dict[str, Any], int | None, int]  # cluster id, run id, the RunMeta, the rank's node before, now


def _note_moves(moves: list[Move]) -> None:
    """A rank that reports from another node than before (restarted elsewhere, rescheduled by the job manager) gets
    an event: the server keeps only each rank's current node, and the diagnosis ties a loss spike to the move."""
    moved = [mv for mv in moves if mv[3] is not None and mv[3] != mv[4]]
    if not moved:
        return
    host = dict(m.Node.objects.filter(id__in={n for mv in moved for n in mv[3:]}).values_list("id", "hostname"))
    m.Event.objects.bulk_create([m.Event(
        cluster_id=cluster_id, node_id=new, run_id=run_id, ts=_dt(meta["ts"]), kind="hook", severity="warning",
        gpu_index=meta["gpu_index"], rank=meta["rank"],
        message=f"rank {meta['rank']} of {meta['run']} moved from {host[was]} to {host[new]}",
        data={"moved_from": host[was], "moved_to": host[new]}) for cluster_id, run_id, meta, was, new in moved])


def _sqlite_datetime(value: datetime) -> str:
    # What Django's SQLite backend stores for an aware datetime under USE_TZ (naive UTC, str()), without its
    # per-value field machinery (most of the ingest cost once the statements are batched).
    return str(value.replace(tzinfo=None))


Memo = dict[Callable[[Any], Any], dict[int, tuple[Any, Any]]]  # adapter -> {id(value): (value, adapted)}
Adapter = Callable[[list[list[Any]], int, Memo], None]


def _per_row(adapt: Callable[[Any], Any]) -> Adapter:
    def column(rows: list[list[Any]], i: int, memo: Memo) -> None:
        for row in rows:
            value = row[i]
            if value is not None:
                row[i] = adapt(value)
    return column


def _per_object(adapt: Callable[[Any], Any]) -> Adapter:
    """Column ``i`` adapted once per distinct object: a node's GPUs, ranks, probes, host and ports share one datetime
    per sample (:func:`_collect_series`), and converting it row by row was a tenth of the embedded server's
    GIL-holding samples at 512 nodes. Keyed by identity (a datetime's hash costs more than its id) in ``memo``, which
    the group's tables share (so each sample time is converted once, not once per table) and which holds each key's
    object, so no id is reused while it lives."""
    def column(rows: list[list[Any]], i: int, memo: Memo) -> None:
        seen = memo.setdefault(adapt, {})
        for row in rows:
            value = row[i]
            if value is not None:
                hit = seen.get(id(value))
                if hit is None:
                    hit = seen[id(value)] = (value, adapt(value))
                row[i] = hit[1]
    return column


_EMPTY_JSON = {list: "[]", dict: "{}"}


def _json_text(value: Any) -> str | None:
    # msgspec writes the same JSON as json.dumps (whitespace aside) several times faster: most rows carry a JSON column,
    # and many an empty one (a GPU's throttle reasons while it is not throttled), whose text needs no encoder.
    if value is None:
        return None
    if not value and type(value) in _EMPTY_JSON:
        return _EMPTY_JSON[type(value)]
    return _encode_json(value).decode()


def _json_pg(value: Any) -> Any:
    from psycopg.types.json import Jsonb

    return None if value is None else Jsonb(value, dumps=_encode_json)


# Rows per INSERT statement on SQLite (see _Table.insert).
SQLITE_ROWS_PER_STATEMENT = 512


class _Table:
    """A prepared bulk INSERT for one time-series table: binary ``COPY`` on PostgreSQL, ``executemany`` elsewhere.

    The ORM's bulk_create builds a model instance and compiles SQL for every batch; at thousands of rows per second
    that is most of the ingest cost. Here the statement is built once and values are adapted only for the columns
    that need it, as the backend's own adapters would (timestamps on SQLite, JSON): PostgreSQL takes aware datetimes
    as they are, and COPY streams a whole group's rows in one round trip. Binary COPY, with every column's type
    declared up front, skips writing each float as decimal text (and PostgreSQL parsing it back): it halved the
    formatting, which was the writer's largest cost.
    """

    def __init__(self, model: type[models.Model], names: list[str]) -> None:
        fields = [model._meta.get_field(n) for n in names]
        quote = connection.ops.quote_name
        columns = ", ".join(quote(f.column) for f in fields)
        self.copy = connection.vendor == "postgresql"
        self.sql = f"COPY {quote(model._meta.db_table)} ({columns}) FROM STDIN (FORMAT BINARY)"
        # SQLite: whole rows per statement (below SQLite's 32,766 bound values), see insert(). Its statements are
        # written with sqlite3's own placeholders and run on the raw connection: Django's cursor rewrites every "%s"
        # of a statement with a regular expression at each call (thousands of them in a statement of 512 rows).
        self.per_statement = max(1, min(SQLITE_ROWS_PER_STATEMENT, 32_766 // len(fields)))
        self._head = f"INSERT INTO {quote(model._meta.db_table)} ({columns}) VALUES "
        self._row = f"({', '.join(['?'] * len(fields))})"
        self._sqlite: dict[int, str] = {}  # rows per statement -> its text
        # The columns' PostgreSQL types by name ("double precision", "varchar(64)" -> "varchar"), for the binary
        # dumpers: a Python int bound for a smallint column must be sent as one.
        self.types = [re.sub(r"\(.*", "", f.db_type(connection) or "") for f in fields]
        self.adapt: list[tuple[int, Adapter]] = []  # (column, its whole-column adapter)
        if not self.copy:  # binary COPY takes dicts for jsonb and aware datetimes as they are
            for i, f in enumerate(fields):
                if isinstance(f, models.JSONField):
                    self.adapt.append((i, _per_row(_json_text)))
                elif isinstance(f, models.DateTimeField):
                    self.adapt.append((i, _per_object(_sqlite_datetime)))

    def insert(self, cursor: Any, rows: list[list[Any]], memo: Memo | None = None) -> None:
        """``cursor``: Django's, whose psycopg cursor writes JSON with msgspec (:func:`_insert_rows`). ``memo``: the
        values already adapted, by object (shared by the tables of one group)."""
        if not rows:
            return
        if self.copy:
            with cursor.cursor.copy(self.sql) as copy:
                copy.set_types(self.types)
                write = copy.write_row
                for row in rows:
                    write(row)
            return
        memo = {} if memo is None else memo
        for i, adapt in self.adapt:
            adapt(rows, i, memo)
        # Python's sqlite3 hands the GIL back around every sqlite3_step, that is per row of an executemany; while the
        # event loop is busy (decoding the next posts) each hand-back can wait up to the switch interval (5 ms) to
        # get it again. So a statement carries many rows, and the rows past the last whole statement go in a few
        # statements too (statement_sizes), not one by one (benchmarks/sqlite_convoy.py: the rows a second a
        # writer thread stores beside a busy thread).
        k = self.per_statement
        whole = len(rows) // k
        raw = cursor.db.connection  # the sqlite3 connection; errors become Django's in _copy_cursor
        if whole:
            raw.executemany(self._statement(k), [list(chain.from_iterable(rows[i:i + k]))
                                                 for i in range(0, whole * k, k)])
        start = whole * k
        for size in statement_sizes(len(rows), k)[whole:]:
            raw.execute(self._statement(size), list(chain.from_iterable(rows[start:start + size])))
            start += size

    def _statement(self, rows: int) -> str:
        sql = self._sqlite.get(rows)
        if sql is None:
            sql = self._sqlite[rows] = self._head + ", ".join([self._row] * rows)
        return sql


_tables: dict[str, _Table] = {}


def _table(model: type[models.Model], names: list[str]) -> _Table:
    key = f"{connection.alias}:{connection.vendor}:{model.__name__}"
    table = _tables.get(key)
    if table is None:
        table = _tables[key] = _Table(model, names)
    return table


HOST_COLS = ["cluster", "node", "ts", *HOST_FIELDS]
PORT_COLS = ["cluster", "node", "ts", *PORT_FIELDS]
EVENT_COLS = ["cluster", "node", "run", "ts", *EVENT_FIELDS]


# The frame tables (dashboard.storage.frames): a post's GPU samples, steps and probes, a row per frame.
GPU_FRAME_COLS = ["cluster", "node", "ts", "n", "layout", "data"]
STEP_FRAME_COLS = ["cluster", "run", "node", "ts", "rank_group", "step_lo", "step_hi", "n", "layout", "data"]
PROBE_FRAME_COLS = ["cluster", "node", "ts", "n", "layout", "data", "peers"]

RANK_COLS = ["run", "rank", "node", "local_rank", "gpu_index", "meta", "updated_at"]
# A group's changed ranks are looked up by number up to this many (one bound value each); more read the runs' ranks.
RANKS_BY_NUMBER = 2000
GPU_INVENTORY_COLS = ["node", "index", "uuid", "name", "pci_bus_id"]
SERIES: list[tuple[type[models.Model], list[str]]] = [
    (m.HostSample, HOST_COLS), (m.PortSample, PORT_COLS), (m.Event, EVENT_COLS), (m.GpuFrame, GPU_FRAME_COLS),
    (m.StepFrame, STEP_FRAME_COLS), (m.ProbeFrame, PROBE_FRAME_COLS)]
Rows = dict[type[models.Model], list[list[Any]]]  # model -> rows (in its column order) still to insert


def _new_rows() -> Rows:
    return {model: [] for model, _ in SERIES}


# Each table's record fields in its column order after (cluster, node): from dicts or from the compiled records the
# ingest path keeps (wire.parse_batch's keep_records). The sample time (and a step's or event's run name) is read
# with them and turned into its column's value after.
_HOST, _PORT = (wire.Fields("ts", *f) for f in (HOST_FIELDS, PORT_FIELDS))
_EVENT = wire.Fields("run", "ts", *EVENT_FIELDS)


# kind name -> the posts' parts of a group to frame at once (frames.build_group), with their cluster and node ids
Framed = dict[str, list[tuple[int, int, frames.Part]]]


def _collect_series(rows: Rows, cluster: m.Cluster, node_id: int, batch: dict[str, Any], runs: dict[str, int],
                    gpus: list[tuple[int, Any]] | None = None, framed: Framed | None = None) -> None:
    """The batch's rows into ``rows``; its GPUs into ``gpus`` for :meth:`_Inventory.note_gpus` (or noted now); its
    framed kinds into ``framed``, for :func:`_add_frames` to frame a whole group's at once (or framed now)."""
    c, n = cluster.id, node_id
    if gpus is None:
        for g in rows_of(batch["gpus"], _GPU_ID):
            inventory.note_gpu(node_id, g)
    else:
        # Each GPU once (a batch of several seconds names it each second).
        gpus += [(node_id, g) for g in dict.fromkeys(rows_of(batch["gpus"], _GPU_ID))]
    # A node's GPUs, ranks and probes share a sample time: one datetime each.
    times: dict[float, datetime] = {}

    def add(model: type[models.Model], fields: wire.Fields, records: list[Any], at: int, run: bool = False) -> None:
        """Rows of ``records``: their sample time (column ``at``) made a datetime, and with ``run`` the run's name
        (column 2) its id."""
        if not records:
            return
        new = rows[model]
        start = len(new)
        new += [[c, n, *r] for r in rows_of(records, fields)]
        for i in range(start, len(new)):
            row = new[i]
            when = times.get(row[at])
            if when is None:
                when = times[row[at]] = _dt(row[at])
            row[at] = when
            if run:
                row[2] = runs[row[2]] if row[2] else None  # an event may belong to no run

    add(m.HostSample, _HOST, batch["hosts"], 2)
    add(m.PortSample, _PORT, batch["ports"], 2)
    add(m.Event, _EVENT, batch["events"], 3, run=True)
    mine: Framed = {} if framed is None else framed
    for kind in frames.KINDS.values():
        if batch[kind.name]:
            mine.setdefault(kind.name, []).append((c, n, _part(kind, batch[kind.name], runs)))
    if framed is None:
        _add_frames(rows, mine, times)


# Each framed kind's numeric fields (today's layout) and object fields, read from records of either kind.
_FRAME_NUMS = {k.name: wire.Fields(*k.numbers) for k in frames.KINDS.values()}
_FRAME_OBJS = {k.name: [(f, wire.Fields(f)) for f in k.objects] for k in frames.KINDS.values()}


def _part(kind: frames.Kind, records: Any, runs: dict[str, int]) -> frames.Part:
    """A batch's records of ``kind`` as frames.build_group takes them: its matrix, object fields and run ids."""
    if type(records) is Block:  # version 2: the post's own matrix, in the frames' column order (frames.Kind)
        mat, objs = records.mat, frames.objects(kind, records.cols)
    else:
        get = _FRAME_NUMS[kind.name].of(records)
        mat = frames.matrix(kind, [get(r) for r in records])
        objs = frames.objects(kind, {f: list(map(one.of(records), records)) for f, one in _FRAME_OBJS[kind.name]})
    run_ids = [runs[name] for name in rows_of(records, _RUN)] if kind is frames.STEPS else None
    return mat, objs, run_ids


def _add_frames(rows: Rows, framed: Framed, times: dict[float, datetime]) -> None:
    """The frames of ``framed`` into ``rows`` (each frame table's columns, its time a datetime shared with the other
    rows of the same sample time)."""
    for name, posts in framed.items():
        kind = frames.KINDS[name]
        into = rows[kind.model]
        for i, b in frames.build_group(kind, [part for _, _, part in posts]):
            cluster_id, node_id, _ = posts[i]
            when = times.get(b.ts)
            if when is None:
                when = times[b.ts] = _dt(b.ts)
            if kind is frames.STEPS:
                into.append([cluster_id, b.run_id, node_id, when, b.rank_group, b.step_lo, b.step_hi, b.n,
                             kind.layout, b.data])
            elif kind is frames.PROBES:
                into.append([cluster_id, node_id, when, b.n, kind.layout, b.data, b.peers])
            else:
                into.append([cluster_id, node_id, when, b.n, kind.layout, b.data])


@contextmanager
def _copy_cursor() -> Iterator[Any]:
    # COPY goes past Django's cursor wrapper: its errors are made Django's here (a lost connection must read as the
    # DatabaseError it is, for store_group to answer 503 at once).
    with connection.wrap_database_errors, connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            from psycopg.types.json import set_json_dumps

            set_json_dumps(_encode_json, context=cursor.cursor)  # this cursor only: the ORM passes its own dumps
        yield cursor


def _insert_rows(rows: Rows) -> None:
    memo: Memo = {}
    with _copy_cursor() as cursor:
        for model, cols in SERIES:
            _table(model, cols).insert(cursor, rows[model], memo)


def _copy_in(model: type[models.Model], cols: list[str], rows: list[list[Any]]) -> None:
    """New inventory rows (ranks, GPUs) the way the time series go in. A row another process inserted meanwhile
    fails the group on the unique constraint, as bulk_create would; the group is then stored batch by batch."""
    if rows:
        with _copy_cursor() as cursor:
            _table(model, cols).insert(cursor, rows)


def _count(batch: dict[str, Any]) -> int:
    return sum(len(batch[k]) for k in ("gpus", "hosts", "ports", "steps", "events", "probes", "runs"))


_RUN_STEP_TS, _RUN = wire.Fields("run", "step", "ts"), wire.Fields("run")


def _advance_runs(steps: list[Any], runs: dict[str, int]) -> None:
    last: dict[int, tuple[int, float]] = {}
    for name, step, ts in rows_of(steps, _RUN_STEP_TS):
        run_id = runs[name]
        if run_id not in last or step > last[run_id][0]:
            last[run_id] = (step, ts)
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


# --- group commit -------------------------------------------------------------------------------------------------
Job = tuple[m.Cluster, dict[str, Any], str]  # a validated batch with its cluster and its content digest
Outcome = Stored | Exception
BATCH_COLS = ["cluster", "agent_id", "seq", "host", "received_at", "sent_at", "records", "dropped", "digest"]


def store_group(jobs: list[Job]) -> list[Outcome]:
    """Store several validated batches in one transaction: one outcome per job, in order, all decided by one commit.

    The normal path is set-based (one INSERT of the idempotency rows, one COPY or executemany per series table), so a
    group of 200 batches costs a handful of statements. Whatever fails it (a deadlock with another process's group, a
    row that a cached id points at deleted meanwhile, a value the database refuses) rolls the group back and stores
    its batches one transaction each, so one failing batch fails alone. A database that is gone fails them all
    (the caller answers 503, the agents retry)."""
    refused = check_posts([batch for _, batch, _ in jobs])
    if any(r is not None for r in refused):  # a version 2 post's numbers the wire refuses: its 400; the rest stored
        keep = [i for i, r in enumerate(refused) if r is None]
        outcomes: list[Outcome | None] = list(refused)
        for i, outcome in zip(keep, store_group([jobs[i] for i in keep]) if keep else [], strict=True):
            outcomes[i] = outcome
        return [o for o in outcomes if o is not None]
    try:
        with transaction.atomic():
            return _store_set(jobs)
    except Exception as exc:  # a bug one batch triggers must not fail the batches grouped with it, again and again
        if isinstance(exc, DatabaseError) and not isinstance(exc, IntegrityError) and not _usable():
            return [exc] * len(jobs)
        log.warning("ingest: a group of %d batches failed (%r); storing them one by one", len(jobs), exc,
                    exc_info=not isinstance(exc, DatabaseError))
        clear_caches()
    out = []
    for cluster, batch, digest in jobs:
        try:
            out.append(store_batch(cluster, batch, digest))
        except Exception as exc:  # this batch's answer (503 or 500); the others still get theirs
            out.append(exc)
    return out


def _usable() -> bool:
    try:
        return connection.connection is not None and connection.is_usable()
    except Exception:
        return False


def _key(job: Job) -> tuple[int, str, int]:
    return job[0].id, job[1]["agent_id"], job[1]["seq"]


def _store_set(jobs: list[Job]) -> list[Outcome]:
    received = datetime.now(tz=UTC)
    out: list[Outcome | None] = [None] * len(jobs)
    claims: dict[tuple[int, str, int], int] = {}  # (cluster, agent, seq) -> the job that inserts it
    late = purged_among([k for k in map(_key, jobs) if _unsure(*k)])
    for i, job in enumerate(jobs):
        if _key(job) in late:
            out[i] = Stored("duplicate", 0)  # a late retry whose record retention has purged: never stored twice
        else:
            claims.setdefault(_key(job), i)
    won = _claim([jobs[i] for i in claims.values()], received)
    accepted = [i for key, i in claims.items() if key in won]
    taken = set(accepted)
    lost = [i for i, o in enumerate(out) if o is None and i not in taken]
    if lost:
        _answer_repeats(jobs, lost, out)
    rows, touched, published = _new_rows(), [], []
    gpus: list[tuple[int, Any]] = []
    framed: Framed = {}
    interfaces: list[tuple[int, Any, float]] = []
    metas: list[Meta] = []
    memo: dict[tuple[int, str], int] = {}  # node ids this transaction found or created
    run_memo: dict[tuple[int, str], int] = {}
    stored_places: dict[int, dict[str, str] | None] = {}
    inventory.prefetch_nodes([(jobs[i][0], jobs[i][1]["host"]) for i in accepted], memo, stored_places)
    for i in accepted:
        cluster, batch, _ = jobs[i]
        records = _count(batch)
        batch = _with_gap_event(batch, received)
        node_id = inventory.node_id(cluster, batch["host"], batch["agent_id"], memo)
        if inventory.seen_due(node_id):
            touched.append(node_id)
        inventory.place_node(node_id, batch["topology"], stored_places)
        due = inventory.interfaces_due(node_id, batch["hosts"])
        if due is not None:
            interfaces.append(due)
        runs = _run_ids(cluster, batch, run_memo)
        metas += [(cluster, node_id, meta, runs[meta["run"]]) for meta in batch["runs"]]
        _collect_series(rows, cluster, node_id, batch, runs, gpus, framed)
        _advance_runs(batch["steps"], runs)
        published.append((cluster.id, batch["host"], batch, runs))
        out[i] = Stored("accepted", records)
    _add_frames(rows, framed, {})
    _store_run_metas(metas, memo)
    inventory.note_gpus(gpus)
    if interfaces:
        inventory.store_interfaces(interfaces)
    if touched:
        m.Node.objects.filter(id__in=sorted(touched)).update(last_seen=received)
    _insert_rows(rows)
    keys = [_key(jobs[i]) for i in accepted]
    transaction.on_commit(lambda: [_committed(*key) for key in keys])
    if published:  # on the publisher's thread: this writer's next group need not wait for Redis
        transaction.on_commit(lambda: _hand_over(published, publisher.submit))
    return [o if o is not None else DatabaseError("not stored; retry it") for o in out]


def _claim(jobs: list[Job], received: datetime) -> set[tuple[int, str, int]]:
    """Insert the idempotency rows; returns the keys this transaction inserted (the rest were stored before).

    Sorted, so two processes' groups take the unique index's locks in one order and cannot deadlock on them; another
    process's uncommitted row with the same key makes this wait for its commit, then counts as stored before."""
    if not jobs:
        return set()
    fields = [m.AgentBatch._meta.get_field(n) for n in BATCH_COLS]
    pg = connection.vendor == "postgresql"
    when: Callable[[datetime], Any] = (lambda d: d) if pg else _sqlite_datetime
    as_json = _json_pg if pg else _json_text
    now = when(received)
    values: list[Any] = []
    for job in sorted(jobs, key=_key):
        cluster, batch, digest = job
        values += [cluster.id, batch["agent_id"], batch["seq"], batch["host"], now, when(_dt(batch["sent_at"])),
                   _count(batch), as_json(batch["dropped"]), digest]
    quote = connection.ops.quote_name
    insert = f"INSERT INTO {quote(m.AgentBatch._meta.db_table)} ({', '.join(quote(f.column) for f in fields)}) "
    if pg:
        # One array per column: psycopg parses a statement with thousands of placeholders for every group.
        types = ["bigint", "text", "bigint", "text", "timestamptz", "timestamptz", "integer", "jsonb", "text"]
        width = len(fields)
        params: list[Any] = [values[c::width] for c in range(width)]
        source = f"SELECT * FROM unnest({', '.join(f'%s::{t}[]' for t in types)})"
    else:
        params = values
        one = f"({', '.join(['%s'] * len(fields))})"
        source = f"VALUES {', '.join([one] * len(jobs))}"
    sql = insert + source + " ON CONFLICT (cluster_id, agent_id, seq) DO NOTHING RETURNING cluster_id, agent_id, seq"
    if pg:
        from psycopg import Cursor

        # Server-side binding: the arrays travel in binary. Django's cursor binds client-side, quoting each array as
        # text with a regular expression per element (a twentieth of the server's CPU at 256 nodes).
        with connection.wrap_database_errors, Cursor(connection.connection) as cursor:
            cursor.execute(sql, params)
            return {(int(c), str(a), int(s)) for c, a, s in cursor.fetchall()}
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return {(int(c), str(a), int(s)) for c, a, s in cursor.fetchall()}


def _answer_repeats(jobs: list[Job], lost: list[int], out: list[Outcome | None]) -> None:
    """A seq stored before (or earlier in this group): a duplicate when its content is the same, else seq_reused.

    Without both digests ("": a row from before migration 0004, an in-process caller) nothing can be told, and a
    repeat stays a duplicate."""
    where = Q()
    for i in lost:
        cluster_id, agent_id, seq = _key(jobs[i])
        where |= Q(cluster_id=cluster_id, agent_id=agent_id, seq=seq)
    stored = {(c, a, s): d for c, a, s, d in
              m.AgentBatch.objects.filter(where).values_list("cluster_id", "agent_id", "seq", "digest")}
    for i in lost:
        digest = jobs[i][2]
        had = stored.get(_key(jobs[i]))
        if had is None:  # purged between the INSERT and this read: let the agent ask again
            out[i] = DatabaseError("the batch's idempotency record changed while it was stored; retry it")
        else:
            out[i] = Stored("seq_reused" if had and digest and had != digest else "duplicate", 0)
