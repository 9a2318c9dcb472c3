"""NCCL misconfiguration: NCCL_* drift across ranks, socket transport or IB disabled on an IB cluster, GPUDirect RDMA
off, and the settings audit of :mod:`clusterdx.nccl_rules` (IB timeout and retries, P2P/SHM off, forced algorithm or
protocol, GID index on RoCE, verbose debug, NCCL_SOCKET_IFNAME / NCCL_IB_HCA against what the node has).

Facts come from each rank's environment (RunMeta.env, kept as state on the rank) and from the NCCL log events the
agents parse (transport, network, GDR, the HCAs and interfaces NCCL saw). A node's interfaces are the list its agent
reports (``HostSample.interfaces``: name, state, addresses; kept on the Node by the ingest writer, and put on the
window's host sample by the loader where a rank sets NCCL_SOCKET_IFNAME) and the ones its NCCL logs named
(Bootstrap / NET/Socket / OOB); its HCAs are the devices of its IB ports. A wrong NCCL_SOCKET_IFNAME is named with
the node's real interfaces, the usable ones first and the down ones flagged.

The socket fallback is state of the run: the newest transport a node's ranks reported (``Window.nccl_state``, read
over the runs' lifetime) holds until they report another one, not only while the event is in the 2-minute window."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from typing import Any

import numpy as np

from clusterdx import nccl_rules
from dashboard.diagnosis.detectors.base import SEVERITY_RANK, Detection, Thresholds
from dashboard.diagnosis.detectors.window import RankInfo, RunInfo, Window, of_ranks, run_nodes

# Variables that legitimately differ per rank or only change logging.
IGNORED = {"NCCL_DEBUG", "NCCL_DEBUG_FILE", "NCCL_DEBUG_SUBSYS", "NCCL_COMM_ID", "NCCL_HOSTID"}


def _nccl_env(meta: dict[str, Any]) -> dict[str, str]:
    env = meta.get("env") or {}
    return {k: v for k, v in env.items() if k.startswith(("NCCL_", "TORCH_NCCL_")) and k not in IGNORED}


class _Envs:
    """A run's ranks that say their environment, each with the index of its environment among the run's distinct
    ones. A 16,384-rank run has one or a few distinct environments: each is filtered (and audited) once, not once per
    rank, which was most of this detector's time at 2,048 nodes. Distinct environments are numbered in the order
    their first rank comes, so counts taken over them break ties as counts over the ranks do."""

    __slots__ = ("_by_node", "count", "full", "nccl", "ranks")

    def __init__(self, run: RunInfo) -> None:
        self.ranks: list[tuple[int, RankInfo, int]] = []  # (rank, its info, its environment's index)
        self.nccl: list[dict[str, str]] = []  # _nccl_env of each distinct environment
        self.full: list[dict[str, str]] = []  # _all_nccl_env of each
        self.count: list[int] = []  # how many ranks have it
        self._by_node: dict[str, int] | None = None
        seen: dict[Any, int] = {}
        shared: dict[int, int] = {}  # id of an environment dict -> its index: ranks sharing one (share_env)
        for r, info in run.ranks.items():
            env = info.meta.get("env")
            if env is None:
                continue
            i = shared.get(id(env))
            if i is not None:
                self.count[i] += 1
                self.ranks.append((r, info, i))
                continue
            try:  # the same items in the same order: the same environment
                key: Any = tuple(env.items())
                i = seen.get(key)
            except TypeError:  # an unhashable value: this rank's environment stands alone
                key, i = object(), None
            else:
                shared[id(env)] = i if i is not None else len(self.nccl)
            if i is None:
                i = seen[key] = len(self.nccl)
                self.nccl.append(_nccl_env(info.meta))
                self.full.append(_all_nccl_env(info.meta))
                self.count.append(0)
            self.count[i] += 1
            self.ranks.append((r, info, i))

    @staticmethod
    def of(run: RunInfo) -> _Envs:
        """The run's, worked out once while its ranks are the loader's held ones (window.of_ranks)."""
        return of_ranks(run.ranks, "envs", lambda: _Envs(run))

    def by_node(self) -> dict[str, int]:
        """node -> the environment of its first rank."""
        if self._by_node is None:
            by_node: dict[str, int] = {}
            for _, i, e in self.ranks:
                if i.node and i.node not in by_node:
                    by_node[i.node] = e
            self._by_node = by_node
        return self._by_node


def share_env(meta: dict[str, Any], pool: dict[Any, Any]) -> dict[str, Any]:
    """``meta`` (a rank's, decoded where it was read) with its "env" replaced by the equal one already in ``pool``
    (kept there if new). Ranks of one job share one environment; sharing one dict lets :class:`_Envs` take each
    rank's by identity instead of building and hashing its items at every pass (16,384 ranks at 2,048 nodes). The
    pool belongs to the caller and is emptied past 10,000 environments."""
    env = meta.get("env")
    if not isinstance(env, dict):
        return meta
    if len(pool) > 10_000:
        pool.clear()
    try:
        same = pool.setdefault(tuple(env.items()), env)
    except TypeError:  # an unhashable value: kept as it is
        return meta
    if same is not env:
        meta["env"] = same
    return meta


def _drift(run: RunInfo, envs: _Envs | None = None) -> dict[int, dict[str, tuple[str | None, str | None]]]:
    """rank -> {var: (its value, the majority's)} for ranks that differ from the majority."""
    envs = envs or _Envs.of(run)
    total = len(envs.ranks)
    if total < 3:
        return {}
    by_env: dict[int, dict[str, tuple[str | None, str | None]]] = {}
    for var in sorted(set().union(*envs.nccl)):  # sorted: the same order of differences in every process
        values: Counter[str | None] = Counter()
        for e, n in zip(envs.nccl, envs.count, strict=True):
            values[e.get(var)] += n
        common, n = values.most_common(1)[0]
        if n <= total / 2 or n == total:
            continue
        for i, e in enumerate(envs.nccl):
            if e.get(var) != common:
                by_env.setdefault(i, {})[var] = (e.get(var), common)
    return {r: dict(by_env[i]) for r, _, i in envs.ranks if i in by_env}


def _host(e: dict[str, Any]) -> str | None:
    return e.get("node") or (e.get("data") or {}).get("host")


def _nccl_events(w: Window) -> list[dict[str, Any]]:
    """The runs' NCCL state events (held for the runs' lifetime) and the recent window's, oldest first."""
    held = getattr(w, "nccl_state", None) or []
    return sorted((e for e in [*held, *w.events] if e.get("kind") == "nccl"), key=lambda e: e.get("ts") or 0.0)


def _run_nodes(w: Window) -> set[str]:
    return set().union(*(run_nodes(run) for run in w.runs))


def _socket_facts(w: Window, envs: list[_Envs] | None = None) -> dict[str, list[str]]:
    """host -> what its NCCL logs or ranks say about falling back to sockets / GDR off. The newest inter-node
    transport a host reported decides: a fallback holds until its ranks report IB (or another RDMA network) again."""
    facts: dict[str, list[str]] = {}
    if w.interconnect == "eth":
        return facts
    state: dict[str, tuple[float, str | None]] = {}  # host -> (ts, fact or None when the newest says RDMA)
    gdr: dict[str, tuple[float, bool]] = {}
    for e in _nccl_events(w):
        data, host = e.get("data") or {}, _host(e)
        if not host:
            continue
        ts = float(e.get("ts") or 0.0)
        fact = data.get("fact")
        if data.get("transport") == "Socket" or data.get("network") == "Socket":
            state[host] = (ts, "NCCL uses the socket transport (NET/Socket)")
        elif fact == "fallback":
            state[host] = (ts, f"NCCL found no IB device ({data.get('reason', '')})")
        elif (fact == "transport" and "gdr" in data) or (fact == "network" and data.get("network")):
            state[host] = (ts, None)  # a NET transport other than sockets (only NET/ transports carry "gdr")
        if fact == "transport" and data.get("transport") == "IB" and "gdr" in data:
            gdr[host] = (ts, data["gdr"] == "false")
    recent = w.now - SPANS_EVENTS
    running = _run_nodes(w)

    def held(host: str, ts: float) -> bool:
        # Past the event window a fact holds on the nodes of an active run; when no rank said where it runs (hooks
        # without RunMeta), on any node while a run is active (the loader reads only since the oldest one began).
        return ts >= recent or host in running or (bool(w.runs) and not running)

    for host, (ts, fact) in state.items():
        if fact and held(host, ts):
            facts.setdefault(host, []).append(fact)
    for host, (ts, off) in gdr.items():
        if off and held(host, ts):
            facts.setdefault(host, []).append("GPUDirect RDMA is off (IB without GDRDMA)")
    for run_envs in envs if envs is not None else map(_Envs.of, w.runs):
        said = [_env_facts(env) for env in run_envs.nccl]
        if not any(said):
            continue
        for _, info, i in run_envs.ranks:
            if info.node and said[i]:
                facts.setdefault(info.node, []).extend(said[i])
    return {h: sorted(set(f)) for h, f in facts.items()}


def _env_facts(env: dict[str, str]) -> list[str]:
    """What a rank's NCCL environment says about sockets or GDR being off."""
    out = []
    if env.get("NCCL_IB_DISABLE") == "1" or env.get("NCCL_NET", "").lower() == "socket":
        out.append("NCCL_IB_DISABLE=1" if env.get("NCCL_IB_DISABLE") == "1" else f"NCCL_NET={env['NCCL_NET']}")
    if env.get("NCCL_NET_GDR_LEVEL") in ("0", "LOC"):
        out.append(f"NCCL_NET_GDR_LEVEL={env['NCCL_NET_GDR_LEVEL']} (GDR off)")
    return out


def nccl_config(w: Window, t: Thresholds) -> list[Detection]:
    out: dict[str, Detection] = {}
    envs = [_Envs.of(run) for run in w.runs]
    for host, facts in _socket_facts(w, envs).items():
        socket = any("socket" in f.lower() or "IB_DISABLE" in f or "no IB" in f for f in facts)
        out[host] = Detection(
            "nccl_config", "node", host, "error" if socket else "warning",
            f"NCCL on {host} " + ("falls back to sockets on an InfiniBand cluster" if socket else "runs without GDR"),
            f"{'; '.join(facts)} → unset NCCL_IB_DISABLE / NCCL_NET, check that the IB devices and drivers are "
            "visible on that node (ibv_devinfo, NCCL_IB_HCA), and that nvidia-peermem is loaded for GPUDirect RDMA; "
            "every all-reduce runs at the speed of this node's slowest path.",
            {"metrics": {"facts": facts}}, 0.95, node=host)
    node_facts = _node_facts(w)
    for run, run_envs in zip(w.runs, envs, strict=True):
        for det in _drift_detections(run, run_envs) + _audit_detections(w, run, node_facts, t, run_envs):
            if det.subject in out:
                prev = out[det.subject]
                prev.action += " Also: " + det.title + "."
                if SEVERITY_RANK[det.severity] > SEVERITY_RANK[prev.severity]:
                    prev.severity = det.severity
                rules = det.evidence.get("metrics", {}).get("rules")
                if rules:
                    prev.evidence.setdefault("metrics", {}).setdefault("rules", []).extend(rules)
            else:
                out[det.subject] = det
    return list(out.values())


# How long the recent event window is (SPANS["events"]); a fact older than that holds only while a run is on the node.
SPANS_EVENTS = 120.0
_NO_IFACE = ("no socket interface found", "No usable listening interface", "no interface found")


_DOWN = frozenset({"down", "lowerlayerdown", "notpresent", "dormant"})
# Interfaces never worth suggesting for NCCL_SOCKET_IFNAME (NCCL itself skips lo and docker* unless asked).
_NOT_FOR_NCCL = ("lo", "docker", "virbr", "veth", "br-", "cni", "flannel", "cali", "ifb", "tunl", "vxlan")


class _NodeFacts:
    __slots__ = ("hcas", "interfaces", "links", "no_iface", "roce")

    def __init__(self) -> None:
        self.hcas: set[str] = set()
        self.interfaces: set[str] = set()
        self.links: dict[str, dict[str, Any]] = {}  # name -> the agent's NetInterface record
        self.roce = False
        self.no_iface: str | None = None


def _is_down(link: dict[str, Any]) -> bool:
    return link.get("state") in _DOWN


def _shown(links: list[dict[str, Any]]) -> str:
    """"eth0 up 10.0.0.7/24, ib0 up IPoIB 10.1.0.7/16, lo; down: eth1": usable first (loopback last), the down ones
    flagged after them; link-local IPv6 left out (every interface has one)."""
    def one(i: dict[str, Any]) -> str:
        if i.get("kind") == "loopback":
            return i["name"]
        what = [i["name"], i.get("state") or "state unknown"] + (["IPoIB"] if i.get("kind") == "infiniband" else [])
        return " ".join(what + [a for a in i.get("addresses") or [] if not a.lower().startswith("fe80:")][:2])

    usable = sorted((i for i in links if not _is_down(i)), key=lambda i: (i.get("kind") == "loopback", i["name"]))
    down = sorted(i["name"] for i in links if _is_down(i))
    text = ", ".join(map(one, usable)) or "none up"
    return text + (f"; down: {', '.join(down)}" if down else "")


def _candidates(links: list[dict[str, Any]]) -> list[str]:
    """What NCCL_SOCKET_IFNAME could name on this node: up, with an address, not loopback or container plumbing."""
    return sorted(i["name"] for i in links if not _is_down(i) and i.get("kind") != "loopback" and i.get("addresses")
                  and not i["name"].startswith(_NOT_FOR_NCCL))


def _ifname_hits(ifname: str, nf: _NodeFacts, hits: list[nccl_rules.Hit],
                 selected: dict[tuple[str, tuple[str, ...]], list[str]] | None = None) -> list[nccl_rules.Hit]:
    """With the agent's list: the audit's socket_ifname_missing reworded with the node's real interfaces (states,
    addresses) and a concrete fix, and a value that selects only interfaces that are down (which the names alone
    cannot tell: NCCL then says "no socket interface found" or bootstraps over nothing usable). ``selected``: what
    a value selects among a set of names, shared by the nodes of a pass (most nodes have the same names); the
    wording is built only for a node that gets a hit (asked for every node with a list at 2,048 nodes)."""
    links = list(nf.links.values())
    if not links:
        return hits
    rule = nccl_rules.RULES["socket_ifname_missing"]

    def fix() -> str:
        good = _candidates(links)
        return (f"set NCCL_SOCKET_IFNAME={good[0]}" + (f" (up here: {', '.join(good)})" if len(good) > 1 else "")
                + " on every rank of this node, or " + rule.fix) if good else rule.fix

    if any(h.rule == "socket_ifname_missing" for h in hits):
        title, fixed = f"NCCL_SOCKET_IFNAME={ifname} selects none of the node's interfaces ({_shown(links)})", fix()
        return [dataclasses.replace(h, title=title, fix=fixed) if h.rule == "socket_ifname_missing" else h
                for h in hits]
    out = list(hits)
    case = (ifname, tuple(sorted(nf.links)))
    names = selected.get(case) if selected is not None else None
    if names is None:
        names = nccl_rules.selects(ifname, case[1])
        if selected is not None:
            selected[case] = names
    picked = [nf.links[n] for n in names]
    if picked and all(map(_is_down, picked)):
        out.append(nccl_rules.Hit(
            rule.name, rule.severity, "NCCL_SOCKET_IFNAME", ifname,
            f"NCCL_SOCKET_IFNAME={ifname} selects only interfaces that are down "
            f"({', '.join(i['name'] for i in picked)}; the node has {_shown(links)})", rule.reason, fix()))
    return out


def _node_facts(w: Window) -> dict[str, _NodeFacts]:
    """What each node has: HCAs from its IB ports, interfaces and RoCE from what its NCCL logs named (and a host
    sample's ``interfaces`` where the agent sends one), and an NCCL warning that no interface matched."""
    out: dict[str, _NodeFacts] = {}
    if len(w.ports):
        # Per distinct (node, device), not per sample row (~43,000 port rows at 2,048 nodes, a few devices each).
        node, dev = w.ports["node"], w.ports["device"]
        devs = [d for d in dict.fromkeys(dev) if d]
        if devs:
            code = {d: k for k, d in enumerate(devs)}
            codes = np.fromiter(map(code.get, dev, itertools.repeat(-1)), dtype=np.int64, count=len(dev))
            ok = (codes >= 0) & (node >= 0) & (node < len(w.nodes))
            for pair in np.unique(node[ok].astype(np.int64) * len(devs) + codes[ok]):
                i, k = divmod(int(pair), len(devs))
                out.setdefault(w.nodes[i], _NodeFacts()).hcas.add(str(devs[k]))
    for host, sample in w.hosts.items():
        links = sample.get("interfaces") if isinstance(sample, dict) else None
        if isinstance(links, list | tuple):
            nf = out.setdefault(host, _NodeFacts())
            nf.links.update((i["name"], i) for i in links if isinstance(i, dict) and i.get("name"))
            nf.interfaces.update(nf.links)
    for e in _nccl_events(w):
        host, data = _host(e), e.get("data") or {}
        if not host:
            continue
        fact = data.get("fact")
        if fact == "interfaces" and data.get("interfaces"):
            out.setdefault(host, _NodeFacts()).interfaces.update(data["interfaces"].split())
        elif fact == "net_devices":
            nf = out.setdefault(host, _NodeFacts())
            if data.get("oob"):
                nf.interfaces.add(data["oob"])
            nf.roce = nf.roce or "RoCE" in data.get("links", "").split()
        elif fact == "warn" and any(n in data.get("warn", "") for n in _NO_IFACE):
            out.setdefault(host, _NodeFacts()).no_iface = data["warn"][:200]
    return out


def _majority_env(envs: list[dict[str, str]], counts: list[int] | None = None) -> dict[str, str]:
    """The most common environment; ``counts``: how many ranks have each of ``envs`` (one each by default)."""
    tally: Counter[tuple[tuple[str, str], ...]] = Counter()
    for e, n in zip(envs, counts or [1] * len(envs), strict=True):
        tally[tuple(sorted(e.items()))] += n
    common = tally.most_common(1)
    return dict(common[0][0]) if common else {}


def _audit_detections(w: Window, run: RunInfo, nodes: dict[str, _NodeFacts], t: Thresholds,
                      envs: _Envs | None = None) -> list[Detection]:
    """The rule table on the run's common environment (one finding on the run) and, per node, the rules that depend
    on what the node has (its interfaces and HCAs; one finding on the node)."""
    envs = envs or _Envs.of(run)
    if not envs.ranks:
        return []
    world = run.world_size or len(run.ranks)
    env = _majority_env(envs.full, envs.count)
    roce = w.interconnect == "roce" or any(nodes[n].roce for n in envs.by_node() if n in nodes)
    fabric = "eth" if w.interconnect == "eth" else ("roce" if roce else "ib")
    hits = nccl_rules.audit(env, interconnect=fabric, world_size=world, scale_ranks=t.ib_timeout_scale_ranks,
                            min_at_scale=t.ib_timeout_min)
    out = []
    if hits:
        out.append(_audit_detection("run", run.name, run, hits, node=None))
    by_node = envs.by_node()
    # Most nodes have the same environment and the same devices: the node rules are asked once per distinct case.
    asked: dict[tuple[int, frozenset[str], frozenset[str]], list[nccl_rules.Hit]] = {}
    selected: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for node, e in sorted(by_node.items()):
        nf = nodes.get(node)
        if nf is None:
            continue
        node_env = envs.full[e]
        case = (e, frozenset(nf.interfaces), frozenset(nf.hcas))
        if case not in asked:
            asked[case] = [h for h in nccl_rules.audit(
                node_env, interconnect=fabric, interfaces=nf.interfaces or None, hcas=nf.hcas or None)
                if h.rule in ("socket_ifname_missing", "ib_hca_missing")]
        node_hits = list(asked[case])
        if node_env.get("NCCL_SOCKET_IFNAME"):
            node_hits = _ifname_hits(node_env["NCCL_SOCKET_IFNAME"], nf, node_hits, selected)
        if nf.no_iface and node_env.get("NCCL_SOCKET_IFNAME") and not any(
                h.rule == "socket_ifname_missing" for h in node_hits):
            known = (f"its interfaces: {_shown(list(nf.links.values()))}" if nf.links else
                     f"the interfaces NCCL named there: {', '.join(sorted(nf.interfaces))}" if nf.interfaces else
                     "the agent reports no interface names")
            rule = nccl_rules.RULES["socket_ifname_missing"]
            node_hits.append(nccl_rules.Hit(
                rule.name, rule.severity, "NCCL_SOCKET_IFNAME", node_env["NCCL_SOCKET_IFNAME"],
                f"NCCL_SOCKET_IFNAME={node_env['NCCL_SOCKET_IFNAME']} matched no interface on {node} (NCCL: "
                f"\"{nf.no_iface}\"; {known})", rule.reason, rule.fix))
        if node_hits:
            det = _audit_detection("node", node, run, node_hits, node=node)
            if nf.links:  # what the finding page shows next to the rule: the node's interfaces as its agent saw them
                det.evidence["metrics"]["interfaces"] = [
                    {k: i.get(k) for k in ("name", "state", "kind", "addresses")} for i in list(nf.links.values())[:64]]
            out.append(det)
    return out


def _all_nccl_env(meta: dict[str, Any]) -> dict[str, str]:
    """NCCL_* as launched, NCCL_DEBUG included (the audit checks it; drift ignores it)."""
    env = meta.get("env") or {}
    return {k: str(v) for k, v in env.items() if k.startswith("NCCL_")}


def _audit_detection(stype: str, subject: str, run: RunInfo, hits: list[nccl_rules.Hit], node: str | None) -> Detection:
    worst = max(hits, key=lambda h: SEVERITY_RANK.get(h.severity, 0))
    title = hits[0].title if len(hits) == 1 else f"{hits[0].title} (+{len(hits) - 1} more NCCL settings)"
    where = f" on {subject}" if stype == "node" else f" in {run.name}"
    return Detection(
        "nccl_config", stype, subject, worst.severity, title + where,
        " ".join(h.sentence() + "." for h in hits),
        {"metrics": {"rules": [{"rule": h.rule, "var": h.var, "value": h.value, "severity": h.severity,
                                "title": h.title} for h in hits],
                     "world_size": run.world_size or len(run.ranks)}},
        0.9, node=node, run=run.name)


def _drift_detections(run: RunInfo, envs: _Envs | None = None) -> list[Detection]:
    drift = _drift(run, envs)
    if not drift:
        return []
    by_node: dict[str, list[int]] = {}
    for r in drift:
        node = run.ranks[r].node
        if node:
            by_node.setdefault(node, []).append(r)
    out, covered = [], set()
    for node, ranks in by_node.items():
        on_node = [r for r, i in run.ranks.items() if i.node == node]
        same = len({tuple(sorted(drift[r].items())) for r in ranks}) == 1
        if len(on_node) >= 2 and sorted(ranks) == sorted(on_node) and same:
            out.append(_drift_detection(run, "node", node, ranks, drift[ranks[0]], node=node))
            covered.update(ranks)
    for r, diff in sorted(drift.items()):
        if r not in covered:
            out.append(_drift_detection(run, "rank", f"{run.name}/rank{r}", [r], diff, node=run.ranks[r].node))
    return out


def _drift_detection(run: RunInfo, stype: str, subject: str, ranks: list[int],
                     diff: dict[str, tuple[str | None, str | None]], node: str | None) -> Detection:
    shown = ", ".join(f"{k}={v if v is not None else '(unset)'} (others: {c if c is not None else '(unset)'})"
                      for k, (v, c) in sorted(diff.items()))
    who = f"rank {ranks[0]}" if stype == "rank" else f"every rank on {subject}"
    return Detection(
        "nccl_config", stype, subject, "warning", f"NCCL settings of {who} differ from the rest of {run.name}",
        f"{who.capitalize()} runs with {shown} → launch every rank with the same NCCL_* environment (check the "
        "launcher, the node's /etc/nccl.conf and its module files); mismatched settings cause hangs or slow "
        "collectives.",
        {"metrics": {"ranks": ranks[:64], "differences": {k: {"value": v, "others": c} for k, (v, c) in diff.items()}}},
        0.95, node=node, rank=ranks[0] if stype == "rank" else None, run=run.name)
