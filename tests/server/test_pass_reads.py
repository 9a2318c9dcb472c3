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
from tests.server.conftest import World, make_batch, post

pytestmark = pytest.mark.django_db


def _send(client: Any, world: World, seq: int, host: str, ts: float, **extra: Any) -> None:
    batch = make_batch(seq, host=host, steps=[], **extra)
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
