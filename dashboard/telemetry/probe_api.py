"""``GET /api/v1/probes/peers?host=H``: the peers an agent probes (server-planned, :mod:`.probeplan`).

Authenticated with the agent's ingest token and its scope rules: an ``agent`` token asks only for the hosts it may
post as, a ``hook`` token not at all. The server knows no node addresses (Node has a host name and a place, no IP),
so each peer's ``address`` is its host name and the agent resolves it, as it does for static peers.
"""

from __future__ import annotations

import time
from fnmatch import fnmatchcase
from typing import Any

from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.http import require_GET

from dashboard.telemetry import probeplan, tokens
from dashboard.telemetry.models import Node

EPOCH_S = 60.0  # the cross-leaf sample rotates this often; agents ask again at this period
K_LOCAL = 4
K_REMOTE = 4
DEFAULT_PORT = 8651  # collectors.sources.probe_responder.DEFAULT_PORT (the server does not import collectors)

# cluster id -> (built at, layout). Every agent asks once an epoch: rebuilding from all the cluster's nodes for each
# would be O(n) per request, O(n²) per epoch; a layout a few seconds old only delays a new node's first plan.
LAYOUT_TTL_S = 15.0
_layouts: dict[int, tuple[float, probeplan.Layout]] = {}


def _error(status: int, code: str, detail: str) -> JsonResponse:
    return JsonResponse({"error": code, "detail": detail}, status=status)


def _layout(cluster_id: int) -> probeplan.Layout:
    now = time.monotonic()
    hit = _layouts.get(cluster_id)
    if hit is not None and now - hit[0] < LAYOUT_TTL_S:
        return hit[1]
    rows = Node.objects.filter(cluster_id=cluster_id).values_list("hostname", "switch", "rack")
    layout = probeplan.Layout.build(rows)
    _layouts[cluster_id] = (now, layout)
    return layout


def clear_cache() -> None:
    _layouts.clear()


@require_GET
def probe_peers(request: HttpRequest) -> JsonResponse:
    header = request.headers.get("Authorization", "")
    if not header.startswith("Bearer "):
        return _error(401, "missing_token", "send 'Authorization: Bearer <token>' (the agent's ingest token)")
    row = tokens.lookup(header[len("Bearer "):].strip())
    if row is None:
        return _error(401, "unknown_token", "the token is unknown or has been revoked")
    host = request.GET.get("host", "").strip()
    if not host:
        return _error(400, "bad_request", "the query needs host=<this node's host name>")
    port_text = request.GET.get("port", str(DEFAULT_PORT))
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return _error(400, "bad_request", f"port must be 1-65535, got {port_text!r}")
    if row.scope == "hook":
        return _error(403, "scope", "a hook token may not ask for probe peers")
    if row.scope == "agent" and not any(fnmatchcase(host, p) for p in row.hosts.split()):
        return _error(403, "scope", f"this token may only ask as {' or '.join(row.hosts.split())}")
    layout = _layout(row.cluster_id)
    if host not in layout.where and Node.objects.filter(cluster_id=row.cluster_id, hostname=host).exists():
        clear_cache()  # a node that reported after the cached layout was built
        layout = _layout(row.cluster_id)
    if host not in layout.where:
        return _error(404, "unknown_host", f"no node {host!r} in cluster {row.cluster.name}; it is planned once its "
                                           "agent has posted a batch")
    tokens.mark_used(row)
    epoch = probeplan.epoch_of(time.time(), EPOCH_S)
    port = int(port_text)
    peers = [{"host": name, "address": name, "port": port}
             for name in layout.peers(host, epoch, K_LOCAL, K_REMOTE)]
    return JsonResponse({"peers": peers, "round_s": EPOCH_S, "plan": probeplan.PLAN, "epoch": epoch,
                         "leaf": layout.leaf_of(host)})


def openapi_paths() -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": {
        "type": "object", "required": ["error", "detail"],
        "properties": {"error": {"enum": ["bad_request", "missing_token", "unknown_token", "scope", "unknown_host"]},
                       "detail": {"type": "string"}}}}}}
    peer = {"type": "object", "required": ["host", "address", "port"],
            "properties": {"host": {"type": "string"},
                           "address": {"type": "string", "description": "what to connect to; the host name today "
                                                                         "(the server knows no node addresses)"},
                           "port": {"type": "integer"}}}
    return {"/api/v1/probes/peers": {"get": {
        "operationId": "probePeers",
        "summary": "The peers a node's agent probes: same-leaf neighbours plus a rotating cross-leaf sample",
        "description": (f"At most {K_LOCAL} same-leaf (switch, else rack) neighbours and {K_REMOTE} nodes on other "
                        f"leaves; the cross-leaf sample rotates every `round_s` seconds, so every leaf pair is "
                        "probed within ceil((leaves-1)/k) rounds. An `agent` token may ask only as its hosts."),
        "security": [{"clusterToken": []}],
        "parameters": [
            {"name": "host", "in": "query", "required": True, "schema": {"type": "string"}},
            {"name": "port", "in": "query", "required": False,
             "schema": {"type": "integer", "default": DEFAULT_PORT}, "description": "the fleet's responder port"},
        ],
        "responses": {
            "200": {"description": "The plan for this epoch", "content": {"application/json": {"schema": {
                "type": "object", "required": ["peers", "round_s", "plan"],
                "properties": {"peers": {"type": "array", "items": peer}, "round_s": {"type": "number"},
                               "plan": {"type": "string"}, "epoch": {"type": "integer"},
                               "leaf": {"type": "string"}}}}}},
            "400": {"description": "`bad_request`: no host, or a bad port", **error},
            "401": {"description": "`missing_token` or `unknown_token`", **error},
            "403": {"description": "`scope`: the token may not ask as this host", **error},
            "404": {"description": "`unknown_host`: no node of that name has reported yet", **error},
        },
    }}}


urlpatterns = [path("api/v1/probes/peers", probe_peers, name="probe-peers")]
