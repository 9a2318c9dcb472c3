"""The diagnosis API: GET /api/v1/findings and GET /api/v1/runs/{id}/steps/{step}/explain, for members, outsiders
and anonymous callers, on findings and steps produced by a real pass over simulated ingest."""

from __future__ import annotations

from typing import Any

import pytest

from dashboard.diagnosis.models import Finding
from dashboard.storage import frames as fr
from dashboard.telemetry.models import Run
from tests.server.conftest import World
from tests.server.test_diagnosis_pass import Feed

pytestmark = pytest.mark.django_db


@pytest.fixture
def starved(world: World) -> Feed:
    feed = Feed(world, [{"kind": "data_starvation", "at_s": 6, "rank": 5, "magnitude": 0.6},
                        {"kind": "xid", "at_s": 8, "node": 3, "gpu": 2, "code": 94}], nodes=4)
    feed.run(16)
    return feed


def _steps_newest_first(run: Run) -> list[int]:
    """The step of every rank sample stored for ``run`` (read straight from its frames), highest first."""
    return sorted(fr.read(fr.STEPS, run_id=run.id)["step"].astype(int).tolist(), reverse=True)


def test_it_lists_findings_with_filters(client: Any, world: World, starved: Feed) -> None:
    client.force_login(world.teammate)
    body = client.get("/api/v1/findings", {"cluster": "prod-a"}).json()
    assert sorted((f["kind"], f["subject"]) for f in body["findings"]) == [
        ("data_starvation", "llm/rank5"), ("failing_gpu", "node-003/gpu2")]
    assert all(f["cluster"] == "prod-a" and f["state"] == "open" and f["evidence"] for f in body["findings"])
    run = Run.objects.get(name="llm")
    by_run = client.get("/api/v1/findings", {"run": run.id, "kind": "failing_gpu"}).json()["findings"]
    assert [f["subject"] for f in by_run] == ["node-003/gpu2"], "a run sees its nodes' hardware findings"
    assert "Xid 94" in by_run[0]["title"]
    assert client.get("/api/v1/findings", {"state": "resolved"}).json() == {"findings": []}
    assert client.get("/api/v1/findings", {"cluster": str(world.cluster.id), "limit": 1}).json()["findings"][0]


def test_findings_refuse_outsiders_anonymous_and_bad_filters(client: Any, world: World, starved: Feed) -> None:
    assert client.get("/api/v1/findings").status_code == 401
    client.force_login(world.outsider)
    assert client.get("/api/v1/findings").json() == {"findings": []}
    assert client.get("/api/v1/findings", {"cluster": "prod-a"}).status_code == 404
    run = Run.objects.get(name="llm")
    assert client.get("/api/v1/findings", {"run": run.id}).status_code == 404
    client.force_login(world.owner)
    bad = client.get("/api/v1/findings", {"kind": "gremlins"})
    assert bad.status_code == 400 and "kind must be one of" in bad.json()["detail"]
    assert client.get("/api/v1/findings", {"state": "maybe"}).status_code == 400
    assert client.get("/api/v1/findings", {"limit": "many"}).status_code == 400


def test_explain_names_the_starved_rank_for_a_slow_step(client: Any, world: World, starved: Feed) -> None:
    Finding.objects.all().delete()  # the per-step analysis on its own, without findings to lean on
    run = Run.objects.get(name="llm")
    step = _steps_newest_first(run)[2]
    client.force_login(world.owner)
    body = client.get(f"/api/v1/runs/{run.id}/steps/{step}/explain").json()
    assert body["cause"]["kind"] == "data_starvation" and body["cause"]["subject"] == "llm/rank5"
    assert 0.5 <= body["cause"]["confidence"] <= 1
    assert "Rank 5" in body["cause"]["summary"]
    assert len(body["ranks"]) == 16
    r5 = next(r for r in body["ranks"] if r["rank"] == 5)
    assert r5["data_wait_s"] > 0.3 and r5["host"] == "node-001" and r5["gpu"] == 1
    assert r5["util_gpu_pct"] is not None and r5["sm_clock_mhz"] > 1000
    assert body["layers"]["probes"]["pairs"] > 0 and body["layers"]["gpus"]["gpus"] == 16
    assert [x["code"] for x in body["layers"]["xid"]] in ([], [94])


def test_explain_prefers_an_open_finding_and_shows_every_layer(client: Any, world: World, starved: Feed) -> None:
    run = Run.objects.get(name="llm")
    step = _steps_newest_first(run)[0]
    client.force_login(world.teammate)
    body = client.get(f"/api/v1/runs/{run.id}/steps/{step}/explain").json()
    assert body["cause"]["subject"] in {"llm/rank5", "node-003/gpu2"}
    assert {f["kind"] for f in body["findings"]} == {"data_starvation", "failing_gpu"}


def test_explain_refuses_outsiders_and_missing_steps(client: Any, world: World, starved: Feed) -> None:
    run = Run.objects.get(name="llm")
    assert client.get(f"/api/v1/runs/{run.id}/steps/3/explain").status_code == 401
    client.force_login(world.outsider)
    assert client.get(f"/api/v1/runs/{run.id}/steps/3/explain").status_code == 404
    client.force_login(world.owner)
    assert client.get(f"/api/v1/runs/{run.id}/steps/999999/explain").status_code == 404
    assert client.get(f"/api/v1/runs/{run.id + 99}/steps/3/explain").status_code == 404


def test_the_openapi_document_has_both_paths(client: Any) -> None:
    paths = client.get("/api/openapi.json").json()["paths"]
    assert "/api/v1/findings" in paths and "/api/v1/runs/{run_id}/steps/{step}/explain" in paths
    cause = paths["/api/v1/runs/{run_id}/steps/{step}/explain"]["get"]["responses"]["200"]
    assert cause["content"]["application/json"]["schema"]["properties"]["cause"]["required"] == [
        "summary", "kind", "subject", "confidence"]
