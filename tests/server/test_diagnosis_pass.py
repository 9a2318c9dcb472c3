"""The diagnosis pass against the database: simulator batches through the real validator and ingest writer, the
loader's bounded queries, the detectors, and the findings lifecycle (open, escalate, resolve with hysteresis)."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest

from clusterdx import wire
from collectors.sim.model import SimCluster
from collectors.sim.scenario import parse
from dashboard.diagnosis.models import Finding
from dashboard.diagnosis.signals import finding_changed
from dashboard.diagnosis.tasks import diagnose, run_pass
from dashboard.ingest.writer import store_batch
from dashboard.storage import frames as fr
from dashboard.telemetry.models import Run
from tests.server import framed
from tests.server.conftest import World

pytestmark = pytest.mark.django_db


class Feed:
    """A simulated cluster whose batches go through ingest, with a pass after every simulated second."""

    def __init__(self, world: World, faults: list[dict[str, Any]], nodes: int = 8, gpus: int = 4, **cluster: Any):
        scenario = parse({"cluster": {"nodes": nodes, "gpus_per_node": gpus, "run": "llm", "seed": 5, **cluster},
                          "fault": faults})
        self.cluster = world.cluster
        # Simulated time ends near the wall clock, so Node.last_seen (the server's clock) agrees with the data.
        self.t0 = time.time() - 300
        self.sim = SimCluster(scenario, self.t0)
        self.t = 0

    def run(self, seconds: int, passes: bool = True) -> list[tuple[int, str, str]]:
        """Advance; returns (second, kind, subject) of every finding opened meanwhile."""
        opened = []
        for _ in range(seconds):
            self.t += 1
            now = self.t0 + self.t
            for batch in self.sim.tick(now):
                store_batch(self.cluster, wire.validate_batch(batch))
            if passes:
                res = run_pass(self.cluster, now)
                assert res.changes is not None
                opened += [(self.t, f.kind, f.subject) for f in res.changes.opened]
        return opened


def test_it_names_the_starved_rank_and_nothing_else(world: World) -> None:
    feed = Feed(world, [{"kind": "data_starvation", "at_s": 12, "rank": 13, "magnitude": 0.5}])
    assert feed.run(11) == [], "a healthy start is quiet"
    opened = feed.run(12)
    assert [(k, s) for _, k, s in opened] == [("data_starvation", "llm/rank13")]
    assert opened[0][0] - 12 <= 6, f"named {opened[0][0] - 12} s after the fault began"
    f = Finding.objects.get(kind="data_starvation")
    assert (f.rank, f.node.hostname, f.gpu_index, f.run.name, f.state) == (13, "node-003", 1, "llm", "open")
    assert f.evidence["metrics"]["data_wait_share"] > 0.2
    assert f.evidence["metrics"]["dataloader"]["num_workers"] == 8
    assert "/mnt/nfs" in f.action and "0.9 ms RTT" in f.action
    assert len(f.evidence["series"]["data_wait_s"]["rank"]) == len(f.evidence["series"]["data_wait_s"]["step"])


def test_a_dead_node_is_named_and_the_stalled_run_is_not_also_reported_hung(world: World) -> None:
    feed = Feed(world, [{"kind": "node_down", "at_s": 10, "node": 5}])
    opened = feed.run(30)
    assert [(k, s) for _, k, s in opened] == [("node_down", "node-005")]
    assert opened[0][0] - 10 <= 5
    f = Finding.objects.get(kind="node_down")
    assert f.severity == "critical" and f.evidence["stalled_runs"] == ["llm"]
    assert "llm/rank20" in f.evidence["metrics"]["ranks"]


def test_lifecycle_escalates_then_resolves_after_the_hysteresis(world: World, django_capture_on_commit_callbacks:
                                                                  Any) -> None:
    seen: list[tuple[str, str, str]] = []

    def receiver(sender: Any, finding: Finding, event: str, **kw: Any) -> None:
        seen.append((event, finding.kind, finding.severity))

    finding_changed.connect(receiver)
    try:
        feed = Feed(world, [{"kind": "straggler", "at_s": 5, "duration_s": 15, "rank": 6, "magnitude": 0.4},
                            {"kind": "ecc_storm", "at_s": 5, "node": 2, "gpu": 1, "dbe_after_s": 6}])
        with django_capture_on_commit_callbacks(execute=True):
            feed.run(19)
        assert ("opened", "straggler", "error") in seen
        assert ("opened", "failing_gpu", "warning") in seen and ("escalated", "failing_gpu", "critical") in seen
        straggler = Finding.objects.get(kind="straggler")
        assert straggler.subject == "llm/rank6" and straggler.evidence["metrics"]["gpu"]["reasons"]
        assert not Finding.objects.filter(kind="throttling").exists(), "the throttle is the straggler's evidence"
        with django_capture_on_commit_callbacks(execute=True):
            feed.run(12)  # the straggler healed at 20 s; the finding holds through the hysteresis
        straggler.refresh_from_db()
        assert straggler.state == "open" and straggler.clear_passes >= 2
        with django_capture_on_commit_callbacks(execute=True):
            feed.run(25)
        straggler.refresh_from_db()
        assert straggler.state == "resolved" and ("resolved", "straggler", "error") in seen
        assert Finding.objects.filter(kind="straggler").count() == 1, "one row per episode: no flapping"
        assert Finding.objects.get(kind="failing_gpu").state == "open", "hardware findings stay open longer"
    finally:
        finding_changed.disconnect(receiver)


def _parts() -> dict[str, float]:
    from dashboard import metrics

    return {part: metrics.DIAGNOSIS_PART_SECONDS.labels(part)._value.get()
            for part in ("load", "detect", "reconcile", "handover")}


def test_the_scheduled_task_runs_every_active_cluster(world: World) -> None:
    feed = Feed(world, [{"kind": "nccl_env_drift", "at_s": 3, "rank": 9}], nodes=4)
    feed.t0 = time.time() - 8  # the task uses the wall clock
    feed.sim = SimCluster(feed.sim.s, feed.t0)
    feed.run(7, passes=False)
    before = _parts()
    took = diagnose()
    assert set(took) == {world.cluster.name}
    spent = {part: seconds - before[part] for part, seconds in _parts().items()}
    assert spent["handover"] == 0 and all(spent[p] > 0 for p in ("load", "detect", "reconcile")), spent
    assert sum(spent.values()) == pytest.approx(took[world.cluster.name], abs=0.001), spent
    assert Finding.objects.filter(kind="nccl_config", subject="llm/rank9", state="open").exists()


def test_a_pass_reads_a_bounded_window(world: World, django_assert_max_num_queries: Any) -> None:
    feed = Feed(world, [], nodes=4)
    feed.run(40, passes=False)
    # 23: the nodes' interface lists (the simulated ranks set NCCL_SOCKET_IFNAME), the ingest ledger's arrival delays,
    # the ranks' metas that changed since the pass process last read them (all of them, at its first pass)
    with django_assert_max_num_queries(23):
        res = run_pass(world.cluster, feed.t0 + feed.t)
    assert res.detections == []
    assert res.timings_s["total"] < 5


def test_a_node_created_while_the_pass_reads_waits_for_the_next_pass(world: World, monkeypatch: Any) -> None:
    """At scale a new agent's first batch can commit between the pass's inventory read and its sample reads (seen at
    128 nodes as a KeyError in the loader): that pass skips the newcomer, the next one sees it."""
    from dashboard.diagnosis import loader
    from tests.server.conftest import make_batch

    feed = Feed(world, [], nodes=4, gpus=2)
    feed.run(3, passes=False)
    now = feed.t0 + feed.t
    original, joined = loader._gpus, []

    def late_agent(cluster_id: int, at: float, lut: Any) -> Any:
        if not joined:
            ts = now - 1
            batch = make_batch(host="node-late", steps=[], hosts=[{"ts": ts, "cpu_pct": 5.0}],
                               probes=[{"ts": ts, "peer": "node-000", "sent": 5, "lost": 0, "rtt_ms": 0.1}],
                               ports=[{"ts": ts, "device": "mlx5_0", "port": 1, "state": "ACTIVE"}])
            for g in batch["gpus"]:
                g["ts"] = ts
            store_batch(world.cluster, wire.validate_batch(batch))
            joined.append(True)
        return original(cluster_id, at, lut)

    monkeypatch.setattr(loader, "_gpus", late_agent)
    first = loader.load_window(world.cluster, now)
    assert joined and "node-late" not in first.nodes and len(first.gpus)
    second = loader.load_window(world.cluster, now)
    assert "node-late" in second.nodes and "node-late" in second.hosts


@pytest.mark.django_db(transaction=True)  # the pass's own process reads what this one committed
def test_the_embedded_pass_reads_in_its_own_process_and_survives_its_death(world: World, settings: Any) -> None:
    """Embedded, the scheduler runs the pass's read and detectors in a child process (so it never holds the server's
    GIL or database thread); the findings are reconciled here, and the child precomputes the overview page's first
    paint. A child that dies is replaced at the next pass."""
    settings.CLUSTERDX = {**settings.CLUSTERDX, "DIAGNOSIS_MAX_CPU_SHARE": 1.0}  # no rest: a pass at every call
    import asyncio
    import os
    import signal

    from asgiref.sync import sync_to_async
    from django.db import connections

    from dashboard.diagnosis import offload
    from dashboard.live.state import get_state
    from dashboard.scheduler import EMBEDDED_RUNNERS
    from dashboard.web.pages.overview import first_paint, overview

    assert EMBEDDED_RUNNERS["dashboard.diagnosis.tasks.diagnose"] == "dashboard.diagnosis.offload.diagnose"
    feed = Feed(world, [{"kind": "nccl_env_drift", "at_s": 3, "rank": 5}], nodes=4, gpus=2)
    feed.t0 = time.time() - 8  # the task uses the wall clock
    feed.sim = SimCluster(feed.sim.s, feed.t0)
    feed.run(7, passes=False)
    try:
        offload._wanted.pop(world.cluster.id, None)
        before = _parts()
        took = asyncio.run(offload.diagnose())
        assert took.keys() == {world.cluster.name}
        assert Finding.objects.filter(kind="nccl_config", subject="llm/rank5", state="open").exists()
        spent = {part: seconds - before[part] for part, seconds in _parts().items()}
        # /metrics says where the pass's time went: the child's read and detectors, the reconcile here, the trip
        assert all(spent[part] > 0 for part in ("load", "detect", "reconcile")), spent
        assert sum(spent.values()) == pytest.approx(took[world.cluster.name], abs=0.01), spent
        assert offload.precomputed_overview(world.cluster.id, 600) is None, "no page open: no overview computed"
        offload._wanted[world.cluster.id] = time.time() - offload.OVERVIEW_WANTED_S - 1
        asyncio.run(offload.diagnose())
        assert world.cluster.id not in offload._overviews, "opened too long ago: not computed either"
        first_paint(world.cluster)  # the page opened (it computes its own this once) ...
        assert asyncio.run(offload.diagnose()).keys() == {world.cluster.name}
        # ... and then the overview, which the page renders itself with: what the page would compute at that moment.
        got = offload.precomputed_overview(world.cluster.id, 600)
        assert got is not None
        body, _ = got
        # Asked first: the page uses it while it is younger than two passes, and the comparison below computes an
        # overview here, which on a loaded machine took longer than that.
        assert first_paint(world.cluster) is body
        live = get_state()
        assert body == overview(world.cluster, body["now"], (live.gpus(world.cluster.id),
                                                             live.heartbeats(world.cluster.id)))
        assert [f["subject"] for f in body["findings"]] == ["llm/rank5"] and len(body["nodes"]) == 4
        Finding.objects.filter(subject="llm/rank5").update(severity="critical")  # not what the page would show now
        assert first_paint(world.cluster)["findings"][0]["severity"] == "critical"
        child = offload.pool().submit(os.getpid).result(timeout=60)
        assert child != os.getpid()
        os.kill(child, signal.SIGKILL)
        assert asyncio.run(offload.diagnose()) == {}, "the pass the child died in is skipped, not raised"
        assert asyncio.run(offload.diagnose()).keys() == {world.cluster.name}, "a new child took over"
        assert offload.pool().submit(os.getpid).result(timeout=60) not in (child, os.getpid())
    finally:
        offload.shutdown(wait=True)  # the child's connection closes before the test database is dropped
        # ... and so does the one of asgiref's thread that ran the reconcile
        asyncio.run(sync_to_async(connections.close_all, thread_sensitive=True)())


class _Clock:
    """The pace's clock (``tasks.time``), moved by hand: a rest of 100 ms checked against the real clock failed
    whenever the machine stalled a test for longer than the margin (CI runs two suites at once on two cores)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __getattr__(self, name: str) -> Any:  # perf_counter, thread_time, monotonic: the real ones
        return getattr(time, name)

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: Any) -> _Clock:
    from dashboard.diagnosis import tasks

    c = _Clock()
    monkeypatch.setattr(tasks, "time", c)
    return c


