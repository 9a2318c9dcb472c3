"""Real faults on a four-node testbed, and the diagnosis must name the right subject.

Each scenario builds four network namespaces (node-a..d) on a private bridge, runs a real ``clusterdx agent`` in
each (probes to the three others, the hooks socket) and one rank of a gloo DDP job with ``trainer_hooks``; the
server runs outside, on the bridge's address. Once every agent probes and every rank steps, the healthy cluster
gets one diagnosis pass (nothing may be named), then one fault is injected and the pass runs about once a second
until the faulty subject is named, and nothing else may be. What each pass saw is printed (``pytest -s`` or ``-rP``)
and is the failure message.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
from netns_testbed import Testbed
from netns_watch import FAULT_KINDS, Watch, check_named, describe

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(120)]


def _started(site, bed: Testbed, run: str) -> Watch:
    t0 = time.monotonic()
    bed.start_agents(site.server.url, site.token)  # agents first, as on a real cluster: they hear the run's metadata
    bed.start_job(run)
    watch = Watch(site.cluster, bed, run)
    watch.warm_up()
    healthy = watch.diagnose()
    print(f"\n[{run}] warm-up {time.monotonic() - t0:.1f} s; healthy pass: {[d.key for d in healthy]}")
    assert not [d for d in healthy if d.kind in FAULT_KINDS], (
        f"a healthy cluster was diagnosed: {[describe(d) for d in healthy]}\n{watch.seen()}")
    return watch


def test_added_delay_entering_one_node_is_a_slow_link_naming_that_node(site, bed, delay_program) -> None:
    watch = _started(site, bed, "delay")
    since = time.time()
    bed.add_delay("node-c", 30, delay_program)
    # The delay also slows bulk transfers (TCP's slow start at 30 ms), which may name node-c first; the finding
    # must come to show the delay itself, as the probes measure it in user space.
    out = watch.until("slow_link", "node-c", since, accept=lambda d: (d.evidence["metrics"]["rtt_ms"] or 0) > 25)
    check_named(watch, out, {("slow_link", "node-c")})


def test_a_rate_limit_on_one_node_is_a_slow_link_naming_that_node(site, bed) -> None:
    watch = _started(site, bed, "ratelimit")
    since = time.time()
    bed.limit_rate("node-b", "100mbit")
    # Idle RTT does not show a rate limit; bulk transfers do (and pings that share the link with one).
    out = watch.until("slow_link", "node-b", since, accept=lambda d: (d.evidence["metrics"]["bw_gbps"] or 1) < 0.12)
    check_named(watch, out, {("slow_link", "node-b")})
    metrics = out.detection.evidence["metrics"]
    assert metrics["bw_gbps"] < 0.12 < metrics["baseline_bw_gbps"] / 4, metrics  # 100 Mb/s of a 1 Gb/s cluster


def test_a_slow_dataloader_on_one_rank_is_data_starvation_naming_that_rank(site, bed) -> None:
    watch = _started(site, bed, "slowdata")
    since = time.time()
    bed.slow_loader(2, 0.15)
    out = watch.until("data_starvation", "slowdata/rank2", since)
    check_named(watch, out, {("data_starvation", "slowdata/rank2")})
    assert out.detection.node == "node-c" and out.detection.rank == 2


def _stopped_rank(site, bed: Testbed, run: str, node: str, rank: int, sig: signal.Signals) -> Any:
    """Kill or freeze one rank: its beats stop while its node's agent and the other ranks keep reporting, so the
    rank itself must be named (``rank_down``, on its node), and nothing else: not the run, not a node."""
    watch = _started(site, bed, run)
    since = time.time()
    bed.signal_rank(node, sig)
    culprit = f"{run}/rank{rank}"
    out = watch.until("rank_down", culprit, since, timeout=20)
    check_named(watch, out, {("rank_down", culprit)})
    assert out.detection.node == node and out.detection.rank == rank, describe(out.detection)
    return out.detection


def test_a_killed_rank_is_named(site, bed) -> None:
    found = _stopped_rank(site, bed, "killed", "node-b", 1, signal.SIGKILL)
    # gloo's survivors die of "Read error [<node-b's address>]:port: Connection reset by peer": the evidence says so.
    metrics = found.evidence["metrics"]
    addr = next(n.addr for n in bed.nodes if n.name == "node-b")
    assert metrics["state"] != "crashed" and addr in metrics["peer_addresses"], metrics


def test_a_frozen_rank_is_named(site, bed) -> None:
    found = _stopped_rank(site, bed, "frozen", "node-d", 3, signal.SIGSTOP)
    assert found.evidence["metrics"]["beats"].get("step", 0) >= 1, found.evidence["metrics"]  # the others wait
