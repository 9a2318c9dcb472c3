"""Network and liveness detectors: node down / agent silent, a node's clock behind, and slow or flapping links.

A network fault shows in the pairwise probes, not in any one rank's timing (the all-reduce slows everyone alike).
A pair is *bad* when its RTT, loss or bulk bandwidth is far from the cluster's quiet baseline; the node to blame is
the one common to the bad pairs (nearly all of its pairs bad, in several consecutive probe rounds). When the bad
pairs share no node, the link between two nodes is named.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from dashboard.diagnosis.detectors.base import Detection, Thresholds, groups, rnd
from dashboard.diagnosis.detectors.window import PORT_ERRORS, Table, Window

# -- node down -----------------------------------------------------------------------------------------------------

def report_intervals(w: Window) -> dict[int, float]:
    """node -> its agent's reporting interval (median gap between its GPU sample times); 1 s when unknown."""
    g = w.gpus
    if not len(g):
        return {}
    first = g["gpu"] == np.nanmin(g["gpu"])  # one GPU per node is enough to see the cadence
    node, ts = g["node"][first], g["ts"][first]
    order = np.lexsort((ts, node))
    node, ts = node[order], ts[order]
    same = node[1:] == node[:-1]
    # Each node's median gap in one sort (by node, then gap), not one np.median per node: 2,048 of those cost more
    # than the rest of the pass's node checks.
    nodes, gaps = node[1:][same], np.diff(ts)[same]
    order = np.lexsort((gaps, nodes))
    nodes, gaps = nodes[order], gaps[order]
    starts = np.r_[0, np.nonzero(np.diff(nodes))[0] + 1] if len(nodes) else np.empty(0, dtype=int)
    counts = np.diff(np.r_[starts, len(nodes)])
    median = (gaps[starts + (counts - 1) // 2] + gaps[starts + counts // 2]) / 2
    keep = counts >= 2
    return dict(zip(nodes[starts][keep].astype(int).tolist(), median[keep].tolist(), strict=True))


def quiet_nodes(w: Window) -> set[str]:
    """Nodes not heard from for 1.5 times their cadence: the interval they sample at (:func:`report_intervals`), or
    the interval they post at when that is longer (``Window.post_interval``: a node between two posts of 4 s of
    samples is not quiet)."""
    index = w.node_index()
    intervals = report_intervals(w)
    return {h for h, heard in w.last_heard.items()
            if w.now - heard > 1.5 * max(intervals.get(index.get(h, -1), 1.0), w.post_interval.get(h, 0.0))}


def unreachable_all(w: Window, heard: dict[int, float], t: Thresholds) -> dict[int, tuple[int, int, int, int]]:
    """node ``i`` -> (lost, sent, peers, rounds) of the peers' newest probe rounds to it that each lost it
    (``probe_loss_frac`` of their pings), for every node in ``heard`` (node -> when it was last heard): the rounds
    since it was heard after the last one that reached it. Not a sum over everything since then: a round reports when
    it ends, seconds after its pings, so rounds that ended after the node's last word often probed it before it went
    away; summed in, they dilute the loss of the rounds after them for as long as the window holds them (the
    testbed's cut node took 15 s to name that way). A round that reached the node after one that lost it says it is
    back, or that the loss was the prober's.

    Every node at once, by one sort of the probe rows to them by (node, time) and sums over the groups: nodes_down
    asks about hundreds of nodes a pass at 2,048 nodes posting every 4 s (those between two posts), and a few numpy
    calls per node were 6 % of a pass."""
    out = dict.fromkeys(heard, (0, 0, 0, 0))
    p = w.probes
    if not heard or not len(p):
        return out
    peer = p["peer"]
    n = len(w.nodes) + 1
    since = np.full(n, np.inf)  # the nodes not asked about: no row is past +inf
    since[np.fromiter(heard, dtype=np.intp, count=len(heard))] = np.fromiter(heard.values(), dtype=float,
                                                                              count=len(heard))
    ok = (peer >= 0) & (peer < n)
    target = np.where(ok, peer, n - 1).astype(np.intp)
    rows = np.flatnonzero(ok & (p["ts"] > since[target]) & (p["sent"] > 0))
    if not len(rows):
        return out
    rows = rows[np.lexsort((p["ts"][rows], target[rows]))]  # stable: by node, then time, then window order
    node = target[rows]
    lost, sent = p["lost"][rows], p["sent"][rows]
    starts = np.flatnonzero(np.r_[True, node[1:] != node[:-1]])
    group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(rows)]))
    with np.errstate(invalid="ignore"):
        reached = lost / sent < t.probe_loss_frac
    pos = np.arange(len(rows))
    last = np.maximum.reduceat(np.where(reached, pos, -1), starts)  # each node's last round that reached it
    tail = pos > last[group]
    k = len(starts)
    lost_sum = np.bincount(group[tail], weights=np.nan_to_num(lost[tail]), minlength=k)
    sent_sum = np.bincount(group[tail], weights=np.nan_to_num(sent[tail]), minlength=k)
    count = np.bincount(group[tail], minlength=k)
    # Distinct senders per node: (group, sender) as one integer (senders are node indexes, -1 unknown).
    pairs = np.unique(group[tail] * (1 << 32) + np.nan_to_num(p["node"][rows][tail], nan=-1).astype(np.int64) + 1)
    senders = np.bincount(pairs >> 32, minlength=k)
    for g, i in enumerate(node[starts].tolist()):
        out[i] = (int(lost_sum[g]), int(sent_sum[g]), int(senders[g]), int(count[g]))
    return out


