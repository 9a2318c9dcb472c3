"""A node whose clock runs behind (``detectors.network.clock_behind``): its batches keep arriving, each stamped
minutes earlier than this server's clock says it arrived, at a steady delay. Its samples' age is its clock's, not its
silence: it is named ``clock_skew``, not down, until its batches stop arriving. An agent replaying its spool after an
outage also sends old batches, but faster than it sampled them: their delays fall, and that is not a clock.

The cluster of ``test_node_cutoff`` (four agents posting every second and probing each other): node-c's newest
stored sample is ``BEHIND`` seconds old, as a node with its clock that far behind would look."""

from __future__ import annotations

import dataclasses

import numpy as np

from dashboard.diagnosis.detectors import Thresholds, run_all
from dashboard.diagnosis.detectors.network import arrival_slack, clock_behind, nodes_down
from dashboard.diagnosis.detectors.window import Window
from tests.diagnosis.test_arrival_delay import late_window

BEHIND = 300.0
T = Thresholds()


def arrivals(now: float, delays: list[float], every: float = 1.0, last: float = 0.5) -> np.ndarray:
    """(arrival, delay) rows, oldest first: one batch every ``every`` s, the newest ``last`` s before ``now``."""
    n = len(delays)
    received = now - last - every * np.arange(n)[::-1]
    return np.column_stack([received, np.asarray(delays, dtype=float)])


def skewed(delays: list[float] | None = None, *, every: float = 1.0, last: float = 0.5, lag: float = 0.05) -> Window:
    w = late_window(BEHIND, delay={"node-c": BEHIND}, lag=lag)
    steady = [BEHIND + 0.05 + 0.02 * (i % 3) for i in range(12)]
    return dataclasses.replace(w, arrivals={"node-c": arrivals(w.now, delays or steady, every, last)})


def kinds(w: Window) -> list[tuple[str, str]]:
    return sorted((d.kind, d.subject) for d in run_all(w, T) if d.kind in ("clock_skew", "node_down"))


def test_a_node_whose_batches_arrive_at_a_steady_delay_is_named_clock_skew_not_down() -> None:
    w = skewed()
    behind = clock_behind(w, T, "node-c")
    assert behind is not None and abs(behind - BEHIND) < 0.1  # the median delay less the cluster's 0.05 s
    assert kinds(w) == [("clock_skew", "node-c")]
    d = next(d for d in run_all(w, T) if d.kind == "clock_skew")
    assert d.severity == "warning" and d.node == "node-c"
    assert d.title.startswith("node-c's clock is 300 s behind this server's")
    assert d.evidence["metrics"]["behind_s"] == 300.0 and d.evidence["metrics"]["batches"] == 12
    assert "chronyc" in d.action


def test_without_its_arrivals_the_same_node_is_named_down() -> None:
    """What the pass said before it read the node's arrivals: silent 300 s, past heartbeat + the 120 s cap."""
    w = dataclasses.replace(skewed(), arrivals={})
    assert kinds(w) == [("node_down", "node-c")]


def test_its_slack_is_its_clock_not_the_cap() -> None:
    w = skewed()
    assert arrival_slack(w, T, "node-c") > T.ingest_lag_max_s
    assert arrival_slack(dataclasses.replace(w, arrivals={}), T, "node-c") == T.ingest_lag_max_s


def test_a_skewed_node_whose_batches_stop_arriving_is_named_down() -> None:
    # Its newest batch arrived 20 s before the pass: past the 15 s heartbeat, so the node is silent after all.
    w = skewed(last=T.heartbeat_s + 5)
    assert clock_behind(w, T, "node-c") is None
    assert kinds(w) == [("node_down", "node-c")]


def test_a_spool_replay_is_not_a_clock() -> None:
    """Back after 5 min, its agent sends the spool as fast as the server takes it: 12 batches sampled a second apart
    arrive 0.1 s apart, so each is ~0.9 s less late than the one before."""
    replay = [BEHIND + 11 * 0.9 - i * 0.9 for i in range(12)]
    w = skewed(replay, every=0.1)
    assert clock_behind(w, T, "node-c") is None
    assert ("clock_skew", "node-c") not in kinds(w)


def test_a_node_only_a_little_behind_the_clusters_lag_is_not_named() -> None:
    # A server 20 s behind on ingest; the node's batches arrive 20 + 25 s late: under clock_behind_s of its own.
    w = skewed([45.0] * 12, lag=20.0)
    assert clock_behind(w, T, "node-c") is None
    # ... and 20 + 40 s late is 40 s behind the cluster, not 60.
    assert abs(clock_behind(skewed([60.0] * 12, lag=20.0), T, "node-c") - 40.0) < 1e-9


def test_too_few_batches_say_nothing() -> None:
    w = skewed([BEHIND] * (T.clock_batches - 1))
    assert clock_behind(w, T, "node-c") is None


def test_a_skewed_node_is_not_named_down_on_silence_but_is_when_its_peers_lose_it() -> None:
    """The probe path is evidence, not silence: a node its peers cannot reach is down whatever its clock says."""
    from tests.diagnosis.test_arrival_delay import LAST
    w = late_window(BEHIND, delay={"node-c": BEHIND}, cut=LAST + 1)
    w = dataclasses.replace(w, arrivals={"node-c": arrivals(w.now, [BEHIND] * 12)})
    assert [d.subject for d in nodes_down(w, T, {})] == ["node-c"]
