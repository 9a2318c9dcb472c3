"""The server's send interval: the agent keeps sampling every interval but posts at most once per advertised
``send_interval_s``, several intervals' records in one batch; a 429 with ``Retry-After`` holds the batch and slows
the agent down; staged intervals survive a crash and are sealed, numbered, into the next batch."""

from __future__ import annotations

import gzip
import json
import statistics
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from agent_support import TOKEN, Receiver, start_agent, wait_for

from collectors.agent.delivery import Backoff, Poster, Sender, classify
from collectors.agent.spool import Spool

HEAD = {"v": 1, "agent_id": "n1", "host": "n1", "sent_at": 1.0}


class AdvertisingReceiver(Receiver):
    """The real test receiver, answering as a large cluster's server: every 200 and 429 carries
    ``send_interval_s``; the first ``refuse`` posts get 429 with ``Retry-After``. Keeps each POST's body and arrival."""

    def __init__(self, advert: float, refuse: int = 0, retry_after: str = "1") -> None:
        self.advert, self.refuse, self.retry_after = advert, refuse, retry_after
        self.arrivals: list[tuple[float, int, bytes]] = []  # (monotonic time, status, raw body)
        super().__init__()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                refused = len(receiver.arrivals) < receiver.refuse
                if refused:
                    status, answer = 429, {"error": "overloaded", "detail": "write queue full"}
                else:
                    status, answer = receiver.handle(self.path, dict(self.headers), body)
                if status in (200, 429):
                    answer["send_interval_s"] = receiver.advert
                receiver.arrivals.append((time.monotonic(), status, body))
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if refused:
                    self.send_header("Retry-After", receiver.retry_after)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


def sample_times(batch: dict[str, Any]) -> list[float]:
    return sorted({g["ts"] for g in batch.get("gpus", [])})


def test_the_agent_posts_once_per_advertised_interval_holding_every_sample(standin: Path, tmp_path: Path) -> None:
    # The first post is refused with 429 + Retry-After 1 s (and the advert); then every answer advertises 0.6 s,
    # six times the agent's 0.1 s sampling interval.
    receiver = AdvertisingReceiver(advert=0.6, refuse=1)
    agent = start_agent(tmp_path, receiver.url, lib_dir=standin, interval=0.1, backoff_max=5)
    try:
        wait_for(lambda: len(receiver.accepted) >= 5, timeout=20, what="five accepted batches")
    finally:
        agent.stop()
        receiver.stop()
    (t_refused, status, refused_body), (t_retry, _, retry_body) = receiver.arrivals[:2]
    assert status == 429
    assert t_retry - t_refused >= 0.95  # Retry-After obeyed (a loaded machine only makes this longer)
    assert retry_body == refused_body  # the spooled batch is resent byte for byte
    seqs = receiver.seqs()
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and not receiver.duplicates
    # After the advert, each batch carries several intervals, each sample once, in time order across batches.
    per_batch = [sample_times(b) for b in receiver.accepted[1:]]
    assert statistics.median(len(ts) for ts in per_batch) >= 3, per_batch
    every = [t for b in receiver.accepted for t in sample_times(b)]
    assert every == sorted(set(every))
    assert all(len(b["gpus"]) == 8 * len(sample_times(b)) for b in receiver.accepted)  # whole intervals only
    assert "the server asks for at most one post every 0.6s" in agent.log()


def test_a_429_keeps_the_batch_and_waits_retry_after_and_takes_the_advert(tmp_path: Path) -> None:
    receiver = AdvertisingReceiver(advert=4.0, refuse=1, retry_after="2")
    spool = Spool(tmp_path / "spool.sqlite3")
    poster = Poster(receiver.url, lambda: TOKEN, timeout=2)
    sender = Sender(spool, poster, Backoff(0.05, 10))
    try:
        seq = spool.put({**HEAD, "gpus": [{"ts": 1.0, "index": 0}]})
        assert sender.deliver(spool.oldest()) == 2.0  # Retry-After, not the 50 ms backoff
        assert spool.depth == 1 and sender.advised_interval_s == 4.0
        assert sender.deliver(spool.oldest()) == 0.0
        assert receiver.seqs() == [seq] and spool.depth == 0
    finally:
        poster.close()
        spool.close()
        receiver.stop()


def test_only_a_sane_advert_from_a_200_or_429_counts() -> None:
    def advert(status: int, answer: object) -> float | None:
        return classify(status, json.dumps(answer).encode(), None).send_interval_s

    assert advert(200, {"status": "accepted", "send_interval_s": 5}) == 5.0
    assert advert(429, {"error": "overloaded", "send_interval_s": 2.5}) == 2.5
    assert advert(503, {"error": "unavailable", "send_interval_s": 9}) is None  # not our contract for 5xx
    assert advert(200, {"status": "accepted", "send_interval_s": 86_400}) == 300.0  # capped
    for bad in (0, -1, "5", None, True, float("nan")):
        assert advert(200, {"status": "accepted", "send_interval_s": bad}) is None, bad


