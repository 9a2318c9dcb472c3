"""The node page and the GPU view: their APIs on real data (the simulator through the real writer and diagnosis pass,
or batches over HTTP), the GPU samples downsampled from their frames on SQLite and PostgreSQL, who may see them, and
the pages in Chromium."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from django.test import RequestFactory

from collectors.sim.model import SimCluster
from dashboard.diagnosis.models import Finding
from dashboard.storage import gpu_samples
from dashboard.telemetry.models import Node
from dashboard.web.links import gpu_url, node_url
from dashboard.web.series import TimeRange, parse_range
from tests.server import framed
from tests.server.conftest import AsgiServer, World, make_batch, off_site_assets, post
from tests.server.test_diagnosis_pass import Feed

NODE_API = "/api/v1/clusters/prod-a/nodes/{host}"


def _api(client: Any, host: str, suffix: str = "", **params: Any) -> Any:
    return client.get(NODE_API.format(host=host) + suffix, params)


def _gpu_rows(world: World, node: Node, t0: float, seconds: int, gpus: int = 2) -> None:
    """One sample per GPU per second (util = the second modulo 100, so every bucket's min/mean/max is known), posted
    every second as ingest frames a post."""
    for s in range(seconds):
        framed.gpus(world.cluster, node, [
            {"ts": t0 + s, "index": g, "util_gpu_pct": float(s % 100), "power_w": 300.0 + g, "power_limit_w": 700.0,
             "ecc_sbe_aggregate": s // 60, "throttle_reasons": ["sw_power_cap"] if 100 <= s < 160 else []}
            for g in range(gpus)])


# -- a node's GPU samples downsampled from their frames on this database (the suite runs this file on SQLite and on
# PostgreSQL) ---------------------------------------------------------------------------------------------------------

@pytest.mark.django_db
def test_downsample_buckets_match_the_raw_samples(world: World) -> None:
    node = Node.objects.create(cluster=world.cluster, hostname="node-x")
    t0 = 1_700_000_040.0  # a whole minute: buckets of 60 s hold seconds 0..59 of each minute
    _gpu_rows(world, node, t0, 600)
    tr = TimeRange(t0, t0 + 599, points=10)
    assert tr.bucket_s == 60
    out = gpu_samples.buckets(node.id, tr, ["util_gpu_pct", "power_w"])
    assert sorted(out) == ["0", "1"]
    s = out["1"]
    assert len(s["t"]) == 10 and s["t"][0] == t0 and s["t"][1] - s["t"][0] == 60
    # Second 60..119 of util = s % 100: 60..99 then 0..19.
    expect = [float(v % 100) for v in range(60, 120)]
    assert s["util_gpu_pct"]["min"][1] == min(expect) and s["util_gpu_pct"]["max"][1] == max(expect)
    assert s["util_gpu_pct"]["mean"][1] == pytest.approx(sum(expect) / 60)
    assert set(s["power_w"]["mean"]) == {301.0}


@pytest.mark.django_db
def test_downsample_computes_only_the_statistics_asked_for_with_the_same_values(world: World) -> None:
    node = Node.objects.create(cluster=world.cluster, hostname="node-x")
    t0 = 1_700_000_040.0
    _gpu_rows(world, node, t0, 600)
    tr = TimeRange(t0, t0 + 599, points=10)
    fields = ["util_gpu_pct", "power_limit_w", "ecc_sbe_aggregate"]
    full = gpu_samples.buckets(node.id, tr, fields)
    keep = {"util_gpu_pct": ("min", "mean", "max"), "power_limit_w": ("max",), "ecc_sbe_aggregate": ("max",)}
    part = gpu_samples.buckets(node.id, tr, fields, keep=keep)
    for gpu in ("0", "1"):
        assert part[gpu]["t"] == full[gpu]["t"]
        for f, stats in keep.items():
            assert set(part[gpu][f]) == set(stats)
            assert all(part[gpu][f][stat] == full[gpu][f][stat] for stat in stats)
    assert part["0"]["ecc_sbe_aggregate"]["max"] == [float(m) for m in range(10)]  # s // 60 at each minute's end
    assert all(isinstance(v, float) for v in part["1"]["power_limit_w"]["max"])  # plain floats on either database


@pytest.mark.django_db
def test_a_range_returns_no_more_buckets_than_points(world: World) -> None:
    """15 min of 1 Hz samples asked as 900 points: 1 s buckets, and never a 901st for the range's ragged edges."""
    node = Node.objects.create(cluster=world.cluster, hostname="node-x")
    now = time.time()
    _gpu_rows(world, node, now - 905, 906, gpus=1)
    for points in (900, 300, 77):
        req = RequestFactory().get("/", {"range": "15m", "points": points})
        tr = parse_range(req, now=now + 0.5)
        s = gpu_samples.buckets(node.id, tr, ["util_gpu_pct"])["0"]
        assert len(s["t"]) <= points, (points, len(s["t"]))
        assert len(s["t"]) >= 900 // tr.bucket_s - 1, "the range is still covered"


@pytest.mark.django_db
def test_whole_second_samples_keep_their_own_second(world: World) -> None:
    """Agents stamp whole seconds too: each 1 s bucket holds exactly its own sample (SQLite's julianday() once put
    half of them in the bucket before)."""
    node = Node.objects.create(cluster=world.cluster, hostname="node-x")
    t0 = 1_750_000_000.0
    _gpu_rows(world, node, t0, 120, gpus=1)
    s = gpu_samples.buckets(node.id, TimeRange(t0, t0 + 119.5, points=120), ["util_gpu_pct"])["0"]
    assert s["t"] == [t0 + i for i in range(120)]
    assert s["util_gpu_pct"]["min"] == s["util_gpu_pct"]["max"] == [float(i % 100) for i in range(120)]


# -- the APIs on simulated data ------------------------------------------------------------------------------------

@pytest.fixture
def sim(world: World) -> Feed:
    """4 nodes × 2 GPUs: node-001's GPU 1 has an ECC storm (then a DBE, Xid 48), rank 4 (node-002 GPU 0) throttles."""
    feed = Feed(world, [{"kind": "ecc_storm", "at_s": 3, "node": 1, "gpu": 1, "dbe_after_s": 4},
                        {"kind": "straggler", "at_s": 3, "rank": 4, "magnitude": 0.5}], nodes=4, gpus=2)
    feed.run(25)
    return feed


@pytest.mark.django_db
def test_node_api_gives_facts_findings_events_and_ranks(client: Any, world: World, sim: Feed) -> None:
    client.force_login(world.owner)
    body = _api(client, "node-001").json()
    assert body["node"]["host"] == "node-001" and body["node"]["url"] == node_url("prod-a", "node-001")
    assert body["node"]["state"] == "up"
    assert [(g["index"], g["url"]) for g in body["gpus"]] == [(i, gpu_url("prod-a", "node-001", i)) for i in (0, 1)]
    assert body["gpus"][1]["uuid"] and body["gpus"][1]["pci_bus_id"] and body["gpus"][1]["latest"]["ecc_dbe_volatile"] == 1
    finding = next(f for f in body["findings"]["open"] if f["kind"] == "failing_gpu")
    assert finding["subject_url"] == gpu_url("prod-a", "node-001", 1), "a GPU finding lands on the GPU view"
    assert finding["url"] == f"/findings/{finding['id']}/"
    xid = next(e for e in body["events"] if e["kind"] == "xid")
    assert xid["code"] == 48 and "double" in xid["xid"]["meaning"].lower() and xid["xid"]["action"]
    assert xid["gpu_url"] == gpu_url("prod-a", "node-001", 1)
    ranks = {r["rank"]: r for r in body["ranks"]}
    assert set(ranks) == {2, 3} and ranks[2]["active"] and ranks[2]["url"].endswith("/ranks/2/")
    # The GPU view's facts: that GPU's findings, not GPU 0's.
    gpu0 = _api(client, "node-001", gpu=0).json()
    assert not [f for f in gpu0["findings"]["open"] if f["gpu_index"] == 1]
    assert _api(client, "node-001", gpu=7).status_code == 404


@pytest.mark.django_db
def test_series_api_draws_every_concern_under_the_points_cap(client: Any, world: World, sim: Feed) -> None:
    client.force_login(world.owner)
    body = _api(client, "node-002", "/series", range="15m", points=50).json()
    assert body["range"]["points"] == 50
    g0 = body["gpus"]["0"]
    for field in ("util_gpu_pct", "mem_used_bytes", "power_w", "temp_c", "sm_clock_mhz"):
        assert set(g0[field]) == {"min", "mean", "max"} and len(g0[field]["mean"]) == len(g0["t"]) <= 50
    assert g0["power_limit_w"]["max"][-1] == 700.0 and g0["sm_clock_max_mhz"]["max"][-1] > g0["sm_clock_mhz"]["min"][-1]
    assert g0["pcie_width"]["min"][-1] == 16 and g0["pcie_gen_max"]["max"][-1] == 5
    assert "ecc_sbe_aggregate" in g0 and "nvlink_crc_errors_total" in g0
    bands = body["throttle"]["0"]
    assert set(bands) == {"hw_thermal_slowdown", "sw_thermal_slowdown"} and "1" not in body["throttle"]
    assert all(a < b for a, b in bands["hw_thermal_slowdown"])
    assert body["host"]["cpu_pct"]["mean"]
    assert body["host"]["mem_total_bytes"]["max"][-1] == pytest.approx(2048 * 1024**3, rel=1e-3)
    assert body["nfs"]["/mnt/nfs"]["rtt_ms"]["mean"][-1] == pytest.approx(0.9)
    port = body["ports"]["mlx5_0/1"]
    assert port["xmit_bytes_per_s"]["mean"][-1] == pytest.approx(2.1e10) and port["rate_gbps"]["min"][-1] == 400.0
    assert "port_xmit_wait" in port["counters"]
    probes = body["probes"]
    assert {p["peer"] for p in probes["peers"] if p["direction"] == "out"} == {"node-000", "node-001", "node-003"}
    assert {p["peer"] for p in probes["peers"] if p["direction"] == "in"} == {"node-000", "node-001", "node-003"}
    peer = next(p for p in probes["peers"] if p["peer"] == "node-003")
    assert peer["url"] == node_url("prod-a", "node-003")
    assert peer["link_url"] == "/clusters/prod-a/links/node-002/node-003/"
    assert set(probes["all"]) == {"out", "in"} and probes["series"]
    # ECC climbing on node-001 GPU 1: the total's max grows across the buckets.
    sbe = _api(client, "node-001", "/series", range="15m", gpu=1).json()["gpus"]["1"]["ecc_sbe_aggregate"]["max"]
    assert sbe[-1] > sbe[0] and sbe[-1] > 100
    one = _api(client, "node-001", "/series", range="15m", gpu=1).json()
    assert list(one["gpus"]) == ["1"] and "host" not in one


def _plans(queries: list[dict[str, str]], table: str) -> list[str]:
    """SQLite's plan (its lines joined) for each captured query that reads ``table``."""
    from django.db import connection

    plans = []
    with connection.cursor() as cursor:
        for q in queries:
            if f'"{table}"' in q["sql"]:
                cursor.execute("EXPLAIN QUERY PLAN " + q["sql"])
                plans.append(" | ".join(str(r[-1]) for r in cursor.fetchall()))
    return plans


def test_probes_of_a_node_are_read_by_index_ranges_never_by_scanning(client: Any, world: World, sim: Feed) -> None:
    """Every query of the probe frames the node page and a node-down finding's evidence make is an index search,
    never a scan of the table: the probes a node sent along (node, ts); the probes sent to it by the ids the inbound
    index lists (the primary key), and those written since that index's last pass along (cluster, ts), bounded by
    the range (dashboard.storage.probe_samples)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from dashboard.storage import probe_index
    from dashboard.web import evidence
    from dashboard.web.pages import node_series

    if connection.vendor != "sqlite":
        pytest.skip("the plan checked is SQLite's (PostgreSQL plans these few rows with a sequential scan)")
    node = Node.objects.get(hostname="node-002")
    now = time.time()
    finding = Finding(cluster=world.cluster, node=node, kind="node_down", subject=node.hostname)
    assert probe_index.update() > 0  # most of the range indexed, as the 15 s task keeps it
    with CaptureQueriesContext(connection) as seen:
        series = node_series.probe_series(node, TimeRange(now - 900, now, 100))
        got = evidence._pair_probes(finding, TimeRange(now - 900, now, 100), ["rtt_ms"])
    assert {p["direction"] for p in series["peers"]} == {"in", "out"} and got and got["t"]
    plans = _plans(seen.captured_queries, "telemetry_probeframe")
    assert len(plans) >= 3, plans
    ways = ("(node_id=? AND ts>", "INTEGER PRIMARY KEY (rowid=?)")
    for plan in plans:
        assert "SCAN telemetry_probeframe" not in plan, plan
        assert any(w in plan for w in (*ways, "(cluster_id=? AND ts>")), plan
    assert all(any(w in plan for plan in plans) for w in ways), plans


def test_a_nodes_and_a_gpus_samples_are_read_by_the_node_index(client: Any, world: World, sim: Feed) -> None:
    """Every query of the GPU frames the node page, the GPU view and a GPU or node-down finding's evidence make is
    answered from the (node, ts) index (a GPU's samples are in its node's frames), never by scanning the table or the
    cluster's range."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from dashboard.diagnosis.detectors import Thresholds
    from dashboard.web import evidence
    from dashboard.web.pages import node as node_page
    from dashboard.web.pages import node_series

    if connection.vendor != "sqlite":
        pytest.skip("the plan checked is SQLite's (PostgreSQL plans these few rows with a sequential scan)")
    node = Node.objects.get(hostname="node-001")
    now = time.time()
    gpu_finding = Finding(cluster=world.cluster, node=node, gpu_index=1, kind="gpu_throttling", subject="node-001/1")
    down = Finding(cluster=world.cluster, node=node, kind="node_down", subject=node.hostname)
    with CaptureQueriesContext(connection) as seen:
        whole = node_series.node_series(node, TimeRange(now - 900, now, 100), None)
        one = node_series.node_series(node, TimeRange(now - 900, now, 100), 1)
        latest = node_page._latest_gpus(node)
        evidence._throttling(gpu_finding, Thresholds(), now - 60, now)
        evidence._node_down(down, Thresholds(), now - 60, now)
    assert sorted(whole["gpus"]) == ["0", "1"] and list(one["gpus"]) == ["1"] and sorted(latest) == [0, 1]
    plans = _plans(seen.captured_queries, "telemetry_gpuframe")
    # The series and bands twice, the node's newest frame and the GPUs' latest samples, the two findings' evidence.
    assert len(plans) >= 8, plans
    for plan in plans:
        assert "SCAN telemetry_gpuframe" not in plan and "(cluster_id=? AND ts" not in plan, plan
        assert "telemetry_g_node_id_b54e8f_idx (node_id=?" in plan, plan


@pytest.mark.django_db
def test_a_day_of_samples_comes_back_downsampled(client: Any, world: World) -> None:
    """24 h asked with ?points=200: every series holds at most 200 buckets, whatever the raw count."""
    node = Node.objects.create(cluster=world.cluster, hostname="node-x")
    now = time.time()
    framed.gpus(world.cluster, node, [{"ts": now - 86400 + 7 * s, "index": 0, "util_gpu_pct": float(s % 100)}
                                      for s in range(86400 // 7)])
    client.force_login(world.owner)
    body = _api(client, "node-x", "/series", range="24h", points=200).json()
    s = body["gpus"]["0"]
    assert 150 <= len(s["t"]) <= 200 and body["range"]["bucket_s"] >= 86400 / 200
    assert max(s["util_gpu_pct"]["max"]) == 99 and min(s["util_gpu_pct"]["min"]) == 0
    assert _api(client, "node-x", "/series", range="2d").status_code == 400
    assert _api(client, "node-x", "/series", points=3).status_code == 400


@pytest.mark.django_db
def test_http_ingested_batches_show_on_the_node_api(client: Any, world: World) -> None:
    for seq in range(3):
        batch = make_batch(seq=seq, host="node-007")
        batch["gpus"][0]["power_limit_w"] = 450.0
        batch["events"] = [{"ts": time.time(), "kind": "xid", "severity": "critical", "code": 79, "gpu_index": 0,
                            "message": "NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus."}] if seq == 2 else []
        assert post(client, batch, world.token).status_code == 200
    client.force_login(world.teammate)
    facts = _api(client, "node-007").json()
    assert facts["events"][0]["xid"]["name"] == "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS"
    series = _api(client, "node-007", "/series", range="5m").json()
    assert series["gpus"]["0"]["power_limit_w"]["max"][-1] == 450.0
    assert series["gpus"]["1"]["util_gpu_pct"]["mean"][-1] == 51.0
    assert "power_limit_w" not in series["gpus"]["1"], "a field the GPU never reported is absent, not zero"


# -- who may see it ----------------------------------------------------------------------------------------------

@pytest.mark.django_db
def test_pages_and_apis_are_for_members_only(client: Any, world: World) -> None:
    post(client, make_batch(host="node-000"), world.token)
    urls = ["/clusters/prod-a/nodes/node-000/", "/clusters/prod-a/nodes/node-000/gpus/1/",
            NODE_API.format(host="node-000"), NODE_API.format(host="node-000") + "/series"]
    for url in urls[2:]:
        r = client.get(url)
        assert r.status_code == 401 and r.json()["error"] == "unauthenticated", url
    for url in urls[:2]:
        assert client.get(url).status_code == 302, url
    client.force_login(world.outsider)
    for url in [*urls, "/clusters/prod-b/nodes/node-000/", "/api/v1/clusters/prod-b/nodes/node-000"]:
        assert client.get(url).status_code == 404, url
    client.force_login(world.owner)
    for url in urls:
        assert client.get(url).status_code == 200, url
    page = client.get(urls[0]).content.decode()
    assert 'id="page-data"' in page and "/static/web/node.js" in page and off_site_assets(page) == []
    assert client.get("/clusters/prod-a/nodes/node-000/gpus/9/").status_code == 404
    assert client.get("/clusters/prod-a/nodes/nope/").status_code == 404


@pytest.mark.django_db
def test_a_gpu_finding_links_to_the_gpu_view(client: Any, world: World, sim: Feed) -> None:
    f = Finding.objects.get(kind="failing_gpu")
    client.force_login(world.owner)
    findings = client.get("/api/v1/findings", {"cluster": "prod-a", "kind": "failing_gpu"}).json()["findings"]
    url = next(row["subject_url"] for row in findings if row["id"] == f.id)
    assert url == "/clusters/prod-a/nodes/node-001/gpus/1/"
    assert client.get(url).status_code == 200


# -- in the browser --------------------------------------------------------------------------------------------------

def _points(page: Any, chart_id: str) -> int:
    return int(page.evaluate(f"Number(document.getElementById('{chart_id}').dataset.points || 0)"))


@pytest.mark.browser
def test_the_node_page_draws_live_gpu_charts(asgi_server: AsgiServer, world: World, page: Any, tmp_path: Path) -> None:
    from tests.server.test_live import ingest

    feed = Feed(world, [{"kind": "straggler", "at_s": 50, "rank": 2, "magnitude": 0.5},
                        {"kind": "ecc_storm", "at_s": 45, "node": 1, "gpu": 1, "dbe_after_s": 8}], nodes=3, gpus=4)
    # The simulated minute ends now, so the live points continue its lines (Feed starts 5 min back by default).
    feed.t0 = time.time() - 70
    feed.sim = SimCluster(feed.sim.s, feed.t0)
    feed.run(69, passes=False)  # the server's own diagnosis passes (real clock) name the faults from here on
    # The simulator keeps going in real time, its batches over HTTP: the nodes stay alive and the charts grow.
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(1.0):
            for batch in feed.sim.tick(time.time()):
                ingest(asgi_server, world.token, batch)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        _wait_until_no_node_is_down()
        _browse(asgi_server, page, tmp_path)
    finally:
        stop.set()
        ticker.join(10)


def _wait_until_no_node_is_down(timeout_s: float = 60) -> None:
    """Storing the minute of history takes longer than a minute's worth of data ages on the wall clock, so the server's
    own passes may call the nodes silent until the live batches catch up; the pages are looked at once they have."""
    from dashboard.diagnosis.models import Finding

    deadline = time.monotonic() + timeout_s
    while Finding.objects.filter(kind="node_down", state="open").exists():
        assert time.monotonic() < deadline, "the live nodes are still reported down"
        time.sleep(0.5)


def _browse(asgi_server: AsgiServer, page: Any, tmp_path: Path) -> None:
    from tests.server.browser import keep_screenshot, no_js_errors, sign_in, wait_live

    sign_in(page, asgi_server.url, "alice", World.password, "/clusters/prod-a/nodes/node-000/?range=15m")
    wait_live(page)
    page.wait_for_function("Number(document.getElementById('chart-util').dataset.points || 0) > 0")
    before = _points(page, "chart-util")
    page.wait_for_function(f"Number(document.getElementById('chart-util').dataset.points) > {before}", timeout=10_000)
    # The charts below the first screen are drawn in the tasks after it: wait for them, as for the live points.
    page.wait_for_selector("#chart-throttle .scatterlayer .trace", state="attached", timeout=10_000)  # GPU 2 throttles
    page.wait_for_selector("#findings-open li:has-text('straggler') a", timeout=20_000)
    assert page.locator("#chart-power text", has_text="limit W").count() == 1, "the power limit line is labelled"
    no_js_errors(page)
    keep_screenshot(page, "node", tmp_path)

    # A live frame redraws only the charts in view; one below the screen draws its newest figure when scrolled to.
    page.set_viewport_size({"width": 1400, "height": 600})
    page.evaluate("window.scrollTo(0, 0)")
    page.wait_for_timeout(300)  # the observer reports the new layout
    temp, util = _points(page, "chart-temp"), _points(page, "chart-util")
    page.wait_for_function(f"Number(document.getElementById('chart-util').dataset.points) > {util + 4}", timeout=15_000)
    assert _points(page, "chart-temp") == temp, "a chart out of view is not redrawn on every frame"
    page.locator("#chart-temp").scroll_into_view_if_needed()
    page.wait_for_function(f"Number(document.getElementById('chart-temp').dataset.points) > {temp}", timeout=5_000)
    no_js_errors(page)

    page.goto(f"{asgi_server.url}/clusters/prod-a/nodes/node-001/gpus/1/?range=15m")
    wait_live(page)
    page.wait_for_function("Number(document.getElementById('chart-ecc-sbe').dataset.points || 0) > 0")
    page.wait_for_selector("#findings-open li:has-text('node-001/gpu1')", timeout=20_000)
    assert page.locator("#gpu-health", has_text="Xid 48").count() == 1
    assert page.locator("#chart-rtt").count() == 0, "the GPU view leaves the host's links to the node page"
    no_js_errors(page)
    keep_screenshot(page, "gpu", tmp_path)
