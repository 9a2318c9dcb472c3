"""A real browser draws the run page's NCCL panel: the rank strip (one heatmap, in node order) with the ranks on
sockets in red and linked, from NCCL log lines that went through the agent's parser and HTTP ingest."""

from __future__ import annotations

import os
import shutil
from datetime import timedelta
from typing import Any

import pytest

from dashboard.telemetry.models import Run
from tests.server import browser
from tests.server.conftest import AsgiServer, World
from tests.server.test_diagnosis_pass import Feed
from tests.server.test_live import ingest
from tests.server.test_page_run_nccl import SILENT, SOCKET_NODE, WORLD, agent_batches, nccl_log

pytestmark = pytest.mark.browser


def test_the_nccl_panel_draws_the_rank_strip_and_links_the_socket_ranks(asgi_server: AsgiServer, world: World,
                                                                         page: Any, tmp_path: Any) -> None:
    Feed(world, []).run(3, passes=False)
    run = Run.objects.get(name="llm")
    began = run.created_at - timedelta(minutes=5)
    logs = {r: nccl_log(r, 5000 + r) for r in range(WORLD) if r not in SILENT}
    for batch in agent_batches(began.timestamp() + 60, logs):
        assert ingest(asgi_server, world.token, batch).status_code == 200
    browser.sign_in(page, asgi_server.url, world.owner.username, world.password, f"/runs/{run.id}/")
    # The panel marks itself when its data is in; the strip is drawn once plotly has run, which may be a moment later.
    page.wait_for_function(f"document.body.dataset.ncclRanks === '{WORLD}'"
                           " && (document.getElementById('nccl-strip').data || []).length > 0")
    trace = page.evaluate("(() => { const t = document.getElementById('nccl-strip').data[0];"
                          " return {type: t.type, rows: t.z.length, cols: t.z[0].length, z: t.z}; })()")
    assert (trace["type"], trace["rows"], trace["cols"]) == ("heatmap", 8, 4), "one row per node, a cell per rank"
    socket_row = trace["z"][SOCKET_NODE]
    assert len({v for v in socket_row}) == 1 and socket_row[0] != trace["z"][0][0], "the socket node is its own colour"
    assert page.locator("#nccl-strip .hm, #nccl-strip svg").count() >= 1
    assert page.locator("#nccl .nccl-class.suspect").inner_text().startswith("TCP sockets")
    socket_links = page.eval_on_selector_all(".nccl-socket a[href*='/ranks/']", "els => els.map(e => e.textContent)")
    assert socket_links == ["rank 20", "rank 21", "rank 22", "rank 23"]
    browser.no_js_errors(page)
    page.wait_for_selector("#settings table")  # the cards above are drawn before the shot
    shot = browser.keep_screenshot(page, "run-nccl", tmp_path, selector="section:has(#nccl)")
    for extra in filter(None, [os.environ.get("CLUSTERDX_NCCL_SHOT")]):
        shutil.copy(shot, extra)
    # a click on a cell opens its rank's page (its handler is attached once plotly has run)
    page.wait_for_function("document.getElementById('nccl-strip').dataset.clicks === '1'")
    page.evaluate("document.getElementById('nccl-strip').emit('plotly_click', {points: [{pointNumber: [5, 1]}]})")
    page.wait_for_url(f"**/runs/{run.id}/ranks/21/")
