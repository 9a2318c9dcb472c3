"""Posts batches to a clusterdx server over real HTTP (keep-alive, gzip), many nodes in parallel.

Standard library only: the simulator is also the load generator for the ingest benchmark, so it records each
request's latency and outcome.
"""

from __future__ import annotations

import gzip
import http.client
import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


@dataclass
class SendStats:
    latencies_s: list[float] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, latency: float) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            self.latencies_s.append(latency)


class Sender:
    def __init__(self, server: str, token: str, threads: int = 8, timeout_s: float = 10.0, gzip_level: int = 1) -> None:
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
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sim-send")
        self.local = threading.local()
        self.stats = SendStats()

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self.local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            conn = self.local.conn = cls(self.netloc, timeout=self.timeout_s)
        return conn

    def _post(self, batch: dict[str, Any]) -> str:
        body = gzip.compress(json.dumps(batch, separators=(",", ":")).encode(), self.gzip_level)
        t0 = time.perf_counter()
        for attempt in (1, 2):  # one reconnect: the server may have closed an idle keep-alive connection
            try:
                conn = self._conn()
                conn.request("POST", self.path, body=body, headers=self.headers)
                response = conn.getresponse()
                payload = response.read()
                outcome = json.loads(payload).get("status", "?") if response.status == 200 else f"http_{response.status}"
                break
            except (OSError, http.client.HTTPException, ValueError) as exc:
                self.local.conn = None
                outcome = f"error_{type(exc).__name__}"
                if attempt == 2:
                    break
        self.stats.add(outcome, time.perf_counter() - t0)
        return outcome

    def send(self, batches: list[dict[str, Any]]) -> None:
        """Fire and forget: returns at once; stats record the outcome."""
        for batch in batches:
            self.pool.submit(self._post, batch)

    def send_and_wait(self, batches: list[dict[str, Any]]) -> list[str]:
        return list(self.pool.map(self._post, batches))

    def close(self) -> None:
        self.pool.shutdown(wait=True)


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
