"""A real browser (Debian's chromium through Playwright) signs in, opens the run page of a simulated run with faults,
sees it change live, explains a step, and opens a rank's page."""

from __future__ import annotations

from typing import Any

import pytest

from dashboard.telemetry.models import Run
from tests.server import browser
from tests.server.conftest import AsgiServer, World, make_batch
from tests.server.test_diagnosis_pass import Feed
from tests.server.test_live import ingest

pytestmark = pytest.mark.browser

FAULTS = [{"kind": "straggler", "at_s": 4, "rank": 6, "magnitude": 0.6},
          {"kind": "nccl_env_drift", "at_s": 0, "rank": 13},
          {"kind": "xid", "at_s": 20, "node": 2, "gpu": 1, "code": 13}]


def sign_in(page: Any, server: AsgiServer, world: World, next_path: str) -> None:
    browser.sign_in(page, server.url, world.owner.username, world.password, next_path)


def _live_seconds(feed: Feed, server: AsgiServer, world: World, seconds: int) -> None:
    """The simulator's next seconds over real HTTP ingest, so they reach the page through the websocket."""
    for _ in range(seconds):
        feed.t += 1
        for batch in feed.sim.tick(feed.t0 + feed.t):
            assert ingest(server, world.token, batch).status_code == 200


def test_the_run_page_draws_the_run_live_and_explains_a_step(asgi_server: AsgiServer, world: World, page: Any,
                                                              tmp_path: Any) -> None:
    feed = Feed(world, FAULTS)
    feed.run(30)  # with diagnosis passes: the straggler and the drift are open findings
    run = Run.objects.get(name="llm")
    sign_in(page, asgi_server, world, f"/runs/{run.id}/")
    browser.wait_live(page)
    page.wait_for_function("(document.getElementById('steps').data || [{x: []}])[0].x.length > 20")
    assert page.evaluate("document.getElementById('steps').data.map(t => t.name)") == [
        "data wait", "compute", "communication", "other", "slowest rank"]
    page.wait_for_selector("#findings a[href*='/findings/']")
    assert "rank6" in page.inner_text("#findings")
    # the rank x step heatmap: one row per rank, ordered by node, with node ticks
    page.wait_for_function("document.body.dataset.heatmapRows === '32'"
                           " && (document.getElementById('rank-heatmap').data || []).length > 0")
    assert page.evaluate("document.getElementById('rank-heatmap').data[0].type") == "heatmap"
    # settings: rank 13's drift highlighted and linked
    page.wait_for_selector("#settings tr.drift a[href$='/ranks/13/']")
    page.wait_for_selector("#nccl a[href*='/nodes/node-000/']")
    # live: new steps arrive and the step counter moves
    before = int(page.inner_text("#kpi-step"))
    _live_seconds(feed, asgi_server, world, 3)
    page.wait_for_function(f"+document.getElementById('kpi-step').textContent > {before}", timeout=10_000)
    # a click on a step explains it with every layer: timeline, per-rank split, GPU, probes, IB, Xid, NCCL, findings
    step = run.last_step - 3 if run.last_step else 25
    page.evaluate(f"document.getElementById('steps').emit('plotly_click', {{points: [{{x: {step}, customdata: {step}}}]}})")
    page.wait_for_function(f"document.body.dataset.explained === '{step}'")
    assert page.inner_text("#explain-step") == str(step)
    assert page.inner_text("#explain-cause").startswith("Most likely:")
    assert page.evaluate("document.getElementById('explain-ranks').data.length") == 3
    assert page.evaluate("document.getElementById('explain-timeline').data[0].x.length") == 2
    assert "throttle" in page.inner_text("#explain-gpu").lower() or "rank" in page.inner_text("#explain-gpu")
    assert page.locator("#explain-probes table tr").count() > 1, "the probes of the window are listed"
    assert page.locator("#explain-findings a[href*='/findings/']").count() >= 1
    browser.no_js_errors(page)
    browser.keep_screenshot(page, "run", tmp_path)

    # zoom into a window: the chart refetches it at one step per point
    page.evaluate("Plotly.relayout('steps', {'xaxis.range[0]': 5, 'xaxis.range[1]': 15})")
    page.wait_for_function("document.body.dataset.historyBucket === '1'")

    # a rank's page: its split, its node and GPU linked, its settings
    page.goto(f"{asgi_server.url}/runs/{run.id}/ranks/6/")
    page.wait_for_function("(document.getElementById('steps').data || [{x: []}])[0].x.length > 10")
    assert page.locator("h1 a[href='/clusters/prod-a/nodes/node-001/gpus/2/']").count() == 1
    page.wait_for_selector("#settings table")
    assert "bf16" in page.inner_text("#settings")
    page.wait_for_selector("#findings a[href*='/findings/']")
    browser.no_js_errors(page)
    browser.keep_screenshot(page, "rank", tmp_path)


def test_an_outsider_cannot_open_the_run_page(asgi_server: AsgiServer, world: World, page: Any) -> None:
    assert ingest(asgi_server, world.token, make_batch(seq=0)).status_code == 200
    run = Run.objects.get(name="run-1")
    page.goto(f"{asgi_server.url}/runs/{run.id}/")
    page.fill("input[name=username]", world.outsider.username)
    page.fill("input[name=password]", world.password)
    page.click("button[type=submit]")
    page.wait_for_load_state()
    assert page.locator("text=Not Found").count() + page.locator("h1:has-text('Not Found')").count() >= 1
