"""Single sign-on against a real OpenID provider the test starts (tests/server/oidc_provider.py): the redirect flow
driven with httpx through a live server, roles set from the groups claim at each login (and taken away), forged
tokens and local-account takeovers refused, local accounts still signing in, and the settings parsed strictly."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from dashboard.envconf import ConfigError, env_oidc, parse_oidc_roles
from dashboard.telemetry.models import AuditEntry, Cluster, Membership
from tests.server.conftest import AsgiServer
from tests.server.oidc_provider import Provider

ROLES = "gpu-oncall=prod:member,gpu-admins=prod:owner,gpu-admins=lab:viewer"


@pytest.fixture(scope="module")
def provider() -> Iterator[Provider]:
    p = Provider()
    yield p
    p.stop()


@pytest.fixture
def sso(provider: Provider, settings: Any, asgi_server: AsgiServer) -> AsgiServer:
    from dashboard import sso as module

    provider.forge, provider.groups_in = False, "userinfo"
    module._discovered.clear()  # each test's provider answers discovery afresh
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.CLUSTERDX_OIDC = env_oidc({"CLUSTERDX_OIDC_CLIENT_ID": provider.client_id,
                                        "CLUSTERDX_OIDC_CLIENT_SECRET": provider.client_secret,
                                        "CLUSTERDX_OIDC_ISSUER": provider.issuer, "CLUSTERDX_OIDC_ROLES": ROLES})
    for name in ("prod", "lab", "staging"):
        Cluster.objects.create(name=name)
    return asgi_server


def sso_login(server: AsgiServer, provider: Provider, next_path: str = "/") -> tuple[httpx.Client, httpx.Response]:
    """The browser's walk: our server -> the provider's authorize -> our callback. Returns the callback's answer."""
    client = httpx.Client(timeout=20)
    start = client.get(f"{server.url}/oidc/authenticate/", params={"next": next_path})
    assert start.status_code == 302 and start.headers["location"].startswith(f"{provider.issuer}/authorize?")
    back = client.get(start.headers["location"])
    assert back.status_code == 302, back.text
    assert back.headers["location"].startswith(f"{server.url}/oidc/callback/?code=")
    return client, client.get(back.headers["location"])


def roles(username: str) -> dict[str, str]:
    return dict(Membership.objects.filter(user__username=username).values_list("cluster__name", "role"))


def test_it_signs_in_with_sso_and_sets_roles_from_the_groups_at_each_login(sso: AsgiServer, provider: Provider,
                                                                           django_user_model: Any) -> None:
    page = httpx.get(f"{sso.url}/login/?next=/clusters/prod/findings/").text
    assert re.search(r'<a class="button sso" id="sso" href="/oidc/authenticate/\?next=/clusters/prod/findings/">'
                     r'Sign in with SSO</a>', page)

    provider.login(sub="u-1", preferred_username="dana", email="dana@example.com",
                   groups=["gpu-oncall", "gpu-admins", "unrelated"])
    client, done = sso_login(sso, provider, "/clusters/prod/findings/")
    assert done.status_code == 302 and done.headers["location"] == "/clusters/prod/findings/"
    assert "Max-Age=43200" in done.headers["set-cookie"]  # CLUSTERDX_OIDC_SESSION_HOURS: 12 h by default
    assert roles("dana") == {"prod": "owner", "lab": "viewer"}  # the highest role a group maps to
    dana = django_user_model.objects.get(username="dana")
    assert dana.email == "dana@example.com" and not dana.has_usable_password()
    assert client.get(f"{sso.url}/api/v1/clusters/prod/silences").status_code == 200
    Membership.objects.create(cluster=Cluster.objects.get(name="staging"), user=dana, role="viewer")  # by hand

    provider.login(sub="u-1", preferred_username="dana", email="dana@example.com", groups=["gpu-oncall"])
    sso_login(sso, provider)
    assert roles("dana") == {"prod": "member", "staging": "viewer"}  # lab is gone; staging is not the mapping's

    provider.login(sub="u-1", preferred_username="dana", email="dana@example.com")  # left every group
    client, done = sso_login(sso, provider)
    assert done.status_code == 302 and roles("dana") == {"staging": "viewer"}
    assert client.get(f"{sso.url}/api/v1/clusters/prod/silences").status_code == 404
    assert list(AuditEntry.objects.filter(actor_name="sso").order_by("id").values_list("action", "cluster__name",
                                                                                        "target")) == [
        ("user.add", None, "dana"), ("member.add", "lab", "dana"), ("member.add", "prod", "dana"),
        ("member.remove", "lab", "dana"), ("member.role", "prod", "dana"), ("member.remove", "prod", "dana")]
    assert provider.requests.count("GET /.well-known/openid-configuration") == 1  # discovery cached

    # The groups claim may come in the ID token instead of userinfo (Okta's custom claim, Keycloak's mapper).
    provider.groups_in = "id_token"
    provider.login(sub="u-1", preferred_username="dana", groups="gpu-admins")  # a single group as a string
    sso_login(sso, provider)
    assert roles("dana") == {"prod": "owner", "lab": "viewer", "staging": "viewer"}

    # Local accounts keep working beside SSO.
    django_user_model.objects.create_user("erin", password="local password 1")
    local = httpx.Client(timeout=20)
    local.get(f"{sso.url}/login/")
    signed = local.post(f"{sso.url}/login/", data={"username": "erin", "password": "local password 1", "next": "/",
                                                  "csrfmiddlewaretoken": local.cookies["csrftoken"]},
                        headers={"Referer": f"{sso.url}/login/"})
    assert signed.status_code == 302 and signed.headers["location"] == "/"


