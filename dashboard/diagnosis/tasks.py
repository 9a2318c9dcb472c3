"""The periodic diagnosis pass (Celery beat in production, the embedded scheduler otherwise; same table).

Per cluster: read a bounded recent window (:mod:`dashboard.diagnosis.loader`), run the pure detectors, reconcile the
findings. Reading and computing happen outside any transaction (SQLite takes its write lock at BEGIN; ingest must
not wait for a pass), only the reconcile writes. On PostgreSQL, a per-cluster advisory lock makes a second worker
that picks up an overlapping tick skip that cluster instead of doing the same work twice.

The process that runs a pass keeps its window for the next one (:mod:`dashboard.diagnosis.held`): its first pass
reads the whole window, the next ones what was written since. Beat's ticks go to whichever worker process is free,
and a process that took only every fourth tick (two workers of two processes each) read four passes' worth of rows
each time. So a cluster whose pass is paced (:func:`due`) belongs to the process that ran its last pass: the others
leave it to that process while its next pass is no more than ``DIAGNOSIS_HANDOVER_S`` overdue (a worker that died,
or that is busy elsewhere, is taken over after that), and a worker shutting down hands its clusters back at once
(:func:`release`). ``clusterdx worker`` runs its tasks in threads of one process, so a worker is one owner, however
many tasks it runs at a time.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import shared_task
from celery.signals import worker_process_shutdown, worker_shutdown
from django.conf import settings
from django.core.cache import cache
from django.db import connection

from dashboard import metrics, turns
from dashboard.diagnosis import efficiency
from dashboard.diagnosis.detectors import Detection, Thresholds, run_all
from dashboard.diagnosis.lifecycle import Changes, reconcile
from dashboard.diagnosis.loader import load_window
from dashboard.ingest import listening
from dashboard.telemetry.models import Cluster

log = logging.getLogger(__name__)
LOCK_NAMESPACE = 0x6378_6478  # "cxdx": keeps our advisory lock ids apart from anyone else's


def thresholds() -> Thresholds:
    c = settings.CLUSTERDX
    return Thresholds(heartbeat_s=float(c["HEARTBEAT_TIMEOUT_S"]), gpu_hour_usd=float(c["GPU_HOUR_PRICE_USD"]))


@dataclass
class PassResult:
    cluster: str
    detections: list[Detection] = field(default_factory=list)
    changes: Changes | None = None
    timings_s: dict[str, float] = field(default_factory=dict)  # seconds of each part, and their total
    cpu_s: float | None = None  # CPU seconds of the window and the detectors: what the pace budgets (due)
    skipped: bool = False


@contextlib.contextmanager
def _cluster_lock(cluster_id: int) -> Iterator[bool]:
    if connection.vendor != "postgresql":
        yield True  # embedded: one scheduler, no overlap
        return
    with connection.cursor() as cur:
        cur.execute("SELECT pg_try_advisory_lock(%s, %s)", [LOCK_NAMESPACE, cluster_id])
        got = bool(cur.fetchone()[0])
    try:
        yield got
    finally:
        if got:
            with connection.cursor() as cur:
                cur.execute("SELECT pg_advisory_unlock(%s, %s)", [LOCK_NAMESPACE, cluster_id])


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """The cyclic garbage collector held off for a pass. A pass allocates hundreds of thousands of short-lived rows
    (the driver's tuples) beside the window the process holds (millions of objects at 2,048 nodes): the allocations
    set off full collections that walk all of it, two per pass and ~0.4 s of CPU there, and find nothing, since the
    rows are freed by reference counting. Cycles made meanwhile wait for the next collection after the pass."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def detect(cluster: Cluster, now: float, t: Thresholds | None = None, beats: list[dict[str, Any]] | None = None,
           listening_since: float | None = None) -> tuple[list[Detection], dict[str, float]]:
    """The read-only half of a pass (the window, the detectors): what the embedded default runs in a process of its
    own (:mod:`dashboard.diagnosis.offload`). Returns the detections and the seconds each part took, and the CPU
    seconds of the two together ("cpu", this thread's: what the pace budgets)."""
    with _no_gc():
        t0, cpu0 = time.perf_counter(), time.thread_time()
        window = load_window(cluster, now, beats, listening_since)
        t1 = time.perf_counter()
        detections = run_all(window, t or thresholds())
        # Freed before the collector is back: its first collection (at the next allocation) walked every container
        # the window still held (~60 ms a pass at 2,048 nodes) to find nothing.
        del window
    return detections, {"load": t1 - t0, "detect": time.perf_counter() - t1, "cpu": time.thread_time() - cpu0}


