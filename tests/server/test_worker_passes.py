"""Diagnosis passes through real ``clusterdx worker`` processes on Redis and PostgreSQL: a paced cluster's passes all
run in the worker that holds its window, whichever worker beat's ticks reach, and a worker that shuts down hands
its clusters to the other at once.

Needs PostgreSQL and Redis (the suite's second pass sets DATABASE_URL and REDIS_URL); skipped with the reason
otherwise. The workers use this run's test database and a Redis key prefix of their own, so no other test's tasks
reach them.
"""

from __future__ import annotations

import ast
import os
import re
import signal as signals
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from django.conf import settings

from tests.server.conftest import World, make_batch, post
from tests.server.test_alerts_worker import _require_services

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
ROOT = Path(__file__).resolve().parents[2]
PREFIX = f"cdx-passes-{os.getpid()}-{uuid.uuid4().hex[:6]}"
# Ticks every 0.25 s; a pass rests ~100 times its CPU (8 nodes: ~12 ms on a fast machine, 1.2 s of rest, well past
# the 0.5 s tick), so the cluster is paced and its passes are the owner's; a handover far longer than the test's wait
# for the takeover. (At 4 nodes and 1.5 % a fast machine's pass of ~7 ms rested under a tick: any worker's to take.)
ENV = {"CLUSTERDX_DIAGNOSIS_INTERVAL_S": "0.5", "CLUSTERDX_DIAGNOSIS_MAX_CPU_SHARE": "0.01",
       "CLUSTERDX_DIAGNOSIS_HANDOVER_S": "60"}
HOSTS = [f"node-{i:03d}" for i in range(8)]
SUCCEEDED = re.compile(r"Task dashboard\.diagnosis\.tasks\.diagnose\[[-0-9a-f]+\] succeeded in [0-9.e-]+s: (\{.*\})")


class Worker:
    """``clusterdx worker --concurrency 2`` as compose runs it, in its own process group."""

    def __init__(self, log_path: Path) -> None:
        db = settings.DATABASES["default"]
        self.log_path = log_path
        self.env = {**os.environ, **ENV, "REDIS_URL": settings.REDIS_URL, "CLUSTERDX_REDIS_PREFIX": PREFIX,
                    "DJANGO_SETTINGS_MODULE": "dashboard.settings", "PYTHONUNBUFFERED": "1",
                    "CLUSTERDX_DATA_DIR": str(log_path.parent),
                    "DATABASE_URL": f"postgresql://{db['USER']}:{db['PASSWORD']}@{db['HOST'] or '127.0.0.1'}:"
                                    f"{db['PORT'] or 5432}/{db['NAME']}"}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Worker:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "clusterdx", "worker", "--concurrency", "2"], cwd=ROOT,
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def ready(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"the worker exited:\n{self.tail()}")
        return b" ready." in self.log_path.read_bytes()

    def passes(self) -> list[dict[str, float]]:
        """Every diagnose tick this worker ran, as the cluster -> seconds it returned ({}: no pass here)."""
        return [ast.literal_eval(m.group(1)) for m in SUCCEEDED.finditer(self.log_path.read_text(errors="replace"))]

    def stop(self, sig: int = signals.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signals.SIGKILL)
                self.proc.wait(10)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def wait_for(what: str, done: Callable[[], bool], workers: list[Worker], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {w.log_path.name} ---\n{w.tail()}" for w in workers)
            raise AssertionError(f"{what}: not within {timeout} s\n{logs}")
        time.sleep(0.1)


@pytest.fixture
def workers(world: World, tmp_path: Path) -> Iterator[list[Worker]]:
    _require_services()
    pair = [Worker(tmp_path / "worker.1.log").start(), Worker(tmp_path / "worker.2.log").start()]
    try:
        wait_for("both workers ready", lambda: all(w.ready() for w in pair), pair, 90)
        yield pair
    finally:
        for w in pair:  # before the test database is dropped: the workers hold connections to it
            w.stop()


@pytest.fixture
def ticks() -> Iterator[Callable[[float], None]]:
    """Beat's diagnosis ticks, sent as beat sends them, to the workers' prefix."""
    app = Celery("ticks", broker=settings.REDIS_URL, set_as_current=False)  # the tasks here keep the suite's app
    app.conf.broker_transport_options = {"global_keyprefix": f"{PREFIX}:"}

    def send(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            app.send_task("dashboard.diagnosis.tasks.diagnose", queue="clusterdx")
            time.sleep(0.25)

    yield send
    app.close()


def ran(worker: Worker, cluster: str) -> int:
    return sum(cluster in result for result in worker.passes())


def test_a_paced_clusters_passes_stay_in_one_worker_until_it_hands_them_over(
        world: World, client: Any, workers: list[Worker], ticks: Callable[[float], None]) -> None:
    for seq in range(3):
        for host in HOSTS:
            assert post(client, make_batch(seq=seq, host=host), world.token).status_code == 200
    name = world.cluster.name
    # Ticks until the cluster has had three passes (on a slow machine its rest is seconds) and 40 ticks have run.
    deadline = time.monotonic() + 60
    while sum(ran(w, name) for w in workers) < 3 or sum(len(w.passes()) for w in workers) < 40:
        assert time.monotonic() < deadline, "\n".join(f"--- {w.log_path.name} ---\n{w.tail()}" for w in workers)
        ticks(1.0)
    counts = [ran(w, name) for w in workers]
    assert all(w.passes() for w in workers), "both workers took ticks (else the test proves nothing)"
    assert sum(counts) >= 3 and 0 in counts, f"every pass in one worker: {counts}"
    owner, other = (workers[0], workers[1]) if counts[0] else (workers[1], workers[0])

    # The owner shuts down (a deploy, a scale-in): the other worker takes the cluster at its next due tick, not
    # after the 60 s handover it would give a worker that vanished.
    owner.stop()
    before = ran(other, name)
    deadline = time.monotonic() + 20
    while ran(other, name) == before and time.monotonic() < deadline:
        ticks(1.0)
    assert ran(other, name) > before, f"taken over at once\n{other.tail()}"
