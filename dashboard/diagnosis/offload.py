"""The embedded default's diagnosis pass, with its reading and computing in a process of its own.

In production the pass runs in a Celery worker, a process apart from the web workers. Embedded, the scheduler runs
inside the server process: a pass there held the GIL (numpy, JSON decoding, row conversion) and the one thread that
does the server's database work, and ingest waited for it. Here the read-only half of the pass (the window, the
detectors: :func:`dashboard.diagnosis.tasks.detect`) runs in one child process that keeps its imports and its
database connection from pass to pass; only the reconcile (a few writes, and the broadcasts and alert signals that
must reach this process's channel layer) stays in the server. SQLite in WAL mode lets the child read while ingest
writes. The ranks' beats live in this process's memory, so they are handed to the child with each pass.

After each pass the child also computes the cluster overview (given this process's live GPU rows), which the
overview page renders itself with while it is fresh (:func:`dashboard.web.pages.overview.first_paint`), for a
cluster whose overview page was opened within ``OVERVIEW_WANTED_S``: at 1,024 nodes with no page open, computing it
anyway was a third of the pass process's CPU (docs/scaling.md). The first opening after a quiet spell computes its
own, as a page whose precomputed copy is stale does.

A child that dies (killed, out of memory) is replaced at the next pass; that pass's clusters are logged and skipped.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from datetime import UTC, datetime
from typing import Any

from dashboard import metrics
from dashboard.diagnosis.detectors import Detection, Thresholds

log = logging.getLogger(__name__)
_lock = threading.Lock()
_pool: ProcessPoolExecutor | None = None
_overviews: dict[int, tuple[float, dict[str, Any], list[Any]]] = {}  # cluster -> (computed at, overview, freshness)
_wanted: dict[int, float] = {}  # cluster -> when its overview page was last opened (time.time())
OVERVIEW_WANTED_S = 30 * 60.0  # an on-call's shift glancing back at the page; past it the first paint computes its own


def _child_init(db_name: str) -> None:
    """Django in the child, on the parent's database (under the tests, the test database, whose name the settings
    module alone does not know)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
    threading.Thread(target=exit_with_parent, args=(os.getppid(),), name="parent-watch", daemon=True).start()
    import django
    from django.conf import settings

    settings.DATABASES["default"]["NAME"] = db_name
    django.setup()
    from dashboard import affinity

    affinity.release()  # spawned by a web worker held to its CPU: the pass runs on any


def exit_with_parent(parent: int) -> None:
    """A server killed outright (SIGKILL, a crash) never shuts its pool down: the child, re-parented, would live on,
    holding the database and the server's stdout (a benchmark waiting for that pipe's end hung). Leave with it."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _child_detect(cluster_id: int, now: float, t: Thresholds, beats: list[dict[str, Any]],
                  listening_since: float | None = None) -> tuple[list[Detection], dict[str, float], int]:
    from django.db import close_old_connections

    from dashboard.diagnosis.tasks import detect
    from dashboard.telemetry.models import Cluster

    close_old_connections()  # a connection the database dropped (a restart) is replaced, not reused
    detections, timings = detect(Cluster.objects.get(id=cluster_id), now, t, beats, listening_since)
    return detections, timings, os.getpid()


def _child_overview(cluster_id: int, now: float, gpus: list[list[Any]],
                    heartbeats: dict[str, float]) -> tuple[dict[str, Any], list[Any]]:
    """The cluster overview as its page would compute it now (given this server's live rows), with its freshness."""
    from dashboard.telemetry.models import Cluster
    from dashboard.web.pages.overview import freshness, overview

    cluster = Cluster.objects.get(id=cluster_id)
    key = freshness(cluster)  # read first: a change after it makes the page compute its own, never show it stale
    return overview(cluster, now, (gpus, heartbeats)), key


def precomputed_overview(cluster_id: int, max_age_s: float) -> tuple[dict[str, Any], list[Any]] | None:
    """The overview the pass process computed after the cluster's last pass, and its freshness, while younger than
    ``max_age_s``; None otherwise (or in production, where no server process runs the pass). Asking marks the
    cluster's overview as wanted, so the passes of the next ``OVERVIEW_WANTED_S`` precompute it."""
    _wanted[cluster_id] = time.time()
    got = _overviews.get(cluster_id)
    return (got[1], got[2]) if got is not None and time.time() - got[0] <= max_age_s else None


async def _precompute_overview(loop: asyncio.AbstractEventLoop, executor: ProcessPoolExecutor, cluster_id: int) -> None:
    from dashboard.live.state import get_state

    live, now = get_state(), time.time()
    body, key = await loop.run_in_executor(executor, _child_overview, cluster_id, now, live.gpus(cluster_id),
                                           live.heartbeats(cluster_id))
    _overviews[cluster_id] = (now, body, key)


def pool() -> ProcessPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            from django.db import connection

            # spawn, not fork: the server has threads (the event loop, the database thread) that a fork would copy
            # mid-flight, locks included.
            _pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=_child_init, initargs=(str(connection.settings_dict["NAME"]),))
        return _pool


