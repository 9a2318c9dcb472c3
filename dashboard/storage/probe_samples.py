"""Every read of network probe samples that a page, an API, the evidence or "why was step N slow" makes.

Probes are stored as frames (:mod:`dashboard.storage.frames`, :class:`~dashboard.telemetry.models.ProbeFrame`): the
probes one post carried from one node within one aligned 10 s window, as one packed matrix (``ts``, ``sent``,
``lost``, ``rtt_ms``, ``rtt_p99_ms``, ``bw_gbps``) with each probe's peer beside it, and the frame's distinct peers
in its ``peers`` column (" a b "). Each function here selects whole frames by indexed columns, decodes them and
works out its answer in numpy; callers get plain values (epoch seconds, floats, tuples, the ``downsample`` dicts),
never frames or querysets. Derived values (a probe's loss as a fraction or a percentage) and the bucketing of the
link matrix are worked out here for the same reason.

Which frames: a probe goes *from* a node (the agent that sent it: the frame's ``node``, index (node, ts)) *to* a
peer, stored by host name (the peer may be an address without an agent). The probes *to* a host are in the frames
the inbound index lists for it (:mod:`dashboard.storage.probe_index`, per minute) and in those written since that
index's last pass whose ``peers`` contains " host " (a few seconds of the primary key); that match only narrows the
frames (SQLite's LIKE ignores case), the samples are then kept by their own peer. The frames of samples taken in
[t0, t1] are those with ``window_start(t0) <= ts <= t1`` (a frame's ``ts`` is its oldest sample's).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import numpy as np
from django.db.models import Max, Q

from dashboard.storage import frames as fr
from dashboard.storage import probe_index
from dashboard.telemetry.models import Node
from dashboard.web.series import TimeRange, downsample_rows

# What a bucket series may be asked for: the stored columns, and the two forms of a probe's loss (None where the
# probe sent nothing: no loss to speak of, rather than 0 %).
COLUMNS = ("rtt_ms", "rtt_p99_ms", "bw_gbps", "sent", "lost")
DERIVED = ("loss", "loss_pct")
COUNTS = ("sent", "lost")  # whole numbers: handed out as ints, as the integer columns they were read from were
PROBES = fr.PROBES


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def _known(fields: list[str] | tuple[str, ...]) -> None:
    """An unknown name is a caller's bug, said before anything is read."""
    unknown = [f for f in fields if f not in COLUMNS and f not in DERIVED]
    if unknown:
        raise ValueError(f"not a probe field: {unknown}")


def _value(rows: fr.Rows, field: str) -> np.ndarray:
    """A field's value per sample, NaN where null (a loss where nothing was sent)."""
    if field in COLUMNS:
        return rows[field]
    sent, lost = rows["sent"], rows["lost"]
    with np.errstate(divide="ignore", invalid="ignore"):
        if field == "loss":
            return np.where(sent != 0, lost / sent, np.nan)
        # lost * 100 / sent, not 100 * (lost / sent): the percentages the node page always showed, to the last bit.
        return np.where(sent > 0, lost * 100.0 / sent, np.nan)


def _span(t0: float, t1: float) -> Q:
    """The frames that can hold samples taken in [t0, t1]: ANDed into each arm of an OR, so each arm is one index
    range on its own."""
    return Q(ts__gte=_dt(fr.window_start(t0)), ts__lte=_dt(t1))


def _to(host: str) -> Q:
    """Frames with a probe to ``host`` among others (Django escapes LIKE's wildcards: a host name may hold "_")."""
    return Q(peers__contains=f" {host} ")


def _peers(rows: fr.Rows) -> np.ndarray:
    return np.asarray(rows.objs["peer"], dtype=str)


def _read(where: Q, tr: TimeRange, cols: tuple[str, ...] = (), peers: bool = False) -> fr.Rows:
    """The probes of the frames ``where`` selects, from the first bucket of ``tr`` on (all a series shows)."""
    t0 = tr.first_bucket_t
    return fr.read(PROBES, where & _span(t0, tr.t1), t0=t0, t1=tr.t1, cols=cols,
                   objects=("peer",) if peers else ())