def test_a_long_pass_rests_in_proportion_before_the_next(settings: Any, clock: _Clock) -> None:
    """At most DIAGNOSIS_MAX_CPU_SHARE of a core per cluster: a pass that took d waits d * (1/share - 1)."""
    from dashboard.diagnosis import tasks

    settings.CLUSTERDX = {**settings.CLUSTERDX, "DIAGNOSIS_MAX_CPU_SHARE": 0.25}
    assert tasks.due(987_654)  # never ran here: due at once
    tasks.paced(987_654, 0.05)  # took 50 ms: rests 150 ms
    assert not tasks.due(987_654)
    clock.sleep(0.16)
    assert tasks.due(987_654)
    tasks.paced(987_654, 0.0)  # a quick pass keeps the schedule's own cadence
    assert tasks.due(987_654)


def test_the_rest_budgets_the_passs_cpu_seconds_not_its_wait_for_a_core(settings: Any, clock: _Clock) -> None:
    """A pass of ``cpu`` CPU seconds that took ``took`` rests ``cpu / share - took``: on a machine whose cores are
    full, a pass waits for a core as long as it computes, and resting in proportion to that wait made each next
    pass read a longer delta (the pass grew without end)."""
    from django.core.cache import cache

    from dashboard.diagnosis import tasks

    settings.CLUSTERDX = {**settings.CLUSTERDX, "DIAGNOSIS_MAX_CPU_SHARE": 0.25}
    cid = 987_650
    try:
        tasks.paced(cid, 0.2, cpu=0.05)  # 50 ms of CPU over 200 ms: a quarter of a core already, no rest
        assert tasks.due(cid)
        tasks.paced(cid, 0.1, cpu=0.05)  # 50 ms of CPU over 100 ms: rests 100 ms
        assert not tasks.due(cid)
        clock.sleep(0.06)
        assert not tasks.due(cid)
        clock.sleep(0.06)
        assert tasks.due(cid)
        cache.set(tasks._pace_key(cid), (clock.time(), 0.05, tasks.me()))  # a record from before CPU seconds
        assert not tasks.due(cid), "paced by its wall time: rests 150 ms"
    finally:
        cache.delete(tasks._pace_key(cid))


