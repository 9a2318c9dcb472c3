"""Single sign-on with OpenID Connect (mozilla-django-oidc), on only when ``CLUSTERDX_OIDC_CLIENT_ID`` is set.

The authorization code flow with PKCE and a nonce; the ID token's RS256 signature is checked against the provider's
JWKS, and (beyond what the library checks) its issuer and audience. Endpoints come from the issuer's discovery
document unless given one by one. At each login the user's cluster roles are set from the groups claim through
``CLUSTERDX_OIDC_ROLES`` (group -> cluster:role): a user who left a group loses the role at the next login, and the
SSO session lasts ``CLUSTERDX_OIDC_SESSION_HOURS`` so that next login comes. Only clusters the mapping names are
managed; memberships an owner gave by hand in other clusters stay. Local accounts keep working beside it, and an SSO
login never takes over a local account (one with a password) of the same name.

Every change of a membership is audited, with the actor ``sso``. Settings: :func:`dashboard.envconf.env_oidc`;
docs/sso.md for the provider side (Keycloak, Okta, Google).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import jwt
import requests
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth import views as auth_views
from django.core.exceptions import SuspiciousOperation
from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import path
from django.views import View
from mozilla_django_oidc.auth import OIDCAuthenticationBackend
from mozilla_django_oidc.utils import import_from_settings
from mozilla_django_oidc.views import OIDCAuthenticationCallbackView, OIDCAuthenticationRequestView

from dashboard.telemetry.models import ROLE_RANK, Cluster, Membership, Role

log = logging.getLogger(__name__)
ACTOR = "sso"
DISCOVERY_TTL_S = 3600.0
HTTP_TIMEOUT_S = 10.0
FAILED = "/login/?sso=failed"
_discovered: dict[str, tuple[float, dict[str, Any]]] = {}

# The library's setting names -> ours (settings.CLUSTERDX_OIDC), so nothing OIDC_* needs to live in settings.py.
_NAMES = {"OIDC_RP_CLIENT_ID": "client_id", "OIDC_RP_CLIENT_SECRET": "client_secret",
          "OIDC_RP_SIGN_ALGO": "sign_algo", "OIDC_RP_SCOPES": "scopes"}
_ENDPOINTS = {"OIDC_OP_AUTHORIZATION_ENDPOINT": "authorization_endpoint", "OIDC_OP_TOKEN_ENDPOINT": "token_endpoint",
              "OIDC_OP_USER_ENDPOINT": "userinfo_endpoint", "OIDC_OP_JWKS_ENDPOINT": "jwks_uri"}
_FIXED: dict[str, Any] = {"OIDC_USE_PKCE": True, "OIDC_USE_NONCE": True, "OIDC_TIMEOUT": HTTP_TIMEOUT_S,
                          "LOGIN_REDIRECT_URL_FAILURE": FAILED, "OIDC_CREATE_USER": True}


def config() -> dict[str, Any] | None:
    return getattr(settings, "CLUSTERDX_OIDC", None)


def discover(issuer: str) -> dict[str, Any]:
    """The issuer's discovery document, cached an hour per process. It must name the same issuer (OIDC Discovery
    4.3): a document served for another issuer would hand tokens to the wrong party."""
    hit = _discovered.get(issuer)
    if hit and time.monotonic() - hit[0] < DISCOVERY_TTL_S:
        return hit[1]
    response = requests.get(f"{issuer}/.well-known/openid-configuration", timeout=HTTP_TIMEOUT_S)
    response.raise_for_status()
    doc = response.json()
    if not isinstance(doc, dict) or str(doc.get("issuer", "")).rstrip("/") != issuer:
        raise SuspiciousOperation(f"the discovery document of {issuer} names another issuer")
    _discovered[issuer] = (time.monotonic(), doc)
    return doc


def setting(attr: str, *default: Any) -> Any:
    """What the library asks for, from our settings (endpoints from discovery when not given)."""
    cfg = config()
    if cfg is not None and attr in _NAMES:
        return cfg[_NAMES[attr]]
    if cfg is not None and attr in _ENDPOINTS:
        key = _ENDPOINTS[attr]
        return cfg.get(key) or (discover(cfg["issuer"]).get(key) if cfg.get("issuer") else None)
    if attr in _FIXED:
        return _FIXED[attr]
    return import_from_settings(attr, *default)


# -- roles from groups (pure) -----------------------------------------------------------------------------------------
def groups_of(claims: dict[str, Any], claim: str) -> set[str]:
    """The groups claim as a set: a list of names, or one name (some providers send a string for one group)."""
    value = claims.get(claim)
    if isinstance(value, str):
        return {value}
    return {str(g) for g in value} if isinstance(value, list) else set()


def wanted_roles(groups: set[str], mapping: list[tuple[str, str, str]]) -> dict[str, str]:
    """cluster -> the highest role any of the user's groups maps to there."""
    out: dict[str, str] = {}
    for group, cluster, role in mapping:
        if group in groups and (cluster not in out or ROLE_RANK[Role(role)] > ROLE_RANK[Role(out[cluster])]):
            out[cluster] = role
    return out