def stranded(w: Window, ranks: list[str]) -> dict[str, int]:
    """run -> how many of its other ranks wait for ``ranks`` (["run/rankN"], a node's ranks): a collective needs
    every rank, so the rest of each run stalls in it until the node is back or the run's timeout kills it."""
    cut: dict[str, int] = {}
    for r in ranks:
        run = r.rsplit("/rank", 1)[0]
        cut[run] = cut.get(run, 0) + 1
    return {run.name: len(run.ranks) - cut[run.name] for run in w.runs if run.name in cut}


def nodes_down(w: Window, t: Thresholds, ranks_on: dict[str, list[str]]) -> list[Detection]:
    """``ranks_on``: host -> ["run/rankN", ...] of the runs that were stepping (their stop is the damage).

    Named as soon as the node is silent for ``silent_min_s`` (or ``silent_intervals`` of its reporting interval) and
    its peers' newest rounds lose it (:func:`unreachable`, ``probe_lost_rounds`` of them): a cut link or a dead node
    within seconds. Silence alone waits ``heartbeat_s``: an agent that is slow or restarting while its node answers
    its peers is not a node down."""
    out = []
    index = w.node_index()
    intervals = report_intervals(w)
    silent_past: list[tuple[str, float, int]] = []  # (host, heard, its index): silent past its limit
    for host, heard in w.last_heard.items():
        i = index.get(host, -1)
        if w.now - heard >= max(t.silent_min_s, t.silent_intervals * intervals.get(i, 1.0)):
            silent_past.append((host, heard, i))
    probed = unreachable_all(w, {i: heard for _, heard, i in silent_past if i >= 0}, t)
    for host, heard, i in silent_past:
        silent = w.now - heard
        lost, sent, peers, rounds = probed[i] if i >= 0 else (0, 0, 0, 0)
        rounds_lost = sent > 0 and rounds >= t.probe_lost_rounds
        late = arrival_slack(w, t, host)
        # Silence alone counts from when this server began listening (``cluster_silence`` says why): after a restart
        # a node whose batches have not come yet is not down. Its peers losing it is evidence at once.
        if not rounds_lost and w.now - max(heard, w.listening_since) < t.heartbeat_s + late:
            continue
        ranks = ranks_on.get(host, [])
        waiting = stranded(w, ranks)
        if rounds_lost:
            title = f"{host} is down: silent for {silent:.0f} s and {peers} peer(s) lose {lost / sent:.0%} of probes to it"
        else:
            title = f"{host}'s agent is silent for {silent:.0f} s"
            if late >= 1.0:
                title += f" (past the {t.heartbeat_s:g} s heartbeat and the {late:.0f} s its batches take to arrive)"
        if waiting:
            title += "; stalls " + ", ".join(sorted(waiting))
        stalls = "".join(f"; the other {n} rank(s) of {run} wait for it in their collective (the run is stalled, "
                         "not hung on its own)" for run, n in sorted(waiting.items()))
        action = (f"Check the node (IPMI/BMC console, power, kernel panic, its link and switch port); {len(ranks)} rank(s) "
                  f"on it are cut off{': ' + ', '.join(ranks[:8]) if ranks else ''}{stalls} → drain it and restart the "
                  "run(s) from the last checkpoint without it." if rounds_lost or ranks else
                  "Check the agent (systemctl status clusterdx-agent, its log) and the node's network.")
        out.append(Detection(
            "node_down", "node", host, "critical" if ranks else "error", title, action,
            {"metrics": {"silent_s": rnd(silent, 1), "last_heard": rnd(heard), "probe_loss": rnd(lost / sent) if sent
                         else None, "probing_peers": peers, "ranks": ranks[:64], "waiting_ranks": waiting,
                         "ingest_delay_s": rnd(late, 1)},
             "window": [rnd(heard), rnd(w.now)]},
            0.97 if rounds_lost else 0.8, node=host))
    return out