def shutdown(wait: bool = False) -> None:
    """``wait``: until the child has exited (and closed its database connection), e.g. before a database is dropped;
    the server does not wait (a pass at 2,048 nodes takes seconds)."""
    global _pool
    with _lock:
        old, _pool = _pool, None
    if old is not None:
        old.shutdown(wait=wait, cancel_futures=True)


def _discard(broken: ProcessPoolExecutor) -> None:
    global _pool
    with _lock:
        if _pool is broken:
            _pool = None
    broken.shutdown(wait=False, cancel_futures=True)


async def diagnose() -> dict[str, float]:
    """The embedded scheduler's stand-in for :func:`dashboard.diagnosis.tasks.diagnose`: the same pass per active
    cluster, with the same result (cluster name -> seconds)."""
    from dashboard.diagnosis.lifecycle import reconcile
    from dashboard.diagnosis.tasks import active_clusters, due, observe_parts, paced, thresholds
    from dashboard.ingest import listening
    from dashboard.live.state import get_state
    from dashboard.scheduler import in_jobs_thread

    now = time.time()
    clusters = await in_jobs_thread(active_clusters)(now)
    t = thresholds()
    took: dict[str, float] = {}
    loop = asyncio.get_running_loop()
    for cluster in clusters:
        if not due(cluster.id):
            continue
        executor = pool()
        t0 = time.perf_counter()
        cpu: float | None = None
        try:
            # This process's beats and listening (the child sees neither: both live in this process's memory).
            detections, parts, _ = await loop.run_in_executor(executor, _child_detect, cluster.id, now, t,
                                                              get_state().beats(cluster.id), listening.since(now))
            t1 = time.perf_counter()
            cpu = parts.pop("cpu", None)  # the child's: what the pace budgets (tasks.due)
            await in_jobs_thread(reconcile)(cluster, detections, datetime.fromtimestamp(now, tz=UTC))
            observe_parts({**parts, "reconcile": time.perf_counter() - t1,
                           "handover": t1 - t0 - parts["load"] - parts["detect"]})
        except BrokenProcessPool:
            log.error("diagnosis process died during the pass for cluster %s; a new one starts", cluster.name)
            _discard(executor)
            continue
        except Exception:  # one cluster's bad data must not starve the others of their pass
            log.exception("diagnosis pass for cluster %s failed", cluster.name)
            continue
        finally:
            paced(cluster.id, time.perf_counter() - t0, cpu)
        took[cluster.name] = round(time.perf_counter() - t0, 4)
        metrics.DIAGNOSIS_SECONDS.observe(took[cluster.name])
        if time.time() - _wanted.get(cluster.id, -OVERVIEW_WANTED_S) > OVERVIEW_WANTED_S:
            _overviews.pop(cluster.id, None)  # no one looks: nothing to keep fresh
            continue
        try:  # the overview page's first paint, computed off the server's GIL and database thread
            await _precompute_overview(loop, executor, cluster.id)
        except Exception:  # the page computes its own
            log.exception("precomputing the overview of cluster %s failed", cluster.name)
    return took
