"""A node cut off the network: its link goes down while its agent and its rank keep running, unreachable.

The server hears nothing more from the node and its peers' probes to it time out; the other ranks of the job wait
in their all-reduce for the cut rank (gloo's collective timeout is minutes away). The diagnosis must name the node
down within seconds of the cut, list the rank it strands and the run stalled on it, and name nothing else: not the
run's hang, not the waiting ranks, not a slow link.
"""

from __future__ import annotations

import time

import pytest
from netns_watch import FAULT_KINDS, Outcome, Watch, describe

from dashboard.diagnosis.detectors.base import Thresholds

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(120)]

NAMED_WITHIN_S = 5.0


def cluster_quiet(watch: Watch) -> float:
    """Seconds since the freshest word of any node, as a pass would load the window now."""
    from dashboard.diagnosis.loader import load_window

    w = load_window(watch.cluster, time.time())
    return w.now - max(w.last_heard.values()) if w.last_heard else float("inf")


def passes(watch: Watch, since: float, seconds: float, every: float = 0.5) -> Outcome:
    """The diagnosis pass every ``every`` s until node-c is named down or ``seconds`` are up (the server's schedule is
    DIAGNOSIS_INTERVAL_S; here the pass runs often enough that the time measured is the data's, not the poll's)."""
    out = Outcome(None, float("nan"))
    while time.time() - since < seconds:
        started = time.monotonic()
        found = watch.diagnose()
        out.passes.append((time.time() - since, found))
        hit = next((d for d in found if d.key == ("node_down", "node-c")), None)
        if hit is not None and out.detection is None:
            out.detection, out.seconds = hit, out.passes[-1][0]
            return out
        time.sleep(max(0.0, every - (time.monotonic() - started)))
    return out


def test_a_node_cut_off_the_network_is_named_down_with_the_ranks_it_strands(site, bed) -> None:
    t0 = time.monotonic()
    bed.start_agents(site.server.url, site.token)
    bed.start_job("cutoff")
    watch = Watch(site.cluster, bed, "cutoff")
    watch.warm_up()
    healthy = watch.diagnose()
    print(f"\n[cutoff] warm-up {time.monotonic() - t0:.1f} s; healthy pass: {[d.key for d in healthy]}")
    assert not [d for d in healthy if d.kind in FAULT_KINDS], (
        f"a healthy cluster was diagnosed: {[describe(d) for d in healthy]}\n{watch.seen()}")

    since = time.time()
    bed.cut_off("node-c")
    # Passes a little longer than the bound, so a late detection is measured (and printed), not just missed.
    out = passes(watch, since, NAMED_WITHIN_S + 10)
    seen = watch.seen()
    print(f"[cutoff] node_down node-c after {out.seconds:.1f} s in {len(out.passes)} pass(es): "
          f"{describe(out.detection) if out.detection else None}\n"
          + "\n".join(f"  pass at {at:.1f} s: {[d.key for d in found]}" for at, found in out.passes) + f"\n{seen}")
    assert out.detection is not None, f"node-c never named down; last pass: {[describe(d) for d in out.last()]}"
    assert out.seconds <= NAMED_WITHIN_S, f"node-c named down {out.seconds:.1f} s after the cut"

    found = out.detection
    assert found.evidence["metrics"]["ranks"] == ["cutoff/rank2"], found.evidence
    assert found.evidence.get("stalled_runs") == ["cutoff"], found.evidence
    assert found.evidence["metrics"]["waiting_ranks"] == {"cutoff": 3}, found.evidence  # the three others wait
    assert "cutoff/rank2" in found.action and "cutoff" in found.title, (found.title, found.action)
    assert found.evidence["metrics"]["probe_loss"] >= 0.8, found.evidence  # the peers saw it, not the silence alone
    # A few more passes: the stalled run and its waiting ranks stay consequences, never causes of their own. A pass
    # that runs while this (loaded) server's ingest has stalled, every node silent for silent_min_s, judges the window
    # as of the freshest word (detectors.run_all); node-c's silence is then measured against the others' last words
    # and may be short of the bound. Such a pass proves nothing either way, so the passes go on (a little) until one
    # sees the cluster heard.
    extra: list[tuple[float, float]] = []  # (seconds after the cut, the cluster's quiet around that pass)
    deadline = time.monotonic() + 15
    while len(extra) < 4 or (extra[-1][1] >= Thresholds().silent_min_s and time.monotonic() < deadline):
        time.sleep(0.75)
        before = cluster_quiet(watch)
        out.passes.append((time.time() - since, watch.diagnose()))
        extra.append((out.passes[-1][0], max(before, cluster_quiet(watch))))
    assert ("node_down", "node-c") in {d.key for d in out.last()}, (
        f"{[describe(d) for d in out.last()]}; the cluster's quiet at the extra passes: {extra}\n{watch.seen()}")
    wrong = [f"after {at:.1f} s: {describe(d)}" for at, found_ in out.passes for d in found_
             if d.kind in FAULT_KINDS and d.key != ("node_down", "node-c")]
    assert not wrong, "also named:\n" + "\n".join(wrong) + f"\n{seen}"
