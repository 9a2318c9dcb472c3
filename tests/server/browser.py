"""Driving Debian's chromium through Playwright: sign in, wait for live frames, keep the screenshots the docs show."""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import service_missing

CHROMIUM = os.environ.get("CLUSTERDX_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"


def launch_page(monkeypatch: pytest.MonkeyPatch, width: int = 1400, height: int = 1100) -> Iterator[Any]:
    if not shutil.which(CHROMIUM) and not os.path.exists(CHROMIUM):
        service_missing(f"no chromium at {CHROMIUM} (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    from tests import network_lock

    # Playwright's sync API keeps an event loop on this thread; the test's own ORM calls are still plain sync code.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    # No testbed changes the host's addresses while the browser runs: Chromium would fail its pending requests.
    with network_lock.browsing(), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            # The pages' Content-Security-Policy forbids eval, which Playwright's wait_for_function uses: the shared
            # page bypasses it (tests/server/test_security.py checks the pages under the policy).
            page = browser.new_page(viewport={"width": width, "height": height}, bypass_csp=True)
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.js_errors = errors  # type: ignore[attr-defined]
            # What a page that never draws leaves behind: a module whose fetch failed stops the script silently (no
            # pageerror), so the failed requests, error answers and console errors are kept for :func:`wait_for`.
            trouble: list[str] = []
            page.on("console", lambda m: m.type == "error" and trouble.append(f"console: {m.text}"))
            page.on("requestfailed", lambda r: trouble.append(f"failed: {r.method} {r.url}: {r.failure}"))
            page.on("response", lambda r: r.status >= 400 and trouble.append(f"answered {r.status}: {r.url}"))
            page.trouble = trouble  # type: ignore[attr-defined]
            # CI's loaded cores evaluate plotly seconds after a page's data is in: a test that reads a chart before
            # it is drawn fails there only. CLUSTERDX_TEST_PLOTLY_DELAY_S=2 holds plotly back to show such a test here.
            delay = float(os.environ.get("CLUSTERDX_TEST_PLOTLY_DELAY_S") or 0)
            if delay:
                page.route(re.compile(r"/plotly[^/]*\.js"), lambda route: (time.sleep(delay), route.continue_()))
            yield page
        finally:
            browser.close()


def elsewhere(work: Callable[[], None], timeout: float = 120) -> None:
    """Run ``work`` (ingest, diagnosis passes) on another thread and wait for it: Playwright's sync API keeps an event
    loop on this one, where the passes' live broadcasts (async_to_sync) cannot run."""
    from django.db import connection

    raised: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # failed there, fails the test here (a thread's error is only printed)
            raised.append(exc)
        finally:
            connection.close()

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout)
    assert not t.is_alive()
    if raised:
        raise raised[0]


def sign_in(page: Any, base_url: str, username: str, password: str, next_path: str) -> None:
    page.goto(f"{base_url}{next_path}")
    assert "/login/" in page.url, f"{next_path} must require a login"
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")
    page.wait_for_url(f"{base_url}{next_path}")


def wait_for(page: Any, selector: str, timeout: int = 30_000) -> None:
    """``page.wait_for_selector``, failing with what the page went through: its JS errors, failed requests and
    error answers, and the element's parent's HTML (a page that drew something else, or nothing)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_selector(selector, timeout=timeout)
    except PlaywrightTimeout:
        parent = selector.split()[0]
        raise AssertionError(f"{selector} did not appear in {timeout} ms {_went_through(page)}; "
                             f"{parent}: {_text_of(page, parent, 'e.outerHTML')[:2000]}") from None


def _went_through(page: Any) -> str:
    return (f"on {page.url}; JS errors: {getattr(page, 'js_errors', [])}; "
            f"trouble: {getattr(page, 'trouble', [])}")


def _text_of(page: Any, selector: str, expr: str) -> str:
    return page.eval_on_selector(selector, f"e => {expr}") if page.query_selector(selector) else "(absent)"


def wait_live(page: Any, timeout: int = 30_000) -> None:
    # 30 s: 10 ran out in CI for the node and the overview pages, three test processes and Chromium on two cores
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function("(document.getElementById('live-status') || {}).textContent === 'live'",
                               timeout=timeout)
    except PlaywrightTimeout:
        status = _text_of(page, "#live-status", "e.textContent")
        raise AssertionError(f"not live in {timeout} ms (live-status: {status!r}) {_went_through(page)}") from None


def keep_screenshot(page: Any, name: str, tmp_path: Path, selector: str | None = None) -> Path:
    """A full-page PNG (or of the element ``selector`` matches) in the test's tmp dir, copied to docs/img/<name>.png:
    the docs show what the suite saw."""
    shot = tmp_path / f"{name}.png"
    if selector is None:
        page.screenshot(path=str(shot), full_page=True)
    else:  # a clip of the full page: an element shot scrolls, and cards that draw on scroll move the element
        box = page.eval_on_selector(selector, "e => { const r = e.getBoundingClientRect();"
                                              " return {x: r.x + scrollX, y: r.y + scrollY, width: r.width, height: r.height}; }")
        page.screenshot(path=str(shot), full_page=True, clip=box)
    if os.environ.get("CLUSTERDX_KEEP_SCREENSHOTS", "1") != "0":
        DOCS_IMG.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, DOCS_IMG / shot.name)
    for extra in filter(None, [os.environ.get("CLUSTERDX_SCREENSHOT_DIR")]):
        shutil.copy(shot, extra)
    return shot


def no_js_errors(page: Any) -> None:
    errors = getattr(page, "js_errors", [])
    assert not errors, f"the page threw: {errors}"