def arrival_slack(w: Window, t: Thresholds, host: str) -> float:
    """Seconds of a node's silence that the way to this server accounts for: how late its newest batch arrived, or
    how late the cluster's batches arrive (the median), whichever is more, up to ``ingest_lag_max_s``.

    Silence is measured from the node's newest sample to this server's clock, so anything that delays a batch on its
    way looks like silence: a server behind on ingest (every batch queued at its door, drained in order), or a node
    whose clock runs behind. At 2,048 nodes a server 15 s behind named a thousand healthy nodes down, each a page.
    A dead node's batches stop arriving at all; with a server that keeps up it is named as before, and behind one it
    is named that many seconds later. The probe path (peers losing it) needs no slack: it is evidence, not silence."""
    behind = clock_behind(w, t, host)
    if behind is not None:  # its data is that much older than it looks, for as long as its batches keep arriving
        return w.ingest_lag_s + behind
    return min(t.ingest_lag_max_s, w.arrival_delay(host))


def clock_behind(w: Window, t: Thresholds, host: str) -> float | None:
    """Seconds the node's clock runs behind this server's (beyond the delay every node's batches share), or None.

    Its newest ``clock_batches`` or more batches (``Window.arrivals``) each arrived ``clock_behind_s`` or more after
    the ``sent_at`` it stamped, the cluster's median delay taken off, at a steady delay (within ``clock_spread_s``),
    and the newest within ``heartbeat_s``. A steady delay is the clock: a batch crossing a network or a queue for
    minutes would time out, and an agent replaying its spool sends faster than it sampled, so there the delays fall
    batch by batch."""
    a = w.arrivals.get(host)
    if a is None or len(a) < t.clock_batches or w.now - float(a[:, 0].max()) > t.heartbeat_s:
        return None
    delays = a[:, 1]
    behind = float(np.median(delays)) - w.ingest_lag_s
    if behind < t.clock_behind_s or float(delays.max() - delays.min()) > t.clock_spread_s:
        return None
    return behind


def clocks_behind(w: Window, t: Thresholds) -> list[Detection]:
    """One finding a node whose clock runs behind (:func:`clock_behind`): its samples, steps and events sit that
    many seconds early on every chart, the window reads little or none of them, and its silence cannot be judged by
    its samples' age (``nodes_down`` waits for its batches to stop arriving instead)."""
    out = []
    for host in sorted(w.arrivals):
        behind = clock_behind(w, t, host)
        if behind is None:
            continue
        a = w.arrivals[host]
        title = (f"{host}'s clock is {behind:.0f} s behind this server's: its batches arrive {behind:.0f} s after "
                 "the times it stamps on them")
        action = ("Fix the node's time sync (chronyc tracking / timedatectl timesync-status: is chronyd or "
                  "systemd-timesyncd running and reaching its NTP or PTP source?). Until then its GPU samples, steps "
                  f"and events are stored {behind:.0f} s early: misaligned with the other nodes on every chart, "
                  "outside the diagnosis window, and its ranks' step times skewed against theirs.")
        out.append(Detection(
            "clock_skew", "node", host, "warning", title, action,
            {"metrics": {"behind_s": rnd(behind, 1), "arrival_delay_s": rnd(float(np.median(a[:, 1])), 1),
                         "ingest_lag_s": rnd(w.ingest_lag_s, 1), "batches": len(a),
                         "delay_spread_s": rnd(float(a[:, 1].max() - a[:, 1].min()), 2)},
             "window": [rnd(float(a[0, 0])), rnd(w.now)]},
            0.85, node=host))
    return out


