"""Posts batches to a clusterdx server over real HTTP (keep-alive, gzip), many nodes in parallel.

Standard library only: the simulator is also the load generator for the ingest benchmark, so it records each
request's latency and outcome.

Like the agent, a simulated node samples every tick but posts at most once per *send interval*: the larger of the
sender's own ``send_interval_s`` and the ``send_interval_s`` the server last advertised. A node's ticks in between
wait in memory and go out as one batch (:func:`merge`). A batch the server refuses with 429 or 503 goes back into
its node's queue, to be merged into that node's next post no sooner than ``Retry-After``: nothing is dropped.
"""

from __future__ import annotations

import gzip
import http.client
import json
import threading
import time
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from collectors.agent.batch import LISTS, fits
from collectors.agent.delivery import advised_interval

DEFAULT_RETRY_AFTER_S = 1.0


@dataclass
class SendStats:
    latencies_s: list[float] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, latency: float) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            self.latencies_s.append(latency)


def merge(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One node's consecutive batches as one batch: the newest head (its ``seq``, the largest, so seqs keep
    growing) and every record list concatenated in time order. When the result would exceed the wire's bounds,
    the batches are returned as they are, each with its own seq."""
    if len(batches) <= 1:
        return batches
    lists = {name: [r for b in batches for r in b.get(name) or ()] for name in LISTS}
    if not fits(lists):
        return batches
    head = {k: v for k, v in batches[-1].items() if k not in LISTS}
    return [{**head, **{k: v for k, v in lists.items() if v}}]


class Sender:
    def __init__(self, server: str, token: str, threads: int = 8, timeout_s: float = 10.0, gzip_level: int = 1,
                 send_interval_s: float = 0.0) -> None:
        parts = urlsplit(server)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"server must be an http(s) URL, got {server!r}")
        self.https = parts.scheme == "https"
        self.netloc = parts.netloc
        self.path = parts.path.rstrip("/") + "/api/v1/ingest"
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json",
                        "Content-Encoding": "gzip"}
        self.timeout_s = timeout_s
        self.gzip_level = gzip_level
        self.own_interval_s = send_interval_s
        self.advised_interval_s: float | None = None  # the server's latest advert
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sim-send")
        self.local = threading.local()
        self.stats = SendStats()
        self._lock = threading.Lock()  # guards the queues below: send() runs in the simulator, requeues in the pool
        self._queued: dict[str, list[dict[str, Any]]] = {}
        self._due: dict[str, float] = {}  # agent_id -> monotonic time of its next post
        self._phased: set[str] = set()
        self._inflight: dict[str, int] = {}  # agent_id -> posts not yet answered
        # agent_id -> how far its seqs are moved: a simulator started again (`clusterdx demo` twice on one data
        # directory) numbers its batches from 0 again, which the server holds with other content (409 seq_reused);
        # like the agent (collectors/agent/spool.py), it then jumps past the whole reused stretch and sends again.
        self._seq_skip: dict[str, int] = {}
        self._last_call = 0.0
        self._tick_s = 0.0  # the caller's spacing of send() calls, for the slack below

    @property
    def send_interval_s(self) -> float:
        return max(self.own_interval_s, self.advised_interval_s or 0.0)

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self.local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            conn = self.local.conn = cls(self.netloc, timeout=self.timeout_s)
        return conn

    def _post(self, batch: dict[str, Any]) -> str:
        outcome = self._post_batch(batch)[0]
        if outcome == "renumbered":  # sent again under the seq it jumped to
            outcome = self._post_batch(batch)[0]
        return outcome

    def _post_batch(self, batch: dict[str, Any]) -> tuple[str, float | None]:
        """POST one batch; returns the outcome and, for 429/503, the seconds to wait before the next try (0 for a
        409 seq_reused: the batch is renumbered, to be sent again at once)."""
        agent = batch.get("agent_id", "")
        if self._seq_skip.get(agent):
            batch = {**batch, "seq": batch["seq"] + self._seq_skip[agent]}
        body = gzip.compress(json.dumps(batch, separators=(",", ":")).encode(), self.gzip_level)
        t0 = time.perf_counter()
        retry_after: float | None = None
        for attempt in (1, 2):  # one reconnect: the server may have closed an idle keep-alive connection
            try:
                conn = self._conn()
                conn.request("POST", self.path, body=body, headers=self.headers)
                response = conn.getresponse()
                payload = response.read()
                answer = _answer(payload)
                outcome = answer.get("status", "?") if response.status == 200 else f"http_{response.status}"
                if response.status in (200, 429):
                    advert = advised_interval(answer)
                    if advert is not None:
                        self.advised_interval_s = advert
                if response.status in (429, 503):
                    retry_after = _seconds(response.getheader("Retry-After"))
                elif response.status == 409 and answer.get("error") == "seq_reused":
                    with self._lock:
                        self._seq_skip[agent] = self._seq_skip.get(agent, 0) + RENUMBER_SKIP
                    outcome, retry_after = "renumbered", 0.0
                break
            except (OSError, http.client.HTTPException) as exc:
                self.local.conn = None
                outcome = f"error_{type(exc).__name__}"
                if attempt == 2:
                    break
        self.stats.add(outcome, time.perf_counter() - t0)
        return outcome, retry_after

    def _post_and_requeue(self, agent: str, batch: dict[str, Any], parts: list[dict[str, Any]]) -> None:
        retry_after: float | None = None
        try:
            _, retry_after = self._post_batch(batch)
        finally:
            with self._lock:
                self._inflight[agent] -= 1
                if retry_after is not None:
                    # Refused for now: back to the front of the node's queue, merged into its next post after the wait.
                    self._queued[agent] = parts + self._queued.get(agent, [])
                    self._due[agent] = max(self._due.get(agent, 0.0), time.monotonic() + retry_after)

    def send(self, batches: list[dict[str, Any]]) -> None:
        """Queue one tick's batches; post each node whose send interval has passed (fire and forget: returns at
        once, stats record the outcomes)."""
        now = time.monotonic()
        if self._last_call:
            self._tick_s = now - self._last_call
        self._last_call = now
        gap = self.send_interval_s
        with self._lock:
            for batch in batches:
                self._queued.setdefault(batch["agent_id"], []).append(batch)
            ready = []
            for agent, queue in self._queued.items():
                # Half a tick of slack: a tick a few ms early must not wait a whole tick more.
                # One post per node at a time, as one agent's sender thread does: its seqs then follow time.
                if queue and not self._inflight.get(agent) and self._due.get(agent, 0.0) <= now + self._tick_s / 2:
                    ready.append((agent, queue))
                    due = now + gap
                    if gap and agent not in self._phased:
                        # Nodes that start together are spread over the interval instead of posting in one tick.
                        self._phased.add(agent)
                        due += gap * _phase(agent)
                    self._due[agent] = due
            for agent, queue in ready:
                self._queued[agent] = []
                groups = _groups(queue)
                self._inflight[agent] = len(groups)
                for batch, parts in groups:
                    self.pool.submit(self._post_and_requeue, agent, batch, parts)

    def send_and_wait(self, batches: list[dict[str, Any]]) -> list[str]:
        return list(self.pool.map(self._post, batches))

    def close(self) -> None:
        """Wait for the posts in flight, then post what every node still has queued."""
        self.pool.shutdown(wait=True)
        with self._lock:
            rest = [batch for queue in self._queued.values() for batch, _ in _groups(queue)]
            self._queued.clear()
        for batch in rest:
            self._post_batch(batch)


RENUMBER_SKIP = 2**32  # as the agent's spool: past any stretch a restarted counter can have reused


def _groups(queue: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """A node's queued batches as (batch to post, the batches it holds): one merged batch, or each on its own when
    together they are too large."""
    merged = merge(queue)
    return [(merged[0], queue)] if len(merged) == 1 else [(b, [b]) for b in queue]


def _phase(agent: str) -> float:
    return (zlib.crc32(agent.encode()) % 1000) / 1000


def _answer(payload: bytes) -> dict[str, Any]:
    try:
        answer = json.loads(payload)
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


def _seconds(value: str | None) -> float:
    try:
        return max(0.0, float(value)) if value else DEFAULT_RETRY_AFTER_S
    except ValueError:
        return DEFAULT_RETRY_AFTER_S


def wait_for_server(server: str, timeout_s: float = 30.0) -> bool:
    parts = urlsplit(server)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection(parts.netloc, timeout=2)
            conn.request("GET", "/api/openapi.json")
            if conn.getresponse().status == 200:
                return True
        except OSError:
            pass
        time.sleep(0.2)
    return False
