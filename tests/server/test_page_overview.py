"""The cluster overview and search: the API's nodes, GPUs, findings, runs and events from the simulator through the
real writer and diagnosis; node states; event paging; search; who may see what; size at 2,048 nodes; the page in
Chromium."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone

from dashboard.diagnosis.detectors.base import Thresholds
from dashboard.diagnosis.detectors.window import RunInfo
from dashboard.diagnosis.models import Finding
from dashboard.live.state import get_state
from dashboard.telemetry.models import Cluster, Event, Gpu, Node, Rank, Run
from dashboard.web.pages.overview_health import headline
from dashboard.web.pages.overview_runs import run_state
from tests.server import browser
from tests.server import test_diagnosis_pass as tdp
from tests.server.conftest import AsgiServer, World

API = "/api/v1/clusters/prod-a/overview"
FAULTS = [{"kind": "xid", "at_s": 5, "node": 2, "gpu": 1, "code": 48},
          {"kind": "straggler", "at_s": 4, "rank": 6, "magnitude": 0.4}]


def feed_until_now(world: World, monkeypatch: pytest.MonkeyPatch, seconds: int, faults: list[dict[str, Any]]) -> Any:
    """The simulator's Feed, started so that its simulated clock reaches the wall clock at the end (the run is then
    running, not stalled, and the nodes fresh)."""
    real = time.time
    with monkeypatch.context() as m:
        m.setattr(tdp.time, "time", lambda: real() + 300 - seconds)
        feed = tdp.Feed(world, faults)
    feed.run(seconds)
    while feed.t0 + feed.t < time.time():  # passes took wall time: catch the simulated clock up (no passes)
        feed.run(1, passes=False)
    return feed


def _gpu(node: dict[str, Any], index: int, column: str, columns: list[str]) -> Any:
    return next(g for g in node["gpus"] if g[0] == index)[columns.index(column)]


@pytest.mark.django_db
def test_it_shows_nodes_gpus_findings_runs_and_events_from_the_simulator(
        world: World, client: Any, monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks: Any) -> None:
    with django_capture_on_commit_callbacks(execute=True):  # the live state is filled after each commit
        feed_until_now(world, monkeypatch, 20, FAULTS)
    client.force_login(world.owner)
    body = client.get(API).json()
    cols = body["gpu_columns"]
    nodes = {n["host"]: n for n in body["nodes"]}
    assert len(nodes) == 8 and all(len(n["gpus"]) == 4 for n in nodes.values())
    assert {n["state"] for n in nodes.values()} == {"ok"} and body["summary"]["ok"] == 8
    assert body["group_by"] == "rack" and nodes["node-000"]["url"] == "/clusters/prod-a/nodes/node-000/"
    assert 0 < _gpu(nodes["node-000"], 0, "util_gpu_pct", cols) <= 100
    assert _gpu(nodes["node-000"], 0, "url", cols) is None, "a healthy GPU is reached through its node"
    assert _gpu(nodes["node-002"], 1, "url", cols) == "/clusters/prod-a/nodes/node-002/gpus/1/"

    xid = Finding.objects.get(kind="failing_gpu", state="open")
    row = next(f for f in body["findings"] if f["id"] == xid.id)
    assert row["url"] == f"/findings/{xid.id}/" and row["subject_url"] == "/clusters/prod-a/nodes/node-002/gpus/1/"
    assert "Xid 48" in row["headline"] and row["age_s"] >= 0
    assert nodes["node-002"]["severity"] == xid.severity == _gpu(nodes["node-002"], 1, "severity", cols)
    assert _gpu(nodes["node-002"], 0, "severity", cols) is None and nodes["node-003"]["severity"] is None
    straggler = Finding.objects.get(kind="straggler", state="open")
    srow = next(f for f in body["findings"] if f["id"] == straggler.id)
    assert srow["headline"].startswith("compute ") and "median" in srow["headline"]
    assert _gpu(nodes[straggler.node.hostname], straggler.gpu_index, "severity", cols) == straggler.severity
    assert [f["severity"] for f in body["findings"]] == sorted(
        (f["severity"] for f in body["findings"]), key=["critical", "error", "warning", "info"].index)

    (run,) = body["runs"]
    assert run["name"] == "llm" and run["state"] == "running" and run["url"] == f"/runs/{run['id']}/"
    assert 0.3 < run["step_rate"] < 3 and 0 < run["mfu"] < 1 and run["at_risk"]["usd"] > 0
    assert run["at_risk"]["gpu_hours"] == pytest.approx(run["at_risk"]["usd"] / body["gpu_hour_usd"], abs=0.01)
    (event,) = [e for e in body["events"]["events"] if e["kind"] == "xid"]
    assert event["code"] == 48 and event["url"] == "/clusters/prod-a/nodes/node-002/"
    assert event["gpu_url"] == "/clusters/prod-a/nodes/node-002/gpus/1/"


@pytest.mark.django_db
def test_nodes_are_down_or_stale_by_heartbeat_and_a_dead_gpu_shows_no_numbers(
        world: World, client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    now = timezone.now()
    hosts = {"fresh": now, "quiet": now - timedelta(seconds=10), "gone": now - timedelta(seconds=60),
             "named-down": now, "never": None}
    nodes = {h: Node.objects.create(cluster=world.cluster, hostname=h, last_seen=seen) for h, seen in hosts.items()}
    for node in nodes.values():
        Gpu.objects.bulk_create([Gpu(node=node, index=i) for i in range(2)])
    Finding.objects.create(cluster=world.cluster, kind="node_down", subject_type="node", subject="named-down",
                           node=nodes["named-down"], severity="critical", title="down", opened_at=now,
                           updated_at=now, last_seen_at=now)
    t = time.time()
    live = get_state()
    # fresh: GPU 0 reports, GPU 1's rows stopped 30 s before (its node still reports): GPU 1 alone is stale.
    live.record(world.cluster.id, "fresh", [["fresh", 0, t, 91.0, 2**30, 300.0, 60.0],
                                            ["fresh", 1, t - 30, 77.0, 2**30, 300.0, 60.0]])
    with monkeypatch.context() as m:  # "gone" last reported a minute ago, and still has its last GPU row
        m.setattr(time, "time", lambda: t - 60)
        live.record(world.cluster.id, "gone", [["gone", 0, t - 60, 88.0, 2**30, 300.0, 60.0]])
    client.force_login(world.owner)
    body = client.get(API).json()
    cols = body["gpu_columns"]
    got = {n["host"]: n for n in body["nodes"]}
    assert {h: n["state"] for h, n in got.items()} == {"fresh": "ok", "quiet": "stale", "gone": "down",
                                                        "named-down": "down", "never": "stale"}
    assert (body["summary"]["ok"], body["summary"]["stale"], body["summary"]["down"]) == (1, 2, 2)
    assert _gpu(got["fresh"], 0, "state", cols) == "ok" and _gpu(got["fresh"], 0, "util_gpu_pct", cols) == 91.0
    assert _gpu(got["fresh"], 1, "state", cols) == "stale" and _gpu(got["fresh"], 1, "util_gpu_pct", cols) is None
    assert _gpu(got["gone"], 0, "state", cols) == "down"
    assert _gpu(got["gone"], 0, "util_gpu_pct", cols) is None, "a dead node must not keep its last utilisation"
    assert got["named-down"]["severity"] == "critical" and got["named-down"]["node_severity"] == "critical"


def test_run_states_follow_the_documented_rule() -> None:
    t = Thresholds()
    now = 10_000.0

    def state(idle: float, med: float | None = 1.0, hooks: frozenset[str] = frozenset(),
              open_: frozenset[str] = frozenset()) -> str:
        return run_state(RunInfo("r", 8, {}, {}, 100, now - idle), now, med, set(hooks), set(open_), t)

    assert state(1.0) == "running"
    assert state(6.0) == "stalled", "past 5x the median step"
    assert state(6.0, med=2.0) == "running"
    assert state(1.0, open_=frozenset({"stalled"})) == "stalled"
    assert state(30.0, hooks=frozenset({"finished"})) == "finished"
    assert state(30.0, hooks=frozenset({"finished", "crashed"})) == "crashed"
    assert state(1.0, open_=frozenset({"crashed"})) == "crashed"
    assert state(7200.0) == "finished", "an hour without a step and nothing open"


def test_headline_picks_the_key_metric_per_kind() -> None:
    assert headline("node_down", {"metrics": {"silent_s": 42.3, "probe_loss": 1.0, "ranks": ["a", "b"]}}) == \
        "silent 42 s, peers lose 100% of probes, 2 rank(s) stopped"
    assert headline("data_starvation", {"metrics": {"data_wait_s": 0.5, "median_data_wait_s": 0.02,
                                                    "data_wait_share": 0.45}}).startswith("data wait 45% of each step")
    assert headline("slow_link", {"metrics": {"rtt_ms": 2.0, "baseline_rtt_ms": 0.05, "loss": 0.0}}) == \
        "RTT 2.00 ms vs 0.05 ms baseline"
    assert headline("checkpoint_overdue", {"metrics": {"usd_at_risk": 1234.5, "gpu_hours_at_risk": 493.8,
                                                       "steps_since": 900}}).startswith("$1,234 at risk")
    assert headline("hang", {"metrics": {"stalled_s": 40, "median_step_s": 2.0}}) == \
        "no step for 40 s (20× the median step)"
    assert headline("cluster_silent", {"metrics": {"silent_s": 20.4, "nodes": 2048, "ranks": ["a/rank0"]}}) == \
        "all 2,048 nodes silent 20 s, 1 rank(s) of running jobs on them"
    assert headline("cluster_silent", {"metrics": {"silent_s": 31, "nodes": 2048, "ingest_lag_s": 30.2}}) == \
        "all 2,048 nodes silent 31 s; their batches reach this server 30 s late"
    assert headline("cluster_silent", {"metrics": {"silent_s": 31, "nodes": 2048, "ingest_lag_s": 0.1}}) == \
        "all 2,048 nodes silent 31 s"
    assert headline("unknown_kind", {"metrics": {"a": 1, "b": "x", "c": [1]}}) == "a 1, b x"
    assert headline("straggler", {"metrics": {"compute_s": "bad", "median_compute_s": None}}) == "compute_s bad"


@pytest.mark.django_db
def test_events_page_back_in_time_without_gaps_or_repeats(world: World, client: Any) -> None:
    base = datetime(2026, 1, 1, tzinfo=UTC)
    stamps = [0, 1, 1, 1, 2, 3, 3, 4]  # ties at a page boundary are the hard part
    made = [Event.objects.create(cluster=world.cluster, ts=base + timedelta(seconds=s), kind="xid",
                                 severity="error", message=f"e{i}") for i, s in enumerate(stamps)]
    Event.objects.create(cluster=world.cluster, ts=base, kind="checkpoint", severity="info", message="quiet")
    client.force_login(world.owner)
    seen, url = [], "/api/v1/clusters/prod-a/events?limit=3"
    while url:
        page = client.get(url).json()
        seen += [e["id"] for e in page["events"]]
        nxt = page["next"]
        url = f"/api/v1/clusters/prod-a/events?limit=3&before={nxt['before']}&before_id={nxt['before_id']}" \
            if nxt else None
    expected = [e.id for e in sorted(made, key=lambda e: (e.ts, e.id), reverse=True)]
    assert seen == expected
    everything = client.get("/api/v1/clusters/prod-a/events?min_severity=info&limit=50").json()["events"]
    assert len(everything) == len(made) + 1
    assert client.get("/api/v1/clusters/prod-a/events?before=yesterday").status_code == 400
    assert client.get("/api/v1/clusters/prod-a/events?min_severity=loud").status_code == 400


@pytest.mark.django_db
def test_search_finds_nodes_runs_and_ranks_in_your_clusters_only(world: World, client: Any) -> None:
    for host in ("gpu-a01", "gpu-a02", "cpu-b01"):
        Node.objects.create(cluster=world.cluster, hostname=host)
    Node.objects.create(cluster=world.other_cluster, hostname="gpu-secret")
    run = Run.objects.create(cluster=world.cluster, name="llama-70b", world_size=16)
    Rank.objects.create(run=run, rank=5, node=Node.objects.get(hostname="gpu-a02"))
    Run.objects.create(cluster=world.other_cluster, name="llama-secret")
    client.force_login(world.owner)

    def labels(q: str) -> list[str]:
        return [r["label"] for r in client.get("/api/v1/search", {"q": q}).json()["results"]]

    assert labels("gpu-a") == ["gpu-a01", "gpu-a02"], "the outsider cluster's gpu-secret is not found"
    assert labels("llama") == ["llama-70b"]
    assert labels("rank 5") == labels("llama-70b/rank5") == labels("llama 5") == ["llama-70b/rank5"]
    found = client.get("/api/v1/search", {"q": "llama/rank5"}).json()["results"]
    assert found == [{"type": "rank", "label": "llama-70b/rank5", "cluster": "prod-a", "detail": "on gpu-a02",
                      "url": f"/runs/{run.id}/ranks/5/"}]
    assert labels("rank 99") == []
    assert client.get("/api/v1/search", {"q": " "}).status_code == 400
    one = client.get("/search/", {"q": "cpu-b"})
    assert one.status_code == 302 and one["Location"] == "/clusters/prod-a/nodes/cpu-b01/"
    many = client.get("/search/", {"q": "gpu", "cluster": "prod-a"})
    assert many.status_code == 200
    text = many.content.decode()
    assert 'href="/clusters/prod-a/nodes/gpu-a01/"' in text and "gpu-secret" not in text
    assert client.get("/search/", {"q": "gpu", "cluster": "prod-b"}).status_code == 404


@pytest.mark.django_db
def test_outsiders_get_404_and_the_logged_out_api_401(world: World, client: Any) -> None:
    apis = [API, "/api/v1/clusters/prod-a/events", "/api/v1/search?q=node"]
    for url in apis:
        r = client.get(url)
        assert r.status_code == 401 and r.json()["error"] == "unauthenticated", url
    assert client.get("/clusters/prod-a/").status_code == 302
    client.force_login(world.outsider)
    assert client.get("/clusters/prod-a/").status_code == 404
    assert client.get(API).status_code == 404
    assert client.get("/api/v1/clusters/prod-a/events").status_code == 404
    Node.objects.create(cluster=world.cluster, hostname="node-hidden")
    assert client.get("/api/v1/search", {"q": "hidden"}).json()["results"] == []
    client.force_login(world.owner)
    assert client.get("/clusters/prod-a/").status_code == 200 and client.get(API).status_code == 200


def _big_cluster(cluster: Cluster, nodes: int, gpus: int) -> None:
    """2,048 nodes x 8 GPUs in bulk, each reporting now, 64 racks, a few findings."""
    now = timezone.now()
    Node.objects.bulk_create([Node(cluster=cluster, hostname=f"node-{i:04d}", last_seen=now, rack=f"rack-{i // 32:02d}",
                                   switch=f"leaf-{i // 32:02d}") for i in range(nodes)])
    ids = dict(Node.objects.filter(cluster=cluster).values_list("hostname", "id"))
    Gpu.objects.bulk_create([Gpu(node_id=ids[h], index=g) for h in ids for g in range(gpus)], batch_size=4000)
    live, t = get_state(), time.time()
    for h in ids:
        live.record(cluster.id, h, [[h, g, t, 80.0 + g, 40 * 2**30, 650.0, 70.0] for g in range(gpus)])
    Finding.objects.bulk_create([Finding(cluster=cluster, kind="failing_gpu", subject_type="gpu",
                                         subject=f"node-{i:04d}/gpu3", node_id=ids[f"node-{i:04d}"], gpu_index=3,
                                         severity="error", title="x", opened_at=now, updated_at=now, last_seen_at=now)
                                 for i in range(0, nodes, 97)])


@pytest.mark.django_db
def test_the_overview_stays_small_and_few_queries_at_2048_nodes(
        world: World, client: Any, django_assert_max_num_queries: Any) -> None:
    _big_cluster(world.cluster, 2048, 8)
    client.force_login(world.owner)
    with django_assert_max_num_queries(20):  # no per-node queries
        r = client.get(API)
    body = r.json()
    assert len(body["nodes"]) == 2048 and body["summary"]["gpus"] == 16384 and body["summary"]["ok"] == 2048
    assert len(r.content) < 2_000_000, f"{len(r.content)} bytes"
    assert sum(1 for n in body["nodes"] if n["severity"] == "error") == len(range(0, 2048, 97))


# -- the page in Chromium ----------------------------------------------------------------------------------------------

@pytest.mark.browser
def test_the_overview_page_draws_the_health_map_links_findings_and_keeps_events(
        asgi_server: AsgiServer, world: World, page: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    feed = feed_until_now(world, monkeypatch, 20, FAULTS)
    xid = Finding.objects.get(kind="failing_gpu", state="open")
    browser.sign_in(page, asgi_server.url, world.owner.username, world.password, "/clusters/prod-a/")
    browser.wait_live(page)
    page.wait_for_function("document.getElementById('healthmap').dataset.cells === '32'")
    # Every cell is a GPU painted on one canvas, not a DOM element.
    assert page.locator("#healthmap canvas").count() == 1 and page.locator("#healthmap *").count() == 1
    pixel = _pixel(page, "node-002", 1)
    colour = {"warning": [243, 167, 18], "error": [228, 87, 46], "critical": [157, 2, 8]}[xid.severity]
    assert pixel == [*colour, 255], f"the GPU with the Xid is painted in its finding's colour, got {pixel}"
    assert page.locator(f"#findings a[href='/findings/{xid.id}/']").count() == 1
    worst = page.get_attribute("#findings tbody tr:first-child td:nth-child(3) a", "href")
    assert page.locator(f"#answer li:first-child a[href='{worst}']").count() == 1, "the answer on top: the worst"
    assert page.locator("#findings a[href='/clusters/prod-a/nodes/node-002/gpus/1/']").count() == 1
    assert "Xid 48" in page.inner_text("#findings")
    # (its state is the API test's business: here the feed has stopped, so by now the run may rightly be stalled)
    assert page.locator("#runs a[href^='/runs/']", has_text="llm").count() == 1
    assert page.inner_text("#runs .run-state") in ("running", "stalled")
    assert "Xid" in page.inner_text("#events")
    feed.run(2, passes=False)  # fresh samples for the screenshot: nodes stay ok
    page.wait_for_timeout(1200)
    browser.keep_screenshot(page, "overview", tmp_path)
    page.reload()
    browser.wait_live(page)
    page.wait_for_function("document.getElementById('events').innerText.includes('Xid')")
    browser.no_js_errors(page)
    # A mouse click on a healthy GPU of node-005 opens node-005's page.
    page.locator("#healthmap").scroll_into_view_if_needed()
    at = page.evaluate("document.getElementById('healthmap').cellCenter('node-005', 0)")
    page.mouse.click(at["x"], at["y"])
    page.wait_for_url(f"{asgi_server.url}/clusters/prod-a/nodes/node-005/")


# The canvas pixel at the centre of a GPU's cell, as [r, g, b, a]: ([host, gpu]) => pixel
_PIXEL = """([host, gpu]) => { const el = document.getElementById('healthmap'), c = el.querySelector('canvas');
    const at = el.cellCenter(host, gpu), r = c.getBoundingClientRect(), k = c.width / r.width;
    return [...c.getContext('2d').getImageData((at.x - r.left) * k, (at.y - r.top) * k, 1, 1).data]; }"""


def _pixel(page: Any, host: str, gpu: int) -> list[int]:
    return page.evaluate(_PIXEL, [host, gpu])


def _changed(world: World, f: Finding, **fields: Any) -> None:
    """What the lifecycle does when a pass opens or resolves a finding: the row, then its broadcast (off Playwright's
    thread, where the broadcast cannot run)."""
    from dashboard.diagnosis import lifecycle

    def work() -> None:
        for k, v in fields.items():
            setattr(f, k, v)
        f.save()
        resolved = f.state == Finding.State.RESOLVED
        # no transaction on this thread: the broadcast (on_commit) goes at once
        lifecycle._notify(world.cluster.id, lifecycle.Changes(resolved=[f] if resolved else [],
                                                              opened=[] if resolved else [f]))
    browser.elsewhere(work)


@pytest.mark.browser
def test_the_health_map_follows_the_findings_as_they_open_and_resolve_between_refreshes(
        asgi_server: AsgiServer, world: World, page: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The map's colours come with the overview's answer, re-read every 12 s; the findings list is live. The demo
    showed a GPU painted red for a finding the list had already dropped: the map now follows the live findings."""
    feed_until_now(world, monkeypatch, 20, FAULTS)
    browser.sign_in(page, asgi_server.url, world.owner.username, world.password, "/clusters/prod-a/")
    browser.wait_live(page)
    page.wait_for_function("document.getElementById('healthmap').dataset.cells === '32'")
    critical = [157, 2, 8, 255]
    assert _pixel(page, "node-004", 3) != critical

    def change(f: Finding, **fields: Any) -> float:
        before = page.evaluate("performance.now()")
        _changed(world, f, **fields)
        return before

    def painted(colour: list[int], yes: bool) -> None:
        page.wait_for_function(f"([want, yes]) => ({_PIXEL})(['node-004', 3]).every((v, i) => v === want[i]) === yes",
                               arg=[colour, yes], timeout=10_000)

    # A GPU finding no pass makes or clears (its condition is not in the data; it would clear after 600 s unseen).
    now = timezone.now()
    node = Node.objects.get(cluster=world.cluster, hostname="node-004")
    f = Finding(cluster=world.cluster, kind="failing_gpu", subject="node-004/gpu3", subject_type="gpu",
                severity="critical", title="node-004 GPU 3: Xid 79 (fell off the bus)", action="drain it",
                confidence=0.9, node=node, gpu_index=3, evidence={}, opened_at=now, updated_at=now, last_seen_at=now)
    for state, yes in ((Finding.State.OPEN, True), (Finding.State.RESOLVED, False)):
        before = change(f, state=state, resolved_at=timezone.now() if state == Finding.State.RESOLVED else None)
        painted(critical, yes)
        took = page.evaluate("performance.now()") - before
        assert took < 6000, f"the map showed the finding {state} after {took:.0f} ms: the refresh's, not live"
        assert ("GPU 3" in page.inner_text("#trouble")) == yes, "drawn with the map"
        # The list is drawn on a cadence of its own (markLists, 500 ms): it may follow the map by that much.
        page.wait_for_selector(f"#findings a[href='/findings/{f.id}/']", state="attached" if yes else "detached",
                               timeout=3_000)
    browser.no_js_errors(page)


