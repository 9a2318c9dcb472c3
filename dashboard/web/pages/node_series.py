"""The node page's time series: every GPU, port, the host, its NFS mounts and its probes, downsampled in SQL.

Each section is one or a few GROUP BY queries (``dashboard.web.series.downsample``), so a 24 h range costs what
15 min does. What the charts draw as a line gets min/mean/max; a counter (ECC, replays, remaps) only its max per
bucket (a total only grows, its max is the value at the bucket's end); a limit (power cap, max clock) only its max;
a link's current generation and width only their min (a link that trained down for a second must show).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from django.db.models import Case, FloatField, Value, When
from django.db.models.fields.json import KT
from django.db.models.functions import Cast

from dashboard.storage import gpu_samples, probe_samples
from dashboard.telemetry.models import HostSample, Node, PortSample
from dashboard.web.links import link_url, node_url
from dashboard.web.series import TimeRange, downsample, downsample_tiered, in_range, tiered

GPU_LINES = ["util_gpu_pct", "util_mem_pct", "mem_used_bytes", "power_w", "temp_c", "sm_clock_mhz", "mem_clock_mhz"]
GPU_LIMITS = ["mem_total_bytes", "power_limit_w", "sm_clock_max_mhz", "mem_clock_max_mhz", "pcie_gen_max",
              "pcie_width_max", "nvlink_links_total"]
GPU_COUNTERS = ["ecc_sbe_volatile", "ecc_dbe_volatile", "ecc_sbe_aggregate", "ecc_dbe_aggregate", "retired_pages_sbe",
                "retired_pages_dbe", "remap_correctable", "remap_uncorrectable", "pcie_replay_total",
                "nvlink_crc_errors_total", "nvlink_replay_errors_total", "nvlink_recovery_errors_total"]
GPU_FLOORS = ["pcie_gen", "pcie_width", "nvlink_links_up"]
HOST_LINES = ["cpu_pct", "load1", "mem_used_bytes", "disk_read_bytes_per_s", "disk_write_bytes_per_s",
              "net_rx_bytes_per_s", "net_tx_bytes_per_s"]
PORT_LINES = ["xmit_bytes_per_s", "rcv_bytes_per_s"]
MAX_NFS_MOUNTS = 8  # mounts per host sample the page charts (a host with hundreds of mounts is not the NFS story)
MAX_PORT_COUNTERS = 24
TOP_PEERS = 12  # peers drawn one trace each (the worst by RTT); every peer is in the table


def _round(v: float | None, digits: int = 4) -> float | None:
    """Four significant digits: a chart cannot show more, and the JSON shrinks by half."""
    if v is None:
        return None
    return float(f"{v:.{digits}g}")


def _round_all(values: list[float | None], digits: int = 4) -> list[float | None]:
    """:func:`_round` of a whole series at once (a 15 min node answer rounds ~300,000 values). An integer scaled by
    a power of ten is exact, so the results print as the short decimals ``_round`` gives."""
    x = np.array(values, dtype=float)  # None -> nan
    finite = np.isfinite(x) & (x != 0)
    if not finite.any():
        return values
    with np.errstate(all="ignore"):
        k = np.where(finite, digits - 1 - np.floor(np.log10(np.abs(x))), 0)
        p = 10.0 ** np.abs(k)
        r = np.where(finite, np.where(k > 0, np.round(x * p) / p, np.round(x / p) * p), x)
    return [None if v != v else v for v in r.tolist()]


def _compact(series: dict[str, Any], keep: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    """Keep only the statistics a chart draws for each field (``keep``: field -> stats), rounded."""
    out: dict[str, Any] = {"t": series["t"]}
    for field, stats in keep.items():
        if field in series:
            vals = series[field]
            if all(v is None for v in vals.get("max", vals[stats[0]])):
                continue  # the GPU does not report it (unsupported is absent, never a fake 0)
            out[field] = {s: _round_all(vals[s]) for s in stats}
    return out


def gpu_series(node: Node, tr: TimeRange, gpu: int | None) -> dict[str, Any]:
    fields = GPU_LINES + GPU_LIMITS + GPU_COUNTERS + GPU_FLOORS
    keep = {**{f: ("min", "mean", "max") for f in GPU_LINES}, **{f: ("max",) for f in GPU_LIMITS + GPU_COUNTERS},
            **{f: ("min",) for f in GPU_FLOORS}}
    raw = gpu_samples.buckets(node.id, tr, fields, gpu, keep=keep)
    return {key: _compact(s, keep) for key, s in raw.items()}


def _spans(t: list[float], flags: list[float | None], width: float) -> list[list[float]]:
    """Buckets where a flag was set, merged into [start, end] spans (adjacent buckets become one band)."""
    spans: list[list[float]] = []
    for ts, flag in zip(t, flags, strict=True):
        if not flag:
            continue
        if spans and abs(spans[-1][1] - ts) < 1e-6:
            spans[-1][1] = ts + width
        else:
            spans.append([ts, ts + width])
    return spans


def throttle_bands(node: Node, tr: TimeRange, gpu: int | None) -> dict[str, dict[str, list[list[float]]]]:
    """Per GPU, per throttle reason: the time spans it was active."""
    names, flags = gpu_samples.flag_buckets(node.id, tr, gpu)
    out: dict[str, dict[str, list[list[float]]]] = {}
    for key, s in flags.items():
        per = {name: _spans(s["t"], s[name], tr.bucket_s) for name in names}
        if any(per.values()):
            out[key] = {name: spans for name, spans in per.items() if spans}
    return out


def host_series(node: Node, tr: TimeRange) -> dict[str, Any]:
    raw = downsample_tiered(HostSample, {"node": node}, tr, [*HOST_LINES, "mem_total_bytes"]).get("")
    if raw is None:
        return {}
    keep = {**{f: ("min", "mean", "max") for f in HOST_LINES}, "mem_total_bytes": ("max",)}
    return _compact(raw, keep)


def nfs_series(node: Node, tr: TimeRange) -> dict[str, Any]:
    """NFS round-trip per mount. ``HostSample.nfs`` is a JSON list of mounts (wire.NfsMount); element i is grouped by
    its mount name, so a mount that moved position in the list still lands in its own series."""
    qs = HostSample.objects.filter(node=node)
    latest = in_range(qs, tr).exclude(nfs=None).order_by("-ts").values_list("nfs", flat=True).first()
    out: dict[str, Any] = {}
    for i in range(min(len(latest or []), MAX_NFS_MOUNTS)):
        annotated = qs.exclude(nfs=None).annotate(
            mount=KT(f"nfs__{i}__mount"),
            rtt_ms=Cast(KT(f"nfs__{i}__rtt_ms"), FloatField()), exe_ms=Cast(KT(f"nfs__{i}__exe_ms"), FloatField()),
            ops_per_s=Cast(KT(f"nfs__{i}__ops_per_s"), FloatField())).exclude(mount=None)
        for mount, s in downsample(annotated, tr, ["rtt_ms", "exe_ms", "ops_per_s"], by=["mount"]).items():
            series = _compact(s, {"rtt_ms": ("min", "mean", "max"), "exe_ms": ("mean",), "ops_per_s": ("mean",)})
            prev = out.get(mount)
            out[mount] = series if prev is None or len(prev["t"]) < len(series["t"]) else prev
    return out


def port_series(node: Node, tr: TimeRange) -> dict[str, Any]:
    """Per IB/RoCE port: traffic, rate (min: a port that trained down shows), up-ness, and the error counters'
    deltas (``counters`` are deltas per interval on the wire: mean = per sample, max = the worst second)."""
    qs = PortSample.objects.filter(node=node)
    names: set[str] = set()
    for counters in in_range(qs, tr).exclude(counters=None).order_by("-ts").values_list("counters", flat=True)[:50]:
        if isinstance(counters, dict):
            names.update(counters)
    names_l = sorted(n for n in names if n.replace("_", "").isalnum())[:MAX_PORT_COUNTERS]
    extra = {f"c_{n}": Cast(KT(f"counters__{n}"), FloatField()) for n in names_l}
    up = Case(When(state__iexact="ACTIVE", then=Value(1.0)), default=Value(0.0), output_field=FloatField())
    annotated = qs.annotate(active=up, **extra)
    raw = downsample(annotated, tr, [*PORT_LINES, "rate_gbps", "active", *extra], by=["device", "port"])
    out: dict[str, Any] = {}
    for key, s in raw.items():
        series = _compact(s, {**{f: ("min", "mean", "max") for f in PORT_LINES}, "rate_gbps": ("min", "max"),
                              "active": ("min",)})
        series["counters"] = {n: {"mean": _round_all(s[f"c_{n}"]["mean"]), "max": _round_all(s[f"c_{n}"]["max"])}
                              for n in names_l if any(s[f"c_{n}"]["max"])}
        out[key.replace("|", "/")] = series
    return out


def probe_series(node: Node, tr: TimeRange) -> dict[str, Any]:
    """Probes from this node (``out``) and to it (``in``): one series over all peers per direction, each peer's own
    series for the worst few, and a table of every peer with its link. A 2,048-node pingmesh rotates through every
    peer in a day, so drawing one trace per peer would be 2,000 traces."""
    cluster = node.cluster.name
    fields = ["rtt_ms", "rtt_p99_ms", "bw_gbps", "loss_pct"]
    sides = {  # (all peers together, one series per peer)
        "out": (probe_samples.from_node(node.id, tr, fields), probe_samples.from_node_by_peer(node.id, tr, fields)),
        "in": (probe_samples.to_node(node.cluster_id, node.hostname, tr, fields),
               probe_samples.to_node_by_sender(node.cluster_id, node.hostname, tr, fields)),
    }
    keep = {"rtt_ms": ("min", "mean", "max"), "rtt_p99_ms": ("max",), "bw_gbps": ("min", "mean", "max"),
            "loss_pct": ("max",)}
    out: dict[str, Any] = {"all": {}, "peers": [], "series": {}}
    for side, (overall, per_peer) in sides.items():
        if overall:
            out["all"][side] = _compact(overall, keep)
        for peer, s in per_peer.items():
            rtts = [v for v in s["rtt_ms"]["mean"] if v is not None]
            bws = [v for v in s["bw_gbps"]["mean"] if v is not None]
            losses = [v for v in s["loss_pct"]["max"] if v is not None]
            out["peers"].append({
                "direction": side, "peer": peer, "url": node_url(cluster, peer),
                "link_url": link_url(cluster, node.hostname, peer),
                "rtt_ms": _round(sum(rtts) / len(rtts)) if rtts else None, "rtt_max_ms": _round(max(rtts)) if rtts else None,
                "bw_gbps": _round(sum(bws) / len(bws)) if bws else None, "bw_min_gbps": _round(min(bws)) if bws else None,
                "loss_max_pct": _round(max(losses)) if losses else None, "samples": len(s["t"]),
            })
        worst = sorted((p for p in out["peers"] if p["direction"] == side),
                       key=lambda p: -(p["rtt_ms"] or 0) + (1e9 if p["rtt_ms"] is None else 0))[:TOP_PEERS]
        for p in worst:
            out["series"][f"{side}|{p['peer']}"] = _compact(per_peer[p["peer"]], keep)
    out["peers"].sort(key=lambda p: (-(p["loss_max_pct"] or 0), -(p["rtt_ms"] or 0)))
    return out


def node_series(node: Node, tr: TimeRange, gpu: int | None) -> dict[str, Any]:
    # GPU and host series come from the tier the range needs (raw, 10 s or 1 min rollups); throttle reasons, NFS,
    # ports and probes are read raw on the same (tier-aligned) buckets.
    tr = tiered(tr)
    body: dict[str, Any] = {"range": {**tr.as_dict(), "points": tr.points}, "gpu": gpu,
                            "gpus": gpu_series(node, tr, gpu), "throttle": throttle_bands(node, tr, gpu)}
    if gpu is None:  # the GPU view draws only its GPU; the node page adds the host, its ports and its links
        body.update(host=host_series(node, tr), nfs=nfs_series(node, tr), ports=port_series(node, tr),
                    probes=probe_series(node, tr))
    return body