def _series(rows: fr.Rows, tr: TimeRange, fields: list[str], groups: list[np.ndarray]) -> dict[str, dict[str, Any]]:
    return downsample_rows(rows["ts"], {f: _value(rows, f) for f in fields}, tr, fields, groups)


def _one(rows: fr.Rows, tr: TimeRange, fields: list[str]) -> dict[str, Any] | None:
    """All of ``rows`` as one series, None when none is in ``tr``. Grouped by a constant: ``downsample_rows``
    without groups keys every bucket "" (each overwriting the last), so it is not asked that way."""
    return _series(rows, tr, fields, [np.zeros(len(rows))]).get("0")


def from_node(node_id: int, tr: TimeRange, fields: list[str], peer: str | None = None) -> dict[str, Any] | None:
    """Min / mean / max per bucket of ``tr`` over the probes the node sent (to ``peer`` alone when given), all peers
    together: ``downsample``'s series, or None when there is none in the range."""
    _known(fields)
    if peer is None:
        return _one(_read(Q(node_id=node_id), tr), tr, fields)
    rows = _read(Q(node_id=node_id) & _to(peer), tr, peers=True)
    return _one(rows.where(_peers(rows) == peer), tr, fields)


IDS_PER_READ = 2_000  # frame ids named in one statement (well under SQLite's bound on parameters)


def _sent_to(cluster_id: int, host: str, tr: TimeRange, cols: tuple[str, ...] = (), but: int | None = None
             ) -> fr.Rows:
    """The probes the cluster's agents (``but`` one node) sent to ``host``: the frames the inbound index lists
    (:mod:`dashboard.storage.probe_index`), and those written since its last pass, found by their ``peers`` (a
    range of the primary key: the last seconds)."""
    t0 = tr.first_bucket_t
    listed, since = probe_index.frames_to(cluster_id, host, fr.window_start(t0), tr.t1)
    listed = listed[listed <= since]  # the rest are read with the unindexed ones
    where = [Q(id__in=listed[i:i + IDS_PER_READ].tolist()) for i in range(0, len(listed), IDS_PER_READ)]
    where.append(Q(cluster_id=cluster_id, id__gt=since) & _to(host))
    parts = [_read(w if but is None else w & ~Q(node_id=but), tr, cols, peers=True) for w in where]
    rows = fr.concat(PROBES, parts)
    return rows.where(_peers(rows) == host)


def to_node(cluster_id: int, host: str, tr: TimeRange, fields: list[str]) -> dict[str, Any] | None:
    """As :func:`from_node`, over the probes the cluster's agents sent to ``host``."""
    _known(fields)
    return _one(_sent_to(cluster_id, host, tr), tr, fields)


def from_node_by_peer(node_id: int, tr: TimeRange, fields: list[str]) -> dict[str, dict[str, Any]]:
    """The probes the node sent, one ``downsample`` series per peer, keyed by the peer's host name."""
    _known(fields)
    rows = _read(Q(node_id=node_id), tr, peers=True)
    return _series(rows, tr, fields, [_peers(rows)])


def to_node_by_sender(cluster_id: int, host: str, tr: TimeRange, fields: list[str]) -> dict[str, dict[str, Any]]:
    """The probes the cluster's agents sent to ``host``, one series per sender, keyed by the sender's host name."""
    _known(fields)
    rows = _sent_to(cluster_id, host, tr, cols=("node__hostname",))
    return _series(rows, tr, fields, [rows["node__hostname"]])


def of_node(cluster_id: int, node_id: int, host: str, tr: TimeRange, fields: list[str]) -> dict[str, Any] | None:
    """One series over every probe the node sent or was sent (a slow link's pairs, when only one end is known)."""
    _known(fields)
    # The node's own frames, and the probes to it from the others (a frame of its own is never read twice).
    rows = fr.concat(PROBES, [_read(Q(node_id=node_id), tr, cols=("node_id",), peers=True),
                              _sent_to(cluster_id, host, tr, cols=("node_id",), but=node_id)])
    return _one(rows.where((rows["node_id"] == node_id) | (_peers(rows) == host)), tr, fields)


