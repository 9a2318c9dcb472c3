"""Every read of network probe samples that a page, an API, the evidence or "why was step N slow" makes.

The one module outside the writer, the retention list and the diagnosis pass's held window that knows a probe is a
row of :class:`~dashboard.telemetry.models.Probe`. What callers get are plain values (epoch seconds, floats, tuples,
the ``downsample`` dicts), never querysets, so the probes' storage can change here (docs/scaling.md: a post's probes
kept as one compressed frame) without a page noticing. Derived values (a probe's loss as a fraction or a percentage)
and the bucketing of the link matrix are worked out here for the same reason: SQL expressions over row columns in
the callers would tie them to rows.

Which probes: a probe goes *from* a node (the agent that sent it, by id) *to* a peer, stored by host name (the peer
may be an address without an agent; ``peer_node`` is never written), so the probes to a node are found by its
cluster and host name.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.db.models import Avg, Case, F, FloatField, Max, Q, QuerySet, Sum, When
from django.db.models.functions import Cast, Floor, NullIf

from dashboard.telemetry.models import Probe
from dashboard.web.series import Epoch, TimeRange, downsample, in_range

# What a bucket series may be asked for: the stored columns, and the two forms of a probe's loss (None where the
# probe sent nothing: no loss to speak of, rather than 0 %).
COLUMNS = ("rtt_ms", "rtt_p99_ms", "bw_gbps", "sent", "lost")
DERIVED = ("loss", "loss_pct")


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def _with(qs: QuerySet[Any], fields: list[str]) -> QuerySet[Any]:
    """``qs`` with the derived fields among ``fields`` annotated; an unknown name is a caller's bug, said early."""
    unknown = [f for f in fields if f not in COLUMNS and f not in DERIVED]
    if unknown:
        raise ValueError(f"not a probe field: {unknown}")
    if "loss" in fields:
        qs = qs.annotate(loss=Cast(F("lost"), FloatField()) / NullIf(Cast(F("sent"), FloatField()), 0.0))
    if "loss_pct" in fields:
        # lost * 100 / sent, not 100 * (lost / sent): the percentages the node page always showed, to the last bit.
        qs = qs.annotate(loss_pct=Case(When(sent__gt=0, then=F("lost") * 100.0 / F("sent")), default=None,
                                       output_field=FloatField()))
    return qs


def _series(qs: QuerySet[Any], tr: TimeRange, fields: list[str]) -> dict[str, Any] | None:
    return downsample(_with(qs, fields), tr, fields).get("")


def from_node(node_id: int, tr: TimeRange, fields: list[str], peer: str | None = None) -> dict[str, Any] | None:
    """Min / mean / max per bucket of ``tr`` over the probes the node sent (to ``peer`` alone when given), all peers
    together: ``downsample``'s series, or None when there is none in the range."""
    where: dict[str, Any] = {"node_id": node_id} if peer is None else {"node_id": node_id, "peer": peer}
    return _series(Probe.objects.filter(**where), tr, fields)


def to_node(cluster_id: int, host: str, tr: TimeRange, fields: list[str]) -> dict[str, Any] | None:
    """As :func:`from_node`, over the probes the cluster's agents sent to ``host``."""
    return _series(Probe.objects.filter(cluster_id=cluster_id, peer=host), tr, fields)


def from_node_by_peer(node_id: int, tr: TimeRange, fields: list[str]) -> dict[str, dict[str, Any]]:
    """The probes the node sent, one ``downsample`` series per peer, keyed by the peer's host name."""
    qs = _with(Probe.objects.filter(node_id=node_id).annotate(other=F("peer")), fields)
    return downsample(qs, tr, fields, by=["other"])


def to_node_by_sender(cluster_id: int, host: str, tr: TimeRange, fields: list[str]) -> dict[str, dict[str, Any]]:
    """The probes the cluster's agents sent to ``host``, one series per sender, keyed by the sender's host name."""
    qs = Probe.objects.filter(cluster_id=cluster_id, peer=host).annotate(other=F("node__hostname"))
    return downsample(_with(qs, fields), tr, fields, by=["other"])


