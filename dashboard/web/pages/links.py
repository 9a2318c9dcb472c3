"""The link matrix (node x node probe RTT and bandwidth) and one link's page (a pair's series, both directions).

The matrix answers "which path is slow?": every probed pair's median RTT, p99 RTT, loss and bulk bandwidth over the
range, nodes ordered by switch / rack so a sick node is a cross and a sick switch a block, and the pairs the
diagnosis would call bad marked with the diagnosis's own rule (:func:`dashboard.diagnosis.detectors.network._bad_pairs`
on per-pair aggregates, not a second copy of the thresholds).

Cost: one SQL aggregate over the range's probes grouped by (node, peer, time bucket) with a handful of buckets, one
for the host CPU, one for the nodes, one for the findings; the medians are numpy. A probe plan probes O(k) peers per
node, so the matrix is sparse and goes out as coordinate lists (COO: ``i``, ``j`` and one value list per metric).
"""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import quote

import numpy as np
from django.contrib.auth.decorators import login_required
from django.db.models import Avg, Q
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import path
from django.utils.http import RFC3986_SUBDELIMS
from django.views.decorators.gzip import gzip_page

from dashboard.diagnosis.detectors.base import Thresholds
from dashboard.diagnosis.detectors.network import _bad_pairs
from dashboard.diagnosis.detectors.window import GPU_NUM, GPU_OBJ, PORT_NUM, PORT_OBJ, SPANS, STEP_NUM, Table, Window
from dashboard.diagnosis.live import finding_row
from dashboard.diagnosis.models import Finding
from dashboard.storage import probe_samples
from dashboard.telemetry.models import Cluster, HostSample, Node
from dashboard.web.access import BadRequest, api, cluster_or_404
from dashboard.web.links import link_url, node_url
from dashboard.web.series import TimeRange, downsample_tiered, in_range, parse_range, tiered

# A pair's median over the range is the median of its per-bucket means over this many buckets: the database
# returns pairs x buckets rows (not one per probe), and a transient spike in one bucket does not move the median.
MATRIX_BUCKETS = 6
# Beyond this many (pair, bucket) rows the matrix is cut (``truncated``): a rotating probe plan touches nearly every
# pair of a 2,048-node cluster over a long range, and a response with millions of cells helps nobody.
MAX_ROWS = 400_000
NETWORK_KINDS = ("slow_link", "node_down")
URL_SAFE = RFC3986_SUBDELIMS + "/~:@"  # what django.urls.reverse leaves unquoted
# The link page's thresholds come from the cluster's newest probes in its range, over the span a diagnosis pass reads.
BASELINE_S = SPANS["probes"]


def _thresholds() -> Thresholds:
    from dashboard.diagnosis.tasks import thresholds

    return thresholds()


def _sig(v: float, digits: int = 3) -> float | None:
    """Three significant digits: the matrix is drawn as colour, and every digit costs bytes x cells."""
    if v is None or not math.isfinite(v):
        return None
    return float(f"{v:.{digits}g}")


def _sig_list(arr: np.ndarray) -> list[float | None]:
    return [_sig(float(v)) for v in arr]


# -- node order -----------------------------------------------------------------------------------------------------

