"""Retention and exactly-once storage: idempotency records are purged in bounded chunks, a late retry of a batch
whose record was purged is still answered as a duplicate (never stored twice), and batches an agent could not keep
(a full disk, a full spool) show up as a warning event of that node. Real ingest, real retention, both databases."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from dashboard.storage import frames as fr
from dashboard.telemetry import models as m
from dashboard.telemetry.tasks import purge_old_samples
from tests.server import framed
from tests.server.conftest import World, make_batch, post

pytestmark = pytest.mark.django_db


def age(hours: float, **where: Any) -> None:
    """Move stored batches (their records and their time series) ``hours`` into the past."""
    then = timezone.now() - timedelta(hours=hours)
    m.AgentBatch.objects.filter(**where).update(received_at=then, sent_at=then)
    for model in (m.GpuFrame, m.StepFrame, m.Event):  # a frame's ts is what retention cuts by
        model.objects.filter(ts__gt=then).update(ts=then)


_sent: dict[tuple[str, str, int], dict[str, Any]] = {}


def status(client: Any, world: World, seq: int, host: str = "node-000") -> str:
    """Post batch ``seq`` of ``host``'s agent; a retry is the same batch, byte for byte, as the agent's spool has."""
    batch = _sent.setdefault((world.token, host, seq), make_batch(seq=seq, host=host))
    r = post(client, batch, world.token)
    assert r.status_code == 200, r.content
    return str(r.json()["status"])


def test_it_purges_idempotency_records_in_bounded_chunks(client: Any, world: World, settings: Any) -> None:
    old = timezone.now() - timedelta(hours=settings.CLUSTERDX["RETENTION_HOURS"] + 1)
    m.AgentBatch.objects.bulk_create(
        [m.AgentBatch(cluster=world.cluster, agent_id=f"agent-{i % 5}", seq=i, host=f"node-{i % 5:03d}",
                      received_at=old) for i in range(230)])
    with CaptureQueriesContext(connection) as ctx:
        purge_old_samples(chunk=50)
    deletes = [q["sql"] for q in ctx.captured_queries
               if q["sql"].startswith("DELETE") and "telemetry_agentbatch" in q["sql"]]
    assert len(deletes) >= 4, deletes  # 225 rows go, at most 50 a statement
    assert all(" IN (" in sql for sql in deletes), "every DELETE names the rows it removes (no unbounded DELETE)"
    # What stays: each agent's newest purged record, the mark below which its seqs are known (5 agents).
    assert sorted(m.AgentBatch.objects.values_list("agent_id", "seq")) == [(f"agent-{i}", 225 + i) for i in range(5)]


def test_a_late_retry_of_a_purged_batch_is_a_duplicate(client: Any, world: World, settings: Any) -> None:
    hours = settings.CLUSTERDX["RETENTION_HOURS"]
    for seq in range(1, 6):
        assert status(client, world, seq) == "accepted"
    age(hours + 1, seq__lte=3)
    purge_old_samples()
    steps = framed.count(fr.STEPS)

    # The ack of batch 2 was lost; the agent was off for a day and a half and now retries it.
    assert status(client, world, 2) == "duplicate"
    assert status(client, world, 1) == "duplicate"
    assert status(client, world, 5) == "duplicate"  # still on record: the unique row answers
    assert framed.count(fr.STEPS) == steps, "a late retry must not store its records a second time"
    assert status(client, world, 6) == "accepted"
    assert sorted(m.AgentBatch.objects.values_list("seq", flat=True)) == [3, 4, 5, 6]  # 3: the agent's purge mark
    # Another agent, or this one's seqs above the mark, are not affected.
    assert status(client, world, 2, host="node-001") == "accepted"


def test_a_group_asks_for_its_agents_marks_at_once_and_answers_as_one_by_one(
        world: World, settings: Any, django_capture_on_commit_callbacks: Any) -> None:
    """The group commit checks every agent it has not committed for (all of them after a restart) in one statement
    (purged_among) and must answer exactly as the per-agent probe (purged_through) does."""
    from clusterdx import wire
    from dashboard.ingest.writer import clear_caches, store_group
    from dashboard.telemetry.tasks import purged_among, purged_through

    def group(*keys: tuple[str, int]) -> list[str]:
        jobs = [(world.cluster, wire.validate_batch(make_batch(seq=seq, host=host)), "") for host, seq in keys]
        with django_capture_on_commit_callbacks(execute=True):
            return [o.status for o in store_group(jobs)]

    hosts = [f"node-{n:03d}" for n in range(4)]
    assert group(*[(h, seq) for h in hosts for seq in range(1, 6)]) == ["accepted"] * 20
    age(settings.CLUSTERDX["RETENTION_HOURS"] + 1, seq__lte=3)
    purge_old_samples()
    keys = [(world.cluster.id, f"agent-{h}", seq) for h in hosts for seq in range(0, 8)]
    assert purged_among(keys) == {k for k in keys if purged_through(*k)} == \
        {(world.cluster.id, f"agent-{h}", seq) for h in hosts for seq in range(0, 3)}
    clear_caches()  # a restart: no agent committed in this process
    with CaptureQueriesContext(connection) as queries:
        got = group(("node-000", 2), ("node-001", 6), ("node-002", 1), ("node-002", 7), ("node-003", 4))
    assert got == ["duplicate", "accepted", "duplicate", "accepted", "duplicate"]
    probes = [q for q in queries if 'FROM "telemetry_agentbatch"' in q["sql"] and '"seq" >' in q["sql"]]
    assert len(probes) == 1, probes


def test_a_silent_agent_keeps_its_mark_until_it_is_long_gone(client: Any, world: World, settings: Any) -> None:
    hours = settings.CLUSTERDX["RETENTION_HOURS"]
    for seq in (10, 11):
        assert status(client, world, seq) == "accepted"
    age(hours + 1)
    purge_old_samples()
    assert list(m.AgentBatch.objects.values_list("seq", flat=True)) == [11]
    assert status(client, world, 10) == "duplicate" and status(client, world, 11) == "duplicate"
    age(24 * 31)  # a month later the mark goes too (one row per agent must not pile up forever)
    purge_old_samples()
    assert not m.AgentBatch.objects.exists()


def test_batches_an_agent_could_not_keep_become_a_warning_on_its_node(client: Any, world: World) -> None:
    r = post(client, make_batch(seq=1, dropped={"disk_full": 3, "source_error": 2}), world.token)
    assert r.status_code == 200 and r.json()["status"] == "accepted"
    event = m.Event.objects.get(kind="agent")
    assert (event.severity, event.message) == ("warning", "agent node-000 dropped 3 batches: disk full")
    assert event.node.hostname == "node-000" and event.data == {"disk_full": "3"}
    assert m.AgentBatch.objects.get().dropped == {"disk_full": 3, "source_error": 2}

    post(client, make_batch(seq=2, dropped={"spool_overflow": 1, "disk_full": 1}), world.token)
    assert m.Event.objects.filter(kind="agent").latest("id").message == \
        "agent node-000 dropped 2 batches: disk full 1, spool full 1"
    post(client, make_batch(seq=3, dropped={"kmsg_overrun": 4}), world.token)  # records, not batches: no event
    post(client, make_batch(seq=3, dropped={"disk_full": 9}), world.token)  # a duplicate reports nothing again
    assert m.Event.objects.filter(kind="agent").count() == 2


# -- live state and websocket buffers: what a finished run or a stalled client leaves behind is bounded -------------


class Clock:
    """The live state's clock (only its module's ``time``), moved by the test instead of waited for."""

    def __init__(self) -> None:
        self.t = 1.8e9

    def time(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    from dashboard.live import state

    c = Clock()
    monkeypatch.setattr(state, "time", c)
    return c


@pytest.fixture(params=["memory", "redis"])
def live(request: pytest.FixtureRequest, settings: Any) -> Any:
    import os
    import uuid

    from dashboard.live import state

    if request.param == "memory":
        yield state.MemoryState()
        return
    if not settings.REDIS_URL:
        pytest.skip("needs REDIS_URL: the Redis live state is tested in the suite's PostgreSQL + Redis pass")
    redis_state = state.RedisState(settings.REDIS_URL, f"cdxtest-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    yield redis_state
    redis_state.clear()


def beats(run: str, ranks: range) -> list[dict[str, Any]]:
    return [{"run": run, "rank": r, "ts": 1.8e9, "state": "step", "state_s": 1.0, "step": 10} for r in ranks]


def stored_beats(live: Any, cluster_id: int) -> int:
    """What the state really holds, not what a read filters: the memory a finished run keeps."""
    if hasattr(live, "_beats"):
        return len(live._beats.get(cluster_id, {}))
    return int(live._redis.hlen(live._key("beat", cluster_id)))


def test_the_ranks_of_a_finished_run_are_trimmed(live: Any, clock: Clock) -> None:
    live.record_beats(1, "node-000", beats("finished-run", range(500)))
    clock.t += 600
    live.record_beats(1, "node-001", beats("running", range(1)))
    assert len(live.beats(1)) == 501
    clock.t += 2 * 3600 - 599  # two hours on, the finished run's beats are past the limit, the running one's are not
    live.record_beats(1, "node-001", beats("running", range(1)))
    assert [b["run"] for b in live.beats(1)] == ["running"]
    assert stored_beats(live, 1) == 1


def test_beats_per_cluster_are_bounded(live: Any, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    from dashboard.live import state

    monkeypatch.setattr(state, "MAX_BEATS", 100, raising=False)
    for part in range(3):  # 150 ranks, 50 at a time, each part heard later than the one before
        clock.t += 11  # past the Redis state's trim interval
        live.record_beats(7, "node-000", beats("flood", range(part * 50, part * 50 + 50)))
    live.record_beats(8, "node-000", beats("other", range(3)))
    assert stored_beats(live, 7) == 100
    assert sorted(b["rank"] for b in live.beats(7)) == list(range(50, 150))  # the least recently heard went
    assert len(live.beats(8)) == 3


def test_a_watch_lasts_while_renewed_and_a_lapsed_one_is_not_kept(live: Any, clock: Clock) -> None:
    """A run page's socket renews its watch every third of WATCH_TTL_S; a worker that died without unwatching leaves
    watches that lapse, and the lapsed ones are removed, not only filtered out of reads."""
    live.watch_run(5, "page-a", clock.t + 60)
    live.watch_run(5, "page-b", clock.t + 60)
    live.watch_run(6, "page-c", clock.t + 10)
    assert live.watched_runs() == {5, 6}
    live.unwatch_run(5, "page-a")
    assert live.watched_runs() == {5, 6}, "page-b still watches run 5"
    clock.t += 11
    assert live.watched_runs() == {5}
    live.watch_run(5, "page-b", clock.t + 60)  # renewed
    clock.t += 55
    assert live.watched_runs() == {5}
    live.watch_run(7, "page-d", clock.t + 60)
    held = len(live._watched) if hasattr(live, "_watched") else int(live._redis.zcard(live._watched_key))
    assert held == 2, "run 6's lapsed watch is gone"
    live.unwatch_run(5, "page-b")
    assert live.watched_runs() == {7}


def test_a_stalled_clients_pending_events_and_findings_are_bounded() -> None:
    import asyncio

    from dashboard.live.consumers import LiveConsumer

    client = LiveConsumer()
    client.only, client.host, client.run_hosts, client.pending = None, None, None, {}

    async def flood() -> None:
        for i in range(6000):  # the flusher is stuck sending to a client that does not read
            await client.live_event({"event": {"type": "events", "cluster": 1, "events": [
                {"ts": i, "host": "node-000", "kind": "xid", "severity": "error", "code": 79, "message": f"#{i}"}]}})
            await client.live_event({"event": {"type": "findings", "cluster": 1, "findings": [
                {"id": i % 2500, "state": "open", "updated_at": float(i)}]}})

    asyncio.run(flood())
    events, findings = client.pending["events"], list(client.pending["findings"].values())
    assert len(events) <= 2000 and events[-1]["message"] == "#5999"
    assert len(findings) <= 2000 and len({f["id"] for f in findings}) == len(findings)
    assert findings[-1] == {"id": 5999 % 2500, "state": "open", "updated_at": 5999.0}  # each finding's latest state


def test_the_redis_live_state_writes_through_a_dropped_connection_and_a_refused_command(settings: Any) -> None:
    """The live state packs a group's writes itself (``RedisState._send``): a connection Redis dropped (a restart) is
    retried as the client retries its own commands, and a command Redis refuses fails the write, and only that one."""
    import os
    import uuid

    import redis

    from dashboard.live import state

    if not settings.REDIS_URL:
        pytest.skip("needs REDIS_URL: the Redis live state is tested in the suite's PostgreSQL + Redis pass")
    live = state.RedisState(settings.REDIS_URL, f"cdxtest-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    admin = redis.Redis.from_url(settings.REDIS_URL)
    try:
        live.record_hosts(3, {"node-a": [["node-a", 0, 1.5, 40.0]]})
        assert admin.client_kill_filter(_type="normal", skipme=True) >= 1  # every other client, the live state's too
        live.record_hosts(3, {"node-a": [["node-a", 0, 2.5, 41.0]], "node-b": [["node-b", 1, 2.5, None]]})
        live.record_beats(3, "node-b", beats("r", range(2)))
        assert sorted(live.gpus(3)) == [["node-a", 0, 2.5, 41.0], ["node-b", 1, 2.5, None]]
        assert set(live.heartbeats(3)) == {"node-a", "node-b"} and len(live.beats(3)) == 2

        admin.set(live._key("hb", 4), "not a hash")  # the first of the two commands: the second's reply left unread
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            live.record_hosts(4, {"node-c": [["node-c", 0, 3.0, 1.0]]})
        admin.delete(live._key("hb", 4))
        live.record_hosts(4, {"node-c": [["node-c", 0, 3.5, 2.0]]})
        assert live.gpus(4) == [["node-c", 0, 3.5, 2.0]] and list(live.heartbeats(4)) == ["node-c"]
    finally:
        live.clear()
        admin.close()