def test_it_refuses_a_forged_token_and_never_takes_over_a_local_account(sso: AsgiServer, provider: Provider,
                                                                        django_user_model: Any) -> None:
    provider.forge = True  # signed with a key the provider's JWKS does not publish
    provider.login(sub="u-2", preferred_username="mallory", groups=["gpu-admins"])
    _, done = sso_login(sso, provider)
    assert done.status_code == 302 and done.headers["location"] == "/login/?sso=failed"
    assert not django_user_model.objects.filter(username="mallory").exists()
    assert "Single sign-on did not sign you in" in httpx.get(f"{sso.url}{done.headers['location']}").text

    provider.forge = False
    frank = django_user_model.objects.create_user("frank", password="local password 2")
    provider.login(sub="u-3", preferred_username="frank", groups=["gpu-admins"])
    client, done = sso_login(sso, provider)
    assert done.headers["location"] == "/login/?sso=failed" and roles("frank") == {}
    assert client.get(f"{sso.url}/api/v1/clusters/prod/silences").status_code == 401
    frank.refresh_from_db()
    assert frank.check_password("local password 2")


def test_sso_is_off_unless_configured_and_its_settings_are_strict(client: Any, settings: Any, db: None) -> None:
    settings.CLUSTERDX_OIDC = None
    assert "Sign in with SSO" not in client.get("/login/").content.decode()
    assert client.get("/oidc/authenticate/").status_code == 404
    assert env_oidc({}) is None
    base = {"CLUSTERDX_OIDC_CLIENT_ID": "c", "CLUSTERDX_OIDC_CLIENT_SECRET": "s"}
    with pytest.raises(ConfigError, match="set CLUSTERDX_OIDC_ISSUER"):
        env_oidc(base)
    with pytest.raises(ConfigError, match="CLUSTERDX_OIDC_CLIENT_SECRET"):
        env_oidc({"CLUSTERDX_OIDC_CLIENT_ID": "c", "CLUSTERDX_OIDC_ISSUER": "https://idp.example.com"})
    assert parse_oidc_roles(" /org/gpu-oncall = prod:member ,") == [("/org/gpu-oncall", "prod", "member")]
    for bad in ("gpu-oncall=prod", "gpu-oncall=prod:admin", "=prod:member", "gpu-oncall:prod:member"):
        with pytest.raises(ConfigError, match="is not <group>=<cluster>:<role>"):
            parse_oidc_roles(bad)


@pytest.mark.browser
def test_a_person_signs_in_with_sso_in_chromium(sso: AsgiServer, provider: Provider, page: Any, tmp_path: Any) -> None:
    from tests.server import browser

    provider.login(sub="u-4", preferred_username="gail", email="gail@example.com", groups=["gpu-oncall"])
    page.goto(f"{sso.url}/clusters/prod/findings/")
    assert "/login/" in page.url
    browser.keep_screenshot(page, "login-sso", tmp_path)
    page.click("#sso")  # to the provider, which signs gail in at once, and back through the callback
    page.wait_for_url(f"{sso.url}/clusters/prod/findings/")
    assert "Sign out gail" in page.inner_text("header") and roles("gail") == {"prod": "member"}
    browser.no_js_errors(page)
