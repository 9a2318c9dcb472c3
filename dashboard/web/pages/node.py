"""The node page and the GPU view: what this node (or this GPU) is doing, and what is wrong with it, on one time axis.

The answer comes first (its open findings, each linked), then one row per concern the way DCGM dashboards are read:
utilisation, memory, power against its limit, temperature, SM clock against its maximum, throttle bands, errors;
then the IB ports, the host, NFS and the probes to and from each peer. Both pages read the two JSON APIs below.
"""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.db.models import Q
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import path

from collectors.xid import describe_xid
from dashboard.diagnosis import silences
from dashboard.diagnosis.live import finding_row
from dashboard.diagnosis.models import Finding
from dashboard.storage import gpu_samples
from dashboard.telemetry.models import Event, Node, PortSample, Rank
from dashboard.web.access import api, int_param, node_or_404
from dashboard.web.links import cluster_url, gpu_url, node_url, rank_url, run_url
from dashboard.web.pages.attention import forms_context
from dashboard.web.pages.node_series import node_series
from dashboard.web.series import parse_range

ACTIVE_RUN_S = 600  # a run whose last step is older than this is not "running on it now"
EVENT_LIMIT = 100
PAST_FINDINGS = 50
LATEST_FIELDS = ["ts", "util_gpu_pct", "mem_used_bytes", "mem_total_bytes", "temp_c", "power_w", "power_limit_w",
                 "sm_clock_mhz", "sm_clock_max_mhz", "throttle_reasons", "ecc_sbe_volatile", "ecc_dbe_volatile",
                 "ecc_sbe_aggregate", "ecc_dbe_aggregate", "retired_pages_sbe", "retired_pages_dbe",
                 "retired_pages_pending", "remap_correctable", "remap_uncorrectable", "remap_pending", "remap_failure",
                 "pcie_replay_total", "pcie_gen", "pcie_gen_max", "pcie_width", "pcie_width_max", "nvlink_links_up",
                 "nvlink_links_total", "nvlink_crc_errors_total", "nvlink_replay_errors_total",
                 "nvlink_recovery_errors_total", "unavailable"]


def _epoch(dt: Any) -> float | None:
    return dt.timestamp() if dt is not None else None


def _findings(node: Node, gpu: int | None) -> dict[str, list[dict[str, Any]]]:
    """Findings naming this node (as the node, or as one end of a link); for the GPU view, those of its GPU plus the
    node-wide ones (a dead node is that GPU's problem too)."""
    qs = Finding.objects.filter(Q(node=node) | Q(peer_node=node)).select_related("cluster", "node", "peer_node")
    if gpu is not None:
        qs = qs.filter(Q(gpu_index=gpu) | Q(gpu_index=None))
    open_ = silences.mark([finding_row(f) for f in qs.filter(state=Finding.State.OPEN).order_by("-updated_at")[:100]])
    past = [finding_row(f) for f in qs.exclude(state=Finding.State.OPEN).order_by("-updated_at")[:PAST_FINDINGS]]
    return {"open": open_, "past": past}


def _silences(node: Node, gpu: int | None) -> list[dict[str, Any]]:
    """Active silences on this node: of the node itself, of its GPUs (the GPU view: of that GPU), of its links."""
    host = node.hostname
    out = []
    for s in silences.active([node.cluster_id]):
        ends = s.target.split("~") if s.scope == "link" else []
        on_gpu = s.scope == "gpu" and s.target.rpartition("/gpu")[0] == host and \
            (gpu is None or s.target == f"{host}/gpu{gpu}")
        if (s.scope == "node" and s.target == host) or on_gpu or host in ends:
            out.append(silences.silence_info(s))
    return sorted(out, key=lambda s: s["ends_at"])


def _state(node: Node, open_findings: list[dict[str, Any]]) -> str:
    if any(f["kind"] == "node_down" for f in open_findings):
        return "down"
    timeout = float(settings.CLUSTERDX["HEARTBEAT_TIMEOUT_S"])
    if node.last_seen is None or time.time() - node.last_seen.timestamp() > timeout:
        return "stale"
    return "up"


