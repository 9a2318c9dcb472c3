"""After a batch commits: update the live state and broadcast what changed to the browsers that watch it.

Every node posts every second, so one broadcast per batch would be 512 channel-layer messages a second per cluster
at 512 nodes. Deltas are merged per group in this process and sent at most every ``FLUSH_EVERY_S``: by the
publishing thread when it is due, and by :func:`flush_forever` (started by the ASGI lifespan) for the tail.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any

from clusterdx import wire
from dashboard.ingest.blocks import rows_of
from dashboard.live.broadcast import broadcast_all, cluster_group, run_group
from dashboard.live.state import get_state

log = logging.getLogger(__name__)
SEVERE = {"warning", "error", "critical"}
FLUSH_EVERY_S = 0.2
MAX_ROWS = 50_000  # per group and list: a stalled flusher drops the oldest rows, never grows without bound


class Coalescer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, Any]] = {}
        self._last = 0.0

    def add(self, messages: list[tuple[str, dict[str, Any]]]) -> None:
        with self._lock:
            for group, event in messages:
                kind = event["type"]
                merged = self._pending.setdefault(group, {}).get(kind)
                if merged is None:
                    merged = self._pending[group][kind] = {**event, kind: {} if kind == "gpus" else []}
                if kind == "gpus":
                    for row in event["gpus"]:
                        merged["gpus"][(row[0], row[1])] = row  # the latest sample per GPU wins
                else:
                    merged[kind].extend(event[kind])
                    if len(merged[kind]) > MAX_ROWS:
                        del merged[kind][: len(merged[kind]) - MAX_ROWS]

    def due(self) -> bool:
        return time.monotonic() - self._last >= FLUSH_EVERY_S

    def take(self) -> list[tuple[str, dict[str, Any]]]:
        with self._lock:
            pending, self._pending = self._pending, {}
            self._last = time.monotonic()
        out = []
        for group, kinds in pending.items():
            for kind, event in kinds.items():
                if kind == "gpus":
                    event = {**event, "gpus": list(event["gpus"].values())}
                out.append((group, event))
        return out


coalescer = Coalescer()


def flush() -> None:
    messages = coalescer.take()
    if messages:
        broadcast_all(messages)


async def flush_forever() -> None:
    """Sends what the publishing threads left in the coalescer when no later batch came to send it."""
    from asgiref.sync import sync_to_async

    while True:
        await asyncio.sleep(FLUSH_EVERY_S)
        if coalescer.due():
            await sync_to_async(flush, thread_sensitive=False)()


def publish_batches(items: list[tuple[int, str, dict[str, Any], dict[str, int]]]) -> None:
    """The live side of a committed group of batches ``(cluster id, host, batch, run ids)``: the live state is written
    once per group (one Redis round trip, not one per batch) and the deltas go into the merge buffer, which is sent
    at most every FLUSH_EVERY_S."""
    live = get_state()
    # Read fresh for every group, never cached: a run page registers its watch before it reads its snapshot, so a
    # group committed before this read is in that snapshot and one committed after it is sent (no gap).
    watched = live.watched_runs()
    by_cluster: dict[int, dict[str, list[list[Any]]]] = {}
    beats: dict[int, dict[str, list[dict[str, Any]]]] = {}
    messages: list[tuple[str, dict[str, Any]]] = []
    for cluster_id, host, batch, runs in items:
        # A GPU's newest sample of the batch only (a batch of several seconds has several): the live state and the
        # merge buffer keep each GPU's latest anyway, and every older row cost them, and the browsers, for nothing.
        gpus = list({g[0]: [host, *g] for g in rows_of(batch["gpus"], _GPU)}.values())
        by_cluster.setdefault(cluster_id, {}).setdefault(host, []).extend(gpus)  # a replayed spool: two of one host
        if batch["beats"]:
            # Only where each rank is now matters (the diagnosis reads it to name the rank that stopped a run).
            beats.setdefault(cluster_id, {}).setdefault(host, []).extend(_beats(batch["beats"]))
        messages += _messages(cluster_id, host, batch, runs, gpus, watched)
    for cluster_id, hosts in by_cluster.items():
        live.record_hosts(cluster_id, hosts)
    for cluster_id, by_host in beats.items():
        live.record_beats_hosts(cluster_id, by_host)
    coalescer.add(messages)
    if coalescer.due():
        flush()


Items = list[tuple[int, str, dict[str, Any], dict[str, int]]]

GPU_FIELDS = ("index", "ts", "util_gpu_pct", "mem_used_bytes", "power_w", "temp_c")  # what a browser sees of a GPU
STEP_FIELDS = ("run", "step", "rank", "ts", "step_time_s", "data_wait_s", "compute_s", "comm_s", "tokens")


# What the live layer reads of the records, from dicts or from the compiled records ingest keeps (wire.KEPT_RECORDS).
_GPU, _STEPS = wire.Fields(*GPU_FIELDS), wire.Fields(*STEP_FIELDS)


_BEAT = wire.Fields(*wire.field_names(wire.RankBeat))


def _beats(beats: list[dict[str, Any]] | Any) -> list[dict[str, Any]]:
    """Each rank's last beat of the batch as a dict (the live state keeps only where each rank is now), from records
    or a version 2 block."""
    if type(beats) is list:
        return list({(b["run"], b["rank"]): b for b in beats}.values()) if len(beats) > 1 else beats
    last = {(b[0], b[1]): b for b in rows_of(beats, _BEAT)}  # run and rank lead RankBeat's fields
    return [dict(zip(_BEAT.names, b, strict=True)) for b in last.values()]


def live_part(batch: dict[str, Any]) -> dict[str, Any]:
    """What :func:`publish_batches` reads of a stored batch, and nothing more: a process that stores batches for
    another to publish (:mod:`dashboard.ingest.remote`) sends this, a fraction of the batch to pickle."""
    return {"gpus": [dict(zip(GPU_FIELDS, g, strict=True)) for g in rows_of(batch["gpus"], _GPU)],
            "beats": _beats(batch["beats"]),
            "steps": [dict(zip(STEP_FIELDS, s, strict=True)) for s in rows_of(batch["steps"], _STEPS)],
            "events": [e for e in batch["events"] if e["severity"] in SEVERE]}


class Publisher:
    """Publishes committed groups on a thread of its own, in commit order, so the group writer goes on to its next
    transaction instead of waiting for Redis (the live state and the broadcast were a quarter of the writer's time at
    1,024 nodes). Bounded: a live layer that falls ``capacity`` groups behind makes the writer wait, which fills its
    queue and answers agents 429, rather than dropping updates or growing without end."""

    def __init__(self, capacity: int = 64) -> None:
        self.queue: queue.Queue[Items] = queue.Queue(maxsize=capacity)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, items: Items) -> None:
        if self._thread is None or not self._thread.is_alive():
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._run, name="live-publisher", daemon=True)
                    self._thread.start()
        self.queue.put(items)

    def _run(self) -> None:
        while True:
            items = self.queue.get()
            try:
                publish_batches(items)
            except Exception:  # stored already: the browsers miss these deltas, the agents lose nothing
                log.warning("live update of %d stored batch(es) failed; they are stored", len(items), exc_info=True)
            finally:
                self.queue.task_done()

    def drain(self) -> None:
        """Wait until everything submitted is published (tests, shutdown)."""
        self.queue.join()


publisher = Publisher()


def publish_batch(cluster_id: int, host: str, batch: dict[str, Any], runs: dict[str, int]) -> None:
    publish_batches([(cluster_id, host, batch, runs)])


def _messages(cluster_id: int, host: str, batch: dict[str, Any], runs: dict[str, int], gpus: list[list[Any]],
              watched: set[int]) -> list[tuple[str, dict[str, Any]]]:
    messages: list[tuple[str, dict[str, Any]]] = []
    if gpus:
        messages.append((cluster_group(cluster_id), {"type": "gpus", "cluster": cluster_id, "gpus": gpus}))
    by_run: dict[int, list[list[Any]]] = {}
    # A run's steps only while a run page watches it (the live state's watched runs): at 16,384 ranks a run brings
    # 16,384 step rows a second, made into rows, merged and sent to a group nobody was in: 29 of 100 µs a post.
    if watched and not watched.isdisjoint(runs.values()):
        for run, *row in rows_of(batch["steps"], _STEPS):  # the run, then a browser's step row
            if runs[run] in watched:
                by_run.setdefault(runs[run], []).append(row)
    for run_id, rows in by_run.items():
        messages.append((run_group(run_id), {"type": "steps", "run": run_id, "steps": rows}))
    events = [
        {"ts": e["ts"], "host": host, "kind": e["kind"], "severity": e["severity"], "code": e["code"],
         "gpu_index": e["gpu_index"], "message": e["message"][:500]}
        for e in batch["events"] if e["severity"] in SEVERE
    ]
    if events:
        messages.append((cluster_group(cluster_id), {"type": "events", "cluster": cluster_id, "events": events}))
    return messages
