"""A real HTTP receiver for alert tests: verifies Standard Webhooks signatures with the reference library and
answers from a script (500, 429 with Retry-After, 404, or hang) for the first requests, then 200."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from standardwebhooks.webhooks import Webhook, WebhookVerificationError


@dataclass(frozen=True)
class Reply:
    status: int = 200
    retry_after: str | None = None
    hang_s: float = 0.0  # > 0: hold the request this long (or until stop), then drop the connection unanswered


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float
    verified: bool | None  # None: no secret to verify with
    answered: int | None = None  # None: hung up without an answer

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Receiver:
    secret: str | None = None
    script: list[Reply] = field(default_factory=list)
    requests: list[Received] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self.stopping = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hook"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def take(self, headers: dict[str, str], body: bytes, path: str) -> tuple[Received, Reply]:
        verified = None
        if self.secret:
            try:
                Webhook(self.secret).verify(body, headers)
                verified = True
            except WebhookVerificationError:
                verified = False
        row = Received(path, headers, body, time.monotonic(), verified)
        with self._arrived:
            reply = self.script[len(self.requests)] if len(self.requests) < len(self.script) else Reply()
            self.requests.append(row)
            self._arrived.notify_all()
        return row, reply

    def wait_for(self, count: int, timeout: float = 10.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        with self._arrived:
            while len(self.requests) < count and time.monotonic() < deadline:
                self._arrived.wait(max(0.0, deadline - time.monotonic()))
            return list(self.requests)

    @property
    def delivered(self) -> list[Received]:
        return [r for r in self.requests if r.answered is not None and 200 <= r.answered < 300]

    def stop(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()


def _handler(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            row, reply = receiver.take({k.lower(): v for k, v in self.headers.items()}, body, self.path)
            if reply.hang_s:
                receiver.stopping.wait(reply.hang_s)
                self.close_connection = True
                return
            row.answered = reply.status  # before the answer leaves, so a sender that got it sees it counted
            self.send_response(reply.status)
            if reply.retry_after is not None:
                self.send_header("Retry-After", reply.retry_after)
            self.send_header("Content-Type", "text/plain")
            text = b"ok" if reply.status < 300 else f"answer {reply.status} from the test receiver".encode()
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

    return Handler


def make_finding(cluster: Any, *, node: Any = None, kind: str = "failing_gpu", subject: str = "",
                 severity: str = "error", gpu_index: int | None = None, run: Any = None, **extra: Any) -> Any:
    from django.utils import timezone

    from dashboard.diagnosis.models import Finding

    now = timezone.now()
    subject = subject or (f"{node.hostname}/gpu{gpu_index}" if node is not None else "cluster")
    fields: dict[str, Any] = {
        "cluster": cluster, "run": run, "kind": kind, "subject_type": "gpu" if gpu_index is not None else "node",
        "subject": subject, "node": node, "gpu_index": gpu_index, "severity": severity,
        "title": f"Xid 79 on {subject}: GPU has fallen off the bus", "action": "Drain the node and reseat the GPU",
        "evidence": {"metrics": {"xid": 79, "ecc_dbe_rate_per_h": 0.5}, "window": [0, 60]},
        "opened_at": now, "updated_at": now, "last_seen_at": now,
    }
    fields.update(extra)
    return Finding.objects.create(**fields)


def signal(finding: Any, event: str) -> None:
    """What a detector does after its transaction commits."""
    from dashboard.diagnosis.models import Finding
    from dashboard.diagnosis.signals import finding_changed

    finding_changed.send(sender=Finding, finding=finding, event=event)


def resolve(finding: Any) -> None:
    from django.utils import timezone

    finding.state, finding.resolved_at = "resolved", timezone.now()
    finding.save(update_fields=["state", "resolved_at"])
    signal(finding, "resolved")


def drain(timeout: float = 8.0, pause: float = 0.02) -> None:
    """Send everything due until nothing is left pending (retries included), like the embedded sweep does."""
    from dashboard.alerts.models import Delivery
    from dashboard.alerts.tasks import send_due

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        send_due()
        if not Delivery.objects.filter(status__in=Delivery.ACTIVE).exists():
            return
        time.sleep(pause)
    raise AssertionError("deliveries still pending after draining")
