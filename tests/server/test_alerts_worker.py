"""Alerts through a real Celery worker process on Redis and PostgreSQL, to a real receiver: exact request counts
for 5xx, 429 + Retry-After, 404 and a hung receiver; a storm is one request; a duplicated task sends once; a worker
killed mid-request delivers exactly once after a restart.

Needs PostgreSQL and Redis (the suite's second pass sets DATABASE_URL and REDIS_URL); skipped with the reason
otherwise. The worker uses this run's test database and a queue of its own, so concurrent runs never meet.
"""

from __future__ import annotations

import os
import signal as signals
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from dashboard.alerts import endpoints
from dashboard.alerts.models import Delivery
from tests.alerts.alerts_support import Receiver, Reply, make_finding, signal
from tests.conftest import port_open, service_missing

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
S = Delivery.Status
ROOT = Path(__file__).resolve().parents[2]
QUEUE = f"cdx-alerts-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
# The worker's and this process's alert settings: quick retries, a 1 s HTTP timeout (so a 5 s claim lease, shorter
# than the broker's 10 s visibility timeout: a redelivered task finds the dead worker's claim expired).
ALERTS = {"ALERTS_GROUP_WAIT_S": 0.5, "ALERTS_BACKOFF_BASE_S": 0.2, "ALERTS_BACKOFF_MAX_S": 0.5,
          "ALERTS_HTTP_TIMEOUT_S": 1.0, "ALERTS_MAX_ATTEMPTS": 5, "ALERTS_QUEUE": QUEUE}
VISIBILITY_TIMEOUT_S = 10


def _require_services() -> None:
    if not (settings.DATABASE_URL and settings.REDIS_URL):
        pytest.skip("needs DATABASE_URL (PostgreSQL) and REDIS_URL: the Celery-worker tests run in the suite's "
                    "PostgreSQL + Redis pass")
    from urllib.parse import urlsplit

    for url in (settings.DATABASE_URL, settings.REDIS_URL):
        parts = urlsplit(url)
        if not port_open(parts.hostname or "127.0.0.1", parts.port or (5432 if "postgres" in url else 6379)):
            service_missing(f"{parts.scheme} at {parts.hostname}:{parts.port} is not reachable")


