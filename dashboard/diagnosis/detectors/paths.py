"""Where in the fabric a slow network is, Pingmesh-style: one path, or one leaf switch / rack uplink.

The probes form a mesh of pairs. A fault shows as a *pattern* of bad pairs, and the pattern names the layer:

* one pair bad while both of its ends are fine with everyone else → the **path** between them (an ECMP route over a
  bad spine link, a mis-set route or MTU on one hop): a ``slow_link`` on the link ``a~b``;
* most pairs of one node bad → the **node** (its NIC, cable, port): :func:`network.slow_links` names it;
* the pairs that leave one rack bad while the pairs inside it are fine → the rack's **leaf switch uplink**: a
  ``slow_link`` on that switch (or rack, where only racks are known). With two racks only, or when every rack's
  cross pairs are bad, no one leaf can be told from the others: the uplinks between them / the spine are named.

A pair is judged on its newest few probes (either direction), so one late ping does not name a path; the RTT bar is
the one :mod:`network` uses (a multiple of the cluster's quiet RTT and an absolute margin, a wider one when either
end's CPU is saturated, since user-space pings then wait for the scheduler).

A rate-limited uplink adds no idle RTT at all: only bulk transfers show it. So a leaf is also judged on the bulk
transfers that touched it in its last few seconds of them: those that leave it mostly narrow (under ``bw_ratio`` of
the transfers inside the leaves), those inside it fine. Transfers that shared their receiving node with another
(:func:`contended`) are left out: each measured a share of that node's link, not its path.

A shaped link queues whatever shares it behind the transfers that fill it: pings that cross it in those moments come
back milliseconds late, and agents that probe in step can put the same pair's pings there round after round. So a
slow pair is not a path while the links it shares carried narrow transfers in the seconds of its slow probes (those
between the same two leaves, or to or from either end, other than its own: a bad route slows its own transfers too):
that is queueing behind a narrow uplink or node link, which the switch or node rule names once it has its seconds
of transfers. Here a transfer that shared its receiver is not left out but judged against its share of that node's
link (the transfers that fill a shaped uplink are often sent in step). Pure numpy, no Django.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dashboard.diagnosis.detectors.base import Detection, Thresholds, rnd
from dashboard.diagnosis.detectors.network import contended, groups_of, quiet_nodes, sharing
from dashboard.diagnosis.detectors.window import Window


@dataclass
class Pairs:
    """The mesh as unordered pairs: ends, how many of their newest probes were bad, and their rows."""

    a: np.ndarray  # node index of the lower end
    b: np.ndarray
    recent: np.ndarray  # newest probes looked at (<= t.link_buckets)
    bad: np.ndarray  # how many of them were bad
    rounds: np.ndarray  # distinct probe seconds among them
    kept: np.ndarray  # probe rows (into w.probes) of those newest probes, all pairs together ...
    kept_pair: np.ndarray  # ... and the pair each belongs to
    baseline_rtt_ms: float

    def rows(self, which: np.ndarray | int) -> np.ndarray:
        """Probe rows of the newest probes of pair(s) ``which``."""
        return self.kept[np.isin(self.kept_pair, np.atleast_1d(which))]

    @property
    def persistent(self) -> np.ndarray:
        """Bad in every one of its newest probes, across at least two probe rounds."""
        return (self.bad == self.recent) & (self.bad >= 2) & (self.rounds >= 2)

    @property
    def mostly_bad(self) -> np.ndarray:
        return 2 * self.bad > self.recent


def pairs(w: Window, t: Thresholds, skip: set[int]) -> Pairs | None:
    p = w.probes
    if not len(p):
        return None
    src, dst = p["node"], p["peer"]
    use = (src >= 0) & (dst >= 0) & (src != dst)
    for s in skip:
        use &= (src != s) & (dst != s)
    rows = np.nonzero(use)[0]
    if not len(rows):
        return None
    rtt = p["rtt_ms"][rows]
    busy = _busy(w, t)
    either_busy = busy[src[rows].astype(int)] | busy[dst[rows].astype(int)]
    with np.errstate(all="ignore"):
        base = float(np.nanpercentile(rtt, 25)) if np.any(~np.isnan(rtt)) else float("nan")
        slow = rtt > np.maximum(t.rtt_ratio * base, base + np.where(either_busy, t.rtt_busy_abs_ms, t.rtt_abs_ms))
        lossy = p["lost"][rows] / p["sent"][rows] >= t.loss_frac
    bad = np.nan_to_num(slow, nan=0).astype(bool) | np.nan_to_num(lossy, nan=0).astype(bool)
    lo, hi = np.minimum(src[rows], dst[rows]), np.maximum(src[rows], dst[rows])
    key = (lo * (len(w.nodes) + 1) + hi).astype(np.int64)
    # Per pair, newest first, in one integer sort: the pair in the high bits, the probe's age in microseconds
    # (its time at the precision the database keeps, milliseconds on SQLite) in the low ones. Two stable sorts of
    # ~260,000 probe rows (a lexsort) were half of this detector at 2,048 nodes.
    ts = p["ts"][rows]
    t0 = np.floor(ts.min())
    age = np.rint((ts.max() - ts) * 1e6).astype(np.int64)
    shift = int(age.max()).bit_length()
    fits = shift + int(key.max()).bit_length() <= 62  # else a window far longer than any span: two sorts
    order = np.argsort((key << shift) | age, kind="stable") if fits else np.lexsort((-ts, key))
    key, ts, bad, rows, lo, hi = key[order], ts[order], bad[order], rows[order], lo[order], hi[order]
    starts = np.r_[0, np.nonzero(np.diff(key))[0] + 1]
    gid = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(key)]))
    # Each pair's newest k probes, in one pass over the sorted rows rather than a loop over pairs (2,048 nodes
    # probing a dozen peers each are tens of thousands of pairs).
    keep = np.arange(len(key)) - starts[gid] < max(1, t.link_buckets)
    g, sec = gid[keep], np.floor(ts[keep] - t0)
    recent = np.bincount(g, minlength=len(starts))
    nbad = np.bincount(g, weights=bad[keep].astype(float), minlength=len(starts)).astype(int)
    # The probe rounds (distinct whole seconds) of each pair's kept probes: newest first within a pair, so one
    # second's probes sit together and a change of pair or second starts a round.
    first = np.r_[True, (g[1:] != g[:-1]) | (sec[1:] != sec[:-1])]
    rounds = np.bincount(g[first], minlength=len(starts))
    return Pairs(lo[starts].astype(int), hi[starts].astype(int), recent, nbad, rounds, rows[keep], g, base)


def _busy(w: Window, t: Thresholds) -> np.ndarray:
    busy = np.zeros(len(w.nodes) + 1, dtype=bool)
    for i, host in enumerate(w.nodes):
        cpu = (w.hosts.get(host) or {}).get("cpu_pct")
        busy[i] = cpu is not None and cpu >= t.busy_cpu_pct
    return busy


def slow_paths(w: Window, t: Thresholds, down: set[str]) -> list[Detection]:
    """The slow switches first (their nodes and cross pairs are theirs), then single slow paths."""
    index = w.node_index()
    # A node gone quiet is about to be named down; its lost probes are not a slow path (as in network.slow_links).
    mesh = pairs(w, t, {index[h] for h in down | quiet_nodes(w) if h in index})
    if mesh is None:
        return []
    out = _switches(w, t, mesh)
    taken = covered_nodes(out)
    out += _paths(w, t, mesh, {index[h] for h in taken if h in index})
    return out


def covered_nodes(detections: list[Detection]) -> set[str]:
    """Nodes whose slowness a switch finding explains: the node rule leaves them alone."""
    return {h for d in detections if d.subject_type == "switch" for h in d.evidence["metrics"].get("nodes", [])}


# -- one path --------------------------------------------------------------------------------------------------------

def _paths(w: Window, t: Thresholds, mesh: Pairs, skip: set[int]) -> list[Detection]:
    n = len(w.nodes) + 1
    mostly = mesh.mostly_bad
    ends = np.concatenate([mesh.a, mesh.b])
    pairs_per_node = np.bincount(ends, minlength=n)
    bad_per_node = np.bincount(ends, weights=np.concatenate([mostly, mostly]).astype(float), minlength=n)
    with np.errstate(all="ignore"):
        bad_frac = bad_per_node / pairs_per_node
    # An end is healthy when it is fine with someone else and with at least half of its other peers: a node bad
    # with most of them is the node rule's (or, without topology, a leaf's, which would be a storm of paths here).
    with np.errstate(all="ignore"):
        others_bad = (bad_per_node - 1) / (pairs_per_node - 1)
    healthy = (pairs_per_node - bad_per_node >= 1) & (np.nan_to_num(others_bad, nan=0.0) <= 0.5) & \
        (np.nan_to_num(bad_frac, nan=1.0) < t.node_bad_frac)
    out = []
    load: _Load | None = None  # the transfers, read the first time a pair gets that far (most passes: never)
    for i in np.nonzero(mesh.persistent)[0]:
        a, b = int(mesh.a[i]), int(mesh.b[i])
        if a in skip or b in skip or not (healthy[a] and healthy[b]):
            continue
        # One pair alone is named only past an absolute margin too: a busy host's user-space pings jitter by a
        # millisecond or two (a healthy pair at 1.35 ms vs 0.03 ms was named under CI load), a bad route or spine
        # link adds tens. The node and switch rules need many bad pairs, so they keep the finer bar.
        sel = mesh.rows(i)
        rtt = _median(w.probes["rtt_ms"][sel])
        loss = float(np.nansum(w.probes["lost"][sel]) / max(1.0, float(np.nansum(w.probes["sent"][sel]))))
        if loss < 0.2 and not rtt >= mesh.baseline_rtt_ms + t.path_abs_ms:
            continue
        # Late pings on a link that narrow transfers filled at the time waited in its queue: the switch or node
        # rule's fault (once it has its seconds of transfers), not this route's. Loss is not queueing.
        if loss < 0.2:
            if load is None:
                load = _Load.of(w, t, mesh)
            if load.queued(a, b, w.probes["ts"][sel]):
                continue
        out.append(_path_detection(w, mesh, i, {x: (int(pairs_per_node[x]), int(bad_per_node[x])) for x in (a, b)}))
    return out


# A ping reports when its round ends, up to a round (about a second) after it was sent, and a transfer when it ends,
# up to a second after the pings it held up: transfers this close to a pair's probes may have shared the link with
# them.
QUEUE_SPAN_S = 1.0


@dataclass
class _Load:
    """The window's bulk transfers, which of them came out narrow, and each node's group: what loaded which link, and
    when."""

    src: np.ndarray  # node index of each end
    dst: np.ndarray
    ts: np.ndarray
    narrow: np.ndarray
    code: np.ndarray  # per node index: its group's code (-1: none)

    @classmethod
    def of(cls, w: Window, t: Thresholds, mesh: Pairs) -> _Load:
        p = w.probes
        bw, src, dst = p["bw_gbps"], p["node"], p["peer"]
        ends = np.union1d(mesh.a, mesh.b)
        use = ~np.isnan(bw) & (src != dst) & np.isin(src, ends) & np.isin(dst, ends)
        rows = np.nonzero(use)[0]
        share = sharing(w)[rows]
        _, group = groups_of(w)
        codes = {g: i for i, g in enumerate(sorted(set(group.values())))}
        code = np.full(len(w.nodes) + 1, -1)
        for x, g in group.items():
            code[x] = codes[g]
        a, b = src[rows].astype(int), dst[rows].astype(int)
        # What a healthy path moves: the upper quartile of the lone transfers inside the groups (a narrow uplink slows
        # every transfer across it, so those are not the yardstick), of all lone ones where no group is known.
        lone = share == 1
        inside = lone & (code[a] >= 0) & (code[a] == code[b])
        pick = inside if inside.any() else lone if lone.any() else np.ones(len(rows), dtype=bool)
        base = float(np.percentile(bw[rows][pick], 75)) if len(rows) else np.nan
        # Agents that probe in step send at once, often several into one node: each measured its share of that
        # node's link, so a transfer is narrow only when it moved less than its share would on a healthy path. Left
        # out instead (as the switch rule leaves them), the transfers that filled a shaped uplink in its first
        # seconds were every one of them contended, and the pair queued behind them was named a path.
        return cls(a, b, p["ts"][rows], bw[rows] * share < t.bw_ratio * base, code)

    def queued(self, a: int, b: int, ts: np.ndarray) -> bool:
        """Whether a link the pair ``a``~``b`` shares carried narrow transfers around its probes (``ts``), half or more:
        the transfers between the same two groups (across the same uplinks), or those of either end (its own link)."""
        near = (self.ts >= np.nanmin(ts) - QUEUE_SPAN_S) & (self.ts <= np.nanmax(ts) + QUEUE_SPAN_S)
        # The pair's own transfers say nothing here: a bad route slows them as much as a narrow link would.
        near &= ~(((self.src == a) & (self.dst == b)) | ((self.src == b) & (self.dst == a)))
        links = [(self.src == a) | (self.dst == a), (self.src == b) | (self.dst == b)]
        ga, gb = self.code[a], self.code[b]
        if ga >= 0 and gb >= 0 and ga != gb:
            ca, cb = self.code[self.src], self.code[self.dst]
            links.append(((ca == ga) & (cb == gb)) | ((ca == gb) & (cb == ga)))
        # At least half of them narrow, not any one: now and then a healthy transfer comes out slow (a busy CPU), and
        # one such among fast ones must not hide a bad route.
        return any((through := near & link).any() and 2 * self.narrow[through].sum() >= through.sum()
                   for link in links)


def _path_detection(w: Window, mesh: Pairs, i: int, ends: dict[int, tuple[int, int]]) -> Detection:
    p = w.probes
    sel = mesh.rows(i)
    a, b = sorted((w.nodes[int(mesh.a[i])], w.nodes[int(mesh.b[i])]))
    rtt = _median(p["rtt_ms"][sel])
    loss = float(np.nansum(p["lost"][sel]) / max(1.0, float(np.nansum(p["sent"][sel]))))
    what = f"{loss:.0%} probe loss" if loss >= 0.2 else f"RTT {rtt:.2f} ms vs {mesh.baseline_rtt_ms:.2f} ms elsewhere"
    others = {w.nodes[x]: {"pairs": n - 1, "bad": nb - 1} for x, (n, nb) in ends.items()}
    fine = " and ".join(f"{h} is fine with {v['pairs'] - v['bad']} of its {v['pairs']} other peer(s)"
                        for h, v in sorted(others.items()))
    return Detection(
        "slow_link", "link", f"{a}~{b}", "error", f"Slow path between {a} and {b}: {what}",
        f"Only this pair is slow ({what}) while {fine}: neither node's NIC is at fault but the path between them → "
        "check the route it takes: ECMP hashing onto a bad spine link or switch port (compare the switches' port "
        "counters along it, ibdiagnet / ibtracert on InfiniBand, traceroute and the ECMP next hops on Ethernet), "
        "a mis-set route or MTU on one hop, and the two switch ports' error counters.",
        {"metrics": {"layer": "path", "rtt_ms": rnd(rtt), "baseline_rtt_ms": rnd(mesh.baseline_rtt_ms),
                     "loss": rnd(loss), "bad_probes": int(mesh.bad[i]), "probes": int(mesh.recent[i]),
                     "other_pairs": others},
         "window": [rnd(np.nanmin(p["ts"][sel])), rnd(np.nanmax(p["ts"][sel]))],
         "series": {"pairs": _pair_rows(w, sel)}},
        0.85, node=a, peer_node=b)


# -- a leaf switch or rack uplink -------------------------------------------------------------------------------------

@dataclass
class _Side:
    group: str
    nodes: list[int]
    cross: np.ndarray  # pair positions with one end inside, one outside
    inside: np.ndarray
    narrow: dict[str, Any] | None = None  # flagged on bulk bandwidth (_Bulk.narrow_uplink), not on RTT or loss


def _switches(w: Window, t: Thresholds, mesh: Pairs) -> list[Detection]:
    by, group = groups_of(w)
    if by is None:
        return []
    # Group names as integer codes (-1: no group), so each group's pairs are two integer comparisons.
    names = sorted(set(group.values()))
    codes = {g: i for i, g in enumerate(names)}
    code = np.full(len(w.nodes) + 1, -1)
    members: dict[str, list[int]] = {g: [] for g in names}  # each group's nodes, in one pass over the nodes
    for x, g in sorted(group.items()):
        code[x] = codes[g]
        members[g].append(x)
    ga, gb = code[mesh.a], code[mesh.b]
    mostly = mesh.mostly_bad
    bulk = _Bulk.of(w, code, mesh)
    cross, inside = _by_group(ga, gb, len(names))
    sides, flagged = {}, []
    for i, g in enumerate(names):
        side = _Side(g, members[g], cross[i], inside[i])
        sides[g] = side
        if _uplink_bad(t, mesh, mostly, side):
            flagged.append(g)
        elif bulk is not None and (narrow := bulk.narrow_uplink(t, i)) is not None:
            side.narrow = narrow
            flagged.append(g)
    if not flagged:
        return []
    measured = [g for g, s in sides.items() if len(s.cross) or (bulk is not None and bulk.crosses(names.index(g)))]
    if len(measured) == 2 and len(flagged) == 1:
        # Two groups share every cross pair and transfer: the other group's check failed on its own inside pairs
        # (pings queued at a busy node, a transfer contended at that moment), not on the uplink, which is the same
        # one, so both are named, on the same evidence (bandwidth when that was what flagged it, else RTT).
        other = next(g for g in measured if g != flagged[0])
        sides[other].narrow, flagged = sides[flagged[0]].narrow, measured
    if len(flagged) >= 2 and set(flagged) == set(measured):
        # Every group's way out is slow: two racks cannot tell their uplinks apart, and all racks at once is the
        # spine (or every uplink), not one leaf.
        return [_switch_detection(w, by, [sides[g] for g in flagged], mesh, bulk)]
    return [_switch_detection(w, by, [sides[g]], mesh, bulk) for g in flagged]


def _by_group(ga: np.ndarray, gb: np.ndarray, n: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """For each group code 0..n-1, the positions of the pairs with one end in it and of those with both (ascending),
    from one sort of the pairs by group: a comparison of every pair per group was 256 x 79,000 pairs at 2,048
    nodes behind 256 leaf switches."""
    pos = np.arange(len(ga))
    both = (ga == gb) & (ga >= 0)
    one = ga != gb
    # A cross pair belongs to the group of each of its placed ends.
    grp = np.concatenate([ga[one], gb[one]])
    at = np.concatenate([pos[one], pos[one]])
    placed = grp >= 0
    grp, at = grp[placed], at[placed]
    order = np.argsort(grp * len(ga) + at, kind="stable")
    cuts = np.searchsorted(grp[order], np.arange(1, n))
    cross = np.split(at[order], cuts)
    ins = np.nonzero(both)[0]
    ins = ins[np.argsort(ga[ins], kind="stable")]  # stable: ascending positions within a group
    inside = np.split(ins, np.searchsorted(ga[ins], np.arange(1, n)))
    return cross, inside


@dataclass
class _Bulk:
    """The bulk transfers of the window between placed nodes: their rows, ends' group codes and bandwidth."""

    rows: np.ndarray  # into w.probes
    src: np.ndarray  # node index of each end
    dst: np.ndarray
    ga: np.ndarray  # group code of each end
    gb: np.ndarray
    sec: np.ndarray  # whole second of each
    bw: np.ndarray
    inside_bw: float  # the typical transfer inside a group: what a healthy path moves here

    @classmethod
    def of(cls, w: Window, code: np.ndarray, mesh: Pairs) -> _Bulk | None:
        p = w.probes
        bw = p["bw_gbps"]
        src, dst = p["node"], p["peer"]
        use = ~np.isnan(bw) & (src >= 0) & (dst >= 0) & (src != dst)
        judged = np.zeros(len(w.nodes) + 1, dtype=bool)  # nodes the mesh judges (down and quiet ones left out)
        judged[mesh.a] = judged[mesh.b] = True  # index -1 (an unknown end) reads the spare last slot: never judged
        use &= judged[np.where(use, src, -1).astype(int)] & judged[np.where(use, dst, -1).astype(int)]
        rows = np.nonzero(use & ~contended(w))[0]
        placed = (code[src[rows].astype(int)] >= 0) & (code[dst[rows].astype(int)] >= 0)
        rows = rows[placed]
        a, b = src[rows].astype(int), dst[rows].astype(int)
        ga, gb = code[a], code[b]
        inside = bw[rows][ga == gb]
        if not len(inside):
            return None
        # The upper quartile: a transfer only ever comes out slower than its path (a busy CPU, another transfer to
        # the same node at that moment), never faster.
        return cls(rows, a, b, ga, gb, np.floor(p["ts"][rows]), bw[rows], float(np.percentile(inside, 75)))

    def crosses(self, g: int) -> bool:
        return bool(np.any((self.ga == g) != (self.gb == g)))

    def narrow_uplink(self, t: Thresholds, g: int) -> dict[str, Any] | None:
        """The evidence when group ``g``'s transfers to other groups, in their newest few seconds, are mostly narrow
        while its newest ones inside it are fine, from several of its nodes to several outside; else None."""
        cross = self._newest(t, (self.ga == g) != (self.gb == g))
        if cross.sum() < 3:
            return None
        # The inside transfers of the same seconds: a starved CPU or a burst of colliding transfers slows those too,
        # a slow uplink does not. Only when there are none (each node sends to its peers in turn, so a leaf's nodes
        # may all be sending out of it for those seconds), its newest ones wherever they are in the window.
        inside_all = (self.ga == g) & (self.gb == g)
        inside = inside_all & (self.sec >= self.sec[cross].min())
        if not inside.any():
            inside = self._newest(t, inside_all)
        if not inside.any():
            return None
        bar = t.bw_ratio * self.inside_bw
        narrow = self.bw < bar
        if narrow[cross].mean() < t.node_bad_frac or narrow[inside].mean() > 1 - t.node_bad_frac:
            return None
        bad = cross & narrow
        # Several of its nodes, towards several outside nodes: one node's NIC or one far node is not a switch.
        ends = np.concatenate([self.src[bad], self.dst[bad]])
        mine = np.concatenate([self.ga[bad], self.gb[bad]]) == g
        if len(np.unique(ends[mine])) < 2 or len(np.unique(ends[~mine])) < 2:
            return None
        return {"rows": self.rows[cross], "inside_rows": self.rows[inside], "bad": self.rows[bad]}

    def _newest(self, t: Thresholds, which: np.ndarray) -> np.ndarray:
        """``which`` narrowed to its newest ``link_buckets`` seconds."""
        return which & np.isin(self.sec, np.unique(self.sec[which])[-t.link_buckets:])


