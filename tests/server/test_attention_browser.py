"""In Chromium, as a member: acknowledge a finding from its page, silence its node from the node page, and see both
marks on the findings list (screenshots kept for the docs)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from dashboard.diagnosis.models import Finding, Silence
from dashboard.telemetry.models import Node
from tests.alerts.alerts_support import make_finding
from tests.server import browser
from tests.server.conftest import AsgiServer, World

pytestmark = pytest.mark.browser


@pytest.fixture
def server(transactional_db: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[AsgiServer]:
    """The real server without its own diagnosis pass: the hand-made finding has no detector to keep it open."""
    from dashboard import celery

    monkeypatch.setattr(celery, "SCHEDULE", {k: v for k, v in celery.SCHEDULE.items() if k != "diagnosis"})
    s = AsgiServer().start()
    try:
        yield s
    finally:
        s.stop()


def test_a_member_acknowledges_a_finding_and_silences_its_node(server: AsgiServer, world: World, page: Any,
                                                                tmp_path: Any) -> None:
    nodes = [Node.objects.create(cluster=world.cluster, hostname=f"node-{i:03d}") for i in range(3)]
    finding = make_finding(world.cluster, node=nodes[1], gpu_index=2, severity="critical")

    browser.sign_in(page, server.url, "bob", world.password, f"/findings/{finding.id}/")
    browser.wait_live(page)
    page.click("#ack-button")
    page.wait_for_selector("#unack-button")
    assert "acknowledged by bob" in page.inner_text("#f-attention")
    assert Finding.objects.get().acked_by_name == "bob"
    browser.keep_screenshot(page, "finding-ack", tmp_path)

    page.goto(f"{server.url}/clusters/prod-a/nodes/node-001/")
    page.select_option("#silence-form select[name=minutes]", "240")
    page.fill("#silence-form input[name=reason]", "maintenance: reseating GPU 2")
    page.click("#silence-form button[type=submit]")
    page.wait_for_selector("#node-silences .silence")
    assert "node node-001" in page.inner_text("#node-silences")
    page.wait_for_selector("#findings-open .pill.silenced")
    assert "acked by bob" in page.inner_text("#findings-open")
    silence = Silence.objects.get()
    assert (silence.scope, silence.target, silence.created_by_name) == ("node", "node-001", "bob")
    assert round((silence.ends_at - silence.starts_at).total_seconds()) == 4 * 3600
    browser.keep_screenshot(page, "node-silence", tmp_path)

    page.goto(f"{server.url}/clusters/prod-a/findings/")
    page.wait_for_selector("#list tbody tr[data-id] .pill.silenced")
    row = page.inner_text(f"#list tr[data-id='{finding.id}']")
    assert "acked by bob" in row and "silenced until" in row
    assert "maintenance: reseating GPU 2" in page.inner_text("#silences")
    browser.keep_screenshot(page, "findings-silenced", tmp_path)
    browser.no_js_errors(page)
