"""A real browser (Debian's chromium through Playwright) signs in, opens the run page and sees it change live."""

from __future__ import annotations

from typing import Any

import pytest

from dashboard.telemetry.models import Run
from tests.server import browser
from tests.server.conftest import AsgiServer, World, make_batch
from tests.server.test_live import ingest

pytestmark = pytest.mark.browser


def sign_in(page: Any, server: AsgiServer, world: World, next_path: str) -> None:
    browser.sign_in(page, server.url, world.owner.username, world.password, next_path)


def test_the_run_page_draws_live_charts(asgi_server: AsgiServer, world: World, page: Any, tmp_path: Any) -> None:
    for seq in range(3):
        assert ingest(asgi_server, world.token, make_batch(seq=seq)).status_code == 200
    run = Run.objects.get(name="run-1")
    sign_in(page, asgi_server, world, f"/runs/{run.id}/")
    page.wait_for_function("document.getElementById('live-status').textContent === 'live'")
    # plotly keeps the drawn traces on the element: the stacked bars have one x per step.
    page.wait_for_function("(document.getElementById('steps').data || [{x: []}])[0].x.length === 3")
    assert page.evaluate("document.getElementById('steps').data.map(t => t.name)") == [
        "data wait", "compute", "communication", "other"]
    assert page.evaluate("document.getElementById('heatmap').data[0].y") == ["node-000"]

    batch = make_batch(seq=3, host="node-001")
    batch["steps"] = [{**s, "step": 99, "data_wait_s": 0.5} for s in batch["steps"]]
    assert ingest(asgi_server, world.token, batch).status_code == 200
    page.wait_for_function("document.getElementById('steps').data[0].x.length === 4", timeout=10_000)
    assert page.evaluate("document.getElementById('steps').data[0].x.slice(-1)[0]") == 99
    page.wait_for_function("document.getElementById('heatmap').data[0].y.length === 2")
    assert page.inner_text("#kpi-step") == "99"
    # Clicking a step opens what every rank did in it (the chart's own click event, as a mouse click emits it).
    page.evaluate("document.getElementById('steps').emit('plotly_click', {points: [{x: 99}]})")
    page.wait_for_selector("#explain:not([hidden])")
    assert page.inner_text("#explain-step") == "99"
    page.wait_for_function("document.getElementById('explain-body').data[0].x.length === 2")
    assert page.evaluate("document.getElementById('explain-body').data[0].y") == [0.5, 0.5]
    browser.keep_screenshot(page, "run", tmp_path)


def test_an_outsider_cannot_open_the_run_page(asgi_server: AsgiServer, world: World, page: Any) -> None:
    assert ingest(asgi_server, world.token, make_batch(seq=0)).status_code == 200
    run = Run.objects.get(name="run-1")
    world.owner = world.outsider  # sign in as the outsider
    page.goto(f"{asgi_server.url}/runs/{run.id}/")
    page.fill("input[name=username]", world.outsider.username)
    page.fill("input[name=password]", world.password)
    page.click("button[type=submit]")
    page.wait_for_load_state()
    assert page.locator("text=Not Found").count() + page.locator("h1:has-text('Not Found')").count() >= 1