def sync_roles(user: Any, groups: set[str], mapping: list[tuple[str, str, str]]) -> None:
    """Set the user's memberships in the clusters the mapping names from ``groups``; audit each change."""
    from dashboard.telemetry.audit import record

    wanted = wanted_roles(groups, mapping)
    managed = {cluster for _, cluster, _ in mapping}
    with transaction.atomic():
        clusters = {c.name: c for c in Cluster.objects.filter(name__in=managed)}
        for name in sorted(managed - clusters.keys()):
            log.warning("CLUSTERDX_OIDC_ROLES names cluster %r, which does not exist", name)
        have = {m.cluster_id: m for m in Membership.objects.filter(user=user, cluster__in=clusters.values())}
        for name, cluster in sorted(clusters.items()):
            want, row = wanted.get(name), have.get(cluster.id)
            if want and row is None:
                Membership.objects.create(cluster=cluster, user=user, role=want)
                record(ACTOR, "member.add", cluster=cluster, target=user.username, role=want)
            elif want and row is not None and row.role != want:
                record(ACTOR, "member.role", cluster=cluster, target=user.username, role=want, was=row.role)
                Membership.objects.filter(id=row.id).update(role=want)
            elif not want and row is not None:
                record(ACTOR, "member.remove", cluster=cluster, target=user.username, was=row.role)
                row.delete()