@pytest.mark.browser
def test_a_node_page_hears_at_once_of_a_link_finding_that_names_it_as_the_far_end(
        asgi_server: AsgiServer, world: World, page: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node page lists the findings that name its node as either end of a link, and re-reads them when a live
    frame names it: as the far end too (it re-read them only for the near end, so the far end's page waited for its
    next refresh)."""
    feed_until_now(world, monkeypatch, 20, FAULTS)
    browser.sign_in(page, asgi_server.url, world.owner.username, world.password, "/clusters/prod-a/nodes/node-004/")
    browser.wait_live(page)
    browser.wait_for(page, "#findings-open li")
    now = timezone.now()
    near, far = (Node.objects.get(cluster=world.cluster, hostname=h) for h in ("node-003", "node-004"))
    f = Finding(cluster=world.cluster, kind="slow_link", subject="node-003~node-004", subject_type="link",
                severity="error", title="Slow network on the link node-003~node-004: RTT 4.10 ms vs 0.06 ms elsewhere",
                action="check the cable", confidence=0.9, node=near, peer_node=far, evidence={}, opened_at=now,
                updated_at=now, last_seen_at=now)
    _changed(world, f)
    page.wait_for_selector("#findings-open li:has-text('node-003~node-004')", timeout=6_000)
    browser.no_js_errors(page)