def cluster_silence(w: Window, t: Thresholds, ranks_on: dict[str, list[str]]) -> tuple[float | None,
                                                                                    Detection | None]:
    """When every node of a cluster of two or more is silent, the time the freshest of them was last heard, and the
    one finding that says so once that is ``heartbeat_s`` ago; (None, None) otherwise.

    Nodes do fail together (a rack's power, the network between them and this server), but when *all* of a
    cluster's data stops at once the likelier cause is on this side: the server's ingest is behind (every batch
    still queued, accepted later) or cut off from the nodes. Measured against the server's clock, all 2,048 nodes of
    an ingest benchmark whose server fell 20 s behind were "down", and the findings' storm (each opened, reconciled,
    planned for alerts) slowed ingest further. So the caller judges the rest of the window as of the freshest word
    (``now`` moved back to it: a node is silent against the nodes that are heard), and the cluster's silence is one
    finding, with the nodes' last words as its evidence."""
    heard = w.last_heard
    if len(heard) < 2:
        return None, None  # one node's silence is that node's
    freshest = max(heard.values())
    silent = w.now - freshest
    if silent < t.silent_min_s:  # every limit is at least this: the usual pass stops here, before nodes_down's sort
        return None, None
    intervals = report_intervals(w)
    index = w.node_index()
    # Silent: past the least of the nodes' limits, so that every node is past its own.
    limit = min(max(t.silent_min_s, t.silent_intervals * intervals.get(index.get(h, -1), 1.0)) for h in heard)
    if silent < limit:
        return None, None
    # Silent while this server listened: a server restarted after minutes down has heard nothing yet, and its first
    # pass came before the agents' next posts. Until it has listened a heartbeat the rest waits too (the caller
    # judges it as of the freshest word, where no node is past its limit).
    listened = w.now - max(freshest, w.listening_since)
    if listened < t.heartbeat_s:
        return freshest, None
    ranks = sorted(r for h in heard for r in ranks_on.get(h, []))
    # How many nodes were still heard at each second before the silence: a cliff (all at once) points at this
    # server's side or a shared network; a slope at the nodes going one by one.
    ages = np.sort(np.asarray(list(heard.values())))
    ticks = freshest + np.arange(-60.0, min(silent, 60.0) + 1e-9, 1.0)  # the minute before, up to one after
    still = len(ages) - np.searchsorted(ages, ticks, side="left")
    # The ledger tells the two apart: batches still arriving, but late, are this server's ingest falling behind; none
    # arriving is the nodes or the network to them.
    lag = w.ingest_lag_s
    behind = lag >= max(t.silent_min_s, 0.5 * silent)
    if behind:
        title = (f"this server receives the cluster's batches {lag:.0f} s late: no node heard for {silent:.0f} s "
                 f"(all {len(heard)} nodes)")
        action = (f"The nodes are sending: their batches arrive {lag:.0f} s after they were sent, so this server's "
                  "ingest is behind and every page and finding is that late. Check /metrics "
                  "(clusterdx_ingest_queue_batches, clusterdx_ingest_commit_seconds, clusterdx_db_write_wait_seconds, "
                  "refused batches) and the server's CPU; give it cores or web workers, or ask the agents for fewer "
                  "posts (lower CLUSTERDX_INGEST_NODES_PER_S raises their send interval).")
    else:
        title = f"no node of the cluster heard for {silent:.0f} s (all {len(heard)} nodes)"
        action = ("If the nodes are up, this server is not receiving or not storing their batches: check its ingest on "
                  "/metrics (clusterdx_ingest_queue_batches, clusterdx_ingest_commit_seconds, refused batches), its "
                  "log, and the network between the nodes and it (the agents' logs say whether their posts fail). If "
                  "they are down together, look for what they share: power, the management network, the scheduler "
                  "draining them.")
    if listened < silent:
        title += f" (this server has listened for {listened:.0f} s of it)"
    if ranks:
        title += f"; {len(ranks)} rank(s) of running jobs with them"
    return freshest, Detection(
        "cluster_silent", "cluster", "cluster", "critical" if ranks else "error", title, action,
        {"metrics": {"silent_s": rnd(silent, 1), "last_heard": rnd(freshest), "nodes": len(heard),
                     "earliest_heard_ts": rnd(float(ages[0])), "ranks": ranks[:64], "ingest_lag_s": rnd(lag, 1),
                     "listened_s": rnd(listened, 1)},
         "series": {"heard": {"t": [rnd(float(x)) for x in ticks], "nodes": [int(n) for n in still]}},
         "window": [rnd(freshest), rnd(w.now)]},
        0.9)


# Two bulk transfers into one node that end this close together ran at the same time and shared its link: each
# measured a share of it, which says nothing about the path (agents started together probe in step, so on eight
# nodes with a transfer each second this happened every few seconds). A rate-limited path slows a lone transfer too.
CONTENDED_S = 0.25


