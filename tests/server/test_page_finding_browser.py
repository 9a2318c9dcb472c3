"""In Chromium: the link of a real alert (the signed webhook a real delivery sent) opens the finding page, whose
evidence chart shows the injected fault above the detector's threshold line; the findings list filters, and
prepends a finding that opens while it is shown."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest

from dashboard.alerts import endpoints
from dashboard.alerts.alert import build
from dashboard.alerts.models import Delivery
from dashboard.diagnosis.models import Finding
from tests.alerts.alerts_support import Receiver, drain
from tests.server import browser
from tests.server.conftest import AsgiServer, World
from tests.server.test_diagnosis_pass import Feed

pytestmark = pytest.mark.browser

FAULTS = [{"kind": "straggler", "at_s": 5, "rank": 6, "magnitude": 0.4},
          {"kind": "ecc_storm", "at_s": 5, "node": 2, "gpu": 1, "dbe_after_s": 6},
          {"kind": "slow_link", "at_s": 22, "node": 4}]

PLOTTED = """() => {
  const el = document.getElementById('panel-compute');
  const trace = (meta) => el.data.find((t) => t.meta === meta);
  const win = el.layout.shapes.find((s) => s.type === 'rect');
  return {x: trace('subject').x, y: trace('subject').y, tx: trace('threshold').x, ty: trace('threshold').y,
          window: [win.x0, win.x1], breach: trace('breach').y[0], dash: trace('threshold').line.dash};
}"""


def feed_elsewhere(feed: Feed, seconds: int) -> None:
    """Run the simulated seconds on another thread (:func:`browser.elsewhere`)."""
    browser.elsewhere(lambda: feed.run(seconds))


@pytest.fixture
def server(transactional_db: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[AsgiServer]:
    """The real server without its own diagnosis pass and alert sweep: the test's simulated clock runs the passes
    (the server's wall-clock pass would call every simulated node silent) and the test sends the alerts."""
    from dashboard import celery

    keep = {k: v for k, v in celery.SCHEDULE.items() if k not in ("diagnosis", "alerts-sweep")}
    monkeypatch.setattr(celery, "SCHEDULE", keep)
    s = AsgiServer().start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def receiver(settings: Any) -> Iterator[Receiver]:
    settings.CLUSTERDX = {**settings.CLUSTERDX, "ALERTS_ALLOW_PRIVATE": True, "ALERTS_GROUP_WAIT_S": 0.0}
    r = Receiver()
    yield r
    r.stop()


def test_an_alert_opens_the_finding_page_with_the_fault_above_its_threshold(
        server: AsgiServer, world: World, page: Any, receiver: Receiver, settings: Any, tmp_path: Any) -> None:
    settings.SITE_URL = server.url
    endpoints.create(world.cluster, name="oncall", kind="webhook", url=receiver.url)
    feed = Feed(world, FAULTS, nodes=8)
    feed_elsewhere(feed, 16)
    drain()
    straggler = Finding.objects.get(kind="straggler")
    sent = [r.json()["data"] for r in receiver.requests]
    link = next(d["link"] for d in sent if d["findings"][0]["kind"] == "straggler")
    assert link == f"{server.url}/findings/{straggler.id}/"
    assert build(Delivery.objects.get(finding=straggler, event="opened")).link == link, "Slack and PagerDuty too"

    browser.sign_in(page, server.url, world.owner.username, world.password, urlparse(link).path)
    browser.wait_live(page)
    page.wait_for_function("(document.getElementById('panel-compute') || {}).data !== undefined")
    assert page.inner_text("#f-title") == straggler.title
    assert page.get_attribute("#f-subject", "href") == f"/runs/{straggler.run_id}/ranks/6/"
    got = page.evaluate(PLOTTED)
    assert got["dash"] == "dash" and got["tx"] == got["x"], "a per-step threshold, drawn dashed on the same steps"
    w0, w1 = got["window"]
    inside = [(y, t) for x, y, t in zip(got["x"], got["y"], got["ty"], strict=True) if w0 <= x <= w1]
    healthy = [(y, t) for x, y, t in zip(got["x"], got["y"], got["ty"], strict=True) if x < 3]
    assert sum(y > t for y, t in inside) >= 3, inside
    assert healthy and all(y < t for y, t in healthy), healthy
    assert got["breach"] > max(t for _, t in inside) * 0.9
    deliveries = page.inner_text("#deliveries")
    assert "oncall" in deliveries and "delivered" in deliveries
    assert "threshold: z" in page.inner_text("#numbers")
    browser.no_js_errors(page)
    browser.keep_screenshot(page, "finding", tmp_path)

    # The list: open findings, then one that opens while the page is shown arrives on top.
    page.goto(f"{server.url}/clusters/prod-a/findings/?state=open")
    browser.wait_live(page)
    open_ids = set(Finding.objects.filter(state="open").values_list("id", flat=True))
    page.wait_for_function(f"document.querySelectorAll('#list tbody tr[data-id]').length === {len(open_ids)}")
    rows = page.eval_on_selector_all("#list tbody tr[data-id] td:nth-child(3) a", "els => els.map(a => a.href)")
    assert {urlparse(h).path for h in rows} == {f"/findings/{i}/" for i in open_ids}
    feed_elsewhere(feed, 12)  # the slow link opens now
    slow = Finding.objects.get(kind="slow_link")
    page.wait_for_selector(f"#list tbody tr[data-id='{slow.id}']", timeout=15_000)
    assert page.get_attribute("#list tbody tr:first-child", "data-id") == str(slow.id)
    assert "RTT" in page.inner_text(f"#list tbody tr[data-id='{slow.id}'] td.headline")
    browser.no_js_errors(page)
    browser.keep_screenshot(page, "findings", tmp_path)

    page.select_option("select[name=kind]", "straggler")
    page.click("#filters button[type=submit]")
    page.wait_for_url("**kind=straggler**")
    page.wait_for_function("document.querySelectorAll('#list tbody tr[data-id]').length === 1")
    assert page.get_attribute("#list tbody tr[data-id]", "data-id") == str(straggler.id)
