"""A real browser (Debian's chromium through Playwright) signs in, opens the run page and sees it change live."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from dashboard.telemetry.models import Run
from tests.conftest import service_missing
from tests.server.conftest import AsgiServer, World, make_batch
from tests.server.test_live import ingest

pytestmark = pytest.mark.browser
CHROMIUM = os.environ.get("CLUSTERDX_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


@pytest.fixture
def page(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    if not shutil.which(CHROMIUM) and not os.path.exists(CHROMIUM):
        service_missing(f"no chromium at {CHROMIUM} (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop on this thread; the test's own ORM calls are still plain sync code.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 1100})
        finally:
            browser.close()


def sign_in(page: Any, server: AsgiServer, world: World, next_path: str) -> None:
    page.goto(f"{server.url}{next_path}")
    assert "/login/" in page.url, "the run page requires a login"
    page.fill("input[name=username]", world.owner.username)
    page.fill("input[name=password]", world.password)
    page.click("button[type=submit]")
    page.wait_for_url(f"{server.url}{next_path}")


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
    page.screenshot(path=str(tmp_path / "run.png"), full_page=True)
    if os.environ.get("CLUSTERDX_SCREENSHOT_DIR"):
        shutil.copy(tmp_path / "run.png", os.environ["CLUSTERDX_SCREENSHOT_DIR"])


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