def of_node(cluster_id: int, node_id: int, host: str, tr: TimeRange, fields: list[str]) -> dict[str, Any] | None:
    """One series over every probe the node sent or was sent (a slow link's pairs, when only one end is known)."""
    # Each side of the OR on an index of its own, (node, ts) and (cluster, peer, ts), with no cluster term around it
    # (the node is the cluster's): ANDed with one, SQLite scanned every probe of the cluster in the window instead.
    return _series(Probe.objects.filter(Q(node_id=node_id) | Q(cluster_id=cluster_id, peer=host)), tr, fields)


def of_pair(a: tuple[int, str], b: tuple[int, str], tr: TimeRange, fields: list[str]) -> dict[str, Any] | None:
    """One series over both directions of the pair of nodes ``a`` and ``b``, each given as (node id, host name)."""
    (a_id, a_host), (b_id, b_host) = a, b
    return _series(Probe.objects.filter(Q(node_id=a_id, peer=b_host) | Q(node_id=b_id, peer=a_host)), tr, fields)


def across(cluster_id: int, hosts: list[str], tr: TimeRange, fields: list[str]
           ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The probes sent by the cluster's nodes ``hosts`` as two series: to peers outside ``hosts`` (leaving a
    switch's nodes) and to peers among them (inside it); None for a side without probes."""
    qs = Probe.objects.filter(cluster_id=cluster_id, node__hostname__in=hosts)
    return _series(qs.exclude(peer__in=hosts), tr, fields), _series(qs.filter(peer__in=hosts), tr, fields)


def pair_buckets(cluster_id: int, tr: TimeRange, width: float, limit: int
                 ) -> list[tuple[int, str, float, int, int, float | None, float | None, float | None]]:
    """The cluster's probes in ``tr`` per (sender's node id, peer host, bucket of ``width`` seconds aligned to the
    epoch) as ``(node_id, peer, bucket index, sent, lost, mean RTT, mean p99 RTT, mean bandwidth)`` tuples, in no
    set order; at most ``limit`` of them (ask for one more than you keep to know whether the range was cut)."""
    qs = (in_range(Probe.objects.filter(cluster_id=cluster_id), tr).annotate(bucket=Floor(Epoch(F("ts")) / width))
          .values_list("node_id", "peer", "bucket")
          .annotate(s=Sum("sent"), lo=Sum("lost"), rtt=Avg("rtt_ms"), p99=Avg("rtt_p99_ms"), bw=Avg("bw_gbps"))
          .order_by())
    return list(qs[:limit])


def newest(cluster_id: int, tr: TimeRange) -> float | None:
    """When the cluster's newest probe in ``tr`` was taken (epoch seconds); None when the range has none."""
    got = in_range(Probe.objects.filter(cluster_id=cluster_id), tr).aggregate(t=Max("ts"))["t"]
    return None if got is None else got.timestamp()


def values(cluster_id: int, tr: TimeRange, fields: tuple[str, ...], limit: int) -> list[tuple[Any, ...]]:
    """``fields`` of at most ``limit`` of the cluster's probes in ``tr`` (ends included), as tuples in no set
    order."""
    return list(in_range(_with(Probe.objects.filter(cluster_id=cluster_id), list(fields)), tr)
                .values_list(*fields)[:limit])


def exists(cluster_id: int, node_id: int, peer: str) -> bool:
    """Whether any probe the node sent to ``peer`` is still kept (a link whose other end has no agent)."""
    return Probe.objects.filter(cluster_id=cluster_id, node_id=node_id, peer=peer).exists()


def around(cluster_id: int, t0: float, t1: float, fields: tuple[str, ...], limit: int) -> list[tuple[Any, ...]]:
    """The cluster's probes taken in [t0, t1] as ``(sender's host name, peer host, *fields)`` tuples in no set
    order, at most ``limit`` of them: every pair's probes in one step's window."""
    qs = Probe.objects.filter(cluster_id=cluster_id, ts__gte=_dt(t0), ts__lte=_dt(t1))
    return list(_with(qs, list(fields)).values_list("node__hostname", "peer", *fields)[:limit])
