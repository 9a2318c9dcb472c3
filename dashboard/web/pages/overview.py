"""The cluster overview (the answer first: the worst open findings; then the health map of every node and GPU, the
findings, the events timeline and the runs) and the search that finds a node, run or rank by name.

The page renders the overview API's answer into itself (first paint without a second request), then keeps it live
from the websocket (GPU numbers, findings, events) and re-reads the API every few seconds for node states and runs.
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.db.models import F, Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import path, reverse

from dashboard.diagnosis.detectors.base import SEVERITY_RANK
from dashboard.storage import step_samples
from dashboard.telemetry.models import Cluster, Event, Node, Rank, Run
from dashboard.web.access import BadRequest, api, cluster_or_404, epoch_param, int_param, visible_clusters
from dashboard.web.links import cluster_url, findings_url, gpu_url, node_url, rank_url, run_url
from dashboard.web.pages.overview_health import LiveRows, findings_key, node_states
from dashboard.web.pages.overview_runs import runs_overview

EVENTS_PAGE = 50
SEARCH_LIMIT = 50


# -- the overview ----------------------------------------------------------------------------------------------------

def overview(cluster: Cluster, now: float | None = None, live_rows: LiveRows | None = None) -> dict[str, Any]:
    now = time.time() if now is None else now
    body: dict[str, Any] = {"cluster": {
        "id": cluster.id, "name": cluster.name, "url": cluster_url(cluster.name),
        "findings_url": findings_url(cluster.name), "live": f"/ws/live/?cluster={cluster.id}",
        "overview_api": reverse("api-overview", args=[cluster.name]),
        "events_api": reverse("api-events", args=[cluster.name])}, "now": now}
    body.update(node_states(cluster, now, live_rows))
    body.update(runs_overview(cluster, now))
    body["events"] = events_page(cluster, None, None, EVENTS_PAGE, "warning")
    return body


def freshness(cluster: Cluster) -> list[Any]:
    """The open findings (id, severity, last visible change) and the newest event's id: an overview computed earlier
    with the same freshness shows the findings and events as they are now. Two light queries."""
    newest = events_page(cluster, None, None, 1, "warning")["events"]
    return [findings_key(cluster), newest[0]["id"] if newest else None]


def first_paint(cluster: Cluster) -> dict[str, Any]:
    """The overview the page is rendered with. Embedded, the diagnosis process computes it after every pass (off the
    server's GIL and database thread: at 2,048 nodes this was most of the page's time to first byte); it is used while
    it is younger than two passes and shows the findings and the newest event as they are now, else computed here.
    Node states and GPU numbers in it may be a pass old: the websocket snapshot right after corrects them, and the
    API refresh (always computed) replaces it."""
    from dashboard.diagnosis.offload import precomputed_overview

    got = precomputed_overview(cluster.id, 2 * float(settings.CLUSTERDX["DIAGNOSIS_INTERVAL_S"]))
    if got is not None and got[1] == freshness(cluster):
        return got[0]
    return overview(cluster)


@login_required
def cluster_detail(request: HttpRequest, name: str) -> HttpResponse:
    cluster = cluster_or_404(request.user, name)
    return render(request, "web/cluster.html", {"cluster": cluster, "overview": first_paint(cluster)})


@api
def overview_api(request: HttpRequest, name: str) -> dict[str, Any]:
    return overview(cluster_or_404(request.user, name))


# -- events, pages back in time ------------------------------------------------------------------------------------

def _severities(lowest: str) -> list[str]:
    if lowest not in SEVERITY_RANK:
        raise BadRequest(f"min_severity must be one of {', '.join(SEVERITY_RANK)}")
    return [s for s, r in SEVERITY_RANK.items() if r >= SEVERITY_RANK[lowest]]


def events_page(cluster: Cluster, before: float | None, before_id: int | None, limit: int,
                lowest: str) -> dict[str, Any]:
    """Newest first, ``limit`` at a time; ``next`` is the cursor of the page before (ts and id, so events that share
    a timestamp are neither skipped nor repeated)."""
    qs = Event.objects.filter(cluster=cluster, severity__in=_severities(lowest))
    if before is not None:
        at = datetime.fromtimestamp(before, tz=UTC)
        qs = qs.filter(Q(ts__lt=at) | Q(ts=at, id__lt=before_id) if before_id is not None else Q(ts__lt=at))
    rows = list(qs.order_by("-ts", "-id").values("id", "ts", "node__hostname", "kind", "severity", "code", "gpu_index",
                                                   "message", "run_id", "rank")[:limit + 1])
    out = []
    for r in rows[:limit]:
        host, gpu = r["node__hostname"], r["gpu_index"]
        out.append({"id": r["id"], "ts": r["ts"].timestamp(), "host": host, "kind": r["kind"],
                    "severity": r["severity"], "code": r["code"], "gpu_index": gpu, "message": r["message"][:300],
                    "url": node_url(cluster.name, host) if host else None,
                    "gpu_url": gpu_url(cluster.name, host, gpu) if host and gpu is not None else None,
                    "run_url": run_url(r["run_id"]) if r["run_id"] else None, "rank": r["rank"]})
    more = len(rows) > limit and out
    return {"events": out, "next": {"before": out[-1]["ts"], "before_id": out[-1]["id"]} if more else None}


@api
def events_api(request: HttpRequest, name: str) -> dict[str, Any]:
    cluster = cluster_or_404(request.user, name)
    before_id = request.GET.get("before_id")
    return events_page(cluster, epoch_param(request, "before"),
                       int_param(request, "before_id", 0, 0, 2**62) if before_id else None,
                       int_param(request, "limit", EVENTS_PAGE, 1, 500),
                       request.GET.get("min_severity") or "warning")


# -- search ----------------------------------------------------------------------------------------------------------

# A rank is at most 1,000,000 (clusterdx.wire): seven digits. An unbounded \d+ let "q=<5,000 nines>" reach int(),
# which refuses strings over 4,300 digits (a 500 the fuzz found); longer numbers are searched as names only.
_RANK_ANY = re.compile(r"(?:rank\s*)?(\d{1,7})", re.I)
_RANK_IN = re.compile(r"(.+?)\s*[/:\s]\s*(?:rank\s*)?(\d{1,7})", re.I)


def _rank_results(clusters: Any, run_part: str | None, number: int) -> list[dict[str, Any]]:
    runs_q = Run.objects.filter(cluster__in=clusters)
    if run_part:
        runs_q = runs_q.filter(name__icontains=run_part)
    runs = list(runs_q.select_related("cluster").order_by(F("last_step_at").desc(nulls_last=True))[:10])
    placed = {(r.run_id): r for r in Rank.objects.filter(run__in=runs, rank=number).select_related("node")}
    # Runs whose hooks sent no metadata have no Rank rows: their steps still say which ranks exist.
    stepped = step_samples.runs_with_rank([r.id for r in runs if r.id not in placed], number)
    out = []
    for run in runs:
        if run.id not in placed and run.id not in stepped:
            continue
        node = placed[run.id].node if run.id in placed else None
        out.append({"type": "rank", "label": f"{run.name}/rank{number}", "cluster": run.cluster.name,
                    "detail": f"on {node.hostname}" if node else f"rank of {run.name}",
                    "url": rank_url(run.id, number)})
    return out


def search_results(user: Any, q: str, cluster: str | None) -> dict[str, Any]:
    """Nodes whose host name contains ``q``, runs whose name contains it, and ranks ("rank 5", "llm/rank5",
    "llm 5", or a bare number: that rank of each recent run), in the user's clusters (or the one named)."""
    q = q.strip()
    if not q:
        raise BadRequest("q must not be empty")
    clusters = visible_clusters(user)
    if cluster:
        clusters = clusters.filter(name=cluster)
    results: list[dict[str, Any]] = []
    nodes = (Node.objects.filter(cluster__in=clusters, hostname__icontains=q).select_related("cluster")
             .order_by("hostname")[:SEARCH_LIMIT])
    for n in sorted(nodes, key=lambda n: n.hostname.lower() != q.lower()):
        results.append({"type": "node", "label": n.hostname, "cluster": n.cluster.name,
                        "detail": " · ".join(filter(None, [n.rack, n.switch])) or "node",
                        "url": node_url(n.cluster.name, n.hostname)})
    runs = Run.objects.filter(cluster__in=clusters, name__icontains=q).select_related("cluster")
    for r in sorted(runs[:SEARCH_LIMIT], key=lambda r: r.name.lower() != q.lower()):
        results.append({"type": "run", "label": r.name, "cluster": r.cluster.name,
                        "detail": f"step {r.last_step}" if r.last_step is not None else "run", "url": run_url(r.id)})
    if m := _RANK_ANY.fullmatch(q):
        results += _rank_results(clusters, None, int(m.group(1)))
    elif m := _RANK_IN.fullmatch(q):
        results += _rank_results(clusters, m.group(1), int(m.group(2)))
    exact = [r for r in results if r["label"].lower() == q.lower()]
    return {"q": q, "cluster": cluster, "results": results[:SEARCH_LIMIT], "exact": exact[0] if len(exact) == 1 else None,
            "truncated": len(results) > SEARCH_LIMIT}


