"""In Chromium: the link matrix marks the simulator's slow node, and a click on one of its cells opens that pair's
page, which draws both directions' series against the diagnosis's thresholds."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from collectors.sim.model import SimCluster
from tests.server import browser
from tests.server.conftest import AsgiServer, World
from tests.server.test_diagnosis_pass import Feed

pytestmark = pytest.mark.browser

# The pixel centre of the cell (row host, column host) of a plotly matrix, from the chart's own axes.
CELL_XY = """([id, row, col]) => {
  const el = document.getElementById(id), L = el._fullLayout, box = el.getBoundingClientRect();
  const hosts = L.xaxis._categories;
  return [box.left + L.xaxis._offset + L.xaxis.l2p(hosts.indexOf(col)),
          box.top + L.yaxis._offset + L.yaxis.l2p(hosts.indexOf(row))];
}"""


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch, transactional_db: None) -> Iterator[AsgiServer]:
    """The server without its periodic diagnosis pass: the test's simulated cluster stops sending once its data is
    in, and the pass would then (rightly) call every node down halfway through the test. The Feed already ran the
    real pass over the data, second by second."""
    from dashboard import celery

    monkeypatch.delitem(celery.SCHEDULE, "diagnosis")
    srv = AsgiServer().start()
    try:
        yield srv
    finally:
        srv.stop()


def test_the_matrix_marks_the_slow_node_and_a_cell_opens_the_pair(server: AsgiServer, world: World, page: Any,
                                                                  tmp_path: Any) -> None:
    feed = Feed(world, [{"kind": "slow_link", "at_s": 2, "node": 6, "magnitude": 2.0}])
    feed.t0 = time.time() - 14  # the data ends now, as a live cluster's does
    feed.sim = SimCluster(feed.sim.s, feed.t0)
    feed.run(14)
    browser.sign_in(page, server.url, world.owner.username, world.password, "/clusters/prod-a/links/")
    browser.wait_live(page)
    # Each chart is drawn in its own task once plotly has run: wait for both.
    page.wait_for_function("(document.getElementById('rtt').data || []).length === 2"
                           " && (document.getElementById('bw').data || []).length === 2")
    # The overlay of bad pairs (the matrix's second trace) marks node-006's pairs, every one of them and only them.
    marked = page.evaluate("(() => { const t = document.getElementById('rtt').data[1];"
                           " return t.x.map((x, k) => [t.y[k], x]); })()")
    assert len(marked) == 14 and all("node-006" in pair for pair in marked), marked
    assert page.evaluate("document.getElementById('bw').data[1].x.length") == 14
    finding = page.locator("#findings a", has_text="Slow network on node-006").first
    assert finding.get_attribute("href").startswith("/findings/")
    assert page.locator("#findings a[href='/clusters/prod-a/nodes/node-006/']").count() >= 1
    browser.keep_screenshot(page, "links", tmp_path)

    x, y = page.evaluate(CELL_XY, ["rtt", "node-006", "node-002"])
    page.mouse.click(x, y)
    page.wait_for_url("**/clusters/prod-a/links/node-002/node-006/?range=15m")
    browser.wait_live(page)
    page.wait_for_function("(document.getElementById('rtt').data || []).length >= 4")
    names = page.evaluate("document.getElementById('rtt').data.map(t => t.name).filter(Boolean)")
    assert {"node-002 → node-006", "node-006 → node-002"} <= set(names), names
    # The series rises above the dashed threshold line the page draws.
    top = page.evaluate("Math.max(...document.getElementById('rtt').data.filter(t => t.name === "
                        "'node-006 → node-002').flatMap(t => t.y.filter(v => v !== null)))")
    line = page.evaluate("document.getElementById('rtt').layout.shapes[0].y0")
    assert top > line > 0
    assert page.locator("h1 a[href='/clusters/prod-a/nodes/node-006/']").count() == 1
    assert page.locator("#findings a", has_text="Slow network on node-006").count() == 1
    page.wait_for_function("(document.getElementById('cpu').data || []).length >= 2")
    browser.keep_screenshot(page, "link", tmp_path)
    browser.no_js_errors(page)