def sharing(w: Window) -> np.ndarray:
    """Per probe row: how many bulk transfers into its receiving node ended together with it (its run of transfers
    each within :data:`CONTENDED_S` of the next; 1 when alone or no transfer). A transfer that shared with k others
    measured about a k-th of the link."""
    p = w.probes
    out = np.ones(len(p))
    rows = np.nonzero(~np.isnan(p["bw_gbps"]))[0]
    if len(rows) < 2:
        return out
    rows = rows[np.lexsort((p["ts"][rows], p["peer"][rows]))]
    apart = (p["peer"][rows][1:] != p["peer"][rows][:-1]) | (np.diff(p["ts"][rows]) >= CONTENDED_S)
    run = np.r_[0, np.cumsum(apart)]
    out[rows] = np.bincount(run)[run]
    return out


def contended(w: Window) -> np.ndarray:
    """Per probe row: a bulk transfer that shared its receiving node with another one (:data:`CONTENDED_S`)."""
    return sharing(w) > 1


# -- links ---------------------------------------------------------------------------------------------------------

def _bad_pairs(w: Window, t: Thresholds, down: set[int]) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """(rows to use, bad flag per row, baselines)."""
    p = w.probes
    use = np.ones(len(p), dtype=bool)
    for d in down:
        use &= (p["node"] != d) & (p["peer"] != d)
    rows = np.nonzero(use)[0]
    rtt, bw = p["rtt_ms"][rows], p["bw_gbps"][rows]
    # Probes time their pings in user space: on a node whose CPU is saturated (data loader workers, a busy
    # machine) a ping waits for the scheduler and its RTT grows by milliseconds with nothing wrong on the wire.
    busy = _busy_nodes(w, t)
    either_busy = busy[p["node"][rows].astype(int)] | busy[p["peer"][rows].astype(int)]
    with np.errstate(all="ignore"):
        base_rtt = float(np.nanpercentile(rtt, 25)) if np.any(~np.isnan(rtt)) else float("nan")
        base_bw = float(np.nanpercentile(bw, 75)) if np.any(~np.isnan(bw)) else float("nan")
        loss = p["lost"][rows] / p["sent"][rows]
        slow = rtt > np.maximum(t.rtt_ratio * base_rtt,
                                base_rtt + np.where(either_busy, t.rtt_busy_abs_ms, t.rtt_abs_ms))
        lossy = loss >= t.loss_frac
        # A transfer that shared its receiver measured its share of that link: judge it by what the link moved.
        # Agents probe in step, so on a healthy cluster two or three transfers into one node at once are common, and
        # a node that happened to receive together in its last rounds was named slow (0.64 vs 1.07 Gb/s).
        narrow = bw * sharing(w)[rows] < t.bw_ratio * base_bw
    bad = np.nan_to_num(slow, nan=0).astype(bool) | np.nan_to_num(lossy, nan=0).astype(bool)
    return rows, np.vstack([bad, np.nan_to_num(narrow, nan=0).astype(bool)]), {"rtt_ms": base_rtt, "bw_gbps": base_bw}


def _busy_nodes(w: Window, t: Thresholds) -> np.ndarray:
    """Per node index: its host CPU is at least ``busy_cpu_pct`` busy (latest host sample)."""
    busy = np.zeros(len(w.nodes) + 1, dtype=bool)  # the extra slot: rows whose far end is unknown (-1)
    for i, host in enumerate(w.nodes):
        cpu = (w.hosts.get(host) or {}).get("cpu_pct")
        busy[i] = cpu is not None and cpu >= t.busy_cpu_pct
    return busy


Crossing = Callable[[int, np.ndarray], bool]  # (node, the peers of its slow transfers) -> the uplink's pattern


def groups_of(w: Window) -> tuple[str | None, dict[int, str]]:
    """(what the groups are, "switch" or "rack" or None; node index -> its group): by leaf switch when any node has
    one (the switch is what a cross-rack pair leaves through), else by rack."""
    places = w.places
    by = "switch" if any(s for _, s in places.values()) else "rack" if any(r for r, _ in places.values()) else None
    if by is None:
        return None, {}
    index = w.node_index()
    at = 1 if by == "switch" else 0
    return by, {index[h]: v[at] for h, v in places.items() if h in index and v[at]}