def of_pair(a: tuple[int, str], b: tuple[int, str], tr: TimeRange, fields: list[str]) -> dict[str, Any] | None:
    """One series over both directions of the pair of nodes ``a`` and ``b``, each given as (node id, host name)."""
    _known(fields)
    (a_id, a_host), (b_id, b_host) = a, b
    rows = _read((Q(node_id=a_id) & _to(b_host)) | (Q(node_id=b_id) & _to(a_host)), tr, cols=("node_id",),
                 peers=True)
    node, peer = rows["node_id"], _peers(rows)
    return _one(rows.where(((node == a_id) & (peer == b_host)) | ((node == b_id) & (peer == a_host))), tr, fields)


def across(cluster_id: int, hosts: list[str], tr: TimeRange, fields: list[str]
           ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The probes sent by the cluster's nodes ``hosts`` as two series: to peers outside ``hosts`` (leaving a
    switch's nodes) and to peers among them (inside it); None for a side without probes. One read for both."""
    _known(fields)
    # The senders by a subquery, not a join: each one's own (node, ts) range rather than the whole cluster's.
    senders = Node.objects.filter(cluster_id=cluster_id, hostname__in=hosts).values("id")
    rows = _read(Q(node_id__in=senders), tr, peers=True)
    inside = np.isin(_peers(rows), np.asarray(hosts, dtype=str))
    return (_one(rows.where(~inside), tr, fields), _one(rows.where(inside), tr, fields))


def _codes(names: list[str]) -> tuple[list[str], np.ndarray]:
    """(the distinct names sorted, each name's index among them): a string column as integers to group by."""
    distinct = sorted(set(names))
    at = {n: i for i, n in enumerate(distinct)}
    return distinct, np.array(list(map(at.__getitem__, names)), dtype=np.int64)


DENSE_KEYS = 1 << 22  # up to this many possible keys (32 MiB of counts), grouped by counting rather than sorting


def _groups(key: np.ndarray, space: int) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct values of ``key`` ascending, each element's index among them), for keys in [0, space): by
    counting where the space is small (a 5 min matrix of 512 nodes: 30 ms instead of 110), else by sorting."""
    if space > DENSE_KEYS:
        return np.unique(key, return_inverse=True)
    seen = np.bincount(key, minlength=space) > 0
    return np.flatnonzero(seen), (np.cumsum(seen) - 1)[key]


def _means(group: np.ndarray, values: np.ndarray, n: int) -> list[float | None]:
    """Per group, the mean of its non-NaN values (SQL's AVG), None where it has none."""
    ok = ~np.isnan(values)
    total = np.bincount(group[ok], weights=values[ok], minlength=n)
    count = np.bincount(group[ok], minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        return _objects(np.where(count > 0, total / count, np.nan))


def _objects(arr: np.ndarray, whole: bool = False) -> list[Any]:
    """``arr`` as Python numbers (ints where ``whole``), None for NaN."""
    nan = np.isnan(arr)
    out = (np.where(nan, 0, arr).astype(np.int64) if whole else arr).astype(object)
    out[nan] = None
    return out.tolist()


def pair_buckets(cluster_id: int, tr: TimeRange, width: float, limit: int
                 ) -> list[tuple[int, str, float, int, int, float | None, float | None, float | None]]:
    """The cluster's probes in ``tr`` per (sender's node id, peer host, bucket of ``width`` seconds aligned to the
    epoch) as ``(node_id, peer, bucket index, sent, lost, mean RTT, mean p99 RTT, mean bandwidth)`` tuples; at most
    ``limit`` of them (ask for one more than you keep to know whether the range was cut). Ordered by (node id, peer,
    bucket), so a cut keeps the first ``limit`` of that order: every bucket of the lowest node ids' pairs, the last
    pair's perhaps not all."""
    rows = fr.read(PROBES, cluster_id=cluster_id, t0=tr.t0, t1=tr.t1, cols=("node_id",), objects=("peer",))
    if not len(rows):
        return []
    names, peer = _codes(rows.objs["peer"])
    node_ids, node = np.unique(rows["node_id"], return_inverse=True)
    bucket = np.floor(rows["ts"] / width)
    first = bucket.min()
    span = int(bucket.max() - first) + 1
    # One int64 key per (node, peer, bucket), ordered as they are: grouping the keys groups all three at once.
    key = (node.astype(np.int64) * len(names) + peer) * span + (bucket - first).astype(np.int64)
    keys, group = _groups(key, len(node_ids) * len(names) * span)
    keys = keys[:limit]
    n = len(keys)
    keep = group < n
    group = group[keep]
    sums = [np.bincount(group, weights=rows[c][keep], minlength=n) for c in COUNTS]
    means = [_means(group, rows[c][keep], n) for c in ("rtt_ms", "rtt_p99_ms", "bw_gbps")]
    peer_of = [names[i] for i in ((keys // span) % len(names)).tolist()]
    return list(zip(node_ids[keys // (span * len(names))].astype(np.int64).tolist(), peer_of,
                    (keys % span + first).tolist(), *(_objects(s, whole=True) for s in sums), *means, strict=True))


def newest(cluster_id: int, tr: TimeRange) -> float | None:
    """When the cluster's newest probe in ``tr`` was taken (epoch seconds); None when the range has none."""
    frames = PROBES.model._default_manager.filter(Q(cluster_id=cluster_id) & _span(tr.t0, tr.t1))
    last = frames.aggregate(t=Max("ts"))["t"]
    if last is None:
        return None
    # The newest frame holds a sample at ``last``: a newer sample can only be in a frame of ``last``'s window or
    # after it, so only those are decoded (when ``last`` is before t0, that is the range's first window anyway).
    # Less a microsecond: the column holds the sample's time rounded to one, perhaps up.
    rows = fr.read(PROBES, cluster_id=cluster_id, t0=max(tr.t0, last.timestamp() - 1e-6), t1=tr.t1)
    return float(rows["ts"].max()) if len(rows) else None


def _tuples(rows: fr.Rows, fields: tuple[str, ...], limit: int, lead: tuple[list[Any], ...] = ()
            ) -> list[tuple[Any, ...]]:
    """The first ``limit`` samples as tuples of ``lead`` (per-sample lists) then ``fields`` (None for null)."""
    rows = rows if len(rows) <= limit else rows.where(np.arange(limit))
    cols = [_objects(_value(rows, f), whole=f in COUNTS) for f in fields]
    return list(zip(*(c[:limit] for c in lead), *cols, strict=True))


def values(cluster_id: int, tr: TimeRange, fields: tuple[str, ...], limit: int) -> list[tuple[Any, ...]]:
    """``fields`` of at most ``limit`` of the cluster's probes in ``tr`` (ends included), as tuples in no set
    order; a cut keeps the oldest frames' probes."""
    _known(fields)
    rows = fr.read(PROBES, cluster_id=cluster_id, t0=tr.t0, t1=tr.t1, order=("ts",))
    return _tuples(rows, fields, limit)


def exists(cluster_id: int, node_id: int, peer: str) -> bool:
    """Whether any probe the node sent to ``peer`` is still kept (a link whose other end has no agent)."""
    frames = PROBES.model._default_manager.filter(_to(peer), cluster_id=cluster_id, node_id=node_id)
    # ``peers`` is exactly its frame's peers: its text settles it, where SQLite's LIKE would also match "PEER".
    return any(f" {peer} " in p for p in frames.values_list("peers", flat=True).iterator(chunk_size=64))


def around(cluster_id: int, t0: float, t1: float, fields: tuple[str, ...], limit: int) -> list[tuple[Any, ...]]:
    """The cluster's probes taken in [t0, t1] as ``(sender's host name, peer host, *fields)`` tuples in no set
    order, at most ``limit`` of them (the oldest frames' probes when cut): every pair's probes in one step's
    window."""
    _known(fields)
    rows = fr.read(PROBES, cluster_id=cluster_id, t0=t0, t1=t1, cols=("node__hostname",), objects=("peer",),
                   order=("ts",))
    return _tuples(rows, fields, limit, (rows["node__hostname"].tolist(), rows.objs["peer"]))