@api
def search_api(request: HttpRequest) -> dict[str, Any]:
    return search_results(request.user, request.GET.get("q", ""), request.GET.get("cluster") or None)


@login_required
def search(request: HttpRequest) -> HttpResponse:
    q = request.GET.get("q", "").strip()
    name = request.GET.get("cluster") or None
    found = search_results(request.user, q, name) if q else {"q": "", "results": [], "exact": None}
    if len(found["results"]) == 1 or found["exact"]:  # one match (or one exact name): go straight to its page
        return redirect((found["exact"] or found["results"][0])["url"])
    cluster = cluster_or_404(request.user, name) if name else None
    return render(request, "web/search.html", {"found": found, "search_query": q, "cluster": cluster})


urlpatterns: list[Any] = [
    path("clusters/<slug:name>/", cluster_detail, name="cluster"),
    path("search/", search, name="search"),
    path("api/v1/clusters/<slug:name>/overview", overview_api, name="api-overview"),
    path("api/v1/clusters/<slug:name>/events", events_api, name="api-events"),
    path("api/v1/search", search_api, name="api-search"),
]

# -- OpenAPI ---------------------------------------------------------------------------------------------------------

_ERR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_NAME = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}, "description": "cluster name"}
_SEV = {"enum": list(SEVERITY_RANK)}
_EVENT = {"type": "object", "properties": {
    "id": {"type": "integer"}, "ts": {"type": "number"}, "host": {"type": ["string", "null"]},
    "kind": {"type": "string"}, "severity": _SEV, "code": {"type": ["integer", "null"]},
    "gpu_index": {"type": ["integer", "null"]}, "message": {"type": "string"},
    "url": {"type": ["string", "null"], "description": "the node's page"}, "gpu_url": {"type": ["string", "null"]},
    "run_url": {"type": ["string", "null"]}, "rank": {"type": ["integer", "null"]}}}
