"""Fixtures for the testbed scenarios: the delay program, the four namespaces, and the server on the bridge.

The server is the real ASGI app under uvicorn, in a thread of the test process, on the test database, listening on
the bridge's address (the host side of the testbed): the agents in the namespaces reach it like a real server, and
the test reads the same database. The diagnosis pass is not left to the embedded scheduler: the test runs it itself
(the same ``run_pass`` the schedule calls), so each scenario decides when to look and can print what it saw.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from netns_testbed import Testbed, build_delay_program, remove_stale, why_not

from tests.conftest import service_missing
from tests.server.conftest import AsgiServer


@pytest.fixture(scope="session")
def delay_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reason = why_not()
    if reason:
        service_missing(reason)
    return build_delay_program(tmp_path_factory.mktemp("nfq"))


@pytest.fixture
def bed(tmp_path: Path, delay_program: Path) -> Iterator[Testbed]:
    remove_stale()
    testbed = Testbed(tmp_path)
    try:
        try:
            testbed.build()
        except RuntimeError as exc:  # root without CAP_NET_ADMIN (an unprivileged container), for example
            service_missing(f"cannot build the testbed here: {exc}")
        yield testbed
    finally:
        testbed.close()
    assert testbed.leftovers() == [], "the testbed left namespaces or links behind"


@dataclass
class Site:
    server: AsgiServer
    cluster: Any
    token: str


@pytest.fixture
def site(bed: Testbed, transactional_db: None, settings: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Site]:
    from dashboard import celery
    from dashboard.ingest.writer import clear_caches
    from dashboard.live import state
    from dashboard.telemetry import tokens
    from dashboard.telemetry.models import Cluster

    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, bed.bridge_addr]
    # The test runs the diagnosis pass itself; a second, scheduled one would race it for the same findings.
    monkeypatch.delitem(celery.SCHEDULE, "diagnosis")
    clear_caches()  # ids cached by an earlier test point at rows the rollback removed
    state.get_state.cache_clear()
    cluster = Cluster.objects.create(name="testbed")
    _, token = tokens.create_token(cluster, "testbed agents")
    server = AsgiServer(bed.bridge_addr).start()
    try:
        yield Site(server, cluster, token)
    finally:
        server.stop()
        clear_caches()