def _node_bad(w: Window, t: Thresholds, node: int, mine: np.ndarray, other: np.ndarray, bucket: np.ndarray,
              bad: np.ndarray, bw: np.ndarray, crossing: Crossing | None = None) -> dict[str, Any] | None:
    """``node``: its index; ``mine``: positions (into the used rows) of its pairs; ``other``: the far end of each;
    ``crossing``: :func:`_uplink_alike`'s test, or None where no places are known."""
    b = bucket[mine]
    # RTT / loss: the node's pairs in its last few probe rounds.
    buckets = np.unique(b)[-t.link_buckets:]
    sel = np.isin(b, buckets)
    hit = None
    if len(buckets) >= t.link_buckets and sel.sum() >= 3:
        rb = bad[0][mine]
        frac = rb[sel].mean()
        per_bucket = [rb[sel & (b == k)].mean() for k in buckets]
        if frac >= t.node_bad_frac and min(per_bucket) >= 0.5 and len(np.unique(other[sel & rb])) >= 2:
            hit = {"what": "rtt", "bad_frac": frac, "rows": mine[sel]}
    # Bandwidth: bulk transfers may be rare (the real source sends one peer a bulk transfer per period), so use the
    # node's last few probe rounds that carried one, wherever they are in the window. A transfer only ever comes out
    # slower than its link (another probe to the same node at that moment, a busy CPU at either end), never faster:
    # the node is narrow only when its *best* recent transfers are, every one of them, against several peers.
    has_bw = ~np.isnan(bw[mine])
    bw_buckets = np.unique(b[has_bw])[-t.link_buckets:]
    sel_bw = has_bw & np.isin(b, bw_buckets)
    if hit is None and sel_bw.sum() >= 3 and len(bw_buckets) >= 2 and bad[1][mine][sel_bw].all() and \
            len(np.unique(other[sel_bw])) >= (2 if len(w.nodes) > 2 else 1) and \
            not (crossing is not None and crossing(node, other[sel_bw])):
        hit = {"what": "bw", "bad_frac": 1.0, "rows": mine[sel_bw]}
    return hit


def _uplink_alike(w: Window, src: np.ndarray, dst: np.ndarray, bw: np.ndarray, bw_bad: np.ndarray
                  ) -> Crossing | None:
    """A test of a node's slow transfers, or None where no leaf switch or rack is known: whether all of them went to
    peers behind other switches while the other nodes' transfers across switches are mostly slow too. Then they say
    as much of the uplinks as of the node (a narrow uplink makes every node's cross-rack transfers slow, and which
    peers a node sent its few bulk transfers to is chance), and the switch rule (:mod:`paths`) decides; a narrow
    node link leaves the others' cross transfers healthy."""
    _, group = groups_of(w)
    if not group:
        return None
    ids = {name: k for k, name in enumerate(sorted(set(group.values())))}
    code = np.full(len(w.nodes) + 1, -1, dtype=np.int64)  # the extra slot: a far end that is not a node (-1)
    for i, name in group.items():
        code[i] = ids[name]
    gs, gd = code[src.astype(np.int64)], code[dst.astype(np.int64)]
    cross = (~np.isnan(bw)) & (gs >= 0) & (gd >= 0) & (gs != gd)

    def test(node: int, peers: np.ndarray) -> bool:
        mine = group.get(node)
        if mine is None or not all(group.get(int(p)) not in (None, mine) for p in peers):
            return False
        others = cross & (src != node) & (dst != node)
        return bool(others.any() and bw_bad[others].mean() >= 0.5)

    return test


def _flag_nodes(w: Window, t: Thresholds, rows: np.ndarray, bad: np.ndarray, skip: set[int]) -> dict[int, Any]:
    p = w.probes
    src, dst = p["node"][rows], p["peer"][rows]
    pos = np.arange(len(rows))
    ends = np.concatenate([src, dst])
    far = np.concatenate([dst, src])
    at = np.concatenate([pos, pos])
    bucket = np.floor(p["ts"][rows])
    any_bad = bad[0] | bad[1]
    # Most nodes have no bad pair at all: only the ends of a bad pair are grouped and judged (grouping all 2,048
    # nodes' rows to skip them one by one was most of this detector).
    known = ends >= 0
    node = np.where(known, ends, 0).astype(np.int64)
    some_bad = np.bincount(node[known], weights=any_bad[at[known]], minlength=len(w.nodes) + 1) > 0
    some_bad[[n for n in skip if 0 <= n < len(some_bad)]] = False
    sel = np.nonzero(known & some_bad[node])[0]
    crossing = _uplink_alike(w, src, dst, p["bw_gbps"][rows], bad[1]) if len(sel) else None
    hits: dict[int, tuple[np.ndarray, dict[str, Any]]] = {}
    for n, part in groups(ends[sel]).items():
        idx = sel[part]
        hit = _node_bad(w, t, int(n), at[idx], far[idx], bucket, bad, p["bw_gbps"][rows], crossing)
        if hit:
            hits[int(n)] = (idx, hit)
    if len(hits) < 2 or len(w.nodes) - len(skip) <= 2:  # two nodes alone: their one link (slow_links' pair case)
        return {n: hit for n, (_, hit) in hits.items()}
    # A narrow node slows every transfer it takes part in, so its peers' transfers with it are bad too. A peer whose
    # other transfer of its last rounds merely met contention (a busy core) then had nothing but bad transfers
    # against two peers, and was named beside the node (the testbed on four nodes, node-b at 100 Mbit/s: node-d
    # named on its transfers with node-b and one 0.64 Gb/s to node-c). Nodes are judged strongest case first (the
    # most peers it is bad with), each next one without its pairs with the nodes already named.
    def peers_bad(n: int) -> int:
        idx = hits[n][0]
        return len(np.unique(far[idx][any_bad[at[idx]]]))

    flagged: dict[int, dict[str, Any]] = {}
    for n in sorted(hits, key=lambda n: (-peers_bad(n), n)):
        idx, hit = hits[n]
        alone = idx[~np.isin(far[idx], list(flagged))]
        if len(alone) < len(idx):
            hit = _node_bad(w, t, n, at[alone], far[alone], bucket, bad, p["bw_gbps"][rows], crossing) \
                if len(alone) else None
        if hit:
            flagged[n] = hit
    return flagged


