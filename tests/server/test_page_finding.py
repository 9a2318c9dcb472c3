"""The finding page and the findings list: the evidence chart of each kind drawn from real simulator faults (the
injected fault above the detector's threshold, the healthy past below it), the detail API with earlier findings and
deliveries, the list's filters and pages, and who may see what."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pytest
from django.utils import timezone

from dashboard.alerts import endpoints
from dashboard.alerts.models import Delivery
from dashboard.diagnosis.detectors.base import Thresholds, robust_z
from dashboard.diagnosis.models import Finding
from dashboard.web import evidence_math as em
from tests.alerts.alerts_support import Receiver, drain
from tests.server.conftest import World
from tests.server.test_diagnosis_pass import Feed

pytestmark = pytest.mark.django_db

# kind -> (faults, nodes, seconds fed, subject named, words the headline must hold)
FAULTS: dict[str, tuple[list[dict[str, Any]], int, int, str, tuple[str, ...]]] = {
    "straggler": ([{"kind": "straggler", "at_s": 5, "rank": 6, "magnitude": 0.4}], 8, 16, "llm/rank6",
                  ("x median", "z=")),
    "data_starvation": ([{"kind": "data_starvation", "at_s": 6, "rank": 5, "magnitude": 0.6}], 4, 16, "llm/rank5",
                        ("of each step", "z=")),
    "failing_gpu": ([{"kind": "ecc_storm", "at_s": 5, "node": 2, "gpu": 1, "dbe_after_s": 6}], 4, 16,
                    "node-002/gpu1", ("DBE 1", "SBE +")),
    "slow_link": ([{"kind": "slow_link", "at_s": 5, "node": 3}], 8, 14, "node-003", ("RTT", "x quiet")),
    "node_down": ([{"kind": "node_down", "at_s": 10, "node": 5}], 8, 20, "node-005", ("silent", "probe loss")),
}
FIRST_PANEL = {"straggler": "compute", "data_starvation": "data_share", "failing_gpu": "ecc_sbe_volatile",
               "slow_link": "rtt", "node_down": "silence"}


@pytest.fixture
def alerting(settings: Any) -> Iterator[Receiver]:
    """A real receiver, reachable (a private address) and without the grouping wait."""
    settings.CLUSTERDX = {**settings.CLUSTERDX, "ALERTS_ALLOW_PRIVATE": True, "ALERTS_GROUP_WAIT_S": 0.0,
                          "ALERTS_BACKOFF_BASE_S": 0.01, "ALERTS_BACKOFF_MAX_S": 0.05, "ALERTS_HTTP_TIMEOUT_S": 2.0}
    r = Receiver()
    yield r
    r.stop()


def threshold_at(panel: dict[str, Any], i: int) -> float:
    line = panel["thresholds"][0]
    return line["value"] if "value" in line else line["y"][i]


def split(panel: dict[str, Any], onset: float) -> tuple[list[int], list[int]]:
    """Indices of the subject's points before the fault (x < onset) and inside the detector's window."""
    xs = next(s for s in panel["series"] if s["role"] == "subject")["x"]
    w0, w1 = panel["window"]
    return [i for i, x in enumerate(xs) if x < onset], [i for i, x in enumerate(xs) if w0 <= x <= w1]


@pytest.mark.parametrize("kind", list(FAULTS))
def test_the_evidence_shows_the_injected_fault_above_its_threshold(client: Any, world: World, kind: str) -> None:
    faults, nodes, seconds, subject, words = FAULTS[kind]
    feed = Feed(world, faults, nodes=nodes)
    feed.run(seconds)
    f = Finding.objects.get(kind=kind)
    assert f.subject == subject
    client.force_login(world.teammate)
    body = client.get(f"/api/v1/findings/{f.id}").json()
    assert body["finding"]["subject_url"] and body["finding"]["url"] == f"/findings/{f.id}/"
    assert all(w in body["finding"]["headline"] for w in words), body["finding"]["headline"]
    chart = body["chart"]
    assert chart["kind"] == kind and chart["numbers"] and chart["thresholds"]
    panel = chart["panels"][0]
    assert panel["id"] == FIRST_PANEL[kind], [p["id"] for p in chart["panels"]]
    subject_ys = next(s for s in panel["series"] if s["role"] == "subject")["y"]
    # The fault, in the detector's window, is past the threshold; the healthy past before the fault is not. The
    # onset: the fault's first step (per-step charts) or its start time, less a 1 s bucket (a bucket's x is its start).
    onset = 3 if panel["x"] == "step" else feed.t0 + faults[0]["at_s"] - 1.5
    before, inside = split(panel, onset)
    assert before and inside, (panel["x"], panel["window"])
    sign = 1 if panel["direction"] == "above" else -1
    over = [i for i in inside if subject_ys[i] is not None and sign * (subject_ys[i] - threshold_at(panel, i)) > 0]
    assert len(over) >= min(3, len(inside)), (kind, [subject_ys[i] for i in inside])
    assert all(subject_ys[i] is None or sign * (subject_ys[i] - threshold_at(panel, i)) < 0 for i in before), \
        (kind, [(subject_ys[i], threshold_at(panel, i)) for i in before])
    assert panel["breach"]["over"] is True and sign * (panel["breach"]["y"] - panel["breach"]["threshold"]) > 0
    if kind == "failing_gpu":  # only the counters that moved, each against its minimum
        panels = {p["id"]: p for p in chart["panels"]}
        assert set(panels) == {"ecc_sbe_volatile", "ecc_dbe_volatile"}, "PCIe and NVLink did not move"
        assert panel["thresholds"][0]["value"] == Thresholds().sbe_min and panels["ecc_dbe_volatile"]["breach"]["y"] >= 1


def test_a_node_down_past_raw_retention_draws_its_silence_from_the_rollups(client: Any, world: World) -> None:
    from dashboard.storage.rollup import roll_up
    from dashboard.telemetry.models import GpuFrame, HostSample

    faults, nodes, seconds, *_ = FAULTS["node_down"]
    feed = Feed(world, faults, nodes=nodes)
    feed.run(seconds)
    f = Finding.objects.get(kind="node_down")
    assert roll_up(timezone.now()) > 0
    # What retention does to the raw tier after CLUSTERDX_RAW_RETENTION_HOURS (the rollups stay 7 and 30 days).
    assert GpuFrame.objects.filter(node=f.node).exists()
    GpuFrame.objects.filter(node=f.node).delete()
    HostSample.objects.filter(node=f.node).delete()
    client.force_login(world.teammate)
    panel = client.get(f"/api/v1/findings/{f.id}").json()["chart"]["panels"][0]
    assert panel["id"] == "silence" and "rollups" in panel["title"], panel["title"]
    onset = feed.t0 + faults[0]["at_s"]
    xs, ys = next((s["x"], s["y"]) for s in panel["series"] if s["role"] == "subject")
    # Heard every second until the node died (10 s windows: at most a window's worth of estimate), silent after.
    assert all(y <= 11 for x, y in zip(xs, ys, strict=True) if y is not None and x < onset - 1), ys
    assert ys[-1] is not None and ys[-1] >= xs[-1] - onset - 1 > threshold_at(panel, len(xs) - 1), (ys[-1], panel)


def test_the_detail_lists_earlier_findings_and_the_deliveries(client: Any, world: World, alerting: Receiver,
                                                               django_capture_on_commit_callbacks: Any,
                                                               settings: Any) -> None:
    settings.SITE_URL = "https://cdx.example.org"
    endpoints.create(world.cluster, name="oncall", kind="webhook", url=alerting.url)
    with django_capture_on_commit_callbacks(execute=True):  # the pass's finding_changed, as after a real commit
        Feed(world, FAULTS["straggler"][0], nodes=8).run(16)
    f = Finding.objects.get(kind="straggler")
    drain()
    past = Finding.objects.create(
        cluster=world.cluster, kind="throttling", subject_type="rank", subject=f.subject, severity="warning",
        state="resolved", title="an older episode", opened_at=f.opened_at - timedelta(days=2),
        updated_at=f.opened_at - timedelta(days=1), last_seen_at=f.opened_at - timedelta(days=1),
        resolved_at=f.opened_at - timedelta(days=1))
    client.force_login(world.owner)
    body = client.get(f"/api/v1/findings/{f.id}").json()
    assert [(e["id"], e["url"], e["state"]) for e in body["earlier"]] == [(past.id, f"/findings/{past.id}/", "resolved")]
    (d,) = body["deliveries"]
    assert (d["endpoint"], d["endpoint_kind"], d["event"], d["status"], d["attempts"]) == (
        "oncall", "webhook", "opened", "delivered", 1)
    assert d["response_code"] == 200 and d["last_error"] == "" and d["finished_at"] >= d["created_at"]
    # The alert that was sent links to this page; a test alert (no finding) to the cluster.
    assert alerting.requests[0].json()["data"]["link"] == f"https://cdx.example.org/findings/{f.id}/"
    assert Delivery.objects.get().finding_id == f.id
    from dashboard.alerts.alert import dashboard_link

    assert urlparse(dashboard_link(None, "prod-a")).path == "/clusters/prod-a/"


def _findings(client: Any, **params: Any) -> Any:
    return client.get("/api/v1/findings", {"cluster": "prod-a", **params})


@pytest.fixture
def listed(world: World) -> list[Finding]:
    """Two findings from a real pass (a starved rank on node-001, an Xid on node-003) and 7 resolved ones."""
    Feed(world, [{"kind": "data_starvation", "at_s": 6, "rank": 5, "magnitude": 0.6},
                 {"kind": "xid", "at_s": 8, "node": 3, "gpu": 2, "code": 94}], nodes=4).run(16)
    node = Finding.objects.get(kind="failing_gpu").node
    now = timezone.now()
    for i in range(7):
        at = now - timedelta(hours=10 + i)
        Finding.objects.create(cluster=world.cluster, kind="slow_link", subject_type="node", subject=f"old-{i}",
                               node=node, severity="critical" if i % 2 else "warning", state="resolved",
                               title=f"old {i}", opened_at=at, updated_at=at, last_seen_at=at, resolved_at=at)
    return list(Finding.objects.all())


def test_the_list_filters_by_severity_node_run_and_time(client: Any, world: World, listed: list[Finding]) -> None:
    client.force_login(world.teammate)
    critical = _findings(client, severity="critical").json()["findings"]
    assert critical and {f["severity"] for f in critical} == {"critical"}
    assert {f["id"] for f in critical} == {f.id for f in listed if f.severity == "critical"}
    on_node = _findings(client, node="node-003").json()["findings"]
    assert {f["kind"] for f in on_node} == {"failing_gpu", "slow_link"} and len(on_node) == 8
    assert [f["subject"] for f in _findings(client, node="node-001").json()["findings"]] == ["llm/rank5"]
    both = _findings(client, severity=["warning", "error"], state="resolved").json()["findings"]
    assert len(both) == 4 and {f["severity"] for f in both} == {"warning"}
    recent = time.time() - 3 * 3600  # the resolved ones changed 10+ hours ago; the open ones are still open
    assert {f["state"] for f in _findings(client, since=recent).json()["findings"]} == {"open"}
    old = _findings(client, until=time.time() - 9 * 3600).json()["findings"]
    assert len(old) == 7 and all(f["subject"].startswith("old-") for f in old)
    run = next(f.run_id for f in listed if f.run_id)
    # A run's findings are its own and those of the nodes its ranks run on (the old ones on node-003 too).
    assert {f["subject"] for f in _findings(client, run=run, state="open").json()["findings"]} == {
        "llm/rank5", "node-003/gpu2"}
    assert len(_findings(client, run=run).json()["findings"]) == 9
    assert all(f["headline"] and f["url"] == f"/findings/{f['id']}/" for f in critical)


def test_the_list_pages_with_a_total_and_a_next_link(client: Any, world: World, listed: list[Finding]) -> None:
    client.force_login(world.owner)
    seen: list[int] = []
    r = _findings(client, limit=4)
    pages = 0
    while True:
        pages += 1
        assert r.status_code == 200 and r["X-Total-Count"] == str(len(listed))
        seen += [f["id"] for f in r.json()["findings"]]
        if "Link" not in r:
            break
        nxt = r["Link"].split(">")[0].lstrip("<")
        assert nxt.startswith("/api/v1/findings?") and 'rel="next"' in r["Link"]
        r = client.get(nxt)
    assert pages == 3 and len(seen) == len(set(seen)) == len(listed)
    by_time = sorted(listed, key=lambda f: (f.updated_at, f.id), reverse=True)
    assert seen == [f.id for f in by_time], "newest first, across pages"
    assert _findings(client, offset=100).json() == {"findings": []}


BAD = [
    ({"severity": "dire"}, "severity must be one of info, warning, error, critical"),
    ({"since": "yesterday"}, "since must be seconds since 1970"),
    ({"since": "200", "until": "100"}, "until must be after since"),
    ({"until": "nan"}, "until must be seconds since 1970"),
    ({"offset": "-1"}, "offset must be at least 0"),
    ({"limit": "lots"}, "limit must be an integer"),
    ({"node": "node-999"}, "no node named 'node-999'"),
    ({"run": "llm"}, "run must be a run id"),
    ({"kind": "gremlins"}, "kind must be one of"),
    ({"state": "maybe"}, "state must be one of open, resolved"),
]


def test_bad_filters_answer_400_with_the_reason(client: Any, world: World) -> None:
    client.force_login(world.owner)
    for params, reason in BAD:
        r = _findings(client, **params)
        assert r.status_code == 400 and reason in r.json()["detail"], (params, r.content)


def _finding(world: World, **extra: Any) -> Finding:
    from dashboard.telemetry.models import Node

    node = Node.objects.create(cluster=world.cluster, hostname="node-005")
    now = timezone.now()
    fields: dict[str, Any] = {"cluster": world.cluster, "kind": "node_down", "subject_type": "node",
                              "subject": "node-005", "node": node, "severity": "critical",
                              "title": "node-005 is down", "action": "Check the node",
                              "evidence": {"metrics": {"silent_s": 20.0, "probe_loss": 1.0}, "window": [0, 20]},
                              "opened_at": now, "updated_at": now, "last_seen_at": now, **extra}
    return Finding.objects.create(**fields)


def test_outsiders_get_404_and_anonymous_401(client: Any, world: World) -> None:
    f = _finding(world)
    assert client.get(f"/api/v1/findings/{f.id}").status_code == 401
    assert client.get(f"/findings/{f.id}/")["Location"].startswith("/login/")
    assert client.get("/clusters/prod-a/findings/")["Location"].startswith("/login/")
    client.force_login(world.outsider)
    assert client.get(f"/api/v1/findings/{f.id}").status_code == 404
    assert client.get(f"/findings/{f.id}/").status_code == 404
    assert client.get("/clusters/prod-a/findings/").status_code == 404
    assert _findings(client).status_code == 404
    assert client.get("/api/v1/findings", {"node": "node-005"}).status_code == 400, "a node of a cluster not yours"
    client.force_login(world.owner)
    page = client.get(f"/findings/{f.id}/")
    # plotly from this server (its basic bundle: the evidence is lines and bars), never a CDN
    assert page.status_code == 200 and b'id="plotly-src" src="/static/vendor/plotly-basic/' in page.content
    assert f.title.encode() in page.content and b"/clusters/prod-a/nodes/node-005/" in page.content
    listing = client.get("/clusters/prod-a/findings/")
    assert listing.status_code == 200 and b'name="severity"' in listing.content and b"node-005" in listing.content
    assert client.get(f"/api/v1/findings/{f.id + 1000}").status_code == 404


def test_the_api_is_documented(client: Any) -> None:
    paths = client.get("/api/openapi.json").json()["paths"]
    one = paths["/api/v1/findings/{finding_id}"]["get"]
    assert set(one["responses"]) == {"200", "401", "404"}
    listing = paths["/api/v1/findings"]["get"]
    names = {p["name"] for p in listing["parameters"]}
    assert {"severity", "node", "run", "since", "until", "offset", "limit", "state", "kind"} <= names
    assert {"X-Total-Count", "Link"} <= set(listing["responses"]["200"]["headers"])


# -- the arithmetic, against the detectors' own conditions -------------------------------------------------------------

def test_the_compute_line_separates_exactly_what_the_straggler_detector_flags() -> None:
    rng = np.random.default_rng(3)
    comp = 0.8 + rng.normal(0, 0.01, (32, 12))
    comp[6, 5:] *= 1.3
    comp[9, 8] *= 1.03  # slower, but under compute_ratio_min
    t = Thresholds()
    for matrix, slow, not_slow in ((comp, 6, 9), (_fast_steps(), 2, 4)):
        cz, cmed = robust_z(matrix, 0, floor=0.01 * np.nanmedian(matrix))
        flagged = (cz > t.z) & (matrix >= t.compute_ratio_min * cmed) & (matrix - cmed >= t.compute_min_s)
        _, line = em.compute_threshold(matrix, t)
        assert ((matrix > line) == flagged).all() and flagged[slow, 5:].all() and not flagged[not_slow].any()


def _fast_steps() -> np.ndarray:
    """50 ms of compute: a rank 30 % slower (15 ms) is flagged, one 10 % slower (5 ms, a busy host's timer) is not."""
    comp = 0.05 + np.random.default_rng(4).normal(0, 0.0002, (8, 12))
    comp[2, 5:] *= 1.3
    comp[4, 5:] *= 1.1
    return comp


def test_the_rolling_increase_is_what_the_gpu_detector_sums() -> None:
    ts = list(range(60))
    sbe = [0] * 30 + [5 * i for i in range(30)]
    inc = em.rolling_increase(ts, sbe, 20.0)
    assert inc[29] == 0 and inc[59] == 100 and inc[40] == 50
    assert em.rolling_increase([0, 1, 2], [10, 0, 3], 5.0) == [0.0, 0.0, 3.0], "a reset is not a negative count"


def test_silence_and_breach() -> None:
    assert em.silence([10.0, 11.0, 12.0], np.array([9.0, 11.5, 20.0])) == [None, 0.5, 8.0]
    b = em.breach([0, 1, 2, 3], [1.0, 5.0, 2.0, 9.0], 3.0, "above", [0, 2])
    assert b == {"x": 1, "y": 5.0, "threshold": 3.0, "over": True}, "the worst point inside the window"
    low = em.breach([0, 1], [0.9, 0.5], [0.85, 0.85], "below", None)
    assert low == {"x": 1, "y": 0.5, "threshold": 0.85, "over": True}


@pytest.mark.parametrize(("kind", "metrics", "line"), [
    ("throttling", {"clock_ratio": 0.61, "temp_c": 92.4, "reasons": ["hw_thermal_slowdown"]},
     "SM clock 61% of max, 92 °C, hw_thermal_slowdown"),
    ("hang", {"stalled_s": 42.0, "median_step_s": 0.5}, "no step for 42 s (84x median step)"),
    ("cluster_silent", {"silent_s": 42.0, "nodes": 2048}, "silent 42 s, all 2,048 nodes"),
    ("cluster_silent", {"silent_s": 42.0, "nodes": 2048, "ingest_lag_s": 41.0},
     "silent 42 s, all 2,048 nodes, batches arrive 41 s late"),
    ("rank_down", {"state": "step", "silent_s": 9.0, "stalled_s": 12.0, "median_step_s": 1.0},
     "step, no beat for 9 s, no step for 12 s (12x median step)"),
    ("memory_pressure", {"allocated_frac": 0.93, "reserved_frac": 0.97}, "93% allocated, 97% reserved"),
    ("checkpoint_overdue", {"steps_since": 420, "usd_at_risk": 1234.5}, "420 steps since the last checkpoint, $1,234 at risk"),
    ("nccl_config", {"differences": {"NCCL_ALGO": {"value": "Ring", "others": "Tree"}}}, "NCCL_ALGO=Ring (others Tree)"),
    ("efficiency", {"mfu": 0.0123, "tokens_per_s": 5321.0}, "MFU 1.2%, 5,321 tokens/s"),
    ("straggler", {"z": "odd"}, "the title"),
])
def test_the_headline_is_the_deciding_numbers(kind: str, metrics: dict[str, Any], line: str) -> None:
    from dashboard.web.evidence import headline

    f = Finding(kind=kind, title="the title", evidence={"metrics": metrics})
    assert headline(f) == line
