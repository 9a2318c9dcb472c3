"""In Chromium: a node named down behind a server that receives its batches late. The finding page says how late
they arrived, and its silence chart draws the heartbeat line where the detector held it: the heartbeat plus that
delay, with the node's silence crossing it."""

from __future__ import annotations

import time
from typing import Any

import pytest

from dashboard.diagnosis.models import Finding
from dashboard.diagnosis.tasks import run_pass
from tests.server import browser
from tests.server.conftest import AsgiServer, World, listened_for
from tests.server.test_arrival_delay import late_server, skewed_node
from tests.server.test_page_finding_browser import server  # noqa: F401 - the fixture: the real server, no own pass

pytestmark = pytest.mark.browser

TRACES = """() => document.getElementById('panel-silence').data.map((t) => ({meta: t.meta, name: t.name,
  y: t.y.filter((v) => v !== null)}))"""


def test_the_finding_page_draws_the_heartbeat_plus_the_arrival_delay(
        server: AsgiServer, world: World, page: Any, tmp_path: Any) -> None:  # noqa: F811
    def work() -> None:
        now = time.time()
        late_server(world, now)  # every node's batches arrive 12 s late; node-001's stopped 40 s ago (> 15 s + 12 s)
        listened_for(600)  # ... while the server listened (it started a moment ago, the data's times are older)
        run_pass(world.cluster, now)

    browser.elsewhere(work)
    f = Finding.objects.get(kind="node_down")
    assert f.subject == "node-001" and "the 12 s its batches take to arrive" in f.title

    browser.sign_in(page, server.url, world.owner.username, world.password, f"/findings/{f.id}/")
    page.wait_for_function("(document.getElementById('panel-silence') || {}).data !== undefined")
    traces = page.evaluate(TRACES)
    beat = next(t for t in traces if t["name"].startswith("heartbeat_s"))
    assert beat["name"] == "heartbeat_s 15 + 12 s arrival delay" and set(beat["y"]) == {27.0}, beat
    silence = next(t for t in traces if t["meta"] == "subject")
    assert max(silence["y"]) > 27.0
    assert "arrive" in page.inner_text("#f-title")
    browser.no_js_errors(page)
    browser.keep_screenshot(page, "finding-late-node", tmp_path)


DELAYS = """() => document.getElementById('panel-arrival_delay').data.map((t) => ({meta: t.meta, name: t.name,
  y: t.y.filter((v) => v !== null)}))"""


def test_the_finding_page_of_a_clock_behind_draws_its_batches_arrival_delays(
        server: AsgiServer, world: World, page: Any, tmp_path: Any) -> None:  # noqa: F811
    def work() -> None:
        now = time.time()
        skewed_node(world, now)
        run_pass(world.cluster, now + 0.5)

    browser.elsewhere(work)
    f = Finding.objects.get(kind="clock_skew")
    assert not Finding.objects.filter(kind="node_down").exists()

    browser.sign_in(page, server.url, world.owner.username, world.password, f"/findings/{f.id}/")
    page.wait_for_function("(document.getElementById('panel-arrival_delay') || {}).data !== undefined")
    traces = page.evaluate(DELAYS)
    delay = next(t for t in traces if t["meta"] == "subject")
    assert len(delay["y"]) >= 12 and min(delay["y"]) > 299.0, delay
    limit = next(t for t in traces if t["name"].endswith("clock_behind_s 30"))
    # 30 s past the cluster's 0.05 s; shown to 0.1 s, and the ledger's delays come back from julianday() within
    # ~50 us, so 30.05 rounds either way.
    assert limit["y"] and all(y == pytest.approx(30.05, abs=0.051) for y in limit["y"]), limit
    assert "clock is 300 s behind" in page.inner_text("#f-title")
    assert "chronyc" in page.inner_text("body")
    browser.no_js_errors(page)
    browser.keep_screenshot(page, "finding-clock-skew", tmp_path)
