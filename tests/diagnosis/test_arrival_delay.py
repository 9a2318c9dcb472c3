"""A node is silent against what could have reached this server by now (``detectors.network.arrival_slack``).

Silence is the time from a node's newest sample to the server's clock, so whatever delays a batch on its way looks
like silence: a server behind on ingest (at 2,048 nodes one 15 s behind named a thousand healthy nodes down), or a
node whose clock runs behind. The loader gives the pass how late each node's newest batch arrived and the cluster's
median; the silence-only path waits that much longer, the probe path (its peers lose it) does not wait at all.

The cluster of ``test_node_cutoff``: four agents posting every second and probing each other; node-c's batches stop
at ``LAST`` (its peers still reach it unless it is cut)."""

from __future__ import annotations

import dataclasses

from dashboard.diagnosis.detectors import Thresholds, run_all
from dashboard.diagnosis.detectors.network import arrival_slack, nodes_down
from dashboard.diagnosis.detectors.window import Window
from tests.diagnosis.test_node_cutoff import CUT, T0, cluster
from tests.diagnosis.test_rank_beats import diagnose

LAST = T0 + 30.0
BEAT = Thresholds().heartbeat_s


def late_window(silent: float, *, delay: dict[str, float] | None = None, lag: float = 0.0,
                cut: float | None = None) -> Window:
    """The window ``silent`` seconds after node-c's last batch; the others posted up to then."""
    now = LAST + silent
    w = cluster(now, last_post=LAST, cut=cut).window(now)
    return dataclasses.replace(w, ingest_delay=delay or {}, ingest_lag_s=lag)


def named(w: Window) -> list[str]:
    return [d.subject for d in nodes_down(w, Thresholds(), {})]


def test_a_node_silent_past_the_heartbeat_is_named_when_its_batches_arrived_on_time() -> None:
    assert named(late_window(BEAT + 2, delay={h: 0.05 for h in ("node-a", "node-b", "node-c", "node-d")},
                             lag=0.05)) == ["node-c"]


def test_a_node_whose_batches_arrive_late_is_given_that_long_before_it_is_named() -> None:
    # node-c's newest batch took 20 s to arrive (queued at a server that is behind): 17 s of silence is that delay.
    assert named(late_window(BEAT + 2, delay={"node-c": 20.0}, lag=0.05)) == []
    later = nodes_down(late_window(BEAT + 21, delay={"node-c": 20.0}, lag=0.05), Thresholds(), {})
    assert [d.subject for d in later] == ["node-c"]
    d = later[0]
    assert d.evidence["metrics"]["ingest_delay_s"] == 20.0 and d.evidence["metrics"]["silent_s"] == BEAT + 21
    assert "the 20 s its batches take to arrive" in d.title


def test_the_clusters_lag_holds_for_a_node_whose_own_batches_are_not_among_the_newest() -> None:
    # The server receives every node's batches 20 s late (the median); node-c has sent nothing recently enough to have
    # a delay of its own.
    assert named(late_window(BEAT + 2, lag=20.0)) == []
    assert named(late_window(BEAT + 21, lag=20.0)) == ["node-c"]


def test_the_slack_is_bounded() -> None:
    t = Thresholds()
    # A node replaying an hour-old spool lifts its own delay, up to ingest_lag_max_s, and no other node's.
    w = late_window(5.0, delay={"node-c": 3600.0, "node-a": 0.1}, lag=0.1)
    assert arrival_slack(w, t, "node-c") == t.ingest_lag_max_s
    assert arrival_slack(w, t, "node-a") == 0.1
    assert named(late_window(BEAT + t.ingest_lag_max_s + 1, delay={"node-c": 3600.0}, lag=0.1)) == ["node-c"]


def test_a_cut_node_is_named_within_seconds_however_late_batches_arrive() -> None:
    # The probe path is evidence, not silence: its peers lose it, so no arrival delay holds it back.
    now = CUT + 4.0
    w = dataclasses.replace(cluster(now).window(now), ingest_delay={"node-c": 30.0}, ingest_lag_s=30.0)
    assert [d.key for d in run_all(w)] == [("node_down", "node-c")]


def test_a_run_whose_steps_arrive_late_is_not_hung_until_it_stops_for_longer_than_that() -> None:
    # Every rank beats "step" (beats are timed by their arrival), while the newest stored step is 6 s old: behind a
    # server that receives every node's batches 8 s late, the steps of those 6 s are still on their way.
    alive = {r: ("step", 0.5) for r in range(4)}
    assert [d.key for d in diagnose(alive, stalled=6)] == [("hang", "r")]
    assert diagnose(alive, stalled=6, late=8.0) == []
    assert [d.key for d in diagnose(alive, stalled=14, late=8.0)] == [("hang", "r")]


def test_a_cluster_silent_because_its_batches_arrive_late_says_this_server_is_behind() -> None:
    until = T0 + 25.0
    now = until + 20.0
    quiet = cluster(until, cut=None, last_post=until + 100).window(now)
    # Batches still arriving, 20 s after they were sent: this server's ingest is behind.
    (d,) = run_all(dataclasses.replace(quiet, ingest_lag_s=20.0))
    assert d.key == ("cluster_silent", "cluster")
    assert d.title.startswith("this server receives the cluster's batches 20 s late: no node heard for 20 s")
    assert "ingest is behind" in d.action and "CLUSTERDX_INGEST_NODES_PER_S" in d.action
    assert d.evidence["metrics"]["ingest_lag_s"] == 20.0
    # None arriving late (the last arrivals were on time): the nodes, or the network to them.
    (d,) = run_all(dataclasses.replace(quiet, ingest_lag_s=0.05))
    assert d.title.startswith("no node of the cluster heard for 20 s") and "power" in d.action


def test_behind_a_server_that_the_whole_cluster_is_silent_to_the_lag_is_taken_back_once() -> None:
    # node-c's agent stopped 20 s before the others' last word (its peers still reach it); then every node's data
    # stops reaching the pass, batches arriving 10 s late. Judged as of the last word, node-c is 20 s silent: past
    # the heartbeat, with the shared 10 s already taken back by moving the pass to that word.
    last_word = LAST + 20.0
    buf = cluster(last_word, last_post=LAST, cut=None)
    w = dataclasses.replace(buf.window(last_word + 10.0), ingest_lag_s=10.0,
                            ingest_delay=dict.fromkeys(("node-a", "node-b", "node-d"), 10.0))
    assert sorted(d.key for d in run_all(w)) == [("node_down", "node-c")]