def _latest_gpus(node: Node) -> dict[int, dict[str, Any]]:
    """The newest sample of each GPU of the node's inventory."""
    return gpu_samples.latest(node.id, [gpu.index for gpu in node.gpus.all()], LATEST_FIELDS)


def _ranks(node: Node) -> list[dict[str, Any]]:
    now = time.time()
    rows = (Rank.objects.filter(node=node).select_related("run").order_by("-run__last_step_at", "rank")[:256])
    out = []
    for r in rows:
        last = _epoch(r.run.last_step_at)
        out.append({"run": r.run_id, "run_name": r.run.name, "run_url": run_url(r.run_id), "rank": r.rank,
                    "url": rank_url(r.run_id, r.rank), "local_rank": r.local_rank, "gpu_index": r.gpu_index,
                    "last_step": r.run.last_step, "last_step_at": last,
                    "active": last is not None and now - last < ACTIVE_RUN_S})
    return out


def event_row(e: Event, cluster: str, host: str) -> dict[str, Any]:
    row: dict[str, Any] = {"id": e.id, "ts": e.ts.timestamp(), "kind": e.kind, "severity": e.severity, "code": e.code,
                           "gpu_index": e.gpu_index, "message": e.message[:500], "rank": e.rank, "step": e.step,
                           "gpu_url": gpu_url(cluster, host, e.gpu_index) if e.gpu_index is not None else None}
    if e.kind == "xid" and e.code is not None:
        x = describe_xid(e.code)
        row["xid"] = {"name": x.name, "meaning": x.meaning, "action": x.action, "severity": x.severity,
                      "class": x.cls, "known": x.known}
    return row


def _ports(node: Node) -> list[dict[str, Any]]:
    """Each port's newest state (rate, link layer), one row per device/port seen in the last day."""
    seen: dict[tuple[str, int], dict[str, Any]] = {}
    recent = PortSample.objects.filter(node=node).order_by("-ts")[:64]
    for p in recent.values("device", "port", "ts", "state", "phys_state", "rate_gbps", "link_layer"):
        key = (p["device"], p["port"])
        if key not in seen:
            seen[key] = {**p, "ts": _epoch(p["ts"]), "key": f"{p['device']}/{p['port']}"}
    return sorted(seen.values(), key=lambda p: p["key"])


def _interfaces(node: Node) -> dict[str, Any] | None:
    """The newest interface list the agent sent (kept on the node by the ingest writer); None when it never sent one."""
    return {"reported_at": _epoch(node.interfaces_at), "items": node.interfaces} if node.interfaces is not None else None


def node_facts(node: Node, gpu: int | None = None) -> dict[str, Any]:
    cluster, host = node.cluster.name, node.hostname
    findings = _findings(node, gpu)
    latest = _latest_gpus(node)
    gpus = [{"index": g.index, "name": g.name, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id,
             "url": gpu_url(cluster, host, g.index), "latest": latest.get(g.index),
             "open_findings": sum(1 for f in findings["open"] if f["gpu_index"] == g.index)}
            for g in node.gpus.order_by("index")]
    if gpu is not None and not any(g["index"] == gpu for g in gpus):
        raise Http404("no such GPU on this node")
    events = Event.objects.filter(node=node)
    if gpu is not None:
        events = events.filter(Q(gpu_index=gpu) | Q(gpu_index=None))
    return {
        "cluster": {"id": node.cluster_id, "name": cluster, "url": cluster_url(cluster)},
        "node": {"host": host, "url": node_url(cluster, host), "rack": node.rack, "switch": node.switch,
                 "spine": node.spine, "placed_by": node.placed_by,
                 "agent_id": node.agent_id, "first_seen": _epoch(node.first_seen), "last_seen": _epoch(node.last_seen),
                 "state": _state(node, findings["open"])},
        "gpu": gpu,
        "gpus": gpus,
        "ranks": _ranks(node),
        "ports": _ports(node),
        "interfaces": _interfaces(node) if gpu is None else None,
        "findings": findings,
        "silences": _silences(node, gpu),
        "events": [event_row(e, cluster, host) for e in events.order_by("-ts", "-id")[:EVENT_LIMIT]],
        "live": {"ws": f"/ws/live/?cluster={node.cluster_id}&node={host}"},
    }


