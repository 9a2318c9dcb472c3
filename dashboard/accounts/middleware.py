"""``Authorization: Bearer cdxp_…`` on the JSON API: the request acts as the token's user, read-only.

A middleware rather than a decorator so that every JSON API (the pages' ``access.api`` views and the diagnosis API
alike) takes tokens the same way, and none can forget to. It answers only under ``/api/`` and never for ingest, which
takes its own (cluster) tokens: the two kinds never stand in for each other.
"""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, JsonResponse

from dashboard.accounts import tokens

INGEST_PATH = "/api/v1/ingest"
PROBE_PEERS_PATH = "/api/v1/probes/peers"  # an agent asks with its ingest token too (dashboard.telemetry.probe_api)
READS = ("GET", "HEAD", "OPTIONS")


def _error(status: int, code: str, detail: str) -> JsonResponse:
    response = JsonResponse({"error": code, "detail": detail}, status=status)
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="clusterdx"'
    return response


class PersonalTokenAuth:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        header = request.headers.get("Authorization", "")
        if not header or not request.path.startswith("/api/") or request.path.startswith((INGEST_PATH, PROBE_PEERS_PATH)):
            return self.get_response(request)
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return _error(401, "unauthenticated", "use Authorization: Bearer <personal API token>")
        token = token.strip()
        row = tokens.lookup(token)
        if row is None:
            if token.startswith("cdx_"):
                return _error(401, "unauthenticated", "an ingest token only posts batches; the API takes a personal "
                                                      "API token (cdxp_…, from /account/tokens/)")
            return _error(401, "unauthenticated", "unknown or revoked API token")
        if request.method not in READS:
            return _error(403, "read_only_token", "a personal API token reads the API (GET) only")
        tokens.mark_used(row)
        request.user = row.user
        request.api_token = row  # type: ignore[attr-defined]
        return self.get_response(request)