def run_pass(cluster: Cluster, now: float | None = None, t: Thresholds | None = None) -> PassResult:
    now = time.time() if now is None else now
    result = PassResult(cluster.name)
    with _cluster_lock(cluster.id) as got:
        if not got:
            result.skipped = True
            return result
        result.detections, result.timings_s = detect(cluster, now, t, listening_since=listening.since(now))
        result.cpu_s = result.timings_s.pop("cpu")
        t2 = time.perf_counter()
        result.changes = reconcile(cluster, result.detections, datetime.fromtimestamp(now, tz=UTC))
        result.timings_s["reconcile"] = time.perf_counter() - t2
    result.timings_s["total"] = sum(result.timings_s.values())
    return result


def active_clusters(now: float) -> list[Cluster]:
    """Clusters with a node heard from within the last day (a quiet cluster costs nothing)."""
    since = datetime.fromtimestamp(now, tz=UTC) - timedelta(days=1)
    return list(Cluster.objects.filter(nodes__last_seen__gte=since).distinct().order_by("id"))


@shared_task(name="dashboard.diagnosis.tasks.record_efficiency")
def record_efficiency() -> dict[str, int]:
    """MFU per step and goodput per run, stored (dashboard.diagnosis.efficiency): a task of its own, beside the
    pass, so the pass stays a bounded read plus the findings' reconcile. Cluster name -> steps folded."""
    now = time.time()
    return {c.name: efficiency.record(c.id, now) for c in active_clusters(now)}


# cluster id -> (when its last pass ended, time.time(); how long it took; the process that ran it; its CPU seconds):
# where the shared cache is out of reach
_paced: dict[int, tuple[float, float, str | None, float | None]] = {}
_passing = threading.Lock()  # one pass at a time in a process: its threads share one held window


def _pace_key(cluster_id: int) -> str:
    return f"diagnosis:paced:{cluster_id}"


def me() -> str:
    """This process as the owner of the clusters it ran passes for (the pid is read at each call: a prefork child
    is not its parent)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _last(cluster_id: int) -> tuple[float, float, str | None, float | None] | None:
    try:
        last = cache.get(_pace_key(cluster_id))
    except Exception:  # Redis unreachable: this process's own record, better than no pacing
        last = _paced.get(cluster_id)
    if last is None:
        return None
    ended, took, *more = last  # a record from before owners (or CPU seconds) were kept has none
    return ended, took, (more[0] if more else None), (more[1] if len(more) > 1 else None)


def due(cluster_id: int) -> bool:
    """Whether a cluster's pass may run now, in this process. The schedule ticks every DIAGNOSIS_INTERVAL_S (2 s: a
    node cut off is named within ~5 s); a cluster whose pass takes long gets one only once the pass's CPU seconds
    over the time since its start are at most DIAGNOSIS_MAX_CPU_SHARE (a pass of ``cpu`` CPU seconds that took
    ``took`` rests ``cpu / share - took``). 128 nodes (~50 ms a pass) keep the 2 s cadence; 2,048 nodes (~0.5 s of
    CPU a pass) get one every few seconds instead of back to back.

    CPU seconds, not the pass's wall time: a pass reads the rows written since the last, so its length grows with
    its rest. Paced by wall time on a machine whose cores were full (PostgreSQL at 2,048 nodes: a pass's wall time
    2-3 times its CPU), each rest made the next delta longer and the next pass longer still: 0.6, 3.6, 6.0, 6.9 s
    passes in one minute, where CPU seconds settle (the rest grows with the CPU a pass costs, not with the wait for
    a core).

    The last pass is read from the shared cache (Redis in production): ticks go to any worker process, and each
    process pacing only its own passes let two run a 2,048-node cluster's pass twice as often as the share allows.

    A paced cluster (its rest at least a tick) is left to the process that ran its last pass, which holds the window
    and reads only what was written since, for ``DIAGNOSIS_HANDOVER_S`` past due: the owner's next tick comes within
    a few (each worker takes its turn at the queue). A cluster whose pass is quicker than a tick keeps the
    schedule's cadence in any process: reading its whole window costs less than waiting."""
    last = _last(cluster_id)
    if last is None:
        return True
    ended, took, owner, cpu = last
    c = settings.CLUSTERDX
    rest = (took if cpu is None else cpu) / float(c["DIAGNOSIS_MAX_CPU_SHARE"]) - took
    since = time.time() - ended
    if since < rest:
        return False
    if owner is None or owner == me() or rest < float(c["DIAGNOSIS_INTERVAL_S"]):
        return True
    return since >= rest + float(c["DIAGNOSIS_HANDOVER_S"])


