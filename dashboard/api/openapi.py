"""The OpenAPI document, built from the wire format (request schemas) and the ingest error table (answers).

Other apps add their paths by giving their AppConfig an ``openapi_paths()`` method returning OpenAPI path items.
"""

from __future__ import annotations

from typing import Any

from django.apps import apps

from clusterdx import __version__, blocks, wire
from dashboard.ingest.errors import ERRORS
from dashboard.telemetry import probe_api


def _ingest_path() -> dict[str, Any]:
    by_status: dict[int, list[str]] = {}
    for code, (status, meaning) in ERRORS.items():
        by_status.setdefault(status, []).append(f"`{code}`: {meaning}")
    responses: dict[str, Any] = {
        "200": {
            "description": "Stored (`accepted`) or already stored earlier under the same (agent_id, seq) (`duplicate`).",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/IngestAccepted"}}},
        }
    }
    for status, lines in sorted(by_status.items()):
        responses[str(status)] = {
            "description": "; ".join(lines),
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
    return {
        "post": {
            "operationId": "ingest",
            "summary": "Send one batch from a node agent or a training hook",
            "description": (
                "Idempotent on (agent_id, seq). The body may be gzip-compressed (`Content-Encoding: gzip`). "
                "Refused batches change nothing; a 4xx never succeeds on retry, a 503 may."
            ),
            "security": [{"clusterToken": []}],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"oneOf": [{"$ref": "#/components/schemas/Batch"},
                                                                  {"$ref": "#/components/schemas/BatchV2"}]}}},
            },
            "responses": responses,
        }
    }


def _personal_tokens_read(paths: dict[str, Any]) -> None:
    """Every GET a session may read, a personal token may read too (dashboard.accounts.middleware): listed as the
    alternative here, once, rather than in each page's path items."""
    for item in paths.values():
        op = item.get("get")
        if isinstance(op, dict) and {"session": []} in op.get("security", []) and {"personalToken": []} not in op["security"]:
            op["security"] = [*op["security"], {"personalToken": []}]


def document() -> dict[str, Any]:
    schemas = {**wire.json_schema(), **blocks.json_schema()}
    schemas["Error"] = {
        "type": "object",
        "required": ["error", "detail"],
        "properties": {"error": {"enum": sorted(ERRORS)}, "detail": {"type": "string"}},
    }
    schemas["IngestAccepted"] = {
        "type": "object",
        "required": ["status", "seq"],
        "properties": {"status": {"enum": ["accepted", "duplicate"]}, "seq": {"type": "integer"},
                       "records": {"type": "integer"},
                       # Also in the 429 busy answer: the least seconds between one agent's posts the server wants.
                       "send_interval_s": {"type": "number", "minimum": 1}},
    }
    paths: dict[str, Any] = {"/api/v1/ingest": _ingest_path(), **probe_api.openapi_paths()}
    for config in apps.get_app_configs():
        extra = getattr(config, "openapi_paths", None)
        if callable(extra):
            paths.update(extra())
    _personal_tokens_read(paths)
    return {
        "openapi": "3.1.0",
        "info": {"title": "clusterdx", "version": __version__,
                 "description": "Live diagnostics for GPU clusters. Agents and hooks POST batches; people read findings."},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "clusterToken": {"type": "http", "scheme": "bearer",
                                 "description": "A per-cluster ingest token from `clusterdx token create CLUSTER`."},
                "session": {"type": "apiKey", "in": "cookie", "name": "sessionid"},
                "personalToken": {"type": "http", "scheme": "bearer",
                                  "description": "A personal API token (`cdxp_…`) from /account/tokens/ or `clusterdx "
                                                 "token create-personal USER`: acts as its user, GET only."},
            },
        },
    }
