"""In Chromium: the node page lists the interfaces its agent last reported (usable first, the down one flagged) and
the NCCL finding that names them."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from clusterdx import wire
from dashboard.diagnosis.tasks import run_pass
from dashboard.ingest.writer import store_batch
from tests.server import browser
from tests.server.conftest import AsgiServer, World, make_batch
from tests.server.test_interfaces import ETH0, ETH1, LO

pytestmark = pytest.mark.browser


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch, transactional_db: None) -> Iterator[AsgiServer]:
    from dashboard import celery

    monkeypatch.delitem(celery.SCHEDULE, "diagnosis")  # the test runs its pass itself
    srv = AsgiServer().start()
    try:
        yield srv
    finally:
        srv.stop()


def test_the_node_page_shows_its_interfaces_and_the_finding_that_names_them(server: AsgiServer, world: World,
                                                                           page: Any) -> None:
    now = time.time()
    ib0 = {"name": "ib0", "state": "up", "kind": "infiniband", "virtual": False, "mtu": 4092, "speed_mbps": 400000,
           "addresses": ["10.1.0.2/16"]}
    runs = [{"run": "run-1", "rank": r, "world_size": 2, "ts": now - 5, "host": "node-a",
             "env": {"NCCL_SOCKET_IFNAME": "ib9"}} for r in range(2)]
    batch = make_batch(0, host="node-a", runs=runs,
                       hosts=[{"ts": now - 1, "cpu_pct": 5.0, "interfaces": [ETH1, LO, ETH0, ib0]}])
    named: list[str] = []

    def work() -> None:  # off Playwright's thread, where the pass's live broadcast cannot run (browser.elsewhere)
        store_batch(world.cluster, wire.validate_batch(batch))
        named.extend(d.subject for d in run_pass(world.cluster, now).detections if d.kind == "nccl_config")

    browser.elsewhere(work)
    assert named == ["node-a"]

    browser.sign_in(page, server.url, world.owner.username, world.password, "/clusters/prod-a/nodes/node-a/")
    browser.wait_for(page, "#iface-table table")
    rows = page.eval_on_selector_all("#iface-table tr", "rs => rs.slice(1).map(r => [...r.cells].map(c => c.innerText))")
    assert [r[:2] for r in rows] == [["eth0", "up"], ["ib0", "up"], ["lo", "unknown"], ["eth1", "DOWN"]]
    assert rows[0][2].split() == ["10.77.0.2/24", "fe80::2/64"] and rows[1][3] == "IPoIB" and rows[1][5] == "400 Gbit/s"
    finding = page.locator("#findings-open li", has_text="NCCL_SOCKET_IFNAME=ib9").inner_text()
    assert "eth0 up 10.77.0.2/24, ib0 up IPoIB 10.1.0.2/16, lo; down: eth1" in finding
    assert "set NCCL_SOCKET_IFNAME=eth0 (up here: eth0, ib0)" in finding
    assert page.js_errors == []
    shots = os.environ.get("CLUSTERDX_SCREENSHOT_DIR")
    if shots:
        page.screenshot(path=os.path.join(shots, "node-interfaces.png"), full_page=True)
        page.locator("#answer").screenshot(path=os.path.join(shots, "node-interfaces-finding.png"))
        page.locator("#iface-table").screenshot(path=os.path.join(shots, "node-interfaces-table.png"))
