"""Which interconnect a cluster has: detected from the RDMA ports its agents report, unless an owner set it.

The agent reads ``/sys/class/infiniband/*/ports/*/link_layer`` (collectors.sources.ib): "InfiniBand" on an IB HCA,
"Ethernet" on a RoCE NIC. A cluster whose agents report (GPU or host samples) but no RDMA port at all is Ethernet-only
(NCCL can only use sockets there, so "socket transport" is no fault). Training hooks alone say nothing about the
network: a cluster fed only by hook tokens stays undetected. ``Cluster.interconnect`` is the owner's override; "auto"
means use the detected value, and with nothing detected yet the NCCL checks assume InfiniBand, as before detection.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from dashboard.storage import gpu_samples
from dashboard.telemetry.models import Cluster, HostSample, PortSample

KINDS = ("ib", "roce", "eth")
LABELS = {"ib": "InfiniBand", "roce": "RoCE", "eth": "Ethernet", "auto": "detected"}
SAMPLE_PORTS = 512  # the newest port samples looked at: a bounded index range scan whatever the cluster's size
CACHE_TTL_S = 60.0  # the diagnosis asks every pass; the hardware changes far less often

_cache: dict[tuple[int, object], tuple[Detected, float]] = {}


@dataclass(frozen=True)
class Detected:
    kind: str | None  # "ib" | "roce" | "eth", or None when no agent has reported yet
    ports: dict[str, int]  # link layer -> how many of the newest port samples had it

    @property
    def reason(self) -> str:
        if self.kind is None:
            return "no agent has reported yet"
        if not self.ports:
            return "the agents report no InfiniBand or RoCE port"
        return ", ".join(f"{n} {layer or 'unknown'}" for layer, n in sorted(self.ports.items())) + " port samples"


def detect(cluster: Cluster) -> Detected:
    """The interconnect the newest port samples show: IB when most are InfiniBand, RoCE when most are Ethernet (an
    RDMA NIC), Ethernet-only when agents report but no port does."""
    layers = Counter(PortSample.objects.filter(cluster=cluster).order_by("-ts")
                     .values_list("link_layer", flat=True)[:SAMPLE_PORTS])
    if not layers:
        agents = gpu_samples.any_heard(cluster.id) or HostSample.objects.filter(cluster=cluster).exists()
        return Detected("eth" if agents else None, {})
    ib, roce = layers.get("InfiniBand", 0), layers.get("Ethernet", 0)
    # A port whose link layer was unreadable says "RDMA of some kind": IB, the historical default, unless RoCE wins.
    kind = "roce" if roce > ib else "ib"
    return Detected(kind, {str(k): v for k, v in layers.items()})


def detected(cluster: Cluster) -> Detected:
    """:func:`detect`, cached per process for ``CACHE_TTL_S``."""
    now = time.monotonic()
    key = (cluster.id, cluster.created_at)  # a test database may give a new cluster an old one's id
    hit = _cache.get(key)
    if hit is not None and now - hit[1] < CACHE_TTL_S:
        return hit[0]
    if len(_cache) > 10_000:
        _cache.clear()
    found = detect(cluster)
    _cache[key] = (found, now)
    return found


def effective(cluster: Cluster) -> str:
    """The override, else the detected interconnect, else "ib" (what the NCCL checks assumed before detection)."""
    if cluster.interconnect in KINDS:
        return cluster.interconnect
    return detected(cluster).kind or "ib"


def for_nccl(cluster: Cluster) -> str:
    """What the NCCL checks compare against: "ib" where NCCL should use its IB transport (InfiniBand and RoCE alike;
    NCCL drives RoCE through NET/IB), "eth" where sockets are all there is."""
    return "eth" if effective(cluster) == "eth" else "ib"


def clear_cache() -> None:
    _cache.clear()
