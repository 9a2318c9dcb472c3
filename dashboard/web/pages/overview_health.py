"""The health of every node and GPU of a cluster, in a few queries: the overview's health map and findings list.

At 2,048 nodes x 8 GPUs this runs on every overview refresh, so nothing here loops over nodes with a query: one query
for the nodes, one for their GPUs, one for the open findings (light columns), one for the listed findings in full;
the latest GPU samples come from the live state (Redis or memory), not the database.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from django.conf import settings

from dashboard.diagnosis.detectors.base import SEVERITY_RANK
from dashboard.diagnosis.live import finding_row
from dashboard.diagnosis.loader import _epoch, _rows
from dashboard.diagnosis.models import Finding
from dashboard.ingest.writer import LAST_SEEN_EVERY_S
from dashboard.live.state import get_state
from dashboard.telemetry.models import Cluster, Gpu, Node
from dashboard.web.links import gpu_url, node_url

LISTED_FINDINGS = 100
_PLAIN = re.compile(r"[A-Za-z0-9._~-]+")  # nothing to quote in a URL path segment
# What each GPU carries in the overview, as a list (16,384 of them at 2,048 nodes: key names would double the size).
# ``url`` only for a GPU a finding names (the map opens its page); any other GPU is reached through its node's page,
# which keeps 16,384 links (700 kB) out of every refresh.
GPU_COLUMNS = ["index", "util_gpu_pct", "temp_c", "mem_used_gib", "severity", "state", "url"]


def thresholds() -> dict[str, float]:
    """When a node is *stale* (missed a few reports) and *down* (silent past the heartbeat timeout, the same timeout
    the diagnosis uses). Node.last_seen is written at most every LAST_SEEN_EVERY_S, so stale waits at least that long
    past it when the live heartbeat is not there."""
    down = float(settings.CLUSTERDX["HEARTBEAT_TIMEOUT_S"])
    return {"stale_s": min(down, max(down / 2, LAST_SEEN_EVERY_S + 1.0)), "down_s": down}


def worst(*sevs: str | None) -> str | None:
    best = None
    for s in sevs:
        if s is not None and (best is None or SEVERITY_RANK.get(s, -1) > SEVERITY_RANK.get(best, -1)):
            best = s
    return best


@dataclass
class _Marks:
    """Worst open finding severity per node (any finding naming it), per node itself (not one GPU), per GPU."""

    node: dict[int, str] = field(default_factory=dict)
    node_own: dict[int, str] = field(default_factory=dict)
    gpu: dict[tuple[int, int], str] = field(default_factory=dict)
    count: dict[int, int] = field(default_factory=dict)
    down: set[int] = field(default_factory=set)

    def add(self, node_id: int | None, gpu: int | None, sev: str, kind: str, own: bool) -> None:
        if node_id is None:
            return
        self.node[node_id] = worst(self.node.get(node_id), sev) or sev
        self.count[node_id] = self.count.get(node_id, 0) + 1
        if kind == "node_down":
            self.down.add(node_id)
        if gpu is not None and own:
            self.gpu[(node_id, gpu)] = worst(self.gpu.get((node_id, gpu)), sev) or sev
        else:
            self.node_own[node_id] = worst(self.node_own.get(node_id), sev) or sev


def _open_light(cluster: Cluster) -> tuple[list[tuple[Any, ...]], _Marks]:
    rows = list(Finding.objects.filter(cluster=cluster, state=Finding.State.OPEN).values_list(
        "id", "severity", "updated_at", "node_id", "peer_node_id", "gpu_index", "kind", "subject_type"))
    marks = _Marks()
    for _, sev, _, node_id, peer_id, gpu, kind, stype in rows:
        # A rank's finding carries its GPU: the straggler shows as that GPU's cell. Both ends of a link are marked.
        marks.add(node_id, gpu, sev, kind, own=stype in ("gpu", "rank"))
        if peer_id is not None:
            marks.add(peer_id, None, sev, kind, own=False)
    return rows, marks


def _url_maker(make: Any, *sample: Any) -> Any:
    """reverse() costs ~20 µs: 16,384 GPU links would take a third of a second. Reverse once with placeholders and
    fill them in (quoted as reverse quotes them); checked against the real reverse, else every call reverses."""
    marks = [908070605040 + i if isinstance(v, int) else f"__{i}__" for i, v in enumerate(sample)]
    template = make(*marks)

    def fill(*args: Any) -> str:
        out = template
        for m, a in zip(marks, args, strict=True):
            text = str(a)
            out = out.replace(str(m), text if _PLAIN.fullmatch(text) else quote(text, safe="-._~!$&'()*+,;=:@"))
        return out

    return fill if fill(*sample) == make(*sample) else make


LiveRows = tuple[list[list[Any]], dict[str, float]]  # the live state's GPU rows and heartbeats of one cluster


def _latest_gpus(cluster_id: int, given: LiveRows | None) -> tuple[dict[tuple[str, int], list[Any]], dict[str, float]]:
    live = get_state()
    gpus, beats = given if given is not None else (live.gpus(cluster_id), live.heartbeats(cluster_id))
    return {(r[0], int(r[1])): r for r in gpus}, beats


def findings_key(cluster: Cluster) -> list[list[Any]]:
    """What the open findings are now (id, severity, last visible change): one light query, to tell whether an
    overview computed earlier still shows the right findings."""
    return [[i, sev, ts.timestamp()] for i, sev, ts in Finding.objects.filter(
        cluster=cluster, state=Finding.State.OPEN).order_by("id").values_list("id", "severity", "updated_at")]


def node_states(cluster: Cluster, now: float | None = None, live_rows: LiveRows | None = None) -> dict[str, Any]:
    """Every node with its state and its GPUs' latest numbers, and the open findings (the worst first).
    ``live_rows``: the live state's rows when the caller has them (the diagnosis process cannot see the embedded
    server's memory); by default read from the live state."""
    now = time.time() if now is None else now
    th = thresholds()
    # last_seen as epoch seconds from SQL: 2,048 datetime conversions cost more than the query.
    nodes = _rows(Node, ["id", "hostname", "rack", "switch", _epoch("last_seen")], "cluster_id = %s ORDER BY hostname",
                  [cluster.id])
    gpu_index: dict[int, list[int]] = {}
    for node_id, index in Gpu.objects.filter(node__cluster=cluster).values_list("node_id", "index"):
        gpu_index.setdefault(node_id, []).append(index)
    light, marks = _open_light(cluster)
    live, beats = _latest_gpus(cluster.id, live_rows)
    by_host: dict[str, list[int]] = {}  # GPUs the live state knows before their Gpu row commits
    for host, index in live:
        by_host.setdefault(host, []).append(index)
    n_url = _url_maker(lambda h: node_url(cluster.name, h), "node-0")
    g_url = _url_maker(lambda h, i: gpu_url(cluster.name, h, i), "node-0", 0)
    out, counts = [], {"ok": 0, "stale": 0, "down": 0}
    busy: list[float] = []
    for node_id, host, rack, switch, last_seen in nodes:
        heard = max(last_seen if last_seen is not None else -1.0, beats.get(host, -1.0))
        silent = now - heard if heard > 0 else None
        state = ("down" if node_id in marks.down or (silent is not None and silent > th["down_s"])
                 else "stale" if silent is None or silent > th["stale_s"] else "ok")
        counts[state] += 1
        indices = sorted(set(gpu_index.get(node_id, [])) | set(by_host.get(host, [])))
        rows = [live.get((host, i)) for i in indices]
        newest = max((r[2] for r in rows if r and r[2] is not None), default=None)
        gpus = []
        for i, r in zip(indices, rows, strict=True):
            # A GPU whose samples stopped while its node still reports (it fell off the bus) is stale on its own:
            # compared with its node's newest sample, the agent's clock, so clock skew cannot make it look stale.
            gstate = state if state != "ok" else (
                "stale" if r is None or r[3] is None or (newest is not None and newest - r[2] > th["stale_s"])
                else "ok")
            numbers = [r[3], r[6], round(r[4] / 2**30, 1) if r[4] is not None else None] \
                if r is not None and gstate == "ok" else [None, None, None]  # never a dead GPU's last numbers
            if gstate == "ok" and numbers[0] is not None:
                busy.append(float(numbers[0]))
            sev = marks.gpu.get((node_id, i))
            gpus.append([i, *numbers, sev, gstate, g_url(host, i) if sev else None])
        out.append({"host": host, "url": n_url(host), "rack": rack, "switch": switch, "state": state,
                    "silent_s": round(silent, 1) if silent is not None else None,
                    "severity": marks.node.get(node_id), "node_severity": marks.node_own.get(node_id),
                    "findings": marks.count.get(node_id, 0), "gpus": gpus})
    group_by = "rack" if any(n["rack"] for n in out) else "switch" if any(n["switch"] for n in out) else None
    if group_by:
        out.sort(key=lambda n: (n[group_by] or "~", n["host"]))
    by_sev = {s: 0 for s in SEVERITY_RANK}
    for row in light:
        by_sev[row[1]] = by_sev.get(row[1], 0) + 1
    summary = {"nodes": len(out), **counts, "gpus": sum(len(n["gpus"]) for n in out),
               "gpu_util_mean": round(sum(busy) / len(busy), 1) if busy else None,
               "findings": len(light), "findings_by_severity": by_sev}
    return {"nodes": out, "group_by": group_by, "summary": summary, "thresholds": th,
            "gpu_columns": GPU_COLUMNS, "findings": listed_findings(cluster, light, now)}