_EVENTS = {"type": "object", "properties": {
    "events": {"type": "array", "items": _EVENT},
    "next": {"type": ["object", "null"], "description": "pass as before / before_id for the page before this one",
             "properties": {"before": {"type": "number"}, "before_id": {"type": "integer"}}}}}
_NODE = {"type": "object", "properties": {
    "host": {"type": "string"}, "url": {"type": "string"}, "rack": {"type": "string"}, "switch": {"type": "string"},
    "state": {"enum": ["ok", "stale", "down"], "description":
              "down: silent past CLUSTERDX_HEARTBEAT_TIMEOUT_S or an open node_down finding; stale: silent past half "
              "that (at least 6 s, Node.last_seen's write interval + 1 s)"},
    "silent_s": {"type": ["number", "null"]}, "severity": {"type": ["string", "null"],
                                                           "description": "worst open finding naming the node"},
    "node_severity": {"type": ["string", "null"], "description": "worst open finding on the node, not one GPU"},
    "findings": {"type": "integer"},
    "gpus": {"type": "array", "description": "one list per GPU, in the order of gpu_columns (util, temperature and "
             "memory are null unless the GPU's state is ok: a dead GPU never shows its last numbers; url only for a GPU "
             "a finding names, any other GPU is reached through its node's page)",
             "items": {"type": "array"}}}}