def order_nodes(rows: list[tuple[str, str, str]], peers: set[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                                                            str | None]:
    """(nodes in matrix order, groups with their index span, what the groups are: "switch", "rack" or None).

    ``rows``: (hostname, rack, switch) of the cluster's nodes; ``peers``: probed names without a node (an address,
    a host with no agent), appended last. Nodes sort by switch, then rack, then host name, so the pairs behind one
    leaf switch form a block; the groups are the switches when any node has one, else the racks."""
    by = "switch" if any(s for _, _, s in rows) else "rack" if any(r for _, r, _ in rows) else None
    ordered = sorted(rows, key=lambda r: (by is not None and not (r[2] if by == "switch" else r[1]), r[2], r[1], r[0]))
    nodes = [{"host": h, "rack": r, "switch": s, "agent": True} for h, r, s in ordered]
    nodes += [{"host": p, "rack": "", "switch": "", "agent": False} for p in sorted(peers)]
    groups: list[dict[str, Any]] = []
    for i, n in enumerate(nodes):
        label = (n["switch"] if by == "switch" else n["rack"]) if by else ""
        label = label or ("not an agent" if not n["agent"] else "unplaced" if by else "")
        if groups and groups[-1]["label"] == label:
            groups[-1]["end"] = i + 1
        else:
            groups.append({"label": label, "start": i, "end": i + 1})
    return nodes, (groups if by or peers else []), by


# -- the matrix -----------------------------------------------------------------------------------------------------

def grouped_median(inverse: np.ndarray, values: np.ndarray, n_groups: int) -> np.ndarray:
    """Median of the non-NaN ``values`` of each group (``inverse``: the group of each row); NaN where none."""
    ok = ~np.isnan(values)
    g, v = inverse[ok], values[ok]
    order = np.lexsort((v, g))
    v = v[order]
    counts = np.bincount(g, minlength=n_groups)
    starts = np.cumsum(counts) - counts
    lo = np.clip(starts + (counts - 1) // 2, 0, max(len(v) - 1, 0))
    hi = np.clip(starts + counts // 2, 0, max(len(v) - 1, 0))
    if not len(v):
        return np.full(n_groups, np.nan)
    return np.where(counts > 0, (v[lo] + v[hi]) / 2, np.nan)


def _pair_rows(cluster: Cluster, tr: TimeRange) -> tuple[list[tuple[Any, ...]], bool]:
    """(node_id, peer, sent, lost, mean RTT, mean p99 RTT, mean bandwidth) per pair and bucket of the range."""
    width = max(1.0, math.ceil((tr.t1 - tr.t0) / MATRIX_BUCKETS))
    rows: list[tuple[Any, ...]] = list(probe_samples.pair_buckets(cluster.id, tr, width, MAX_ROWS + 1))
    return rows[:MAX_ROWS], len(rows) > MAX_ROWS


def _cpu_by_host(cluster: Cluster, tr: TimeRange) -> dict[str, dict[str, Any]]:
    """host -> {"cpu_pct": mean over the range}: the detector's busy-CPU allowance for user-space ping delay."""
    rows = (in_range(HostSample.objects.filter(cluster=cluster), tr).values_list("node__hostname")
            .annotate(cpu=Avg("cpu_pct")).order_by())
    return {h: {"cpu_pct": cpu} for h, cpu in rows}


def _window(hosts: list[str], src: np.ndarray, dst: np.ndarray, cols: dict[str, np.ndarray],
            cpu: dict[str, dict[str, Any]], now: float) -> Window:
    """A detector Window whose probe rows are the pairs' aggregates, so the diagnosis's own rule marks them."""
    probes = Table({"node": src.astype(float), "peer": dst.astype(float), "ts": np.full(len(src), now), **cols})
    empty = Table.from_rows
    return Window(now=now, nodes=hosts, steps=empty(STEP_NUM, (), []), gpus=empty(GPU_NUM, GPU_OBJ, []),
                  ports=empty(PORT_NUM, PORT_OBJ, []), probes=probes, events=[], hosts=cpu, runs=[], last_heard={})


def _limits(t: Thresholds, base: dict[str, float]) -> dict[str, Any]:
    """The lines a pair crosses to be bad (the same numbers ``_bad_pairs`` compared against)."""
    rtt, bw = base["rtt_ms"], base["bw_gbps"]
    return {"baseline_rtt_ms": _sig(rtt), "baseline_bw_gbps": _sig(bw),
            "rtt_ms": _sig(max(t.rtt_ratio * rtt, rtt + t.rtt_abs_ms)) if math.isfinite(rtt) else None,
            "rtt_busy_ms": _sig(max(t.rtt_ratio * rtt, rtt + t.rtt_busy_abs_ms)) if math.isfinite(rtt) else None,
            "bw_gbps": _sig(t.bw_ratio * bw) if math.isfinite(bw) else None, "loss_frac": t.loss_frac,
            "busy_cpu_pct": t.busy_cpu_pct, "rtt_ratio": t.rtt_ratio, "rtt_abs_ms": t.rtt_abs_ms,
            "bw_ratio": t.bw_ratio}


def network_findings(cluster: Cluster) -> list[dict[str, Any]]:
    qs = (Finding.objects.filter(cluster=cluster, state=Finding.State.OPEN, kind__in=NETWORK_KINDS)
          .select_related("cluster", "node", "peer_node").order_by("-updated_at")[:100])
    return [{**finding_row(f), "peer": f.peer_node.hostname if f.peer_node_id else None} for f in qs]


def link_matrix_data(cluster: Cluster, tr: TimeRange, t: Thresholds | None = None) -> dict[str, Any]:
    t = t or _thresholds()
    rows, truncated = _pair_rows(cluster, tr)
    node_rows = list(Node.objects.filter(cluster=cluster).values_list("id", "hostname", "rack", "switch"))
    host_of = {nid: h for nid, h, _, _ in node_rows}
    known = set(host_of.values())
    peers = {r[1] for r in rows} - known
    nodes, groups, by = order_nodes([(h, r, s) for _, h, r, s in node_rows], peers)
    index = {n["host"]: i for i, n in enumerate(nodes)}
    m = len(nodes)
    src = np.array([index[host_of[r[0]]] for r in rows], dtype=np.int64)
    dst = np.array([index[r[1]] for r in rows], dtype=np.int64)
    num = np.array([r[3:8] for r in rows], dtype=float).reshape(-1, 5).T  # sent, lost, rtt, p99, bw
    pair, inverse = np.unique(src * m + dst, return_inverse=True)
    k = len(pair)
    i, j = pair // m, pair % m
    sent = np.bincount(inverse, weights=num[0], minlength=k)
    lost = np.bincount(inverse, weights=num[1], minlength=k)
    rtt, p99, bw = (grouped_median(inverse, num[c], k) for c in (2, 3, 4))
    cpu = _cpu_by_host(cluster, tr)
    w = _window([n["host"] for n in nodes], i, j,
                {"sent": sent, "lost": lost, "rtt_ms": rtt, "bw_gbps": bw}, cpu, tr.t1)
    used, bad, base = _bad_pairs(w, t, set()) if k else (np.empty(0, int), np.zeros((2, 0), bool),
                                                           {"rtt_ms": math.nan, "bw_gbps": math.nan})
    with np.errstate(all="ignore"):
        loss = np.where(sent > 0, lost / np.maximum(sent, 1), np.nan)
    return {
        "cluster": cluster.name, "range": tr.as_dict(), "truncated": truncated,
        "nodes": _with_urls(cluster.name, nodes),
        "groups": groups, "grouped_by": by,
        "pair_url": link_url(cluster.name, "{a}", "{b}").replace("%7B", "{").replace("%7D", "}"),
        "pairs": {"i": i.tolist(), "j": j.tolist(), "rtt_ms": _sig_list(rtt), "rtt_p99_ms": _sig_list(p99),
                  "bw_gbps": _sig_list(bw), "loss": [_sig(float(v), 2) for v in loss]},
        "bad": _bad_rows(cluster.name, nodes, used, bad, i, j, rtt, bw, loss, t),
        "thresholds": _limits(t, base),
        "findings": network_findings(cluster),
    }


def _with_urls(cluster: str, nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each node's page URL: node_url() once, then the host quoted the way reverse() quotes it (2,048 reverse()
    calls would cost more than the whole matrix)."""
    pattern = node_url(cluster, "HOST-PLACEHOLDER")
    return [{**n, "url": pattern.replace("HOST-PLACEHOLDER", quote(n["host"], safe=URL_SAFE)) if n["agent"] else None}
            for n in nodes]


def _bad_rows(cluster: str, nodes: list[dict[str, Any]], used: np.ndarray, bad: np.ndarray, i: np.ndarray,
              j: np.ndarray, rtt: np.ndarray, bw: np.ndarray, loss: np.ndarray, t: Thresholds) -> list[dict[str, Any]]:
    out = []
    for pos in np.nonzero(bad[0] | bad[1])[0]:
        p = int(used[pos])
        a, b = nodes[int(i[p])]["host"], nodes[int(j[p])]["host"]
        why = (["loss"] if loss[p] >= t.loss_frac else ["rtt"] if bad[0][pos] else []) + (["bw"] if bad[1][pos] else [])
        out.append({"i": int(i[p]), "j": int(j[p]), "from": a, "to": b, "why": why, "rtt_ms": _sig(float(rtt[p])),
                    "bw_gbps": _sig(float(bw[p])), "loss": _sig(float(loss[p]), 2), "url": link_url(cluster, a, b)})
    return out


# -- one link -------------------------------------------------------------------------------------------------------

def _baseline(cluster: Cluster, tr: TimeRange, t: Thresholds) -> dict[str, Any]:
    """The cluster's quiet RTT and bandwidth as the detector computes them (25th / 75th percentile of probe rows),
    from the newest probes in the range (as much as a diagnosis pass reads): the lines the pair's series is judged
    against."""
    newest = probe_samples.newest(cluster.id, tr)
    if newest is None:
        return _limits(t, {"rtt_ms": math.nan, "bw_gbps": math.nan})
    recent = TimeRange(max(tr.t0, newest - BASELINE_S), newest + 1e-3)
    vals = np.array(probe_samples.values(cluster.id, recent, ("rtt_ms", "bw_gbps"), 200_000),
                    dtype=float).reshape(-1, 2)
    with np.errstate(all="ignore"):
        rtt = float(np.nanpercentile(vals[:, 0], 25)) if np.any(~np.isnan(vals[:, 0])) else math.nan
        bw = float(np.nanpercentile(vals[:, 1], 75)) if np.any(~np.isnan(vals[:, 1])) else math.nan
    return _limits(t, {"rtt_ms": rtt, "bw_gbps": bw})


def _end(cluster: Cluster, host: str) -> dict[str, Any]:
    node = Node.objects.filter(cluster=cluster, hostname=host).first()
    return {"host": host, "node": node, "url": node_url(cluster.name, host) if node else None}


def _pair_or_404(cluster: Cluster, a: str, b: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both ends; at least one must be a node of the cluster (the other may be a probed address without an agent)."""
    ea, eb = _end(cluster, a), _end(cluster, b)
    if a == b or (ea["node"] is None and eb["node"] is None):
        raise Http404("no such link")
    if ea["node"] is None or eb["node"] is None:
        agent = ea if ea["node"] else eb
        other = eb if ea["node"] else ea
        if not probe_samples.exists(cluster.id, agent["node"].id, other["host"]):
            raise Http404("no such link")
    return ea, eb


def _direction(cluster: Cluster, frm: dict[str, Any], to: dict[str, Any], tr: TimeRange) -> dict[str, Any]:
    series: dict[str, Any] = {}
    if frm["node"] is not None:
        series = probe_samples.from_node(frm["node"].id, tr, ["rtt_ms", "rtt_p99_ms", "loss", "bw_gbps"],
                                         peer=to["host"]) or {}
    return {"from": frm["host"], "to": to["host"], "series": series}


def link_series_data(cluster: Cluster, a: str, b: str, tr: TimeRange, t: Thresholds | None = None) -> dict[str, Any]:
    t = t or _thresholds()
    ea, eb = _pair_or_404(cluster, a, b)
    ids = [e["node"].id for e in (ea, eb) if e["node"] is not None]
    # The hosts' CPU from the tier the range needs: a week's link history outlives the raw host rows (hot window).
    cpu_tr = tiered(tr)
    cpu = downsample_tiered(HostSample, {"cluster": cluster, "node_id__in": ids}, cpu_tr, ["cpu_pct"], by=["node_id"])
    findings = (Finding.objects.filter(cluster=cluster, state=Finding.State.OPEN)
                .filter(Q(node_id__in=ids) | Q(peer_node_id__in=ids)).select_related("cluster", "node", "peer_node")
                .order_by("-updated_at")[:50])
    return {
        "cluster": cluster.name, "range": tr.as_dict(), "url": link_url(cluster.name, a, b),
        "a": {"host": a, "url": ea["url"]}, "b": {"host": b, "url": eb["url"]},
        "directions": [_direction(cluster, ea, eb, tr), _direction(cluster, eb, ea, tr)],
        "cpu": {e["host"]: cpu.get(str(e["node"].id), {}) for e in (ea, eb) if e["node"] is not None},
        "cpu_range": cpu_tr.as_dict(),
        "thresholds": _baseline(cluster, tr, t),
        "findings": [{**finding_row(f), "peer": f.peer_node.hostname if f.peer_node_id else None} for f in findings],
    }


# -- views ----------------------------------------------------------------------------------------------------------

@login_required
def link_matrix(request: HttpRequest, name: str) -> HttpResponse:
    cluster = cluster_or_404(request.user, name)
    return render(request, "web/links.html", {"cluster": cluster, "page_data": {
        "api": f"/api/v1/clusters/{cluster.name}/links"}})


@login_required
def link_detail(request: HttpRequest, name: str, a: str, b: str) -> HttpResponse:
    cluster = cluster_or_404(request.user, name)
    if a > b:  # one page per link, whichever way round it was named
        query = request.META.get("QUERY_STRING")
        return redirect(link_url(cluster.name, a, b) + (f"?{query}" if query else ""))
    ea, eb = _pair_or_404(cluster, a, b)
    return render(request, "web/link.html", {"cluster": cluster, "a": ea, "b": eb, "page_data": {
        "api": f"/api/v1/clusters/{cluster.name}/links/{a}/{b}/series", "a": a, "b": b}})


@gzip_page  # the matrix is numbers in lists: a 2,048-node answer shrinks several-fold
@api
def link_matrix_api(request: HttpRequest, name: str) -> dict[str, Any]:
    cluster = cluster_or_404(request.user, name)
    return link_matrix_data(cluster, parse_range(request, default="15m"))


@api
def link_series_api(request: HttpRequest, name: str, a: str, b: str) -> dict[str, Any]:
    cluster = cluster_or_404(request.user, name)
    if a == b:
        raise BadRequest("a link joins two different nodes")
    return link_series_data(cluster, a, b, parse_range(request, default="1h"))


urlpatterns: list[Any] = [
    path("clusters/<slug:name>/links/", link_matrix, name="links"),
    path("clusters/<slug:name>/links/<str:a>/<str:b>/", link_detail, name="link"),
    path("api/v1/clusters/<slug:name>/links", link_matrix_api, name="api-links"),
    path("api/v1/clusters/<slug:name>/links/<str:a>/<str:b>/series", link_series_api, name="api-link-series"),
]

_RANGE_PARAMS: list[dict[str, Any]] = [
    {"name": "range", "in": "query", "schema": {"enum": ["5m", "15m", "1h", "6h", "24h", "72h", "7d"]},
     "description": "A window ending now (default 15m for the matrix, 1h for a link's series)."},
    {"name": "from", "in": "query", "schema": {"type": "number"}, "description": "Custom start, epoch seconds."},
    {"name": "to", "in": "query", "schema": {"type": "number"}, "description": "Custom end, epoch seconds."},
    {"name": "points", "in": "query", "schema": {"type": "integer", "minimum": 10, "maximum": 5000},
     "description": "At most this many buckets per series (min / mean / max per bucket)."},
]
_NAME = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}, "description": "Cluster name."}
_ERRORS: dict[str, Any] = {
    "400": {"description": "A query parameter the API cannot use (the reason in `detail`)."},
    "401": {"description": "Not logged in."},
    "404": {"description": "No such cluster or link, or not a member of the cluster."},
}
OPENAPI: dict[str, Any] = {
    "/api/v1/clusters/{name}/links": {"get": {
        "operationId": "linkMatrix",
        "summary": "Node x node probe matrix: median RTT, p99 RTT, loss and bulk bandwidth per probed pair",
        "description": (
            "Directed pairs (row `i` = the probing node, column `j` = its peer), as sparse coordinate lists: "
            "`pairs.i[k]`, `pairs.j[k]` index into `nodes` and `pairs.<metric>[k]` is that pair's value (median "
            "over the range of per-bucket means; `loss` = lost / sent pings). Pairs never probed are absent. `nodes` "
            "are ordered by switch, then rack, then host name; `groups` give each switch's (or rack's) index span "
            "[start, end). `bad` lists the pairs the diagnosis rule (RTT vs the cluster's quiet RTT, loss, "
            "bandwidth vs the cluster's) calls bad, with why and the link page's `url`; `thresholds` are the lines "
            "they crossed. `findings`: open slow_link and node_down findings. `pair_url` is the link page's URL "
            "with `{a}` and `{b}` to fill in. `truncated`: the range held more (pair, bucket) rows than one answer "
            "carries; narrow the range."),
        "security": [{"session": []}],
        "parameters": [_NAME, *_RANGE_PARAMS],
        "responses": {"200": {"description": "The matrix.", "content": {"application/json": {"schema": {
            "type": "object",
            "required": ["cluster", "range", "nodes", "groups", "pairs", "bad", "thresholds", "findings"],
            "properties": {
                "nodes": {"type": "array", "items": {"type": "object", "properties": {
                    "host": {"type": "string"}, "rack": {"type": "string"}, "switch": {"type": "string"},
                    "agent": {"type": "boolean"}, "url": {"type": ["string", "null"]}}}},
                "groups": {"type": "array", "items": {"type": "object", "properties": {
                    "label": {"type": "string"}, "start": {"type": "integer"}, "end": {"type": "integer"}}}},
                "grouped_by": {"enum": ["switch", "rack", None]},
                "pairs": {"type": "object", "properties": {k: {"type": "array"} for k in
                                                           ("i", "j", "rtt_ms", "rtt_p99_ms", "bw_gbps", "loss")}},
                "bad": {"type": "array", "items": {"type": "object"}},
                "thresholds": {"type": "object"}, "findings": {"type": "array", "items": {"type": "object"}},
                "truncated": {"type": "boolean"}, "pair_url": {"type": "string"}}}}}},
            **_ERRORS},
    }},
    "/api/v1/clusters/{name}/links/{a}/{b}/series": {"get": {
        "operationId": "linkSeries",
        "summary": "One link's probe series in both directions, each end's host CPU, and the open findings on it",
        "description": (
            "`directions[0]` is a→b, `directions[1]` b→a; each `series` is `{t, rtt_ms, rtt_p99_ms, loss, bw_gbps}` "
            "with min / mean / max per bucket. `cpu`: host -> `{t, cpu_pct}` (user-space pings slow down on a busy "
            "CPU), read from the storage tier its range needs; `cpu_range` says which (`tier`: `raw`, `10s`, `1m`) and "
            "its `bucket_s`. `thresholds`: the diagnosis's lines from the cluster's newest probes in the range (the span one "
            "diagnosis pass reads). "
            "`findings`: open findings on either node or the pair."),
        "security": [{"session": []}],
        "parameters": [_NAME, {"name": "a", "in": "path", "required": True, "schema": {"type": "string"}},
                       {"name": "b", "in": "path", "required": True, "schema": {"type": "string"}}, *_RANGE_PARAMS],
        "responses": {"200": {"description": "The series.", "content": {"application/json": {"schema": {
            "type": "object", "required": ["a", "b", "directions", "cpu", "thresholds", "findings"]}}}},
            **_ERRORS},
    }},
}