def listed_findings(cluster: Cluster, light: list[tuple[Any, ...]], now: float) -> list[dict[str, Any]]:
    """The open findings a person reads first: worst severity, then most recently updated."""
    light = sorted(light, key=lambda r: (-SEVERITY_RANK.get(r[1], -1), -r[2].timestamp()))[:LISTED_FINDINGS]
    order = {r[0]: i for i, r in enumerate(light)}
    qs = Finding.objects.filter(id__in=list(order)).select_related("cluster", "node", "peer_node")
    rows = []
    for f in sorted(qs, key=lambda f: order[f.id]):
        row = finding_row(f)
        row.pop("action", None)  # the finding page has it; the list stays small
        row["headline"] = headline(f.kind, f.evidence or {})
        row["age_s"] = round(now - f.opened_at.timestamp(), 1)
        rows.append(row)
    from dashboard.diagnosis.silences import mark

    return mark(rows)  # acked_by / silenced for the list's pills, one query


# -- one line of evidence per finding kind -------------------------------------------------------------------------

def _pct(v: Any) -> str:
    return f"{100 * float(v):.0f}%"


def _num(v: Any, nd: int = 2) -> str:
    return f"{float(v):.{nd}f}"


def _have(m: dict[str, Any], *keys: str) -> bool:
    return all(m.get(k) is not None for k in keys)