# -- pages ----------------------------------------------------------------------------------------------------------


def _page(request: HttpRequest, name: str, host: str, gpu: int | None) -> HttpResponse:
    node = node_or_404(request.user, name, host)
    facts = node_facts(node, gpu)  # 404 for a GPU the node does not have
    base = f"/api/v1/clusters/{node.cluster.name}/nodes/{node.hostname}"
    data = {"facts": facts, "api": {"facts": base, "series": f"{base}/series"}}
    if gpu is not None:
        data["api"]["facts"] += f"?gpu={gpu}"
    template = "web/gpu.html" if gpu is not None else "web/node.html"
    # What a member may silence from here: the node (maintenance), and on the GPU view that GPU alone.
    targets = [("node", node.hostname, f"node {node.hostname} (maintenance: its GPUs, ranks and links)")]
    if gpu is not None:
        targets.insert(0, ("gpu", f"{node.hostname}/gpu{gpu}", f"GPU {node.hostname}/gpu{gpu}"))
    return render(request, template, {"cluster": node.cluster, "node": node, "gpu": gpu, "page_data": data,
                                      "facts": facts, "silence_targets": targets,
                                      **forms_context(request.user, node.cluster)})


@login_required
def node_detail(request: HttpRequest, name: str, host: str) -> HttpResponse:
    return _page(request, name, host, None)


@login_required
def gpu_detail(request: HttpRequest, name: str, host: str, index: int) -> HttpResponse:
    return _page(request, name, host, index)


# -- JSON API -------------------------------------------------------------------------------------------------------


@api
def node_api(request: HttpRequest, name: str, host: str) -> dict[str, Any]:
    node = node_or_404(request.user, name, host)
    gpu = int_param(request, "gpu", -1, -1, 1023)
    return node_facts(node, None if gpu < 0 else gpu)


@api
def node_series_api(request: HttpRequest, name: str, host: str) -> dict[str, Any]:
    node = node_or_404(request.user, name, host)
    gpu = int_param(request, "gpu", -1, -1, 1023)
    return node_series(node, parse_range(request), None if gpu < 0 else gpu)


urlpatterns: list[Any] = [
    path("clusters/<slug:name>/nodes/<str:host>/", node_detail, name="node"),
    path("clusters/<slug:name>/nodes/<str:host>/gpus/<int:index>/", gpu_detail, name="gpu"),
    path("api/v1/clusters/<slug:name>/nodes/<str:host>", node_api, name="api-node"),
    path("api/v1/clusters/<slug:name>/nodes/<str:host>/series", node_series_api, name="api-node-series"),
]


# -- OpenAPI ----------------------------------------------------------------------------------------------------------

_ERROR = {"content": {"application/json": {"schema": {"type": "object", "properties": {
    "error": {"type": "string"}, "detail": {"type": "string"}}}}}}
_PARAMS = [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}, "description": "cluster"},
           {"name": "host", "in": "path", "required": True, "schema": {"type": "string"}, "description": "node"},
           {"name": "gpu", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 0},
            "description": "narrow to one GPU (the GPU view)"}]
_RANGE = [{"name": "range", "in": "query", "required": False,
           "schema": {"enum": ["5m", "15m", "1h", "6h", "24h", "72h", "7d"]}, "description": "ending now (default 1h)"},
          {"name": "from", "in": "query", "required": False, "schema": {"type": "number"}, "description": "epoch s"},
          {"name": "to", "in": "query", "required": False, "schema": {"type": "number"}, "description": "epoch s"},
          {"name": "points", "in": "query", "required": False,
           "schema": {"type": "integer", "minimum": 10, "maximum": 5000},
           "description": "at most this many buckets per series (default 1500)"}]