def test_a_paced_cluster_is_left_to_the_process_that_holds_its_window(settings: Any) -> None:
    """The process that ran a cluster's last pass holds its window: another process leaves a paced cluster to it
    for DIAGNOSIS_HANDOVER_S past due, then takes it over; a quick cluster keeps the tick's cadence anywhere."""
    from django.core.cache import cache

    from dashboard.diagnosis import tasks

    settings.CLUSTERDX = {**settings.CLUSTERDX, "DIAGNOSIS_MAX_CPU_SHARE": 0.25, "DIAGNOSIS_INTERVAL_S": 2.0,
                          "DIAGNOSIS_HANDOVER_S": 20.0}
    cid, key = 987_653, tasks._pace_key(987_653)

    def last_pass(ago: float, took: float, owner: str | None) -> bool:
        cache.set(key, (time.time() - ago, took, owner) if owner != "old" else (time.time() - ago, took))
        return tasks.due(cid)

    try:
        # A 3 s pass rests 9 s: due 1 s ago, but for the process holding its window.
        assert not last_pass(10, 3.0, "elsewhere:1"), "another process's cluster, its next pass 1 s overdue"
        assert last_pass(10, 3.0, tasks.me()), "this process's own"
        assert last_pass(10, 3.0, None), "handed back (its worker shut down)"
        assert last_pass(10, 3.0, "old"), "a record from before owners"
        assert not last_pass(28.5, 3.0, "elsewhere:1"), "19.5 s overdue: still the owner's"
        assert last_pass(29.5, 3.0, "elsewhere:1"), "over 20 s overdue: the owner is gone or busy, taken over"
        assert not last_pass(8, 3.0, tasks.me()), "resting, whoever asks"
        # A 0.5 s pass rests 1.5 s, less than a tick: every tick's process runs it.
        assert last_pass(1.6, 0.5, "elsewhere:1")
        settings.CLUSTERDX = {**settings.CLUSTERDX, "DIAGNOSIS_HANDOVER_S": 0.0}
        assert last_pass(10, 3.0, "elsewhere:1"), "no handover wait: any process, as soon as due"
    finally:
        cache.delete(key)


