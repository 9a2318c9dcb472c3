"""RDMA congestion and loss from the port counters: RoCE retransmits and out-of-sequence packets, transport
timeouts, ECN/CNP activity, and transmit wait (PFC pauses on RoCE, credit starvation on InfiniBand).

The agent sends each port's counters as deltas per sample (``collectors.sources.ib``: the PMA counters by name,
the driver's ``hw_counters`` as ``hw.<name>``). Here they become rates over the window, per port, and a port is a
finding only when its counter grew in several samples (one burst at a job's start is not a fabric problem):

* **loss** – ``out_of_sequence``, ``packet_seq_err`` (NAKs: the sender retransmits), ``implied_nak_seq_err``,
  ``roce_adp_retrans``: packets dropped in the fabric. RoCE needs a lossless class (PFC) or working ECN/DCQCN, and
  NCCL must send on that class: ``NCCL_IB_TC`` and ``NCCL_IB_GID_INDEX`` (the RoCE v2 GID);
* **timeouts** – ``local_ack_timeout_err``, ``rnr_nak_retry_err``: a queue pair ran out of retries; NCCL fails
  with "transport retry counter exceeded" when this goes on;
* **ECN** – ``np_cnp_sent`` (this port received ECN-marked packets), ``rp_cnp_handled`` (its sender slowed down):
  congestion control at work, a fault only when sustained and high (incast, oversubscription, ECN thresholds);
* **transmit wait** – ``port_xmit_wait`` ticks far above the cluster's other ports: the port is paused.

When most reporting nodes are congested at once, one cluster finding names the fabric's configuration instead of a
finding per node. Thresholds are per second and may be overridden through ``Thresholds.extra``. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dashboard.diagnosis.detectors.base import SEVERITY_RANK, Detection, Thresholds, rnd
from dashboard.diagnosis.detectors.window import Window

CLASSES: dict[str, tuple[str, ...]] = {
    "loss": ("hw.out_of_sequence", "hw.packet_seq_err", "hw.implied_nak_seq_err", "hw.roce_adp_retrans"),
    "timeouts": ("hw.local_ack_timeout_err", "hw.rnr_nak_retry_err"),
    "ecn": ("hw.np_cnp_sent", "hw.rp_cnp_handled"),
    "xmit_wait": ("port_xmit_wait",),
}
# Per second, per port (Thresholds.extra keys "congestion_<class>_per_s"), and in how many samples it must grow.
DEFAULTS = {"loss": 10.0, "timeouts": 0.1, "ecn": 5000.0, "xmit_wait": 1e6}
XMIT_WAIT_RATIO = 10.0  # ... and transmit wait this many times the cluster's median port
PERSIST_SAMPLES = 3
RECENT_S = 6.0  # rates over the newest samples: a storm that began seconds ago is not diluted by the whole window
CLUSTER_FRAC = 0.5  # this share of the reporting nodes (and at least 3) congested: the fabric, not the nodes
SEVERITY = {"timeouts": "error", "loss": "error", "xmit_wait": "warning", "ecn": "warning"}
WHAT = {"loss": "packets lost and retransmitted", "timeouts": "transport timeouts (retries exhausted)",
        "ecn": "ECN congestion notifications", "xmit_wait": "transmit wait (paused)"}


@dataclass
class PortRates:
    host: str
    port: str  # "mlx5_0:1"
    rates: dict[str, float]  # class -> events per second over the recent samples
    grew: dict[str, int]  # class -> samples in which it grew
    rows: np.ndarray  # its recent rows in w.ports, oldest first


@dataclass
class Mesh:
    """Every port of the window at once: class rates and growth as (ports x classes) arrays."""

    node: np.ndarray  # node index per port
    rates: np.ndarray  # events per second over the port's recent samples
    grew: np.ndarray  # samples in which each class grew
    keys: np.ndarray  # node * 256 + port
    sorted_rows: np.ndarray  # the recent rows of w.ports, by port then time ...
    bounds: np.ndarray  # ... port i's being sorted_rows[bounds[i, 0]:bounds[i, 1]]

    def rows(self, i: int) -> np.ndarray:
        return self.sorted_rows[self.bounds[i, 0]:self.bounds[i, 1]]


def port_mesh(w: Window) -> Mesh | None:
    """Per port, over its samples of the last ``RECENT_S`` that carry counters: each class's events per second.

    One C-level step per row (the counters are dicts); the rest is numpy over all ports at once: a 2,048-node
    window costs one pass over its recent rows, and Python objects are made only for the ports that are hit."""
    q = w.ports
    if not len(q):
        return None
    sel = np.nonzero(q["ts"] >= w.now - RECENT_S)[0]
    sel = sel[np.fromiter((isinstance(c, dict) for c in q["counters"][sel]), dtype=bool, count=len(sel))]
    if not len(sel):
        return None
    names = list(CLASSES.values())
    flat = [n for group in names for n in group]
    # Every watched counter of a row in one C-level map (``get(name, 0)``), then the classes as column sums: no
    # Python loop per row and counter.
    zeros = [0] * len(flat)
    vals = np.array([tuple(map(c.get, flat, zeros)) for c in q["counters"][sel]], dtype=float).reshape(len(sel), -1)
    sums = np.add.reduceat(vals, np.r_[0, np.cumsum([len(g) for g in names])[:-1]], axis=1)
    key, ts = (q["node"] * 256 + q["port"])[sel], q["ts"][sel]
    order = np.lexsort((ts, key))
    sel, sums, key, ts = sel[order], sums[order], key[order], ts[order]
    starts = np.r_[0, np.nonzero(np.diff(key))[0] + 1]
    ends = np.r_[starts[1:], len(key)]
    # Each sample's deltas cover the interval up to its own timestamp: leaving each port's first sample out, the
    # rest cover exactly [first ts, last ts].
    later = np.ones(len(key), dtype=bool)
    later[starts] = False
    span = ts[ends - 1] - ts[starts]
    totals = np.add.reduceat(np.where(later[:, None], sums, 0.0), starts, axis=0)
    grew = np.add.reduceat(((sums > 0) & later[:, None]).astype(int), starts, axis=0)
    keep = span > 0
    with np.errstate(all="ignore"):
        rates = totals / span[:, None]
    return Mesh((key[starts] // 256).astype(int)[keep], rates[keep], grew[keep], key[starts][keep], sel,
                np.column_stack([starts, ends])[keep])


def _limits(t: Thresholds) -> dict[str, float]:
    return {cls: float(t.extra.get(f"congestion_{cls}_per_s", v)) for cls, v in DEFAULTS.items()}


def congested_ports(w: Window, mesh: Mesh, t: Thresholds, down: set[str]) -> list[tuple[PortRates, list[str]]]:
    """(port, the classes over their limit) for every port with at least one."""
    index = w.node_index()
    up = ~np.isin(mesh.node, [index[h] for h in down if h in index])
    limits = np.array(list(_limits(t).values()))
    hit = (mesh.rates >= limits) & (mesh.grew >= PERSIST_SAMPLES) & up[:, None]
    wait = list(CLASSES).index("xmit_wait")
    if up.sum() >= 3:
        # Every port waiting alike is the fabric's load, not one paused port: only an outlier counts.
        hit[:, wait] &= mesh.rates[:, wait] >= XMIT_WAIT_RATIO * float(np.median(mesh.rates[up, wait]))
    q, classes = w.ports, list(CLASSES)
    out = []
    for i in np.nonzero(hit.any(axis=1))[0]:
        rows = mesh.rows(i)
        port = PortRates(w.nodes[int(mesh.node[i])], f"{q['device'][rows[-1]]}:{int(mesh.keys[i] % 256)}",
                         dict(zip(classes, mesh.rates[i].tolist(), strict=True)),
                         dict(zip(classes, mesh.grew[i].tolist(), strict=True)), rows)
        out.append((port, [c for c, h in zip(classes, hit[i], strict=True) if h]))
    return out


def congestion(w: Window, t: Thresholds, down: set[str]) -> list[Detection]:
    mesh = port_mesh(w)
    found = congested_ports(w, mesh, t, down) if mesh is not None else []
    if not found:
        return []
    limits = _limits(t)
    roce = (w.fabric or w.interconnect) in ("roce", "eth")
    reporting = len(np.unique(mesh.node))
    hosts = sorted({p.host for p, _ in found})
    if len(hosts) >= 3 and len(hosts) >= CLUSTER_FRAC * reporting:
        return [_detection(w, "cluster", "cluster", found, roce, reporting, limits)]
    return [_detection(w, "node", h, [(p, c) for p, c in found if p.host == h], roce, reporting, limits)
            for h in hosts]


def _fix(classes: set[str], roce: bool) -> str:
    if roce:
        fix = ("make the RoCE traffic class lossless: PFC enabled on its priority end to end (NIC: mlnx_qos -i <if> "
               "--pfc; every switch port on the path), ECN/DCQCN marking on the switches and enabled on the NICs, "
               "and NCCL on that class: NCCL_IB_TC set to the DSCP-derived traffic class (e.g. 106 for DSCP 26), "
               "NCCL_IB_GID_INDEX to the RoCE v2 GID (show_gids; usually 3)")
    else:
        fix = ("check the fabric for congestion: ibdiagnet / ibqueryerrors along the path, adaptive routing and "
               "congestion control on the subnet manager, oversubscribed uplinks, a slow receiver")
    if "timeouts" in classes:
        fix += ("; retries ran out: find the drops first, then NCCL_IB_TIMEOUT (22) and NCCL_IB_RETRY_CNT (7) "
                "give the transport room")
    if "ecn" in classes and roce:
        fix += "; sustained CNPs mean incast or oversubscription: check the ECN thresholds (min/max) on the switches"
    return fix + "."


def _detection(w: Window, subject_type: str, subject: str, found: list[tuple[PortRates, list[str]]], roce: bool,
               reporting: int, limits: dict[str, float]) -> Detection:
    classes = {c for _, hit in found for c in hit}
    severity = max((SEVERITY[c] for c in classes), key=SEVERITY_RANK.__getitem__)
    worst = max(classes, key=lambda c: (SEVERITY_RANK[SEVERITY[c]], c == "timeouts"))
    rate = max(p.rates[worst] for p, hit in found if worst in hit)
    where = "the RoCE fabric" if subject_type == "cluster" and roce else \
        "the fabric" if subject_type == "cluster" else subject
    title = f"Network congestion on {where}: {WHAT[worst]} at {rate:,.0f}/s"
    if subject_type == "cluster":
        lead = f"{len({p.host for p, _ in found})} of {reporting} nodes' ports show " + \
            ", ".join(WHAT[c] for c in sorted(classes)) + ": a fabric-wide setting, not one node"
    else:
        lead = f"{len(found)} port(s) of {subject} show " + ", ".join(WHAT[c] for c in sorted(classes)) + \
            " while the rest of the cluster does not: its link, switch port or traffic class"
    ports = [{"host": p.host, "port": p.port, "classes": hit, "per_s": {c: rnd(v) for c, v in p.rates.items()},
              "counters": _counts(w, p)} for p, hit in found[:64]]
    first = found[0][0]
    q = w.ports
    ts = [q["ts"][p.rows] for p, _ in found]
    return Detection(
        "congestion", subject_type, subject, severity, title, f"{lead} → {_fix(classes, roce)}",
        {"metrics": {"fabric": "roce" if roce else "ib", "classes": sorted(classes), "worst": worst,
                     "rate_per_s": rnd(rate), "limit_per_s": limits[worst], "ports": ports},
         "window": [rnd(min(x[0] for x in ts)), rnd(max(x[-1] for x in ts))],
         "series": {"port": f"{first.host} {first.port}", "ts": [rnd(v) for v in q["ts"][first.rows]],
                    **{cls: [sum(int((c or {}).get(n) or 0) for n in names) for c in q["counters"][first.rows]]
                       for cls, names in CLASSES.items()}}},
        0.85, node=subject if subject_type == "node" else None)


def _counts(w: Window, p: PortRates) -> dict[str, int]:
    """Each watched counter's total over the port's recent samples (its first left out, as in the rates)."""
    later = w.ports["counters"][p.rows[1:]]
    totals = {n: sum(int(c.get(n) or 0) for c in later) for names in CLASSES.values() for n in names}
    return {n: v for n, v in totals.items() if v}