def _gpu_line(m: dict[str, Any]) -> str:
    gpu = m.get("gpu") or {}
    if gpu.get("clock_ratio") is None:
        return ""
    why = f" ({', '.join(gpu['reasons'])})" if gpu.get("reasons") else ""
    return f"; SM clock {_pct(gpu['clock_ratio'])} of max{why}"


def _headline_rank_timing(kind: str, m: dict[str, Any]) -> str | None:
    if kind == "data_starvation":
        if _have(m, "data_wait_s", "median_data_wait_s", "data_wait_share"):
            return (f"data wait {_pct(m['data_wait_share'])} of each step ({_num(m['data_wait_s'], 3)} s vs "
                    f"{_num(m['median_data_wait_s'], 3)} s median)")
        if _have(m, "data_wait_share"):
            return f"every rank waits {_pct(m['data_wait_share'])} of each step for data"
    if kind == "straggler" and _have(m, "compute_s", "median_compute_s"):
        slower = f" (+{_pct(m['slower_frac'])})" if m.get("slower_frac") is not None else ""
        return (f"compute {_num(m['compute_s'], 3)} s vs {_num(m['median_compute_s'], 3)} s median{slower}"
                + _gpu_line(m))
    return None


def _headline_network(kind: str, m: dict[str, Any]) -> str | None:
    if kind == "node_down" and _have(m, "silent_s"):
        loss = f", peers lose {_pct(m['probe_loss'])} of probes" if m.get("probe_loss") is not None else ""
        ranks = f", {len(m['ranks'])} rank(s) stopped" if m.get("ranks") else ""
        return f"silent {float(m['silent_s']):.0f} s{loss}{ranks}"
    if kind == "cluster_silent" and _have(m, "silent_s", "nodes"):
        ranks = f", {len(m['ranks'])} rank(s) of running jobs on them" if m.get("ranks") else ""
        lag = m.get("ingest_lag_s")
        late = f"; their batches reach this server {float(lag):.0f} s late" if _have(m, "ingest_lag_s") and lag >= 1 else ""
        return f"all {int(m['nodes']):,} nodes silent {float(m['silent_s']):.0f} s{ranks}{late}"
    if kind == "clock_skew" and _have(m, "behind_s"):
        return f"clock {float(m['behind_s']):.0f} s behind this server's; its batches still arrive"
    if kind == "slow_link":
        if m.get("port"):
            errs = ", ".join(f"{k} {v}" for k, v in sorted((m.get("errors") or {}).items())[:2])
            return f"port {m['port']}" + (f": {errs}" if errs else "") + \
                (f", {float(m['rate_gbps']):.0f} Gb/s" if m.get("rate_gbps") is not None else "")
        if (m.get("loss") or 0) >= 0.2:
            return f"probe loss {_pct(m['loss'])}"
        if _have(m, "rtt_ms", "baseline_rtt_ms") and m["rtt_ms"] > 1.5 * m["baseline_rtt_ms"]:
            return f"RTT {_num(m['rtt_ms'])} ms vs {_num(m['baseline_rtt_ms'])} ms baseline"
        if _have(m, "bw_gbps", "baseline_bw_gbps"):
            return f"bandwidth {_num(m['bw_gbps'])} Gb/s vs {_num(m['baseline_bw_gbps'])} Gb/s baseline"
    return None