# -- the library, configured from our settings -------------------------------------------------------------------------
class Backend(OIDCAuthenticationBackend):
    """Answers only the OIDC callback; a password login passes through to the ModelBackend."""

    get_settings = staticmethod(setting)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No settings read and no network here: Django builds a backend for every request of a signed-in SSO user.
        self.UserModel = get_user_model()

    def authenticate(self, request: HttpRequest | None, **kwargs: Any) -> Any:
        cfg = config()
        if request is None or cfg is None or "code_verifier" not in kwargs:
            return None
        try:
            self.OIDC_OP_TOKEN_ENDPOINT = setting("OIDC_OP_TOKEN_ENDPOINT")
            self.OIDC_OP_USER_ENDPOINT = setting("OIDC_OP_USER_ENDPOINT")
            self.OIDC_OP_JWKS_ENDPOINT = setting("OIDC_OP_JWKS_ENDPOINT")
            self.OIDC_RP_CLIENT_ID, self.OIDC_RP_CLIENT_SECRET = cfg["client_id"], cfg["client_secret"]
            self.OIDC_RP_SIGN_ALGO, self.OIDC_RP_IDP_SIGN_KEY = cfg["sign_algo"], None
            return super().authenticate(request, **kwargs)
        except (requests.RequestException, ValueError, jwt.PyJWTError, SuspiciousOperation) as exc:
            # An expired or forged token, a provider that is down: a failed login with the reason logged, never a 500.
            log.warning("sso: login refused: %s: %s", type(exc).__name__, exc)
            return None

    def verify_token(self, token: str, **kwargs: Any) -> dict[str, Any]:
        payload = super().verify_token(token, **kwargs)  # signature (JWKS), expiry, nonce
        cfg = config() or {}
        audience = payload.get("aud")
        audiences = audience if isinstance(audience, list) else [audience]
        if cfg.get("client_id") not in audiences:
            raise SuspiciousOperation("the ID token was issued for another client (aud)")
        if cfg.get("issuer") and str(payload.get("iss", "")).rstrip("/") != cfg["issuer"]:
            raise SuspiciousOperation(f"the ID token comes from another issuer: {str(payload.get('iss'))[:100]!r}")
        return payload

    def get_userinfo(self, access_token: str, id_token: str, payload: dict[str, Any]) -> dict[str, Any]:
        """The ID token's claims and the userinfo endpoint's (where there is one): providers put groups in either."""
        claims = dict(payload)
        if self.OIDC_OP_USER_ENDPOINT:
            info = super().get_userinfo(access_token, id_token, payload)
            if info.get("sub") != payload.get("sub"):
                raise SuspiciousOperation("userinfo describes another subject than the ID token")
            claims.update(info)
        return claims

    def verify_claims(self, claims: dict[str, Any]) -> bool:
        return bool(claims.get("sub")) and bool(self.get_username(claims))

    def get_username(self, claims: dict[str, Any]) -> str:
        value = claims.get((config() or {}).get("username_claim", "preferred_username")) or claims.get("email")
        return str(value)[:150] if value else ""

    def filter_users_by_claims(self, claims: dict[str, Any]) -> Any:
        return self.UserModel.objects.filter(username=self.get_username(claims))

    def create_user(self, claims: dict[str, Any]) -> Any:
        from dashboard.telemetry.audit import record

        user = self.UserModel.objects.create_user(self.get_username(claims), email=claims.get("email") or "")
        record(ACTOR, "user.add", target=user.username)
        return self.update_user(user, claims, created=True)

    def update_user(self, user: Any, claims: dict[str, Any], created: bool = False) -> Any:
        if not created and user.has_usable_password():
            raise SuspiciousOperation(f"{user.username!r} is a local account (it has a password): an SSO login does "
                                      "not take it over")
        cfg = config() or {}
        email = claims.get("email") or ""
        if email and user.email != email:
            user.email = email
            user.save(update_fields=["email"])
        sync_roles(user, groups_of(claims, cfg.get("groups_claim", "groups")), cfg.get("roles", []))
        return user


class Start(OIDCAuthenticationRequestView):
    """GET /oidc/authenticate/?next=...: off to the provider's login page."""

    get_settings = staticmethod(setting)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        View.__init__(self, *args, **kwargs)  # endpoints per request (discovery may be down), not at construction

    def get(self, request: HttpRequest) -> HttpResponse:
        cfg = config()
        if cfg is None:
            raise Http404("single sign-on is not configured")
        try:
            self.OIDC_OP_AUTH_ENDPOINT = setting("OIDC_OP_AUTHORIZATION_ENDPOINT")
        except (requests.RequestException, ValueError, SuspiciousOperation) as exc:
            log.warning("sso: the provider's discovery failed: %s: %s", type(exc).__name__, exc)
            return HttpResponseRedirect("/login/?sso=unavailable")
        self.OIDC_RP_CLIENT_ID = cfg["client_id"]
        return super().get(request)


class Callback(OIDCAuthenticationCallbackView):
    """GET /oidc/callback/?code=...&state=...: the provider sends the browser back here."""

    get_settings = staticmethod(setting)

    def get(self, request: HttpRequest) -> HttpResponse:
        if config() is None:
            raise Http404("single sign-on is not configured")
        return super().get(request)

    def login_success(self) -> HttpResponse:
        response = super().login_success()
        # Roles follow the groups at each login: a bounded session makes that login come.
        self.request.session.set_expiry(int(float((config() or {}).get("session_hours", 12.0)) * 3600))
        return response


class LoginView(auth_views.LoginView):
    """The local sign-in form, with "Sign in with SSO" when it is configured."""

    template_name = "web/login.html"

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        cfg = config()
        context["sso_label"] = cfg["label"] if cfg else None
        context["sso_problem"] = {"failed": "Single sign-on did not sign you in: ask your administrator to check "
                                            "the server log.",
                                  "unavailable": "The single sign-on provider cannot be reached right now."}.get(
            self.request.GET.get("sso", ""))
        return context


urlpatterns: list[Any] = [
    path("oidc/authenticate/", Start.as_view(), name="oidc_authentication_init"),
    path("oidc/callback/", Callback.as_view(), name="oidc_authentication_callback"),
]
