"""Every JSON endpoint the pages read is in /api/openapi.json, so scripts can use exactly what the browser uses."""

from __future__ import annotations

import re
from typing import Any

from django.urls import URLPattern, URLResolver, get_resolver


def url_routes(patterns: list[Any], prefix: str = "") -> list[str]:
    out = []
    for p in patterns:
        if isinstance(p, URLResolver):
            out += url_routes(p.url_patterns, prefix + str(p.pattern))
        elif isinstance(p, URLPattern):
            out.append(prefix + str(p.pattern))
    return out


def _as_openapi(route: str) -> str:
    """Django's ``api/v1/runs/<int:run_id>/`` is OpenAPI's ``/api/v1/runs/{run_id}/``."""
    return "/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route)


def test_it_documents_every_api_route(client: Any) -> None:
    routes = {_as_openapi(r) for r in url_routes(get_resolver().url_patterns) if r.startswith("api/v1/")}
    documented = set(client.get("/api/openapi.json").json()["paths"])
    assert len(routes) >= 3, routes
    assert routes - documented == set(), "API routes missing from the OpenAPI document"
    assert documented - routes - {"/api/v1/ingest"} <= set(), "documented paths that no route serves"


def test_it_names_each_operation_once(client: Any) -> None:
    doc = client.get("/api/openapi.json").json()
    ids = [op["operationId"] for item in doc["paths"].values() for op in item.values() if isinstance(op, dict)]
    assert len(ids) == len(set(ids)), sorted(ids)
    assert all(op.get("responses") for item in doc["paths"].values() for op in item.values() if isinstance(op, dict))