_RUN = {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string"}, "url": {"type": "string"},
    "state": {"enum": ["running", "stalled", "finished", "crashed"], "description":
              "crashed: an open rank_down finding whose rank crashed, or hooks said crashed after the last step; "
              "stalled: an open hang / rank_down finding (or a node_down naming the run), or no step for "
              "max(5 x median step, 3 s); finished: hooks said finished, or no step for an hour; else running"},
    "last_step": {"type": ["integer", "null"]}, "step_rate": {"type": ["number", "null"], "description": "steps/s"},
    "mfu": {"type": ["number", "null"]}, "tokens_per_s": {"type": ["number", "null"]},
    "at_risk": {"type": ["object", "null"], "description": "usd, gpu_hours, steps_since the last checkpoint (or the "
                "start, since: start), priced at CLUSTERDX_GPU_HOUR_PRICE_USD"}}}
_OK = "application/json"

OPENAPI: dict[str, Any] = {
    "/api/v1/clusters/{name}/overview": {"get": {
        "operationId": "clusterOverview", "summary": "Every node and GPU with its state, open findings, runs, events",
        "security": [{"session": []}], "parameters": [_NAME],
        "responses": {
            "200": {"description": "The overview", "content": {_OK: {"schema": {"type": "object", "properties": {
                "cluster": {"type": "object"}, "now": {"type": "number"},
                "summary": {"type": "object", "description": "node counts per state, GPUs, mean utilisation, "
                            "open findings per severity"},
                "thresholds": {"type": "object", "properties": {"stale_s": {"type": "number"},
                                                                "down_s": {"type": "number"}}},
                "group_by": {"enum": ["rack", "switch", None]}, "gpu_columns": {"type": "array"},
                "nodes": {"type": "array", "items": _NODE},
                "findings": {"type": "array", "description": "open findings, worst first (at most 100), each with "
                             "url, subject_url, headline (its key evidence) and age_s", "items": {"type": "object"}},
                "runs": {"type": "array", "items": _RUN}, "runs_total": {"type": "integer"},
                "events": _EVENTS}}}}},
            "401": {"description": "Not logged in", **_ERR},
            "404": {"description": "No such cluster (or not yours)", **_ERR}}}},
    "/api/v1/clusters/{name}/events": {"get": {
        "operationId": "clusterEvents", "summary": "The cluster's events, newest first, paging back in time",
        "security": [{"session": []}],
        "parameters": [_NAME,
                       {"name": "before", "in": "query", "schema": {"type": "number"}, "description": "epoch s"},
                       {"name": "before_id", "in": "query", "schema": {"type": "integer"},
                        "description": "with before: events at exactly that time with a smaller id are included"},
                       {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 500}},
                       {"name": "min_severity", "in": "query", "schema": _SEV, "description": "default warning"}],
        "responses": {"200": {"description": "One page of events", "content": {_OK: {"schema": _EVENTS}}},
                      "400": {"description": "A bad parameter", **_ERR},
                      "401": {"description": "Not logged in", **_ERR},
                      "404": {"description": "No such cluster (or not yours)", **_ERR}}}},
    "/api/v1/search": {"get": {
        "operationId": "search", "summary": "Find nodes, runs and ranks by name in your clusters",
        "security": [{"session": []}],
        "parameters": [{"name": "q", "in": "query", "required": True, "schema": {"type": "string"},
                        "description": "a host name part, a run name part, or a rank: rank 5, llm/rank5, llm 5, 5"},
                       {"name": "cluster", "in": "query", "schema": {"type": "string"}}],
        "responses": {"200": {"description": "Matches, each with its page", "content": {_OK: {"schema": {
            "type": "object", "properties": {"results": {"type": "array", "items": {"type": "object", "properties": {
                "type": {"enum": ["node", "run", "rank"]}, "label": {"type": "string"}, "cluster": {"type": "string"},
                "detail": {"type": "string"}, "url": {"type": "string"}}}}}}}}},
                      "400": {"description": "An empty query", **_ERR},
                      "401": {"description": "Not logged in", **_ERR}}}},
}