def test_a_worker_shutting_down_hands_its_clusters_back_and_keeps_their_pace(settings: Any) -> None:
    from django.core.cache import cache

    from dashboard.diagnosis import tasks

    settings.CLUSTERDX = {**settings.CLUSTERDX, "DIAGNOSIS_MAX_CPU_SHARE": 0.25, "DIAGNOSIS_INTERVAL_S": 2.0,
                          "DIAGNOSIS_HANDOVER_S": 20.0}
    mine, theirs = 987_651, 987_652
    try:
        tasks.paced(mine, 3.0, cpu=1.5)
        tasks.paced(theirs, 3.0)
        cache.set(tasks._pace_key(theirs), (time.time(), 3.0, "elsewhere:1"))  # another process ran it since
        tasks.release()
        assert cache.get(tasks._pace_key(mine))[2] is None
        assert cache.get(tasks._pace_key(mine))[3] == 1.5, "its CPU seconds kept"
        assert cache.get(tasks._pace_key(theirs))[2] == "elsewhere:1", "only what this process still owns"
        assert not tasks.due(mine), "handed back, still resting"
        cache.set(tasks._pace_key(mine), (time.time() - 10, 3.0, None))
        assert tasks.due(mine)
    finally:
        cache.delete_many([tasks._pace_key(mine), tasks._pace_key(theirs)])


