"""Acknowledge and silence through the pages' forms and the JSON API: who may (member, owner), who gets 403 (viewer)
and 404 (outsider) without changing anything, bad input answered 400 with the reason, CSRF on session POSTs, and the
marks on every page and API that lists findings."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from dashboard.diagnosis.models import Finding, Silence
from dashboard.telemetry.models import AuditEntry, Node
from tests.alerts.alerts_support import make_finding
from tests.server.conftest import World


@pytest.fixture
def people(world: World, django_user_model: Any) -> dict[str, Any]:
    viewer = django_user_model.objects.create_user("victor")
    world.cluster.members.add(viewer, through_defaults={"role": "viewer"})
    return {"outsider": world.outsider, "viewer": viewer, "member": world.teammate, "owner": world.owner}


@pytest.fixture
def finding(world: World) -> Finding:
    nodes = [Node.objects.create(cluster=world.cluster, hostname=f"node-{i:03d}") for i in range(3)]
    return make_finding(world.cluster, node=nodes[1], gpu_index=2)


def as_user(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _state() -> tuple[Any, ...]:
    return (list(Finding.objects.values_list("acked_by_name", flat=True)),
            list(Silence.objects.values_list("target", "ends_at")), AuditEntry.objects.count())


SILENCE = {"scope": "node", "target": "node-001", "minutes": 60, "reason": "maintenance: reseating GPUs"}


@pytest.mark.parametrize("who, code", [("outsider", 404), ("viewer", 403), ("member", 200), ("owner", 200)])
def test_it_lets_members_acknowledge_and_silence_and_no_one_below(who: str, code: int, people: dict[str, Any],
                                                                   finding: Finding) -> None:
    client = as_user(people[who])
    before = _state()
    ack = client.post(f"/api/v1/findings/{finding.id}/ack")
    silence = client.post("/api/v1/clusters/prod-a/silences", json.dumps(SILENCE), content_type="application/json")
    form = client.post(f"/findings/{finding.id}/ack", {"ack": "0", "next": "/"})
    assert (ack.status_code, silence.status_code) == (code, 201 if code == 200 else code)
    if code != 200:
        assert ack.json()["error"] == {403: "forbidden", 404: "not_found"}[code]
        assert form.status_code == code and _state() == before
        return
    assert ack.json()["finding"]["acked_by"] == people[who].username and ack.json()["changed"] is True
    assert silence.json()["silence"]["target"] == "node-001"
    assert form.status_code == 302 and form["Location"] == "/"  # the form took the acknowledgement back
    assert Finding.objects.get().acked_at is None
    ended = client.post(f"/api/v1/silences/{silence.json()['silence']['id']}/end")
    assert ended.status_code == 200 and ended.json()["changed"] is True
    assert [a for a, in AuditEntry.objects.order_by("id").values_list("action")] == [
        "finding.ack", "silence.create", "finding.unack", "silence.end"]


def test_it_answers_bad_input_with_the_reason(people: dict[str, Any], finding: Finding) -> None:
    client = as_user(people["member"])
    api = "/api/v1/clusters/prod-a/silences"
    cases = [({**SILENCE, "target": "node-404"}, "no node named 'node-404'"),
             ({**SILENCE, "scope": "rack"}, "scope must be one of node, gpu, link, run, kind"),
             ({**SILENCE, "minutes": 0}, "minutes must be a number from 1 to 43200"),
             ({**SILENCE, "minutes": "60"}, "minutes must be a number"),
             ({**SILENCE, "reason": "  "}, "a reason is required"),
             ({**SILENCE, "scope": "gpu", "target": "node-001/gpuX"}, "a GPU is named <host>/gpu<index>"),
             ({**SILENCE, "scope": "link", "target": "node-001~node-001"}, "a link is named <host>~<host>"),
             ({**SILENCE, "scope": "kind", "target": "bogus"}, "kind must be one of")]
    for body, reason in cases:
        r = client.post(api, json.dumps(body), content_type="application/json")
        assert r.status_code == 400 and r.json()["error"] == "bad_request" and reason in r.json()["detail"], body
    r = client.post(api, b"[1, 2", content_type="application/json")
    assert r.status_code == 400 and r.json()["detail"].startswith("the body must be a JSON object")
    assert client.get(f"/api/v1/findings/{finding.id}/ack").status_code == 405
    assert Client().post(f"/api/v1/findings/{finding.id}/ack").status_code == 401
    form = client.post("/clusters/prod-a/silences/", {"what": "node:node-404", "minutes": "60", "reason": "x"})
    assert form.status_code == 400 and "no node named" in form.content.decode()
    Finding.objects.update(state="resolved", resolved_at=timezone.now())
    r = client.post(f"/api/v1/findings/{finding.id}/ack")
    assert r.status_code == 400 and "only an open finding" in r.json()["detail"]
    assert not Silence.objects.exists() and not AuditEntry.objects.exists()


def test_a_session_post_needs_the_csrf_token(people: dict[str, Any], finding: Finding) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(people["member"])
    assert client.post(f"/api/v1/findings/{finding.id}/ack").status_code == 403
    page = client.get(f"/findings/{finding.id}/")
    token = client.cookies["csrftoken"].value
    assert b'id="ack-button"' in page.content
    r = client.post(f"/api/v1/findings/{finding.id}/ack", HTTP_X_CSRFTOKEN=token)
    assert r.status_code == 200 and Finding.objects.get().acked_by_name == "bob"


def test_every_list_of_findings_carries_the_marks(people: dict[str, Any], finding: Finding) -> None:
    member, viewer = as_user(people["member"]), as_user(people["viewer"])
    member.post(f"/api/v1/findings/{finding.id}/ack")
    silence = member.post("/api/v1/clusters/prod-a/silences", json.dumps({**SILENCE, "scope": "gpu",
                                                                          "target": "node-001/gpu2"}),
                          content_type="application/json").json()["silence"]
    mark = {"id": silence["id"], "until": silence["ends_at"], "reason": SILENCE["reason"], "by": "bob"}
    rows = [viewer.get("/api/v1/findings?cluster=prod-a").json()["findings"][0],
            viewer.get(f"/api/v1/findings/{finding.id}").json()["finding"],
            viewer.get("/api/v1/clusters/prod-a/nodes/node-001").json()["findings"]["open"][0]]
    for row in rows:
        assert (row["acked_by"], row["silenced"]) == ("bob", mark)
    node = viewer.get("/api/v1/clusters/prod-a/nodes/node-001").json()
    assert [s["target"] for s in node["silences"]] == ["node-001/gpu2"]
    assert viewer.get("/api/v1/clusters/prod-a/nodes/node-000").json()["silences"] == []
    assert [s["id"] for s in viewer.get("/api/v1/clusters/prod-a/silences").json()["silences"]] == [silence["id"]]
    # A viewer sees the marks but not the forms; a member sees both.
    page = viewer.get(f"/findings/{finding.id}/").content.decode()
    assert 'id="ack-form"' not in page and 'id="silence-form"' not in page
    assert 'id="silence-form"' in member.get("/clusters/prod-a/nodes/node-001/").content.decode()
    listing = member.get("/clusters/prod-a/findings/").content.decode()
    assert "node-001/gpu2" in listing and "maintenance: reseating GPUs" in listing


GPU_ROW = {"kind": "failing_gpu", "subject_type": "gpu", "subject": "node-001/gpu2", "node": "node-001",
           "gpu_index": 2, "run": 7}
LINK_ROW = {"kind": "slow_link", "subject_type": "link", "subject": "node-000~node-001", "node": "node-000",
            "gpu_index": None, "run": None}


@pytest.mark.parametrize("scope, target, row, covered", [
    ("node", "node-001", GPU_ROW, True), ("node", "node-001", LINK_ROW, True),  # maintenance: GPUs and links too
    ("node", "node-002", GPU_ROW, False), ("node", "node-00", LINK_ROW, False),
    ("gpu", "node-001/gpu2", GPU_ROW, True), ("gpu", "node-001/gpu3", GPU_ROW, False),
    ("gpu", "node-001/gpu2", LINK_ROW, False),
    ("link", "node-001~node-000", LINK_ROW, True), ("link", "node-000~node-002", LINK_ROW, False),
    ("run", "7", GPU_ROW, True), ("run", "7", LINK_ROW, False),
    ("kind", "slow_link", LINK_ROW, True), ("kind", "slow_link", GPU_ROW, False),
])
def test_what_a_silence_covers(scope: str, target: str, row: dict[str, Any], covered: bool) -> None:
    from dashboard.diagnosis.silences import covers

    assert covers(scope, target, row) is covered
