"""A whole cluster silent at once (``detectors.network.cluster_silence``): one finding for the cluster, the rest of
the window judged as of its last word, never one node_down per node.

The cluster of ``test_node_cutoff``: four agents posting every second, probing each other, a four-rank run stepping.
What the server has stored ends at ``until`` for every node alike, as when its ingest falls behind (each batch
still queued, stored later) or when it is cut off from all of them."""

from __future__ import annotations

from dashboard.diagnosis.detectors import Thresholds, run_all
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
