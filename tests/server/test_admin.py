"""Administration through the pages: personal API tokens on the JSON API, the owner's settings page (members, ingest
tokens, interconnect, audit log), and the interconnect detected from the agents' ports."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from django.test import Client

from dashboard.accounts import tokens as personal
from dashboard.accounts.models import PersonalToken
from dashboard.telemetry import audit, interconnect
from dashboard.telemetry.models import AuditEntry, IngestToken, Membership
from tests.server.conftest import World, make_batch, post


@pytest.fixture(autouse=True)
def _fresh(settings: Any) -> None:
    # Runs before `world` creates its users: PBKDF2's deliberate slowness is a second per test on a busy machine.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    personal.clear_cache()
    interconnect.clear_cache()


def _bearer(token: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {token}"}


def test_a_personal_token_reads_the_api_as_its_user_and_nothing_else(world: World, client: Client) -> None:
    assert post(client, make_batch(), world.token).status_code == 200
    client.force_login(world.teammate)
    page = client.post("/account/tokens/", {"name": "grafana"}).content.decode()
    secret = re.search(r"cdxp_[0-9a-f]{12}_[\w-]+", page)[0]  # type: ignore[index]
    row = PersonalToken.objects.get()
    assert (row.user, row.name, row.last_used_at) == (world.teammate, "grafana", None)
    assert secret not in row.digest and secret not in client.get("/account/tokens/").content.decode()
    client.logout()

    anon = Client()
    overview = anon.get("/api/v1/clusters/prod-a/overview", **_bearer(secret))
    assert overview.status_code == 200 and overview.json()["cluster"]["name"] == "prod-a"
    assert anon.get("/api/v1/findings?cluster=prod-a", **_bearer(secret)).status_code == 200
    assert anon.get("/api/v1/clusters/prod-b/overview", **_bearer(secret)).status_code == 404, "bob's roles only"
    assert "sessionid" not in anon.cookies
    refused = anon.post("/api/v1/clusters/prod-a/overview", **_bearer(secret))
    assert (refused.status_code, refused.json()["error"]) == (403, "read_only_token")
    assert anon.get("/clusters/prod-a/", **_bearer(secret)).status_code == 302, "pages need a session"
    row.refresh_from_db()
    assert row.last_used_at is not None

    # Neither kind stands in for the other.
    assert post(anon, make_batch(seq=1), secret).status_code == 401
    ingest_as_api = anon.get("/api/v1/clusters/prod-a/overview", **_bearer(world.token))
    assert ingest_as_api.status_code == 401 and "personal API token" in ingest_as_api.json()["detail"]
    assert anon.get("/api/v1/clusters/prod-a/overview", **_bearer("cdxp_0_nope")).status_code == 401

    client.force_login(world.outsider)  # another user's token is not theirs to revoke
    assert client.post(f"/account/tokens/{row.id}/revoke/").status_code == 404
    client.force_login(world.teammate)
    client.post(f"/account/tokens/{row.id}/revoke/")
    assert anon.get("/api/v1/clusters/prod-a/overview", **_bearer(secret)).status_code == 401
    assert list(AuditEntry.objects.order_by("id").values_list("action", "actor_name")) == [
        ("api_token.create", "bob"), ("api_token.revoke", "bob")]


def test_the_openapi_document_offers_the_token_wherever_a_session_reads(client: Client) -> None:
    doc = client.get("/api/openapi.json").json()
    assert doc["components"]["securitySchemes"]["personalToken"]["scheme"] == "bearer"
    # Every GET a session reads; the agents' own GET (their probe plan) takes the cluster's ingest token instead.
    gets = [item["get"] for item in doc["paths"].values()
            if "get" in item and {"clusterToken": []} not in item["get"]["security"]]
    assert len(gets) >= 10 and all({"personalToken": []} in op["security"] for op in gets)
    assert doc["paths"]["/api/v1/probes/peers"]["get"]["security"] == [{"clusterToken": []}]
    assert doc["paths"]["/api/v1/ingest"]["post"]["security"] == [{"clusterToken": []}]


def test_an_owner_manages_members_tokens_and_the_interconnect(world: World, client: Client,
                                                               django_user_model: Any) -> None:
    django_user_model.objects.create_user("carol")
    client.force_login(world.owner)
    act = "/clusters/prod-a/settings/{}/".format
    assert client.post(act("member-set"), {"username": "carol", "role": "viewer"}).status_code == 302
    assert client.post(act("member-set"), {"username": "carol", "role": "owner"}).status_code == 302
    assert client.post(act("member-set"), {"username": "nobody", "role": "viewer"}).status_code == 400
    assert client.post(act("member-set"), {"username": "carol", "role": "admin"}).status_code == 400
    assert client.post(act("member-remove"), {"username": "carol"}).status_code == 302
    # alice is the last owner again: neither removed nor demoted.
    for action, form in (("member-remove", {"username": "alice"}), ("member-set", {"username": "alice", "role": "member"})):
        answer = client.post(act(action), form)
        assert answer.status_code == 400 and "the last owner of prod-a" in answer.content.decode()
    assert Membership.objects.get(cluster=world.cluster, user=world.owner).role == "owner"

    bad = client.post(act("token-create"), {"name": "x", "scope": "agent", "hosts": ""})
    assert bad.status_code == 400 and "an agent token needs host names" in bad.content.decode()
    made = client.post(act("token-create"), {"name": "rack1", "scope": "agent", "hosts": "node-0*, gpu-??"})
    secret = re.search(r"cdx_[0-9a-f]{12}_[\w-]+", made.content.decode())[0]  # type: ignore[index]
    row = IngestToken.objects.get(name="rack1")
    assert (row.scope, row.hosts) == ("agent", "node-0* gpu-??")
    assert post(Client(), make_batch(host="node-042"), secret).status_code == 200
    assert secret not in client.get("/clusters/prod-a/settings/").content.decode()
    assert client.post(act("token-revoke"), {"prefix": row.prefix}).status_code == 302
    assert client.post(act("token-revoke"), {"prefix": world.other_token[4:16]}).status_code == 400, "prod-b's"
    assert client.post(act("interconnect"), {"interconnect": "roce"}).status_code == 302
    assert client.post(act("interconnect"), {"interconnect": "fddi"}).status_code == 400
    world.cluster.refresh_from_db()
    assert world.cluster.interconnect == "roce"

    assert list(world.cluster.audit.order_by("-at", "-id").values_list("action", "target")) == [
        ("cluster.interconnect", "prod-a"), ("token.revoke", row.prefix), ("token.create", row.prefix),
        ("member.remove", "carol"), ("member.role", "carol"), ("member.add", "carol")]


def test_the_audit_log_pages_latest_first(world: World, client: Client) -> None:
    for i in range(55):
        audit.record("cli:ops", "member.add", cluster=world.cluster, target=f"user{i:02d}")
    client.force_login(world.teammate)
    first = client.get("/clusters/prod-a/settings/").content.decode()
    second = client.get("/clusters/prod-a/settings/?page=2").content.decode()
    assert "user54" in first and "user05" in first and "user04" not in first and "page 1 of 2" in first
    assert "user04" in second and "user00" in second and "user54" not in second


def _ports(layer: str | None) -> list[dict[str, Any]]:
    return [{"ts": time.time(), "device": f"mlx5_{i}", "port": 1, "state": "ACTIVE", "link_layer": layer}
            for i in range(2)]


def test_the_interconnect_is_detected_and_the_setting_overrides_it(world: World, client: Client) -> None:
    from dashboard.diagnosis.loader import load_window

    cluster = world.cluster
    assert (interconnect.detect(cluster).kind, cluster.nccl_interconnect()) == (None, "ib"), "nothing reported: as before"
    hook_only = make_batch(host="cpu-0", gpus=[])
    assert post(client, hook_only, world.token).status_code == 200
    assert interconnect.detect(cluster).kind is None, "training hooks say nothing about the network"
    assert post(client, make_batch(seq=1, host="cpu-0"), world.token).status_code == 200
    assert interconnect.detect(cluster).kind == "eth", "agents without RDMA ports: Ethernet only"
    assert post(client, make_batch(seq=0, host="node-1", ports=_ports("Ethernet")), world.token).status_code == 200
    assert interconnect.detect(cluster).kind == "roce"
    assert post(client, make_batch(seq=0, host="node-2", ports=_ports("InfiniBand") * 2), world.token).status_code == 200
    found = interconnect.detect(cluster)
    assert (found.kind, found.ports) == ("ib", {"Ethernet": 2, "InfiniBand": 4})

    interconnect.clear_cache()
    assert load_window(cluster, time.time()).interconnect == "ib"
    cluster.interconnect = "eth"
    cluster.save()
    assert cluster.interconnect_label() == "Ethernet (set by an owner)"
    assert load_window(cluster, time.time()).interconnect == "eth", "the NCCL checks read the override"
    cluster.interconnect = "auto"
    cluster.save()
    client.force_login(world.teammate)
    assert "InfiniBand (detected)" in client.get("/clusters/prod-a/").content.decode()
    page = client.get("/clusters/prod-a/settings/").content.decode()
    assert "2 Ethernet, 4 InfiniBand port samples" in page


@pytest.mark.browser
def test_an_owner_adds_a_member_and_creates_a_token_in_the_browser(asgi_server: Any, world: World, page: Any,
                                                                    tmp_path: Any, django_user_model: Any) -> None:
    from tests.server.browser import keep_screenshot, no_js_errors, sign_in

    django_user_model.objects.create_user("carol")
    post(Client(), make_batch(host="node-001", ports=_ports("InfiniBand")), world.token)
    audit.record("cli:ops", "cluster.create", cluster=world.cluster, target="prod-a")
    sign_in(page, asgi_server.url, "alice", world.password, "/clusters/prod-a/")
    page.click("#settings-link")
    page.wait_for_url(f"{asgi_server.url}/clusters/prod-a/settings/")
    page.fill("#add-member input[name=username]", "carol")
    page.select_option("#add-member select[name=role]", "viewer")
    page.click("#add-member button[type=submit]")
    page.wait_for_selector("#members tr[data-user=carol]")
    assert "carol: added as viewer" in page.inner_text("main")
    page.fill("#create-token input[name=name]", "rack-2")
    page.fill("#create-token input[name=hosts]", "node-2*")
    page.click("#create-token button[type=submit]")
    secret = page.inner_text("#token-secret").strip()
    row = IngestToken.objects.get(name="rack-2")
    assert secret.startswith(f"cdx_{row.prefix}_") and (row.scope, row.hosts) == ("agent", "node-2*")
    assert post(Client(), make_batch(host="node-207"), secret).status_code == 200
    assert Membership.objects.get(cluster=world.cluster, user__username="carol").role == "viewer"
    assert "InfiniBand (detected)" in page.inner_text("#interconnect")
    no_js_errors(page)
    keep_screenshot(page, "settings", tmp_path)

    page.click("text=API tokens")
    page.fill("input[name=name]", "grafana")
    page.click("text=Create token")
    personal_secret = page.inner_text("#token-secret").strip()
    answer = Client().get("/api/v1/clusters/prod-a/overview", HTTP_AUTHORIZATION=f"Bearer {personal_secret}")
    assert answer.status_code == 200
    keep_screenshot(page, "api-tokens", tmp_path)