def test_staged_intervals_survive_a_restart_and_are_sealed_in_order_with_their_drops(tmp_path: Path) -> None:
    path = tmp_path / "spool.sqlite3"
    spool = Spool(path)
    first = spool.put(HEAD)
    spool.delete(first)
    for t in (1.0, 2.0, 3.0):
        spool.stage({"gpus": [{"ts": t, "index": 0}], "hosts": []}, {"source_error": 1} if t == 2.0 else None)
    spool.close()  # as a kill -9 leaves it: staged, never sealed

    reopened = Spool(path)
    assert reopened.staged == 3
    seqs = reopened.seal({"gpus": [{"ts": 4.0, "index": 0}]}, lambda lists: [{**HEAD, **lists}])
    assert seqs == [first + 1] and reopened.staged == 0
    body = json.loads(gzip.decompress(reopened.oldest().body))
    assert [g["ts"] for g in body["gpus"]] == [1.0, 2.0, 3.0, 4.0]
    assert body["dropped"] == {"source_error": 1}

    # Too much for one batch: the builder splits, each part is numbered; only the first reports drops.
    reopened.stage({"gpus": [{"ts": 5.0, "index": 0}]})
    split = reopened.seal({"gpus": [{"ts": 6.0, "index": 0}]}, lambda lists: [{**HEAD, "gpus": [g]}
                                                                             for g in lists["gpus"]], {"x": 2})
    assert split == [first + 2, first + 3]
    reopened.delete(seqs[0])
    bodies = []
    while (item := reopened.oldest()) is not None:
        bodies.append(json.loads(gzip.decompress(item.body)))
        reopened.delete(item.seq)
    assert [(b["gpus"][0]["ts"], b.get("dropped")) for b in bodies] == [(5.0, {"x": 2}), (6.0, None)]
    reopened.close()


def test_a_clean_stop_seals_what_is_staged(standin: Path, tmp_path: Path) -> None:
    receiver = AdvertisingReceiver(advert=30.0)  # far longer than the test: only the stop can send the rest
    agent = start_agent(tmp_path, receiver.url, lib_dir=standin, interval=0.1)
    try:
        wait_for(lambda: receiver.accepted, what="the first batch")
        time.sleep(0.5)  # a few intervals staged behind the advert
    finally:
        assert agent.stop() == 0
        receiver.stop()
    assert len(receiver.accepted) == 2, receiver.seqs()
    assert len(sample_times(receiver.accepted[1])) >= 2
    assert not agent.spooled_seqs()



@pytest.mark.django_db(transaction=True)
def test_the_agent_follows_the_real_servers_advert(live_server: Any, settings: Any, standin: Path,
                                                   tmp_path: Path) -> None:
    # A budget of one node per second and two nodes already known: the real ingest asks for a post every 2 s.
    from dashboard.storage import frames as fr
    from dashboard.telemetry import tokens
    from dashboard.telemetry.models import AgentBatch, Cluster, Node
    from tests.server import framed

    settings.CLUSTERDX = {**settings.CLUSTERDX, "INGEST_NODES_PER_S": 1}
    cluster = Cluster.objects.create(name="advert")
    Node.objects.bulk_create([Node(cluster=cluster, hostname=f"other-{i}") for i in range(2)])
    _, token = tokens.create_token(cluster, "agents")
    agent = start_agent(tmp_path, live_server.url, lib_dir=standin, interval=0.25, token=token)
    batches = AgentBatch.objects.filter(cluster=cluster)

    def stamps() -> int:  # GPU 0's samples stored
        return int((framed.stored(fr.GPUS, cluster=cluster)["index"] == 0).sum())

    try:
        # Batches sealed before the first answer (a cold server may take a while) hold one interval each.
        wait_for(lambda: "the server asks for at most one post every 2s" in agent.log() and not agent.spooled_seqs(),
                 timeout=20, what="the advert and the backlog sent")
        before = (batches.count(), stamps())
        wait_for(lambda: batches.count() >= before[0] + 2, timeout=20, what="two batches after the advert")
        after = (batches.count(), stamps())
    finally:
        agent.stop()
    seqs = list(batches.order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    # About eight 0.25 s intervals in each batch once the agent posts every 2 s.
    assert (after[1] - before[1]) / (after[0] - before[0]) >= 3, (before, after)
