"""Group commit, backpressure, the advertised send interval and /metrics (issue 11), on both databases.

Real writer thread, real uvicorn (in a thread, and as a subprocess that is SIGKILLed between receiving a batch and
committing it), and the real agent's delivery (spool, poster, sender) against it.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clusterdx import blocks, wire
from collectors.agent.delivery import Backoff, Poster, Sender
from collectors.agent.spool import Spool
from dashboard.ingest import commit, views
from dashboard.ingest.writer import Stored, store_group
from dashboard.storage import frames as fr
from dashboard.telemetry import models as m
from tests.server import framed
from tests.server.conftest import AsgiServer, World, make_batch, post

ROOT = Path(__file__).resolve().parents[2]


def body_of(batch: dict[str, Any]) -> bytes:
    return json.dumps(batch, separators=(",", ":")).encode()


def job(world: World, batch: dict[str, Any]) -> tuple[Any, dict[str, Any], str]:
    data = body_of(batch)
    return world.cluster, wire.validate_batch(json.loads(data)), hashlib.sha256(data).hexdigest()


def stored(world: World) -> list[tuple[str, int]]:
    return sorted(m.AgentBatch.objects.filter(cluster=world.cluster).values_list("agent_id", "seq"))


def wait_for(check: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.django_db
def test_a_group_answers_each_batch_as_if_it_came_alone(world: World) -> None:
    before = make_batch(seq=1, host="node-000")
    assert store_group([job(world, before)]) == [Stored("accepted", 4)]
    fresh = [make_batch(seq=s, host=f"node-{n:03d}") for n in range(3) for s in (2, 3)]
    reused = make_batch(seq=2, host="node-001", sent_at=1.0 + time.time())  # seq 2 again, other content
    outcomes = store_group([job(world, b) for b in [*fresh, before, fresh[0], reused]])
    assert outcomes == [*[Stored("accepted", 4)] * 6, Stored("duplicate", 0), Stored("duplicate", 0),
                        Stored("seq_reused", 0)]
    assert len(stored(world)) == 7
    assert framed.count(fr.GPUS, cluster=world.cluster) == 7 * 2
    assert framed.count(fr.STEPS, cluster=world.cluster) == 7 * 2
    assert m.Node.objects.filter(cluster=world.cluster).count() == 3
    assert m.Gpu.objects.filter(node__cluster=world.cluster).count() == 3 * 2


@pytest.mark.django_db
def test_a_group_stores_every_row_with_its_own_values(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite takes a group's rows SQLITE_ROWS_PER_STATEMENT to an INSERT, the rest in statements of 32, 16, 8 ...
    rows: at 64 a statement, 23 nodes x 8 GPU frames (each GPU sampled in a 10 s window of its own, a frame each) is
    two whole statements and 56 rows over (32 + 16 + 8). Each frame must land with its own values, none twice, none
    lost."""
    from dashboard.ingest import writer

    monkeypatch.setattr(writer, "SQLITE_ROWS_PER_STATEMENT", 64)
    monkeypatch.setattr(writer, "_tables", {})  # the tables' statements are laid out when first used
    hosts = [f"node-{n:03d}" for n in range(23)]
    base = (time.time() // fr.FRAME_S - 20) * fr.FRAME_S
    batches = []
    for n, host in enumerate(hosts):
        batch = make_batch(seq=1, host=host)
        batch["gpus"] = [{**batch["gpus"][0], "ts": base + fr.FRAME_S * i, "index": i, "uuid": f"GPU-{host}-{i}",
                          "util_gpu_pct": n + i / 10, "mem_used_bytes": n * 1000 + i,
                          "throttle_reasons": [f"r{n}"] if i == 3 else None} for i in range(8)]
        batches.append(batch)
    rows = 23 * 8
    assert rows > 2 * writer.SQLITE_ROWS_PER_STATEMENT and rows % writer.SQLITE_ROWS_PER_STATEMENT
    assert store_group([job(world, b) for b in batches]) == [Stored("accepted", 8 + 2)] * 23
    assert m.GpuFrame.objects.filter(cluster=world.cluster).count() == rows
    gpus = framed.stored(fr.GPUS, cluster=world.cluster)
    names = dict(m.Node.objects.filter(cluster=world.cluster).values_list("id", "hostname"))
    got = sorted(zip([names[i] for i in gpus["node_id"].tolist()], gpus["index"].astype(int).tolist(),
                     gpus["util_gpu_pct"].tolist(), gpus["mem_used_bytes"].tolist(), gpus.objs["throttle_reasons"],
                     strict=True))
    assert got == sorted((host, i, n + i / 10, n * 1000 + i, [f"r{n}"] if i == 3 else None)
                         for n, host in enumerate(hosts) for i in range(8))
    assert framed.count(fr.STEPS, cluster=world.cluster) == 23 * 2


@pytest.mark.django_db
def test_a_restarted_writer_reads_a_groups_known_nodes_at_once_and_replaces_only_what_changed(
        world: World, django_capture_on_commit_callbacks: Any) -> None:
    """A server restarting under many nodes meets each again with a cold cache: one read for the group's nodes (ids
    and places), no SELECT and UPDATE each; a node whose agent reports a new place is moved, one placed by an
    uploaded file keeps the file's place."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from dashboard.ingest.writer import clear_caches

    hosts = [f"node-{n:03d}" for n in range(12)]
    place = {"rack": "r1", "switch": "leaf-1"}
    with django_capture_on_commit_callbacks(execute=True):
        store_group([job(world, make_batch(seq=1, host=h, topology=place)) for h in hosts])
    m.Node.objects.filter(hostname="node-011").update(rack="r-file", switch="leaf-file", placed_by="file")
    clear_caches()  # the restart
    moved = {"rack": "r2", "switch": "leaf-2"}
    batches = [make_batch(seq=2, host=h, topology=moved if h in ("node-003", "node-011") else place) for h in hosts]
    with CaptureQueriesContext(connection) as queries, django_capture_on_commit_callbacks(execute=True):
        assert [o.status for o in store_group([job(world, b) for b in batches])] == ["accepted"] * len(hosts)
    sql = [q["sql"] for q in queries]
    node_reads = [q for q in sql if q.startswith("SELECT") and 'FROM "telemetry_node"' in q and "hostname" in q]
    assert len(node_reads) == 1, node_reads
    placed = [q for q in sql if q.startswith('UPDATE "telemetry_node"') and "rack" in q]
    assert len(placed) == 1, placed  # node-003 only: the others' rows already say so, node-011's is the file's
    got = {n.hostname: (n.rack, n.switch) for n in m.Node.objects.filter(cluster=world.cluster)}
    assert got == {**{h: ("r1", "leaf-1") for h in hosts}, "node-003": ("r2", "leaf-2"),
                   "node-011": ("r-file", "leaf-file")}
    # The next group finds everything cached: no node read at all.
    with CaptureQueriesContext(connection) as again, django_capture_on_commit_callbacks(execute=True):
        store_group([job(world, make_batch(seq=3, host=h, topology=moved if h == "node-003" else place))
                     for h in hosts])
    assert not [q for q in again if 'FROM "telemetry_node"' in q["sql"] and "hostname" in q["sql"]]


def meta(rank: int, host: str, **extra: Any) -> dict[str, Any]:
    return {"run": "run-9", "rank": rank, "world_size": 4, "ts": time.time(), "host": host, "local_rank": rank % 2,
            "gpu_index": rank % 2, "env": {"NCCL_IB_TIMEOUT": "22"}, "peak_flops": 989e12, **extra}


@pytest.mark.django_db
def test_a_group_stores_every_ranks_metadata_once(world: World) -> None:
    """A run's first second brings every rank's metadata at once, naming hosts the group itself creates."""
    first = [make_batch(seq=1, host=f"node-{n}", runs=[meta(2 * n + i, f"node-{n}") for i in range(2)]) for n in (0, 1)]
    assert [o.status for o in store_group([job(world, b) for b in first])] == ["accepted"] * 2  # type: ignore[union-attr]
    later = make_batch(seq=2, host="node-0", runs=[meta(1, "node-1", versions={"nccl": "2.27.3"})])  # rank 1 moved
    assert store_group([job(world, later)]) == [Stored("accepted", 5)]
    ranks = {r.rank: r for r in m.Rank.objects.filter(run__name="run-9").select_related("node", "run")}
    assert sorted(ranks) == [0, 1, 2, 3]
    assert {k: r.node.hostname for k, r in ranks.items()} == {0: "node-0", 1: "node-1", 2: "node-1", 3: "node-1"}
    run = ranks[0].run
    assert run.world_size == 4 and run.meta["peak_flops"] == 989e12 and run.meta["versions"] == {"nccl": "2.27.3"}
    assert m.Node.objects.filter(cluster=world.cluster).count() == 2


def test_concurrent_batches_are_stored_once_each_in_shared_commits(transactional_db: None, world: World) -> None:
    from prometheus_client import REGISTRY

    def commits() -> float:
        return REGISTRY.get_sample_value("clusterdx_ingest_batches_per_commit_count") or 0.0

    writer = commit.GroupWriter(capacity=100, max_group=64, window_s=0.5)
    batches = [make_batch(seq=s, host=f"node-{n:03d}") for n in range(8) for s in range(3)]
    jobs = [job(world, b) for b in batches] + [job(world, b) for b in batches[:5]]  # five resent at once
    outcomes: list[Stored] = []
    lock = threading.Lock()
    start, before = threading.Barrier(len(jobs)), commits()

    def send(j: Any) -> None:
        start.wait()
        result = writer.submit(j).result(timeout=60)
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=send, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    writer.stop()
    assert sorted(o.status for o in outcomes) == ["accepted"] * 24 + ["duplicate"] * 5
    assert stored(world) == sorted((b["agent_id"], b["seq"]) for b in batches)
    assert framed.count(fr.GPUS, cluster=world.cluster) == 24 * 2
    assert commits() - before < len(jobs), "batches that arrived together shared commits"


def test_a_busy_writer_gathers_for_its_busy_window_and_a_quiet_one_commits_at_once() -> None:
    """Batches already queued as a group begins mean a busy server: the writer then gathers for the busy window (a
    commit's cost is mostly per commit); with none waiting it commits after the short window, so a lone batch is not
    held back."""
    writer = commit.GroupWriter(capacity=100, max_group=64, window_s=0.002, busy_window_s=1.0)
    arrived: dict[int, float] = {}

    def arrive(name: int, after_s: float) -> None:
        def put() -> None:
            arrived[name] = time.monotonic()
            writer.queue.put(commit._Pending(name))  # type: ignore[arg-type]
        threading.Timer(after_s, put).start()

    def names(group: list[Any]) -> list[int]:
        return [p.job for p in group]

    arrive(1, 0.1)
    arrive(2, 0.5)
    assert names(writer._gather()) == [1], "quiet: committed without waiting for a batch 0.4 s later"
    assert names(writer._gather()) == [2]
    for name in (3, 4):
        writer.queue.put(commit._Pending(name))  # type: ignore[arg-type]
    arrive(5, 0.3)
    began = time.monotonic()
    assert names(writer._gather()) == [3, 4, 5], "busy: the batch 0.3 s later joins the group"
    assert time.monotonic() - began >= 0.9, "and the group waited out its busy window for more"


def test_the_send_interval_follows_the_node_budget(client: Any, world: World, settings: Any) -> None:
    settings.CLUSTERDX = {**settings.CLUSTERDX, "INGEST_NODES_PER_S": 2}
    views._nodes.clear()
    r = post(client, make_batch(seq=0, host="node-000"), world.token)
    assert r.json()["send_interval_s"] == 1.0
    m.Node.objects.bulk_create([m.Node(cluster=world.cluster, hostname=f"node-{i:03d}") for i in range(1, 5)])
    views._nodes.clear()  # counted again every 30 s; here at once
    r = post(client, make_batch(seq=1, host="node-000"), world.token)
    assert r.status_code == 200 and r.json()["send_interval_s"] == 3.0  # 5 nodes, 2 per second


def test_a_node_the_server_creates_is_counted_in_the_next_send_interval(
        client: Any, world: World, settings: Any, django_capture_on_commit_callbacks: Any) -> None:
    """A fleet registering in its first seconds is told its own size's interval at once, not its first nodes' for
    the 30 s the count is kept: a node this server creates makes the count due again."""
    settings.CLUSTERDX = {**settings.CLUSTERDX, "INGEST_NODES_PER_S": 2}
    views._nodes.clear()
    answers = []
    for i in range(5):
        with django_capture_on_commit_callbacks(execute=True):  # the test's transaction never commits
            answers.append(post(client, make_batch(seq=0, host=f"node-{i:03d}"), world.token).json())
    # Each answer is sized before its own batch is stored: 0, 1, 2, 3, 4 nodes known, 2 a second.
    assert [a["send_interval_s"] for a in answers] == [1.0, 1.0, 1.0, 2.0, 2.0]
    again = post(client, make_batch(seq=1, host="node-000"), world.token).json()
    assert again["send_interval_s"] == 3.0


# -- backpressure: a tiny queue, a paused writer, the real agent -------------------------------------------------
@pytest.fixture
def paused(tmp_path: Path, settings: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A writer that stops before its first commit until the returned file is removed, behind a one-batch queue."""
    gate = tmp_path / "gate"
    gate.touch()
    monkeypatch.setenv(commit.PAUSE_ENV, str(gate))
    settings.CLUSTERDX = {**settings.CLUSTERDX, "INGEST_QUEUE_BATCHES": 1}
    commit.reset()
    yield gate
    gate.unlink(missing_ok=True)
    commit.reset()


def test_a_full_queue_answers_429_and_the_agent_delivers_later(transactional_db: None, world: World,
                                                                 paused: Path, tmp_path: Path) -> None:
    server = AsgiServer().start()
    try:
        poster = Poster(server.url, lambda: world.token, timeout=60)
        spool = Spool(tmp_path / "spool.sqlite3")
        for _ in range(3):
            spool.put(make_batch(host="node-007"))
        seqs = [seq for seq, _ in spool._db.execute("SELECT seq, body FROM batch ORDER BY seq")]
        first, second, third = _three(spool)
        answers: list[Any] = []
        holds = [threading.Thread(target=lambda b=b: answers.append(Poster(server.url, lambda: world.token,
                                                                           timeout=60).post(b))) for b in (first, second)]
        holds[0].start()
        wait_for(lambda: Path(str(paused) + ".paused").exists(), "the writer to hold the first batch")
        holds[1].start()
        wait_for(lambda: commit.writer().queue.full(), "the second batch to fill the queue")
        refused = poster.post(third)
        assert (refused.kind, refused.status, refused.retry_after) == ("retry", 429, 1.0)
        assert refused.detail.startswith("busy:") and "not stored" in refused.detail
        sender = Sender(spool, poster, Backoff(0.05, 30.0))
        item = spool.oldest()
        assert item is not None
        assert sender.deliver(item) >= 1.0, "the agent waits at least Retry-After before sending again"
        assert spool.depth == 3 and sender.stats.by_status.get(429) == 1  # kept, nothing lost
        paused.unlink()
        for t in holds:
            t.join(60)
        assert sorted(a.kind for a in answers) == ["ok", "ok"]
        sender.start()
        wait_for(lambda: spool.depth == 0, "the spool to drain")
        sender.stop(1.0)
        assert stored(world) == [("agent-node-007", seq) for seq in seqs]  # each exactly once
        assert sender.stats.duplicates == 2  # the two held batches, acknowledged to their posters before
        metrics = _scrape(server.url)
        assert 'clusterdx_ingest_refused_batches_total{reason="busy"}' in metrics
        assert "clusterdx_ingest_batches_per_commit_bucket" in metrics and "clusterdx_ingest_queue_batches" in metrics
    finally:
        server.stop()


def _three(spool: Spool) -> tuple[bytes, bytes, bytes]:
    """The spooled bodies, byte for byte as the agent sends them (the spool hands out only its oldest)."""
    rows = spool._db.execute("SELECT body FROM batch ORDER BY seq").fetchall()
    return rows[0][0], rows[1][0], rows[2][0]


def _scrape(url: str, token: str | None = None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = httpx.get(url + "/metrics", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.text


def test_metrics_count_answers_and_are_guarded(client: Any, world: World, settings: Any) -> None:
    batch = make_batch(seq=0)
    assert [post(client, batch, world.token).status_code for _ in range(2)] == [200, 200]  # accepted, duplicate
    post(client, b"{", world.token)
    assert post(client, blocks.encode_batch(make_batch(seq=1)), world.token).status_code == 200
    text = client.get("/metrics").content.decode()  # the test client comes from 127.0.0.1
    for line in ('clusterdx_ingest_accepted_batches_total{status="accepted"}',
                 'clusterdx_ingest_accepted_batches_total{status="duplicate"}',
                 'clusterdx_ingest_refused_batches_total{reason="malformed_json"}',
                 'clusterdx_ingest_posts_by_wire_version_total{version="1"}',
                 'clusterdx_ingest_posts_by_wire_version_total{version="2"}'):
        assert line in text, line
    assert client.get("/metrics", REMOTE_ADDR="10.1.2.3").status_code == 403
    settings.CLUSTERDX = {**settings.CLUSTERDX, "METRICS_TOKEN": "s3cret-scrape"}
    assert client.get("/metrics", REMOTE_ADDR="10.1.2.3").json()["error"] == "forbidden"
    assert client.get("/metrics", REMOTE_ADDR="10.1.2.3", HTTP_AUTHORIZATION="Bearer nope").status_code == 403
    assert client.get("/metrics", REMOTE_ADDR="10.1.2.3", HTTP_AUTHORIZATION="Bearer s3cret-scrape").status_code == 200


# -- SIGKILL between receive and commit ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(env: dict[str, str], port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "dashboard.asgi:application", "--port", str(port),
                             "--lifespan", "off", "--log-level", "warning"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def up() -> bool:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else "exited"
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_for(up, "the server subprocess to listen", 90)
    return proc


def test_a_server_killed_before_its_commit_stores_the_retry_once(transactional_db: None, world: World,
                                                                  tmp_path: Path) -> None:
    from django.db import connection

    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env["DJANGO_SETTINGS_MODULE"] = "dashboard.settings"
    if connection.vendor == "sqlite":
        env["CLUSTERDX_SQLITE_PATH"] = connection.settings_dict["NAME"]
    else:
        env["DATABASE_URL"] = env["DATABASE_URL"].rsplit("/", 1)[0] + "/" + connection.settings_dict["NAME"]
    gate = tmp_path / "gate"
    gate.touch()
    port = _free_port()
    first = _serve({**env, commit.PAUSE_ENV: str(gate)}, port)
    body = gzip.compress(body_of(make_batch(seq=5, host="node-042")))
    poster = Poster(f"http://127.0.0.1:{port}", lambda: world.token, timeout=60)
    outcome: list[Any] = []
    sending = threading.Thread(target=lambda: outcome.append(poster.post(body)))
    sending.start()
    try:
        wait_for(lambda: Path(str(gate) + ".paused").exists(), "the writer to stop before its commit")
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        sending.join(60)
    finally:
        if first.poll() is None:
            first.kill()
    assert outcome[0].kind == "retry", "no acknowledgement for a batch that was never committed"
    assert stored(world) == []
    second = _serve(env, port)
    try:
        again = poster.post(body)  # the agent's retry: the spooled body, byte for byte
        assert (again.kind, again.detail) == ("ok", "accepted")
        assert (poster.post(body).kind, poster.post(body).detail) == ("ok", "duplicate")
    finally:
        poster.close()
        second.terminate()
        second.wait(30)
    assert stored(world) == [("agent-node-042", 5)]
    assert framed.count(fr.GPUS, cluster=world.cluster) == 2
