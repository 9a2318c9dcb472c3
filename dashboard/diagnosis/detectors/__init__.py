"""Detectors: pure functions over a :class:`~dashboard.diagnosis.detectors.window.Window` (numpy arrays of a recent
time window), one per finding kind. No database and no Django here, so they are tested and benchmarked directly.

:func:`run_all` runs them in the order that lets a root cause silence its consequences: a dead node or a GPU that
fell off the bus stalls the whole run, so the run is not also reported hung; a throttled GPU that makes its rank
the straggler is reported once, as the straggler, with the throttle as the evidence.
"""

from __future__ import annotations

import dataclasses

from dashboard.diagnosis.detectors.base import Detection, Thresholds
from dashboard.diagnosis.detectors.congestion import congestion
from dashboard.diagnosis.detectors.gpu import failing_gpus, throttling
from dashboard.diagnosis.detectors.groups import exposed_comm, late_in_groups
from dashboard.diagnosis.detectors.loss import loss_spikes
from dashboard.diagnosis.detectors.nccl import nccl_config
from dashboard.diagnosis.detectors.network import clocks_behind, cluster_silence, nodes_down, slow_links
from dashboard.diagnosis.detectors.paths import covered_nodes, slow_paths
from dashboard.diagnosis.detectors.steps import checkpoint_risk, efficiency, hang, late_ranks, memory_pressure
from dashboard.diagnosis.detectors.window import RunInfo, Window, of_ranks

KINDS = ("data_starvation", "straggler", "slow_link", "failing_gpu", "throttling", "node_down", "cluster_silent",
         "clock_skew", "rank_down", "hang", "nccl_config", "congestion",
         "checkpoint_overdue", "memory_pressure", "efficiency", "exposed_comm", "loss_spike")

__all__ = ["KINDS", "Detection", "Thresholds", "Window", "run_all"]


def _active_ranks(w: Window) -> tuple[dict[str, list[str]], set[tuple[str, int]]]:
    """Ranks of runs that stepped in the last minutes: host -> ["run/rankN"], and the (host, GPU) they run on."""
    on_host: dict[str, list[str]] = {}
    gpus: set[tuple[str, int]] = set()
    active = [run for run in w.runs if run.last_step_ts is not None and w.now - run.last_step_ts <= 600]
    if len(active) == 1:  # one run (the usual case): its own, kept with its ranks from pass to pass
        return of_ranks(active[0].ranks, ("on_host", active[0].name), lambda: _ranks_on(active[0]))
    for run in active:
        run_on, run_gpus = of_ranks(run.ranks, ("on_host", run.name), lambda run=run: _ranks_on(run))
        for host, labels in run_on.items():
            on_host.setdefault(host, []).extend(labels)
        gpus |= run_gpus
    return on_host, gpus


def _ranks_on(run: RunInfo) -> tuple[dict[str, list[str]], set[tuple[str, int]]]:
    on_host: dict[str, list[str]] = {}
    gpus: set[tuple[str, int]] = set()
    for r, info in sorted(run.ranks.items()):
        if info.node:
            on_host.setdefault(info.node, []).append(f"{run.name}/rank{r}")
            if info.gpu is not None:
                gpus.add((info.node, info.gpu))
    return on_host, gpus


def _excused(w: Window, down: list[Detection], gpus: list[Detection]) -> dict[str, str]:
    """run -> the root cause that explains why it cannot step (so it is not reported hung as well)."""
    dead_nodes = {d.node: d.subject for d in down}
    dead_gpus = {(d.node, d.gpu_index): d.subject for d in gpus if d.severity == "critical"}
    out: dict[str, str] = {}
    if not dead_nodes and not dead_gpus:  # nothing to look for among every rank of every run
        return out
    for run in w.runs:
        for info in run.ranks.values():
            cause = dead_nodes.get(info.node) or dead_gpus.get((info.node, info.gpu))
            if cause:
                out[run.name] = cause
                break
    return out


def run_all(w: Window, t: Thresholds | None = None) -> list[Detection]:
    t = t or Thresholds()
    ranks_on, rank_gpus = _active_ranks(w)
    freshest, silence = cluster_silence(w, t, ranks_on)
    if freshest is not None:  # the whole cluster is silent: the rest is judged as of its last word
        # ... which already takes back the delay every node's batches share: only what a node's exceeds it by counts.
        shift = w.now - freshest
        w = dataclasses.replace(w, now=freshest, ingest_lag_s=max(0.0, w.ingest_lag_s - shift),
                                ingest_delay={h: max(0.0, d - shift) for h, d in w.ingest_delay.items()},
                                arrivals={h: a - shift for h, a in w.arrivals.items()})
    down = nodes_down(w, t, ranks_on)
    gpus = failing_gpus(w, t)
    excused = _excused(w, down, gpus)
    out = down + gpus
    out += hang(w, t, max(t.silent_min_s, 2.0), excused)
    # Within their process group first (the slow TP rank, the slow stage); the flat cross-rank rule for the rest.
    late = late_in_groups(w, t)
    in_group: dict[str, set[int]] = {}
    for d in late:
        in_group.setdefault(d.run or "", set()).add(d.rank if d.rank is not None else -1)
    late += late_ranks(w, t, in_group)
    # A rank on a node that is down is the node's finding: its last steps before the cut (a few ms late as its link
    # went) are not a straggler of their own.
    dead = {d.node for d in down}
    late = [d for d in late if d.node not in dead]
    out += late
    straggling = {(d.node, d.gpu_index) for d in late if d.kind == "straggler"}
    out += [d for d in throttling(w, t, rank_gpus) if (d.node, d.gpu_index) not in straggling]
    out += memory_pressure(w, t)
    out += exposed_comm(w, t, {d.run for d in late if d.run})
    out += loss_spikes(w, t)
    down_hosts = {d.subject for d in down}
    # Paths and leaf switches first: a switch's nodes are not named one by one, and a path is named only while
    # neither of its ends is (a node with most pairs bad is the node rule's).
    paths = slow_paths(w, t, down_hosts)
    links = slow_links(w, t, down_hosts, covered_nodes(paths))
    named = {d.node for d in links}
    out += [d for d in paths if d.node not in named and d.peer_node not in named] + links
    out += congestion(w, t, down_hosts)
    out += nccl_config(w, t)
    out += checkpoint_risk(w, t)
    out += efficiency(w, t)
    if silence is not None:
        out.append(silence)
    else:  # a whole cluster silent is this server's or the network's story, not one node's clock
        out += clocks_behind(w, t)
    seen: dict[tuple[str, str], Detection] = {}
    for d in out:
        seen.setdefault(d.key, d)
    for d in seen.values():
        stalled = sorted(r for r, c in excused.items() if c == d.subject)
        if stalled:
            d.evidence["stalled_runs"] = stalled
    return list(seen.values())