def paced(cluster_id: int, took: float, cpu: float | None = None) -> None:
    """A pass of ``cluster_id`` ended now, after ``took`` seconds of which ``cpu`` CPU seconds (None: unknown, paced
    by ``took``)."""
    _paced[cluster_id] = record = (time.time(), took, me(), cpu)
    with contextlib.suppress(Exception):  # the local record above still paces this process
        cache.set(_pace_key(cluster_id), record, timeout=3600)


def release() -> None:
    """Hand this process's clusters back (a worker shutting down): the next tick's process takes them at once,
    where it would wait out the handover for a process that is gone. The pace stays."""
    mine = me()
    for cluster_id in list(_paced):
        last = _last(cluster_id)
        if last is not None and last[2] == mine:
            with contextlib.suppress(Exception):
                cache.set(_pace_key(cluster_id), (last[0], last[1], None, last[3]), timeout=3600)
        _paced.pop(cluster_id, None)


@worker_shutdown.connect
@worker_process_shutdown.connect
def _release_on_shutdown(**_: Any) -> None:
    release()


def observe_parts(parts: dict[str, float]) -> None:
    """A pass's parts' seconds into /metrics (metrics.DIAGNOSIS_PART_SECONDS)."""
    for part, seconds in parts.items():
        metrics.DIAGNOSIS_PART_SECONDS.labels(part).inc(max(0.0, seconds))


@shared_task(name="dashboard.diagnosis.tasks.diagnose")
def diagnose() -> dict[str, float]:
    """One tick: a pass for each active cluster that is due here. A tick that finds this process's pass still
    running (another thread of ``clusterdx worker``) leaves it be: the next tick comes in DIAGNOSIS_INTERVAL_S."""
    if not _passing.acquire(blocking=False):
        return {}
    try:
        with turns.urgent():  # the probe index and the efficiency figures wait in this process meanwhile
            return _diagnose()
    finally:
        _passing.release()


def _diagnose() -> dict[str, float]:
    now = time.time()
    took: dict[str, float] = {}
    for cluster in active_clusters(now):
        if not due(cluster.id):
            continue
        started = time.monotonic()
        try:
            res = run_pass(cluster, now)
        except Exception:  # one cluster's bad data must not starve the others of their pass
            log.exception("diagnosis pass for cluster %s failed", cluster.name)
            paced(cluster.id, time.monotonic() - started)
            continue
        if res.skipped:
            continue  # another worker's pass holds the cluster: its end paces the next one, not this skip
        paced(cluster.id, time.monotonic() - started, res.cpu_s)
        took[cluster.name] = round(res.timings_s["total"], 4)
        metrics.DIAGNOSIS_SECONDS.observe(res.timings_s["total"])
        observe_parts({part: res.timings_s[part] for part in ("load", "detect", "reconcile")})
    return took
