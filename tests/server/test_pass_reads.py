"""What the diagnosis pass reads of the hosts' samples and the probes' peers, through the real ingest: each node's
newest host sample (picked by the database, whatever order the samples were stored in), and every probe peer by its
name, an address without an agent included, from pass to pass while the pass holds the probe rows as codes."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from dashboard.diagnosis import held
from dashboard.diagnosis.loader import load_window
from dashboard.live import publish
from tests.server.conftest import World, make_batch, post

pytestmark = pytest.mark.django_db


def _send(client: Any, world: World, seq: int, host: str, ts: float, **extra: Any) -> None:
    batch = make_batch(seq, host=host, **{"steps": [], **extra})
    batch["sent_at"] = ts
    for g in batch["gpus"]:
        g["ts"] = ts
    response = post(client, batch, world.token)
    assert response.status_code == 200, response.content


def test_each_nodes_newest_host_sample_is_the_one_the_pass_sees(client: Any, world: World) -> None:
    now = time.time()
    mount = {"mount": "/data", "server": "nfs-1", "rtt_ms": 2.0}
    # node-a's samples arrive out of order (a spooled one last); only the newest counts, with its own mounts
    _send(client, world, 0, "node-a", now - 8, hosts=[{"ts": now - 8, "cpu_pct": 10.0}])
    _send(client, world, 1, "node-a", now - 2, hosts=[{"ts": now - 2, "cpu_pct": 30.0, "nfs": [mount]}])
    _send(client, world, 2, "node-a", now - 5, hosts=[{"ts": now - 5, "cpu_pct": 20.0,
                                                        "nfs": [{**mount, "rtt_ms": 900.0}]}])
    _send(client, world, 0, "node-b", now - 3, hosts=[{"ts": now - 3, "cpu_pct": 55.0}])
    _send(client, world, 0, "node-c", now - 30, hosts=[{"ts": now - 30, "cpu_pct": 99.0}])  # out of the window
    w = load_window(world.cluster, now, beats=[])
    assert set(w.hosts) == {"node-a", "node-b"}
    assert w.hosts["node-a"]["cpu_pct"] == 30.0 and w.hosts["node-a"]["ts"] == pytest.approx(now - 2, abs=1e-3)
    assert w.hosts["node-a"]["nfs"] == [{**mount, "ops_per_s": None, "exe_ms": None}]  # the same row's mounts
    assert w.hosts["node-b"]["cpu_pct"] == 55.0


def _peers(w: Any) -> set[tuple[str, str]]:
    """(prober, peer) of every probe row in the window, by name."""
    return {(w.nodes[int(a)], w.nodes[int(b)]) for a, b in zip(w.probes["node"], w.probes["peer"], strict=True)}


def test_probe_peers_keep_their_names_from_pass_to_pass(client: Any, world: World) -> None:
    now = time.time()

    def probe(peer: str, ts: float) -> dict[str, Any]:
        return {"ts": ts, "peer": peer, "sent": 10, "lost": 0, "rtt_ms": 0.2}

    held.forget()
    _send(client, world, 0, "node-a", now - 6, probes=[probe("node-b", now - 6), probe("10.9.9.9", now - 6)])
    _send(client, world, 0, "node-b", now - 6, probes=[probe("node-a", now - 6)])
    first = load_window(world.cluster, now - 5, beats=[])
    assert _peers(first) == {("node-a", "node-b"), ("node-a", "10.9.9.9"), ("node-b", "node-a")}
    # the next pass reads only the new rows; a peer first seen now gets its name, the held rows keep theirs
    _send(client, world, 1, "node-b", now - 1, probes=[probe("10.9.9.10", now - 1), probe("node-a", now - 1)])
    second = load_window(world.cluster, now, beats=[])
    want = {("node-a", "node-b"), ("node-a", "10.9.9.9"), ("node-b", "node-a"), ("node-b", "10.9.9.10")}
    assert _peers(second) == want
    assert second.nodes[:2] == ["node-a", "node-b"] and set(second.nodes[2:]) == {"10.9.9.9", "10.9.9.10"}
    held.forget()
    fresh = load_window(world.cluster, now, beats=[])
    assert _peers(fresh) == want
    assert np.array_equal(np.sort(fresh.probes["ts"]), np.sort(second.probes["ts"]))


@pytest.mark.parametrize("text", ['{"env": {"NCCL_IB_HCA": "mlx5_0"}, "rank": 3}', '{"a": 1e400, "b": -1e400}',
                                  '{"a": 123456789012345678901234567890}', '{"s": "\\u00e9\\ud83d\\ude00", "n": null}',
                                  '[1, 2.5, -0.0, true]', '"text"'])
def test_a_json_column_reads_as_json_reads_it(text: str) -> None:
    import json

    from dashboard.diagnosis.loader import _json

    assert repr(_json(text)) == repr(json.loads(text))
    assert _json({"already": "decoded"}) == {"already": "decoded"}


def _run_of_four(client: Any, world: World, run: str, last_step: float, committed: Any) -> None:
    """Ranks 0-3 of ``run``, one on each of node-0..node-3, stepping every 0.5 s until ``last_step``; each node's agent
    and each rank's beat heard now, the ranks saying they are in a step. ``committed``: pytest-django's on-commit
    capture (the live state is written after the commit, which a test's transaction never makes)."""
    now = time.time()
    with committed(execute=True):
        for n in range(4):
            steps = [{"run": run, "rank": n, "step": s, "ts": last_step - 0.5 * (19 - s), "step_time_s": 0.5,
                      "data_wait_s": 0.01, "compute_s": 0.4, "comm_s": 0.09} for s in range(20)]
            meta = {"run": run, "rank": n, "world_size": 4, "ts": last_step - 10, "host": f"node-{n}", "gpu_index": 0}
            beat = {"run": run, "rank": n, "ts": now, "state": "step", "state_s": 1.0, "step": 19}
            _send(client, world, 0 if run == "r" else 1, f"node-{n}", now, steps=steps, runs=[meta], beats=[beat])
    publish.publisher.drain()  # the beats reach the live state after their group commits, on the publisher's thread


def test_the_ranks_beats_are_read_only_for_a_run_that_stopped_stepping(client: Any, world: World,
                                                                        django_capture_on_commit_callbacks: Any
                                                                        ) -> None:
    from dashboard.diagnosis.detectors import run_all
    from dashboard.diagnosis.loader import Beats

    now = time.time()
    _run_of_four(client, world, "r", now - 0.2, django_capture_on_commit_callbacks)
    w = load_window(world.cluster, now + 0.5)
    assert isinstance(w.beats, Beats)
    assert run_all(w) == [] and not w.beats.read  # every run steps: nobody asks where its ranks are
    assert sorted((b["run"], b["rank"], b["state"]) for b in w.beats) == [("r", n, "step") for n in range(4)]
    assert w.beats.read and len(w.beats) == 4

    # A second run on the same nodes stopped 10 s ago, every rank alive and saying it is in a step: a hang of the
    # run, named from its beats.
    _run_of_four(client, world, "h", now - 10, django_capture_on_commit_callbacks)
    w = load_window(world.cluster, now + 0.5)
    found = run_all(w)
    assert [d.key for d in found] == [("hang", "h")] and w.beats.read
    assert found[0].evidence["metrics"]["beats"] == {"step": 4}