_SERIES = {"type": "object", "description": "a downsampled series: t (bucket starts, epoch s) and per field the "
           "statistics the chart draws: min/mean/max for lines, max for counters and limits, min for link width"}
_ERRORS = {"401": {"description": "Not logged in", **_ERROR},
           "404": {"description": "No such cluster, node or GPU (or not yours)", **_ERROR}}

OPENAPI: dict[str, Any] = {
    "/api/v1/clusters/{name}/nodes/{host}": {"get": {
        "operationId": "getNode", "summary": "A node: where it sits, its state, GPUs, ranks, findings and events",
        "security": [{"session": []}], "parameters": _PARAMS,
        "responses": {"200": {"description": "The node", "content": {"application/json": {"schema": {
            "type": "object", "required": ["cluster", "node", "gpus", "ranks", "findings", "events"],
            "properties": {
                "node": {"type": "object", "description": "host, url, rack, switch, spine, placed_by (agent, file: an "
                         "owner's uploaded topology, which wins), agent_id, first_seen, last_seen, "
                         "state (up, stale, down)"},
                "gpus": {"type": "array", "items": {"type": "object", "description":
                         "index, name, uuid, pci_bus_id, url (the GPU view), latest sample, open_findings"}},
                "ranks": {"type": "array", "items": {"type": "object", "description":
                          "run, run_name, run_url, rank, url, gpu_index, active (its run stepped in the last 10 min)"}},
                "ports": {"type": "array", "items": {"type": "object"}},
                "interfaces": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
                    "reported_at": {"type": "number", "description": "epoch s of the agent's newest list"},
                    "items": {"type": "array", "items": {"$ref": "#/components/schemas/NetInterface"}}}}],
                    "description": "the node's network interfaces as its agent last reported them (null on the GPU "
                    "view, or when the agent sends none)"},
                "findings": {"type": "object", "description": "open and past findings on this node, with url and "
                             "subject_url; open ones say acked_by / acked_at and silenced"},
                "silences": {"type": "array", "items": {"type": "object"}, "description": "active silences of the "
                             "node, its GPUs and links: id, scope, target, reason, by, ends_at"},
                "events": {"type": "array", "items": {"type": "object", "description":
                           "newest first; an Xid carries xid: name, meaning, action, severity"}}}}}}},
            "400": {"description": "A bad parameter", **_ERROR}, **_ERRORS}}},
    "/api/v1/clusters/{name}/nodes/{host}/series": {"get": {
        "operationId": "getNodeSeries", "summary": "A node's time series, downsampled to at most ?points= per series",
        "security": [{"session": []}], "parameters": _PARAMS + _RANGE,
        "responses": {"200": {"description": "Per-GPU series and throttle bands; without ?gpu= also the host, NFS, "
                              "IB/RoCE ports and probes to and from each peer", "content": {"application/json": {
                                  "schema": {"type": "object", "required": ["range", "gpus", "throttle"],
                                             "properties": {
                    "range": {"type": "object", "description": "from, to, bucket_s, tier: the storage tier the GPU and "
                              "host series were read from (raw: 1 Hz samples; 10s, 1m: rollup windows, beyond the raw "
                              "hot window or when a bucket spans whole windows anyway)"},
                    "gpus": {"type": "object", "additionalProperties": _SERIES, "description": "by GPU index"},
                    "throttle": {"type": "object", "description": "by GPU index, by reason: [[t0, t1], ...] spans"},
                    "host": _SERIES, "nfs": {"type": "object", "additionalProperties": _SERIES},
                    "ports": {"type": "object", "additionalProperties": _SERIES, "description": "by device/port, "
                              "with counters (deltas per interval)"},
                    "probes": {"type": "object", "description": "all (out, in), series (worst peers), peers (table, "
                               "each with url and link_url)"}}}}}},
            "400": {"description": "A bad range or parameter", **_ERROR}, **_ERRORS}}},
}