class Worker:
    """``celery -A dashboard.celery worker`` in its own process group, on this run's test database."""

    def __init__(self, log_path: Path) -> None:
        db = settings.DATABASES["default"]
        self.log_path = log_path
        self.env = {**os.environ, "REDIS_URL": settings.REDIS_URL, "DJANGO_SETTINGS_MODULE": "dashboard.settings",
                    "DATABASE_URL": f"postgresql://{db['USER']}:{db['PASSWORD']}@{db['HOST'] or '127.0.0.1'}:"
                                    f"{db['PORT'] or 5432}/{db['NAME']}",
                    "CLUSTERDX_ALERTS_ALLOW_PRIVATE": "1", "CLUSTERDX_VISIBILITY_TIMEOUT_S": str(VISIBILITY_TIMEOUT_S),
                    "CLUSTERDX_DATA_DIR": str(log_path.parent), "PYTHONUNBUFFERED": "1",
                    **{f"CLUSTERDX_{k}": str(v) for k, v in ALERTS.items()}}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Worker:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "dashboard.celery", "worker", "-P", "threads", "-c", "4",
                 "-Q", QUEUE, "-n", f"{QUEUE}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat",
                 "-l", "INFO"], cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while b" ready." not in self.log_path.read_bytes()[offset:]:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the celery worker did not start:\n{self.tail()}")
            time.sleep(0.1)
        return self

    def kill(self) -> None:
        """SIGKILL, mid-whatever: no warm shutdown, nothing acknowledged or handed back."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signals.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signals.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="module")
def worker(django_db_setup: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    _require_services()
    w = Worker(tmp_path_factory.mktemp("alerts-worker") / "worker.log").start()
    yield w
    w.stop()  # before the test database is dropped: the worker holds connections to it


@pytest.fixture
def alerts(worker: Worker, transactional_db: None, settings: Any) -> Worker:
    settings.CLUSTERDX = {**settings.CLUSTERDX, **ALERTS, "ALERTS_ALLOW_PRIVATE": True}
    return worker


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()


@pytest.fixture
def world_alerts(alerts: Worker, receiver: Receiver) -> tuple[Any, Any]:
    from dashboard.telemetry.models import Cluster, Node

    cluster = Cluster.objects.create(name="prod-a")
    node = Node.objects.create(cluster=cluster, hostname="node-003")
    _, receiver.secret = endpoints.create(cluster, name="oncall", kind="webhook", url=receiver.url)
    return cluster, node


def settle(worker: Worker, done: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            rows = list(Delivery.objects.values("id", "status", "attempts", "last_error"))
            raise AssertionError(f"not settled: {rows}\n--- worker log ---\n{worker.tail()}")
        time.sleep(0.05)


def finished() -> bool:
    return Delivery.objects.exists() and not Delivery.objects.filter(status__in=Delivery.ACTIVE).exists()


def test_the_worker_retries_5xx_and_delivers_once(alerts: Worker, world_alerts: Any, receiver: Receiver) -> None:
    cluster, node = world_alerts
    receiver.script = [Reply(500), Reply(502)]
    signal(make_finding(cluster, node=node, gpu_index=0), "opened")
    settle(alerts, finished)
    time.sleep(0.7)  # anything extra would arrive by now
    row = Delivery.objects.get()
    assert [r.answered for r in receiver.requests] == [500, 502, 200]
    assert all(r.verified for r in receiver.requests)
    assert len({r.headers["webhook-id"] for r in receiver.requests}) == 1
    assert (row.status, row.attempts, row.response_code) == (S.DELIVERED, 3, 200)


def test_the_worker_waits_as_told_by_retry_after(alerts: Worker, world_alerts: Any, receiver: Receiver) -> None:
    cluster, node = world_alerts
    receiver.script = [Reply(429, retry_after="2")]
    signal(make_finding(cluster, node=node, gpu_index=0), "opened")
    settle(alerts, finished)
    assert [r.answered for r in receiver.requests] == [429, 200]
    assert receiver.requests[1].at - receiver.requests[0].at >= 1.95  # not the 0.2 s backoff


def test_the_worker_stops_at_a_404(alerts: Worker, world_alerts: Any, receiver: Receiver) -> None:
    cluster, node = world_alerts
    receiver.script = [Reply(404)]
    signal(make_finding(cluster, node=node, gpu_index=0), "opened")
    settle(alerts, finished)
    time.sleep(1.0)
    row = Delivery.objects.get()
    assert len(receiver.requests) == 1
    assert (row.status, row.attempts, row.last_error) == (S.FAILED, 1, "HTTP 404 Not Found")


def test_a_hung_receiver_times_out_and_the_retry_delivers(alerts: Worker, world_alerts: Any,
                                                          receiver: Receiver) -> None:
    cluster, node = world_alerts
    receiver.script = [Reply(hang_s=5)]
    signal(make_finding(cluster, node=node, gpu_index=0), "opened")
    settle(alerts, finished)
    row = Delivery.objects.get()
    assert [r.answered for r in receiver.requests] == [None, 200]
    assert (row.status, row.attempts) == (S.DELIVERED, 2)


def test_a_storm_of_eight_findings_is_one_request(alerts: Worker, world_alerts: Any, receiver: Receiver) -> None:
    cluster, node = world_alerts
    for gpu in range(8):
        signal(make_finding(cluster, node=node, gpu_index=gpu), "opened")
    settle(alerts, finished)
    time.sleep(1.0)
    assert len(receiver.requests) == 1
    assert len(receiver.requests[0].json()["data"]["findings"]) == 8
    assert Delivery.objects.filter(status=S.GROUPED).count() == 7


def test_copies_of_a_task_send_once(alerts: Worker, world_alerts: Any, receiver: Receiver) -> None:
    from dashboard.alerts.tasks import deliver

    cluster, node = world_alerts
    signal(make_finding(cluster, node=node, gpu_index=0), "opened")
    row = Delivery.objects.get()
    for _ in range(4):  # as if the broker redelivered it, or the sweep re-enqueued it, four more times
        deliver.apply_async((row.id, 1), queue=QUEUE)
    settle(alerts, finished)
    time.sleep(1.5)
    assert len(receiver.requests) == 1
    assert Delivery.objects.get().attempts == 1


def test_a_worker_killed_mid_request_delivers_exactly_once_after_restart(alerts: Worker, world_alerts: Any,
                                                                         receiver: Receiver) -> None:
    cluster, node = world_alerts
    receiver.script = [Reply(hang_s=60)]  # holds the first request until the worker is dead
    signal(make_finding(cluster, node=node, gpu_index=0), "opened")
    fetched = time.monotonic()
    receiver.wait_for(1, timeout=10)
    assert len(receiver.requests) == 1 and Delivery.objects.get().status == S.SENDING
    alerts.kill()
    # The broker hands an unacknowledged task out again once its visibility timeout has passed.
    time.sleep(max(0.0, fetched + VISIBILITY_TIMEOUT_S + 0.5 - time.monotonic()))
    alerts.start()
    settle(alerts, finished, timeout=30)
    time.sleep(1.0)
    row = Delivery.objects.get()
    assert [r.answered for r in receiver.requests] == [None, 200]
    assert receiver.requests[0].headers["webhook-id"] == receiver.requests[1].headers["webhook-id"]
    assert (row.status, row.attempts) == (S.DELIVERED, 2)
    assert f"delivery {row.id}: attempt 1 was lost with its worker; taking it over" in alerts.tail(200)