def _uplink_bad(t: Thresholds, mesh: Pairs, mostly: np.ndarray, side: _Side) -> bool:
    if len(side.nodes) < 2 or len(side.cross) < 3 or not len(side.inside):
        return False
    cross_bad = mostly[side.cross]
    if cross_bad.mean() < t.node_bad_frac or mostly[side.inside].mean() > 1 - t.node_bad_frac:
        return False
    # Several of its nodes, towards several outside nodes: one node's NIC or one far node is not a switch.
    bad_cross = side.cross[cross_bad]
    ends = set(mesh.a[bad_cross].tolist()) | set(mesh.b[bad_cross].tolist())
    inner = ends & set(side.nodes)
    return len(inner) >= 2 and len(ends - inner) >= 2


def _switch_detection(w: Window, by: str, sides: list[_Side], mesh: Pairs, bulk: _Bulk | None) -> Detection:
    p = w.probes
    names = [s.group for s in sides]
    cross = np.unique(np.concatenate([s.cross for s in sides]))
    inside = np.unique(np.concatenate([s.inside for s in sides]))
    cross_rows = mesh.rows(cross)
    inside_rows = mesh.rows(inside)
    cross_rtt, inside_rtt = _median(p["rtt_ms"][cross_rows]), _median(p["rtt_ms"][inside_rows])
    loss = float(np.nansum(p["lost"][cross_rows]) / max(1.0, float(np.nansum(p["sent"][cross_rows]))))
    hosts = sorted(w.nodes[x] for s in sides for x in s.nodes)
    mostly = mesh.mostly_bad
    narrow = [s.narrow for s in sides if s.narrow is not None]
    bw = _bandwidth(w, narrow, bulk)
    if len(narrow) == len(sides):
        # Flagged on bulk bandwidth alone (a rate limit adds no idle RTT): the transfers are the evidence.
        what = f"bulk bandwidth {bw['bw_gbps']:.2f} Gb/s on transfers that leave it vs {bw['inside_bw_gbps']:.2f} " \
            "Gb/s inside"
        share = f"{bw['cross_bad_frac']:.0%} of the bulk transfers"
        cross_rows = np.unique(np.concatenate([n["rows"] for n in narrow]))
        inside_rows = np.unique(np.concatenate([n["inside_rows"] for n in narrow]))
    else:
        what = (f"{loss:.0%} probe loss" if loss >= 0.2 else f"RTT {cross_rtt:.2f} ms") + \
            f" on pairs that leave it vs {inside_rtt:.2f} ms inside"
        share = f"{mostly[cross].mean():.0%} of the pairs"
    if len(sides) == 1:
        subject = names[0]
        title = f"Slow uplink of {by} {subject}: {what}"
        action = (f"{share} from {by} {subject}'s {len(hosts)} nodes to other {by}es "
                  f"are slow while the pairs inside it are fine: the nodes are healthy, their way out is not → check "
                  f"the leaf switch's uplinks to the spine (port counters and errors, a flapping or down uplink, "
                  "ECMP/adaptive routing, ibdiagnet on InfiniBand, PFC pause storms on RoCE); moving the run off "
                  "this leaf or keeping its collectives inside the leaf avoids it meanwhile.")
    else:
        subject = "~".join(names)
        title = f"Slow links between {by}es {', '.join(names)}: {what}"
        action = (f"Every pair that crosses between {by}es {', '.join(names)} is slow while the pairs inside each "
                  "are fine: the fault is between them, not in a node → check the leaf uplinks and the spine "
                  "switches (port counters and errors, a down or flapping uplink, oversubscription, ECMP/adaptive "
                  "routing, PFC pause storms on RoCE); a run kept inside one leaf avoids it meanwhile.")
    return Detection(
        "slow_link", "switch", subject[:300], "error", title, action,
        {"metrics": {"layer": "switch_uplink", "grouped_by": by, "groups": names, "nodes": hosts,
                     "rtt_ms": rnd(cross_rtt), "inside_rtt_ms": rnd(inside_rtt),
                     "baseline_rtt_ms": rnd(mesh.baseline_rtt_ms), "loss": rnd(loss),
                     "cross_pairs": len(cross), "cross_bad_frac": rnd(mostly[cross].mean() if len(cross) else None),
                     "inside_pairs": len(inside), "inside_bad_frac": rnd(mostly[inside].mean() if len(inside) else None),
                     **{k: rnd(v) for k, v in bw.items()}},
         "window": [rnd(np.nanmin(p["ts"][cross_rows])), rnd(np.nanmax(p["ts"][cross_rows]))],
         "series": {"pairs": _pair_rows(w, np.concatenate([cross_rows, inside_rows]))}},
        0.85)