def _headline_stall(kind: str, m: dict[str, Any]) -> str | None:
    if kind == "hang" and _have(m, "stalled_s"):
        times = (f" ({float(m['stalled_s']) / float(m['median_step_s']):.0f}× the median step)"
                 if m.get("median_step_s") else "")
        return f"no step for {float(m['stalled_s']):.0f} s{times}"
    if kind == "rank_down" and _have(m, "state"):
        silent = f", no beat for {float(m['silent_s']):.0f} s" if m.get("silent_s") is not None else ""
        return f"rank {m['state']}{silent}; run stalled {float(m.get('stalled_s') or 0):.0f} s" + \
            (f": {m['error'][:80]}" if m.get("error") else "")
    if kind == "checkpoint_overdue" and _have(m, "usd_at_risk", "gpu_hours_at_risk"):
        return (f"${float(m['usd_at_risk']):,.0f} at risk: {float(m['gpu_hours_at_risk']):.1f} GPU-hours, "
                f"{m.get('steps_since', '?')} steps since the last checkpoint")
    return None


def _headline_gpu(kind: str, m: dict[str, Any], evidence: dict[str, Any]) -> str | None:
    if kind == "failing_gpu":
        if evidence.get("problems"):
            return str(evidence["problems"][0])
        if m.get("ecc_dbe_volatile"):
            return f"{m['ecc_dbe_volatile']:.0f} uncorrectable ECC error(s)"
    if kind == "throttling" and _have(m, "clock_ratio"):
        temp = f", {float(m['temp_c']):.0f} °C" if m.get("temp_c") is not None else ""
        why = f" ({', '.join(m['reasons'])})" if m.get("reasons") else ""
        return f"SM clock {_pct(m['clock_ratio'])} of max{temp}{why}"
    if kind == "memory_pressure" and _have(m, "allocated_frac"):
        return f"{_pct(m['allocated_frac'])} of GPU memory allocated" + \
            (f", {_pct(m['reserved_frac'])} reserved" if m.get("reserved_frac") is not None else "")
    if kind == "efficiency" and _have(m, "mfu"):
        return f"MFU {float(m['mfu']):.1%}" + \
            (f" at {float(m['tokens_per_s']):,.0f} tokens/s" if m.get("tokens_per_s") is not None else "")
    if kind == "nccl_config":
        if m.get("facts"):
            return str(m["facts"][0])
        if m.get("differences"):
            k, v = next(iter(m["differences"].items()))
            return f"{k}={v.get('value')} vs {v.get('others')} on the other ranks"
        if m.get("NCCL_IB_TIMEOUT") is not None:
            return f"NCCL_IB_TIMEOUT={m['NCCL_IB_TIMEOUT']} at {m.get('world_size')} ranks"
    return None


def headline(kind: str, evidence: dict[str, Any]) -> str:
    """The one line of a finding's evidence that matters, per kind (the finding page draws the rest); any other kind
    or shape falls back to its first few plain metrics."""
    m = evidence.get("metrics") or {}
    try:
        line = (_headline_rank_timing(kind, m) or _headline_network(kind, m) or _headline_stall(kind, m)
                or _headline_gpu(kind, m, evidence))
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError):
        line = None  # evidence of an unexpected shape: the plain metrics below still say something
    if line:
        return line
    plain = [f"{k} {v}" for k, v in m.items() if isinstance(v, int | float | str) and not isinstance(v, bool)]
    return ", ".join(plain[:3])
