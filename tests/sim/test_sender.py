"""The simulator's sender obeys the server's send interval and its 429s, and loses no sample doing so."""

from __future__ import annotations

import gzip
import json
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from clusterdx import wire
from collectors.sim.cli import run_simulation
from collectors.sim.model import SimCluster
from collectors.sim.scenario import parse
from collectors.sim.sender import Sender, merge

TOKEN = "sim-token"


class Receiver:
    """A stdlib HTTP peer answering as a large cluster's server: every answer advertises ``send_interval_s``, and
    each agent's first post is refused with 429 and ``Retry-After``."""

    def __init__(self, advert: float, retry_after: str = "0.3") -> None:
        self.advert, self.retry_after = advert, retry_after
        self.accepted: list[dict[str, Any]] = []
        self.refused: set[str] = set()
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                raw = gzip.decompress(self.rfile.read(int(self.headers["Content-Length"])))
                assert self.headers["Authorization"] == f"Bearer {TOKEN}"
                batch = wire.validate_batch(json.loads(raw))
                with receiver.lock:
                    first = batch["agent_id"] not in receiver.refused
                    receiver.refused.add(batch["agent_id"])
                    if not first:
                        receiver.accepted.append(batch)
                status, answer = (429, {"error": "overloaded"}) if first else (200, {"status": "accepted"})
                data = json.dumps({**answer, "send_interval_s": receiver.advert}).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                if first:
                    self.send_header("Retry-After", receiver.retry_after)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(advert=0.3)
    yield r
    r.server.shutdown()
    r.server.server_close()


def test_the_simulator_posts_once_per_advertised_interval_and_loses_no_sample(receiver: Receiver) -> None:
    sim = SimCluster(parse({"cluster": {"nodes": 3, "gpus_per_node": 2, "seed": 1}}), start_ts=time.time())
    sender = Sender(receiver.url, TOKEN, threads=4)
    try:
        run_simulation(sim, sender, interval=0.05, duration=1.5, progress=False)
    finally:
        sender.close()
    assert sender.advised_interval_s == 0.3 and sender.stats.outcomes["http_429"] == 3
    by_agent: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for batch in receiver.accepted:
        by_agent[batch["agent_id"]].append(batch)
    assert len(by_agent) == 3
    for n, batches in enumerate(by_agent.values()):
        batches.sort(key=lambda b: b["seq"])
        assert len({b["seq"] for b in batches}) == len(batches)  # no seq carries two contents
        samples = [(g["ts"], g["index"]) for b in batches for g in b["gpus"]]
        # Every tick's samples arrive once, the 429-refused ones included, in time order across seqs.
        assert len(samples) == len(set(samples)) == sim.seq[n] * 2
        assert samples == sorted(samples)
        assert statistics.median(len({g["ts"] for g in b["gpus"]}) for b in batches) >= 3


def test_merge_keeps_the_newest_head_and_falls_back_to_single_batches_when_too_large() -> None:
    sim = SimCluster(parse({"cluster": {"nodes": 1, "gpus_per_node": 2}}), start_ts=1_700_000_000.0)
    ticks = [sim.tick(1_700_000_000.0 + t)[0] for t in range(1, 4)]
    (merged,) = merge(ticks)
    assert merged["seq"] == ticks[-1]["seq"] and merged["sent_at"] == ticks[-1]["sent_at"]
    assert [g["ts"] for g in merged["gpus"]] == [g["ts"] for b in ticks for g in b["gpus"]]
    wire.validate_batch(merged)
    huge = [{**b, "gpus": b["gpus"] * 700} for b in ticks]  # 1,400 GPU rows each: together past the list bound
    assert merge(huge) == huge