def _bandwidth(w: Window, narrow: list[dict[str, Any]], bulk: _Bulk | None) -> dict[str, float]:
    """The bulk-bandwidth evidence of the groups flagged on it: transfers leaving them, inside them, the share narrow
    (empty when none was flagged on bandwidth)."""
    if not narrow or bulk is None:
        return {}
    bw = w.probes["bw_gbps"]
    cross = np.unique(np.concatenate([n["rows"] for n in narrow]))
    inside = np.unique(np.concatenate([n["inside_rows"] for n in narrow]))
    bad = np.unique(np.concatenate([n["bad"] for n in narrow]))
    return {"bw_gbps": float(np.median(bw[cross])), "inside_bw_gbps": float(np.median(bw[inside])),
            "baseline_bw_gbps": bulk.inside_bw, "cross_bad_frac": len(bad) / len(cross)}


def _median(x: np.ndarray) -> float:
    return float(np.nanmedian(x)) if np.any(~np.isnan(x)) else float("nan")


def _pair_rows(w: Window, sel: np.ndarray) -> list[list[Any]]:
    p = w.probes
    return [[w.nodes[int(a)], w.nodes[int(b)], rnd(r), rnd(c)]
            for a, b, r, c in zip(p["node"][sel][:64], p["peer"][sel][:64], p["rtt_ms"][sel][:64],
                                  p["bw_gbps"][sel][:64], strict=True)]