def slow_links(w: Window, t: Thresholds, down: set[str], explained: set[str] | frozenset[str] = frozenset()
               ) -> list[Detection]:
    """``explained``: nodes whose bad pairs a leaf switch finding already accounts for (:mod:`paths`)."""
    index = w.node_index()
    # A node that has gone quiet and loses its probes is about to be named down, not slow: leave it to that detector.
    down_i = {index[h] for h in down | quiet_nodes(w) if h in index}
    out: dict[str, Detection] = {}
    if len(w.probes):
        rows, bad, base = _bad_pairs(w, t, down_i)
        flagged = _flag_nodes(w, t, rows, bad, down_i | {index[h] for h in explained if h in index})
        if len(flagged) == 2 and len(w.nodes) - len(down_i) <= 2:
            a, b = sorted(w.nodes[n] for n in flagged)
            det = _probe_detection(w, rows, flagged[next(iter(flagged))], base, f"{a}~{b}", a, b)
            out[det.subject] = det
        else:
            for n, hit in flagged.items():
                out[w.nodes[n]] = _probe_detection(w, rows, hit, base, w.nodes[n], w.nodes[n], None)
    for det in _port_problems(w, t, down):
        if det.subject in out:
            _merge(out[det.subject], det)
        else:
            out[det.subject] = det
    return list(out.values())


def _probe_detection(w: Window, rows: np.ndarray, hit: dict[str, Any], base: dict[str, float], subject: str,
                     node: str, peer: str | None) -> Detection:
    p = w.probes
    sel = rows[hit["rows"]]
    with np.errstate(all="ignore"):
        rtt, bw = float(np.nanmedian(p["rtt_ms"][sel])) if np.any(~np.isnan(p["rtt_ms"][sel])) else float("nan"), \
            p["bw_gbps"][sel]
    loss = float(np.nansum(p["lost"][sel]) / max(1.0, float(np.nansum(p["sent"][sel]))))
    bw_med = float(np.nanmedian(bw)) if np.any(~np.isnan(bw)) else None
    if hit["what"] == "bw":
        what = f"bulk bandwidth {bw_med:.2f} Gb/s vs {base['bw_gbps']:.2f} Gb/s elsewhere"
    elif loss >= 0.2:
        what = f"{loss:.0%} probe loss, RTT {rtt:.2f} ms"
    else:
        what = f"RTT {rtt:.2f} ms vs {base['rtt_ms']:.2f} ms elsewhere"
    where = f"the link {subject}" if peer else node
    return Detection(
        "slow_link", "link" if peer else "node", subject, "error",
        f"Slow network on {where}: {what}",
        f"{hit['bad_frac']:.0%} of {where}'s probe pairs are bad in the last rounds ({what}) while the rest of the "
        "cluster is fine, so the fault is on this node's side → check its NIC and cable, switch port counters and "
        "errors (ethtool -S, ibdiagnet), MTU and traffic-control settings; cordon it if the collective time of the "
        "run is hurting.",
        {"metrics": {"rtt_ms": rnd(rtt), "baseline_rtt_ms": rnd(base["rtt_ms"]), "loss": rnd(loss),
                     "bw_gbps": rnd(bw_med), "baseline_bw_gbps": rnd(base["bw_gbps"]), "bad_frac": rnd(hit["bad_frac"])},
         "window": [rnd(np.nanmin(p["ts"][sel])), rnd(np.nanmax(p["ts"][sel]))],
         "series": {"pairs": [[w.nodes[int(a)] if a >= 0 else None, w.nodes[int(b)] if b >= 0 else None, rnd(r), rnd(c)]
                              for a, b, r, c in zip(p["node"][sel][:64], p["peer"][sel][:64], p["rtt_ms"][sel][:64],
                                                    p["bw_gbps"][sel][:64], strict=True)]}},
        0.9, node=node, peer_node=peer)


