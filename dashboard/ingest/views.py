"""``POST /api/v1/ingest``: the one door for agents and hooks.

Checks run cheapest first (method, headers, size, token) so a flood of bad requests costs little, and nothing is
written until the whole batch has validated: a refused batch changes nothing.
"""

from __future__ import annotations

import json
import logging
import zlib

from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from clusterdx import wire
from dashboard.ingest.errors import error
from dashboard.ingest.writer import store_batch
from dashboard.telemetry import tokens

log = logging.getLogger(__name__)


def _limit() -> int:
    from django.conf import settings

    return int(settings.CLUSTERDX["INGEST_MAX_BODY_BYTES"])


def _read_body(request: HttpRequest, limit: int) -> bytes | None:
    """The raw body, or None when it is over ``limit`` (read no further than limit + 1 bytes)."""
    declared = request.META.get("CONTENT_LENGTH")
    if declared and declared.isdigit() and int(declared) > limit:
        return None
    data = request.read(limit + 1)
    return None if len(data) > limit else data


def _gunzip(data: bytes, limit: int) -> bytes | None:
    """Decompress with a hard output bound: a 10 kB gzip bomb must not become 10 GB of memory."""
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    out = inflater.decompress(data, limit + 1)
    if len(out) > limit or inflater.unconsumed_tail:
        raise OverflowError
    if not inflater.eof:
        raise zlib.error("truncated gzip stream")
    return out


@csrf_exempt
def ingest(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        response = error("method_not_allowed", f"{request.method} is not allowed; POST a batch")
        response["Allow"] = "POST"
        return response
    content_type = request.content_type or ""
    if content_type != "application/json":
        return error("unsupported_media_type", f"Content-Type {content_type or '(none)'!r} is not application/json")
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("identity", "gzip"):
        return error("unsupported_media_type", f"Content-Encoding {encoding!r} is not supported (gzip or identity)")

    auth = request.headers.get("Authorization", "")
    if not auth.startswith("Bearer "):
        return error("missing_token", "send 'Authorization: Bearer <token>' (clusterdx token create CLUSTER)")
    token = tokens.lookup(auth[len("Bearer "):].strip())
    if token is None:
        return error("unknown_token", "the token is unknown or has been revoked")

    limit = _limit()
    body = _read_body(request, limit)
    if body is None:
        return error("too_large", f"body over {limit} bytes; send smaller batches")
    if encoding == "gzip":
        try:
            body = _gunzip(body, limit)
        except OverflowError:
            return error("too_large", f"decompressed body over {limit} bytes; send smaller batches")
        except zlib.error as exc:
            return error("bad_encoding", f"invalid gzip body: {exc}")
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:
        return error("malformed_json", f"invalid JSON: {str(exc)[:200]}")
    try:
        batch = wire.validate_batch(payload)
    except wire.WireError as exc:
        return error("invalid_batch", str(exc)[:500])
    except RecursionError:
        return error("invalid_batch", "nesting too deep")
    cluster = token.cluster
    if batch["cluster"] is not None and batch["cluster"] != cluster.name:
        return error("wrong_cluster", f"token is for cluster {cluster.name!r}, batch names {batch['cluster']!r}")
    try:
        tokens.mark_used(token)
        result = store_batch(cluster, batch)
    except DatabaseError as exc:
        log.warning("ingest: database unavailable for %s seq %s: %s", batch["agent_id"], batch["seq"], exc)
        return error("unavailable", "database unavailable; the batch was not stored, retry it")
    return JsonResponse({"status": result.status, "seq": batch["seq"], "records": result.records})