def test_the_pace_is_shared_by_every_process_that_runs_passes(settings: Any) -> None:
    """A Celery worker's ticks go to any of its processes (``--concurrency 2``): a pass one process ran paces the
    others, through the shared cache, or the two together would run a cluster's pass twice as often as the share."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from django.core.cache import cache

    from dashboard.diagnosis import tasks

    if not settings.REDIS_URL:
        pytest.skip("needs REDIS_URL: the shared pace is tested in the suite's PostgreSQL + Redis pass")
    settings.CLUSTERDX = {**settings.CLUSTERDX, "DIAGNOSIS_MAX_CPU_SHARE": 0.25}
    cluster_id = 900_000 + os.getpid() % 100_000
    cache.delete(tasks._pace_key(cluster_id))
    assert tasks.due(cluster_id)
    other = ("import django; django.setup(); from dashboard.diagnosis import tasks; "
             f"tasks.paced({cluster_id}, 30.0)")  # another process's 30 s pass just ended
    subprocess.run([sys.executable, "-c", other], check=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
                   env={**os.environ, "DJANGO_SETTINGS_MODULE": "dashboard.settings"})
    try:
        assert not tasks.due(cluster_id), "it rests 90 s, whichever process asks"
    finally:
        cache.delete(tasks._pace_key(cluster_id))


def test_a_pass_skipped_for_another_workers_does_not_pace_the_cluster(world: World, client: Any, settings: Any) -> None:
    """On PostgreSQL a pass takes the cluster's advisory lock; a worker that finds it held skips the cluster, and
    that skip, a millisecond long, must not stand as the cluster's last pass (the holder's end paces the next)."""
    from django.db import connection

    from dashboard.diagnosis import tasks
    from tests.server.conftest import make_batch, post

    if connection.vendor != "postgresql":
        pytest.skip("the advisory lock is PostgreSQL's: tested in the suite's PostgreSQL + Redis pass")
    import psycopg

    assert post(client, make_batch(seq=0), world.token).status_code == 200
    cid = world.cluster.id
    tasks._paced.pop(cid, None)
    from django.core.cache import cache

    cache.delete(tasks._pace_key(cid))
    with psycopg.connect(**connection.get_connection_params()) as holder:
        holder.execute("SELECT pg_advisory_lock(%s, %s)", [tasks.LOCK_NAMESPACE, cid])
        assert world.cluster.name not in diagnose(), "another worker holds the pass"
        assert tasks.due(cid), "the skip set no pace"
        # Released here, not by closing: a closed session's locks go when its backend has exited, which on a loaded
        # machine came after the next pass had found the lock still held (and skipped again).
        holder.execute("SELECT pg_advisory_unlock(%s, %s)", [tasks.LOCK_NAMESPACE, cid])
    before = time.time()
    assert world.cluster.name in diagnose()
    last = tasks._last(cid)
    assert last is not None, "the pass that ran set no pace"
    ended, _took, owner, cpu = last
    assert ended >= before and owner == tasks.me() and cpu is not None and cpu > 0, "the pass that ran set the pace"
    # Whether it rests is the pace's arithmetic: a pass of a few CPU milliseconds rests a few hundredths of a second
    # at the default share, which a loaded machine outlasts between the pass and the check (CI did once). A share
    # this small makes that rest minutes long, so the check reads the record and not the clock.
    settings.CLUSTERDX = {**settings.CLUSTERDX, "DIAGNOSIS_MAX_CPU_SHARE": 1e-6}
    assert not tasks.due(cid), "the pass that ran rests before the next"


def test_a_cluster_that_goes_quiet_all_at_once_is_one_finding_not_one_per_node(
        world: World, client: Any, django_capture_on_commit_callbacks: Any, monkeypatch: Any) -> None:
    """What a server whose ingest fell behind, or that lost its network to the nodes, sees: every node's data stops
    at once. Not eight node_down findings (and alerts), but one for the cluster, whose page plots the cliff."""
    from django.db import connection

    from dashboard.diagnosis import silences

    feed = Feed(world, [])
    assert feed.run(12) == []
    depths: list[int] = []
    real_mark = silences.mark

    def mark(rows: Any, *args: Any) -> Any:  # the browsers' rows: built after the commit, out of the write lock
        depths.append(len(connection.savepoint_ids))
        return real_mark(rows, *args)

    monkeypatch.setattr(silences, "mark", mark)
    outside = len(connection.savepoint_ids)  # the test's own transaction; reconcile's atomic would add one
    opened = []
    for k in range(1, 21):  # the data stops; passes go on
        with django_capture_on_commit_callbacks(execute=True):
            res = run_pass(feed.cluster, feed.t0 + feed.t + k)
        opened += [(k, f.kind, f.subject) for f in res.changes.opened]
    assert [(kind, subject) for _, kind, subject in opened] == [("cluster_silent", "cluster")], opened
    # heartbeat_s (15 s) after the last word: at 15, or at 16 when the float seconds since a wall-clock start
    # (feed.t0 = time.time() - 300) come out a hair under 15 at the pass of 15
    assert opened[0][0] in (15, 16), opened
    assert depths and set(depths) == {outside}
    f = Finding.objects.get(kind="cluster_silent")
    assert f.subject_type == "cluster" and f.node_id is None and "all 8 nodes" in f.title
    client.force_login(world.teammate)
    body = client.get(f"/api/v1/findings/{f.id}").json()
    assert body["finding"]["headline"] == "silent 20 s, all 8 nodes"  # refreshed by each pass since
    panel = body["chart"]["panels"][0]
    assert panel["id"] == "heard" and panel["direction"] == "below"
    ys = next(s for s in panel["series"] if s["role"] == "subject")["y"]
    assert ys[0] == 8 and ys[-1] == 0 and panel["breach"]["over"] is True
    page = client.get(f"/findings/{f.id}/")
    assert page.status_code == 200 and b"no node of the cluster heard" in page.content


def test_the_window_knows_the_runs_newest_step_though_the_run_row_lags(world: World) -> None:
    """Ingest moves a run's row (last step, when) at most once a second; the pass takes the run's last step from the
    step rows it reads, or a run would look stalled a second longer than it is: a frozen rank's run was named hung
    before the rank's beats had gone quiet (CI, netns test_a_frozen_rank_is_named)."""
    from dashboard.diagnosis import loader

    feed = Feed(world, [], nodes=2, gpus=2)
    feed.run(5, passes=False)
    now = feed.t0 + feed.t
    run = Run.objects.get(cluster=world.cluster, name="llm")
    steps = framed.stored(fr.STEPS, run=run)
    at = int(np.argmax(steps["ts"]))
    newest_step, newest_ts = int(steps["step"][at]), float(steps["ts"][at])
    behind = datetime.fromtimestamp(newest_ts - 0.9, UTC)
    Run.objects.filter(id=run.id).update(last_step=newest_step - 3, last_step_at=behind)
    info = next(r for r in loader.load_window(world.cluster, now).runs if r.name == "llm")
    assert info.last_step == newest_step and info.last_step_ts == pytest.approx(newest_ts, abs=1e-3)
