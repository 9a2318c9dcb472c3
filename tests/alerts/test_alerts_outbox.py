"""A crash between a finding's commit and its on_commit hooks loses no alert: the outbox row written in the finding's
transaction is drained by the alert sweep into exactly one delivery per endpoint, however often the sweep runs.

The crash is real: a subprocess runs the diagnosis lifecycle and is SIGKILLed by the first on_commit callback, so
the finding is committed and none of its hooks (the alerts' fast path) ever run. Runs on both databases.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection

from dashboard.alerts import tasks
from dashboard.alerts.models import Delivery
from dashboard.diagnosis.models import Finding
from tests.alerts.alerts_support import Receiver

pytestmark = pytest.mark.django_db(transaction=True)  # the crashing process and the sweep have their own connections
ROOT = Path(__file__).resolve().parents[2]

CRASH = r"""
import os, signal, sys
from datetime import UTC, datetime

import django

django.setup()
from django.db import transaction

from dashboard.diagnosis.detectors.base import Detection
from dashboard.diagnosis.lifecycle import reconcile
from dashboard.telemetry.models import Cluster

cluster = Cluster.objects.get(name=sys.argv[1])
d = Detection(kind="failing_gpu", subject_type="gpu", subject="node-000/gpu0", severity=sys.argv[2],
              title="Xid 79 on node-000/gpu0: GPU has fallen off the bus", action="Drain the node", evidence={},
              node="node-000", gpu_index=0)
with transaction.atomic():
    # Registered before the lifecycle's own hooks, so it runs first after the commit: the process dies with the
    # finding committed and the alerts' on_commit never run (a SIGKILL, an OOM kill, a power cut of the worker).
    transaction.on_commit(lambda: os.kill(os.getpid(), signal.SIGKILL))
    reconcile(cluster, [d], datetime.now(tz=UTC))
print("survived the commit", flush=True)
"""


def _db_env() -> dict[str, str]:
    db = settings.DATABASES["default"]
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CLUSTERDX_SQLITE_PATH")}
    if db["ENGINE"] != "django.db.backends.postgresql":
        env["CLUSTERDX_SQLITE_PATH"] = str(db["NAME"])  # the test database file this run created
    else:
        env["DATABASE_URL"] = (f"postgresql://{db['USER']}:{db['PASSWORD'] or ''}@{db['HOST'] or '127.0.0.1'}:"
                               f"{db['PORT'] or 5432}/{db['NAME']}")
    return {**env, "DJANGO_SETTINGS_MODULE": "dashboard.settings"}


def crash_after_commit(cluster: Any, severity: str = "error") -> None:
    proc = subprocess.run([sys.executable, "-c", CRASH, cluster.name, severity], env=_db_env(), cwd=ROOT,
                          capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout.decode() + proc.stderr.decode()[-3000:]


def embedded_sweep() -> None:
    """One tick of the embedded scheduler's alert sweep, waited for (its thread holds ``_sweeping`` until done)."""
    tasks.sweep()
    with tasks._sweeping:
        pass


def test_it_plans_an_alert_whose_process_died_after_the_commit(cluster: Any, nodes: list[Any],
                                                                receiver: Receiver, endpoint_for: Any) -> None:
    endpoint_for(receiver)
    crash_after_commit(cluster)
    finding = Finding.objects.get()
    assert finding.state == "open" and not Delivery.objects.exists()  # the fast path died with the process

    embedded_sweep()
    assert list(Delivery.objects.values_list("finding_id", "event", "status")) == [(finding.id, "opened",
                                                                                    "delivered")]
    assert len(receiver.requests) == 1 and receiver.requests[0].json()["type"] == "finding.opened"

    embedded_sweep()
    embedded_sweep()  # a sweep that runs again (or twice at once, below) finds nothing owed
    assert Delivery.objects.count() == 1 and len(receiver.requests) == 1


def test_it_gives_each_endpoint_one_delivery_per_event_across_crashes(cluster: Any, nodes: list[Any],
                                                                        endpoint_for: Any) -> None:
    receivers = [Receiver(), Receiver()]
    try:
        for i, r in enumerate(receivers):
            endpoint = endpoint_for(r)
            endpoint.name = f"hook-{i}"
            endpoint.save(update_fields=["name"])
        crash_after_commit(cluster, "error")
        crash_after_commit(cluster, "critical")  # escalated, and that process dies too

        from dashboard.alerts import planner

        # Two sweepers at once (two workers picking up the same beat tick): the claim lets one plan each row.
        def sweeper() -> None:
            try:
                planner.drain_outbox()
            finally:
                connection.close()  # this thread's own connection

        sweepers = [threading.Thread(target=sweeper) for _ in range(2)]
        for t in sweepers:
            t.start()
        for t in sweepers:
            t.join(60)
        embedded_sweep()
        rows = sorted(Delivery.objects.values_list("endpoint__name", "event", "severity"))
        assert rows == [("hook-0", "escalated", "critical"), ("hook-0", "opened", "error"),
                        ("hook-1", "escalated", "critical"), ("hook-1", "opened", "error")]
        assert not planner.owed()
    finally:
        for r in receivers:
            r.stop()


def test_the_fast_path_still_plans_at_once_and_the_sweep_adds_nothing(cluster: Any, nodes: list[Any],
                                                                       receiver: Receiver, endpoint_for: Any) -> None:
    from datetime import UTC, datetime

    from dashboard.diagnosis.detectors.base import Detection
    from dashboard.diagnosis.lifecycle import reconcile

    endpoint_for(receiver)
    d = Detection(kind="failing_gpu", subject_type="gpu", subject="node-001/gpu3", severity="error", title="Xid 79",
                  action="Drain", evidence={}, node="node-001", gpu_index=3)
    reconcile(cluster, [d], datetime.now(tz=UTC))  # commits; its on_commit hooks run here
    assert Delivery.objects.filter(status="pending").count() == 1  # planned by the hook, before any sweep
    embedded_sweep()
    embedded_sweep()
    assert Delivery.objects.get().status == "delivered" and len(receiver.requests) == 1
