"""A whole cluster silent at once (``detectors.network.cluster_silence``): one finding for the cluster, the rest of
the window judged as of its last word, never one node_down per node.

The cluster of ``test_node_cutoff``: four agents posting every second, probing each other, a four-rank run stepping.
What the server has stored ends at ``until`` for every node alike, as when its ingest falls behind (each batch
still queued, stored later) or when it is cut off from all of them."""

from __future__ import annotations

from dashboard.diagnosis.detectors import Detection, Thresholds, run_all
from dashboard.diagnosis.detectors.buffer import WindowBuffer
from tests.diagnosis.test_node_cutoff import CUT, T0, cluster


def test_a_cluster_heard_from_ten_seconds_late_is_not_four_nodes_down() -> None:
    until = T0 + 25.0  # healthy data, stored up to here; the pass runs 10 s later
    found = run_all(cluster(until, cut=None, last_post=until + 100).window(until + 10.0))
    assert found == [], [(d.key, d.title) for d in found]


def test_a_cluster_silent_past_the_heartbeat_is_one_finding_with_the_nodes_last_words() -> None:
    until = T0 + 25.0
    now = until + 20.0
    found = run_all(cluster(until, cut=None, last_post=until + 100).window(now))
    assert [d.key for d in found] == [("cluster_silent", "cluster")], [(d.key, d.title) for d in found]
    d = found[0]
    assert d.subject_type == "cluster" and d.severity == "critical"  # a run was stepping on them
    assert "all 4 nodes" in d.title and "20 s" in d.title and "/metrics" in d.action
    m = d.evidence["metrics"]
    assert m["nodes"] == 4 and m["silent_s"] == 20.0 and m["last_heard"] == until
    assert m["ranks"] == [f"job/rank{n}" for n in range(4)]
    heard = d.evidence["series"]["heard"]
    # Every node heard up to its last word, none after it: a cliff, not a slope.
    assert [n for t, n in zip(heard["t"], heard["nodes"], strict=True) if t <= until] == [4] * 61
    assert [n for t, n in zip(heard["t"], heard["nodes"], strict=True) if t > until] == [0] * 20
    assert d.evidence["window"] == [until, now]


def test_a_node_cut_before_the_cluster_went_quiet_is_still_named_against_the_others() -> None:
    # node-c is cut at CUT; what is stored of everyone ends 8 s later; the pass runs 10 s after that.
    until = CUT + 8.0
    found = run_all(cluster(until).window(until + 10.0))
    assert [d.key for d in found] == [("node_down", "node-c")], [(d.key, d.title) for d in found]
    assert "silent for 8 s" in found[0].title


def test_a_lone_nodes_silence_is_that_nodes() -> None:
    buf = WindowBuffer()
    for s in range(20):
        buf.add({"host": "solo", "sent_at": T0 + s, "hosts": [{"ts": T0 + s, "cpu_pct": 40.0}]})
    found = run_all(buf.window(T0 + 19 + Thresholds().heartbeat_s + 1))
    assert [d.key for d in found] == [("node_down", "solo")]


# -- a server restarted after minutes down (dashboard.ingest.listening) ------------------------------------------------
# Nothing could be heard while this server was down: its first passes come before the agents' next posts, and a
# silence counts from the later of a node's newest word and the start of the server's listening.
UNTIL = T0 + 25.0  # the cluster's last words before the server went down
RESTART = UNTIL + 420.0  # seven minutes later it listens again


def keys(found: list[Detection]) -> list[tuple[str, str]]:
    return [d.key for d in found]


def test_a_restarted_server_names_the_clusters_silence_only_once_it_has_listened_a_heartbeat() -> None:
    buf = cluster(UNTIL, cut=None, last_post=UNTIL + 100)
    heartbeat = Thresholds().heartbeat_s
    first = buf.window(RESTART + 2.0)
    assert keys(run_all(first)) == [("cluster_silent", "cluster")]  # what the first pass said when silence was all
    for after in (2.0, 8.0, heartbeat - 0.5):
        w = buf.window(RESTART + after)
        w.listening_since = RESTART
        assert keys(run_all(w)) == [], after  # the nodes' batches may be on their way: nothing yet, not a node either
    w = buf.window(RESTART + heartbeat + 1.0)
    w.listening_since = RESTART
    found = run_all(w)
    assert keys(found) == [("cluster_silent", "cluster")], [(d.key, d.title) for d in found]
    d = found[0]
    assert f"no node of the cluster heard for {420 + heartbeat + 1:.0f} s (all 4 nodes)" in d.title
    assert f"(this server has listened for {heartbeat + 1:.0f} s of it)" in d.title
    assert d.evidence["metrics"]["listened_s"] == heartbeat + 1 and d.evidence["metrics"]["last_heard"] == UNTIL


def test_a_server_listening_all_along_names_the_silence_as_before() -> None:
    w = cluster(UNTIL, cut=None, last_post=UNTIL + 100).window(UNTIL + 20.0)
    w.listening_since = UNTIL - 3600.0
    found = run_all(w)
    assert keys(found) == [("cluster_silent", "cluster")] and "listened" not in found[0].title


def test_after_a_restart_a_node_whose_batches_have_not_come_is_down_only_once_the_server_listened_a_heartbeat() -> None:
    buf = cluster(UNTIL, cut=None, last_post=UNTIL + 100)
    heartbeat = Thresholds().heartbeat_s
    named: list[tuple[float, list[tuple[str, str]]]] = []
    before: list[tuple[float, list[tuple[str, str]]]] = []
    for s in range(1, int(heartbeat) + 4):  # three nodes post again each second; node-c does not
        for host in ("node-a", "node-b", "node-d"):
            buf.add({"host": host, "sent_at": RESTART + s, "hosts": [{"ts": RESTART + s, "cpu_pct": 40.0}]})
        w = buf.window(RESTART + s + 0.5)
        before.append((s + 0.5, keys(run_all(w))))
        w.listening_since = RESTART
        named.append((s + 0.5, keys(run_all(w))))
    # Measured from its last word alone, node-c was down at the first pass after the restart.
    assert before[0] == (1.5, [("node_down", "node-c")]), before[0]
    assert [at for at, found in named if found] == [at for at, _ in named if at >= heartbeat], named
    assert all(found == [("node_down", "node-c")] for _, found in named if found), named