def _port_problems(w: Window, t: Thresholds, down: set[str]) -> list[Detection]:
    q = w.ports
    out = []
    if not len(q):
        return out
    rates = q["rate_gbps"][~np.isnan(q["rate_gbps"])]
    cluster_rate = float(np.median(rates)) if len(rates) else float("nan")
    key = q["node"] * 256 + q["port"]
    rows = np.nonzero(_port_suspects(q, cluster_rate))[0]
    for k, idx in groups(key[rows]).items():
        host = w.nodes[int(k // 256)]
        if host in down:
            continue
        idx = rows[idx]
        idx = idx[np.argsort(q["ts"][idx])]
        det = _port_detection(w, t, host, idx, cluster_rate)
        if det is not None:
            out.append(det)
    return out


def _port_suspects(q: Table, cluster_rate: float) -> np.ndarray:
    """Rows of the ports with any sign of trouble (a state not ACTIVE, an error or link-down count, a low rate), so
    the detailed checks run on a handful of ports instead of one per node: a healthy port never becomes a finding
    (flapping needs a non-active sample, errors a non-zero count, slowness a low rate). The first two come with
    the row (``suspect``, :func:`~dashboard.diagnosis.detectors.window.port_suspect`)."""
    flagged = q["suspect"] > 0
    with np.errstate(invalid="ignore"):
        flagged |= q["rate_gbps"] < 0.9 * cluster_rate
    key = q["node"] * 256 + q["port"]
    return np.isin(key, np.unique(key[flagged]))


def _port_detection(w: Window, t: Thresholds, host: str, idx: np.ndarray, cluster_rate: float) -> Detection | None:
    q = w.ports
    states = [s for s in q["state"][idx] if s]
    counters = [c or {} for c in q["counters"][idx]]
    errs = np.array([sum(int(c.get(k, 0) or 0) for k in PORT_ERRORS) for c in counters])
    downed = sum(int(c.get("link_downed", 0) or 0) for c in counters)
    active = [s.upper().endswith("ACTIVE") for s in states]
    device = f"{q['device'][idx[-1]]}:{q['port'][idx[-1]]:.0f}"
    rate = q["rate_gbps"][idx]
    problems = []
    if downed or (any(active) and not all(active)):
        problems.append(("error", f"IB port {device} flapping: went down {max(downed, 1)} time(s)"))
    if (errs > 0).sum() >= t.port_error_samples:
        problems.append(("warning", f"IB port {device}: {int(errs.sum())} link errors in {len(idx)} samples"))
    if np.isfinite(cluster_rate) and (rate < 0.9 * cluster_rate).sum() >= 3:
        problems.append(("warning", f"IB port {device} runs at {np.nanmin(rate):.0f} of {cluster_rate:.0f} Gb/s"))
    if not problems:
        return None
    problems.sort(key=lambda p: p[0] != "error")
    totals = {k: sum(int(c.get(k, 0) or 0) for c in counters) for k in PORT_ERRORS}
    return Detection(
        "slow_link", "node", host, problems[0][0], f"Flaky network on {host}: {problems[0][1]}",
        "; ".join(p[1] for p in problems) + " → reseat or replace the cable/transceiver, check the switch port "
        "(ibdiagnet, ibqueryerrors), and cordon the node while the link keeps retraining.",
        {"metrics": {"port": device, "errors": {k: v for k, v in totals.items() if v},
                     "states": sorted(set(states)), "rate_gbps": rnd(np.nanmin(rate) if len(rate) else None)},
         "window": [rnd(q["ts"][idx[0]]), rnd(q["ts"][idx[-1]])],
         "series": {"ts": [rnd(v) for v in q["ts"][idx]], "errors": errs.tolist()}},
        0.9, node=host)


def _merge(into: Detection, other: Detection) -> None:
    from dashboard.diagnosis.detectors.base import SEVERITY_RANK

    if SEVERITY_RANK[other.severity] > SEVERITY_RANK[into.severity]:
        into.severity = other.severity
    into.action += " Also: " + other.title + "."
    into.evidence.setdefault("ports", other.evidence)
