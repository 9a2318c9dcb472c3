"""The fault suite's alert check (issue 12): every finding opened during a fault reaches each endpoint exactly once.

A webhook receiver on 127.0.0.1 records every request's ``webhook-id`` and body and answers 200. The suite registers
it as a webhook endpoint of its cluster (``manage.py alerts add``) and, at the start of each fault, has an agent send
one Xid 79 for a GPU index of that fault's own, so each fault opens one failing_gpu finding on a subject of its own
while the part is down. Afterwards the Finding table says which alerts were owed and the receiver what arrived.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DELIVERY_TIMEOUT_S = 60.0  # after the run: how long the alert sweep gets to deliver what is still owed

# What the alert path needs in the server's and worker's environment.
ALERT_ENV = {
    "CLUSTERDX_ALERTS_ALLOW_NETWORKS": "127.0.0.0/8",  # the receiver is on loopback, refused by default
    # Grouping folds findings of one node opened within the window into the first one's alert; the suite opens
    # one finding per fault on the same node and counts one alert for each, so every alert stands alone here.
    "CLUSTERDX_ALERTS_GROUP_WINDOW_S": "0",
    # A delivery that failed while a part was down is retried within seconds, not the production 2 s .. 600 s.
    "CLUSTERDX_ALERTS_BACKOFF_BASE_S": "0.5",
    "CLUSTERDX_ALERTS_BACKOFF_MAX_S": "3",
    "CLUSTERDX_ALERTS_HTTP_TIMEOUT_S": "5",
}


def xid_event(ts: float, gpu_index: int) -> dict[str, Any]:
    """An Xid 79 (the GPU fell off the bus): one event opens a critical failing_gpu finding on ``host/gpu<index>``."""
    return {"ts": ts, "kind": "xid", "severity": "critical", "code": 79, "gpu_index": gpu_index,
            "message": "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."}


@dataclass
class Hit:
    webhook_id: str
    body: dict[str, Any]
    answered: bool = False  # the 200 was written: the sender had no reason to send it again


class AlertReceiver:
    """A thread serving 200 to every POST, keeping each request's webhook-id and JSON body."""

    def __init__(self) -> None:
        self.hits: list[Hit] = []
        self.lock = threading.Lock()
        self.server = _QuietServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()

    def opened(self) -> dict[int, list[Hit]]:
        """Finding id -> the answered ``finding.opened`` requests carrying it."""
        out: dict[int, list[Hit]] = {}
        with self.lock:
            hits = [h for h in self.hits if h.answered and h.body.get("type") == "finding.opened"]
        for hit in hits:
            for finding in hit.body.get("data", {}).get("findings", []):
                out.setdefault(int(finding["id"]), []).append(hit)
        return out

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a worker SIGKILLed on purpose resets its keep-alive connection: expected, not worth a traceback


def _handler(receiver: AlertReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = {}
            hit = Hit(self.headers.get("webhook-id", ""), parsed if isinstance(parsed, dict) else {})
            with receiver.lock:
                receiver.hits.append(hit)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")
            self.wfile.flush()
            hit.answered = True  # only now: a sender killed before the answer left rightly sends it again

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

    return Handler


def register(env: dict[str, str], cwd: Path, cluster: str, url: str) -> None:
    """Add the receiver as a webhook endpoint of ``cluster`` for failing_gpu findings, as an operator would."""
    subprocess.run([sys.executable, str(ROOT / "manage.py"), "alerts", "add", "--cluster", cluster, "--kind",
                    "webhook", "--url", url, "--kinds", "failing_gpu", "--min-severity", "warning"],
                   env=env, cwd=cwd, check=True, capture_output=True, timeout=60)


def findings(pg_url: str, subjects: list[str]) -> dict[str, list[int]]:
    """Subject -> ids of the failing_gpu findings opened on it."""
    import psycopg

    out: dict[str, list[int]] = {s: [] for s in subjects}
    with psycopg.connect(pg_url, connect_timeout=10) as conn:
        for fid, subject in conn.execute("SELECT id, subject FROM diagnosis_finding WHERE kind = 'failing_gpu' "
                                         "AND subject = ANY(%s) ORDER BY id", (subjects,)):
            out[subject].append(int(fid))
    return out


def wait_delivered(receiver: AlertReceiver, pg_url: str, subjects: list[str]) -> dict[str, list[int]]:
    """Wait until every subject has a finding and every finding an answered opened alert, or the deadline."""
    deadline = time.monotonic() + DELIVERY_TIMEOUT_S
    while True:
        with contextlib.suppress(Exception):  # the database may be coming back from the last fault
            owed = findings(pg_url, subjects)
            got = receiver.opened()
            if all(ids and all(i in got for i in ids) for ids in owed.values()) or time.monotonic() > deadline:
                return owed
        if time.monotonic() > deadline:
            return {s: [] for s in subjects}
        time.sleep(0.5)


def tally(receiver: AlertReceiver, ids: list[int]) -> tuple[int, int, int]:
    """(expected, delivered, duplicated) for one fault's findings: an alert counts delivered once its receiver
    answered 200; every further answered request for the same finding's opened event is a duplicate."""
    got = receiver.opened()
    delivered = sum(1 for i in ids if got.get(i))
    duplicated = sum(max(0, len(got.get(i, [])) - 1) for i in ids)
    return len(ids), delivered, duplicated
