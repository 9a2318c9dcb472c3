"""A small OpenID provider for the SSO tests: a real HTTP server (a thread of the test process) with discovery,
authorize, token, userinfo and JWKS endpoints, signing RS256 ID tokens with joserfc.

It signs in whoever the test says (``provider.login(claims)``) without a login form, and checks what a real provider
checks of the client: its id and secret, the redirect URI, the PKCE verifier, a code used once. ``forge`` makes it
sign with a key its JWKS does not publish (a forged token the client must refuse).
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

from joserfc import jwt
from joserfc.jwk import RSAKey


@dataclass
class Provider:
    client_id: str = "clusterdx"
    client_secret: str = "s3cret-of-the-client"
    claims: dict[str, Any] = field(default_factory=dict)  # who signs in next (sub, preferred_username, groups...)
    forge: bool = False
    groups_in: str = "userinfo"  # where the groups claim goes: "userinfo" or "id_token"
    codes: dict[str, dict[str, Any]] = field(default_factory=dict)
    tokens: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)  # "<method> <path>", in order

    def __post_init__(self) -> None:
        self.key = RSAKey.generate_key(2048, parameters={"kid": "k1", "use": "sig", "alg": "RS256"})
        self.rogue = RSAKey.generate_key(2048, parameters={"kid": "k1", "use": "sig", "alg": "RS256"})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.issuer = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="oidc-provider")
        self.thread.start()

    def login(self, **claims: Any) -> None:
        self.claims = claims

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def discovery(self) -> dict[str, Any]:
        return {"issuer": self.issuer, "authorization_endpoint": f"{self.issuer}/authorize",
                "token_endpoint": f"{self.issuer}/token", "userinfo_endpoint": f"{self.issuer}/userinfo",
                "jwks_uri": f"{self.issuer}/jwks", "response_types_supported": ["code"],
                "subject_types_supported": ["public"], "id_token_signing_alg_values_supported": ["RS256"],
                "code_challenge_methods_supported": ["S256"]}

    # -- endpoints: (status, headers, body) ----------------------------------------------------------------------------
    def authorize(self, q: dict[str, str]) -> tuple[int, dict[str, str], Any]:
        if q.get("client_id") != self.client_id or q.get("response_type") != "code" or "openid" not in \
                q.get("scope", "").split() or q.get("code_challenge_method") != "S256":
            return 400, {}, {"error": "invalid_request"}
        code = secrets.token_urlsafe(16)
        self.codes[code] = {"claims": dict(self.claims), "nonce": q.get("nonce"), "redirect_uri": q["redirect_uri"],
                            "challenge": q.get("code_challenge")}
        return 302, {"Location": f"{q['redirect_uri']}?{urlencode({'code': code, 'state': q['state']})}"}, None

    def token(self, form: dict[str, str]) -> tuple[int, dict[str, str], Any]:
        grant = self.codes.pop(form.get("code", ""), None)  # a code is good once
        verifier = form.get("code_verifier", "")
        challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
        if grant is None or form.get("client_id") != self.client_id or \
                form.get("client_secret") != self.client_secret or form.get("redirect_uri") != grant["redirect_uri"] \
                or challenge != grant["challenge"]:
            return 400, {}, {"error": "invalid_grant"}
        claims = grant["claims"]
        now = int(time.time())
        id_claims = {"iss": self.issuer, "aud": self.client_id, "sub": claims["sub"], "iat": now, "exp": now + 300,
                     "nonce": grant["nonce"], **{k: v for k, v in claims.items() if k != "groups"}}
        if self.groups_in == "id_token" and "groups" in claims:
            id_claims["groups"] = claims["groups"]
        key = self.rogue if self.forge else self.key
        id_token = jwt.encode({"alg": "RS256", "kid": "k1"}, id_claims, key)
        access = secrets.token_urlsafe(16)
        self.tokens[access] = claims if self.groups_in == "userinfo" else \
            {k: v for k, v in claims.items() if k != "groups"}
        return 200, {}, {"access_token": access, "token_type": "Bearer", "expires_in": 300, "id_token": id_token}

    def userinfo(self, authorization: str) -> tuple[int, dict[str, str], Any]:
        claims = self.tokens.get(authorization.removeprefix("Bearer "))
        return (200, {}, claims) if claims is not None else (401, {}, {"error": "invalid_token"})


def _handler(p: Provider) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, headers: dict[str, str], body: Any) -> None:
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            for k, v in {**headers, "Content-Type": "application/json", "Content-Length": str(len(data))}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            p.requests.append(f"GET {url.path}")
            q = {k: v[0] for k, v in parse_qs(url.query).items()}
            if url.path == "/.well-known/openid-configuration":
                self._answer(200, {}, p.discovery())
            elif url.path == "/authorize":
                self._answer(*p.authorize(q))
            elif url.path == "/userinfo":
                self._answer(*p.userinfo(self.headers.get("Authorization", "")))
            elif url.path == "/jwks":
                self._answer(200, {}, {"keys": [p.key.as_dict(private=False)]})
            else:
                self._answer(404, {}, {"error": "not_found"})

        def do_POST(self) -> None:
            url = urlsplit(self.path)
            p.requests.append(f"POST {url.path}")
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
            form = {k: v[0] for k, v in parse_qs(body).items()}
            self._answer(*(p.token(form) if url.path == "/token" else (404, {}, {"error": "not_found"})))

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

    return Handler
