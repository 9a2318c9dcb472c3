"""The inbound probe index (dashboard.storage.probe_index): per (cluster, peer, minute) the probe frames that hold
probes to the peer. It must list exactly those frames after a pass, whatever order frames arrive in (a spool replayed
into an old minute, a frame committed below ids a pass has seen), and the readers of probes *to* a host must answer
the same before a pass (searching the unindexed frames by name) as after it (through the index)."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
from django.db import connection

from dashboard.storage import frames as fr
from dashboard.storage import probe_index, probe_samples
from dashboard.telemetry.models import Node, ProbeFrame, ProbeInbound, ProbeIndexState
from dashboard.web.series import TimeRange
from tests.server import framed

pytestmark = pytest.mark.django_db

FIELDS = ["rtt_ms", "loss_pct", "bw_gbps"]


def _nodes(world: Any, n: int) -> list[Node]:
    return [Node.objects.create(cluster=world.cluster, hostname=f"p-{i:02d}") for i in range(n)]


def _post(world: Any, sender: Node, t: float, peers: list[str]) -> None:
    framed.probes(world.cluster, sender, [{"ts": t, "peer": p, "sent": 5, "lost": i % 2, "rtt_ms": 0.1 + t % 7}
                                          for i, p in enumerate(peers)])


def _truth(host: str) -> set[int]:
    """The frames holding probes to ``host``, from the frames themselves."""
    out = set()
    for f in ProbeFrame.objects.all():
        _, objs = fr.unpack(fr.PROBES, f.layout, f.n, f.data)
        if host in objs["peer"]:
            out.add(f.id)
    return out


def _listed(world: Any, host: str) -> set[int]:
    ids, _ = probe_index.frames_to(world.cluster.id, host, 0, time.time() + 3600)
    return set(ids.tolist())


def test_a_pass_lists_exactly_the_frames_with_probes_to_each_host(world: Any) -> None:
    nodes = _nodes(world, 6)
    t0 = math.floor(time.time() / 60) * 60 - 600
    for s in range(0, 300, 5):
        for i, node in enumerate(nodes):
            _post(world, node, t0 + s, [nodes[(i + k + s // 5) % 6].hostname for k in (1, 2)])
    assert probe_index.update() > 0
    for node in nodes:
        assert _listed(world, node.hostname) == _truth(node.hostname), node.hostname
    rows = ProbeInbound.objects.filter(peer="p-00")
    assert sorted({r.ts.timestamp() for r in rows}) == [t0 + 60 * m for m in range(5)]  # a row a minute
    assert probe_index.update() == 0, "a pass over frames indexed already writes nothing"


def test_a_late_frame_joins_its_old_minute_and_a_frame_below_the_seen_id_is_found(world: Any) -> None:
    a, b = _nodes(world, 2)
    t0 = math.floor(time.time() / 60) * 60 - 900
    _post(world, a, t0 + 1, ["p-01"])
    probe_index.update()
    _post(world, a, t0 + 61, ["p-01"])
    _post(world, b, t0 + 2, ["p-00", "p-01"])  # a spool replayed: the first minute again
    probe_index.update()
    assert _listed(world, "p-01") == _truth("p-01") and len(_truth("p-01")) == 3
    assert _listed(world, "p-00") == _truth("p-00")
    if connection.vendor != "postgresql":
        assert probe_index.margin() == 0  # SQLite: one writer, ids commit in order; nothing commits below a seen id
        return
    # A PostgreSQL transaction takes an id, higher ids commit and a pass sees them, then it commits: the margin
    # reads below the seen id again. (The id is made free first: a frame deleted from the middle.)
    gap = framed.probes(world.cluster, b, [{"ts": t0 + 3, "peer": "p-00", "sent": 5, "lost": 0}])[0].id
    _post(world, a, t0 + 62, ["p-01"])
    ProbeFrame.objects.filter(id=gap).delete()
    probe_index.update()
    assert gap < ProbeIndexState.objects.get().seen_id
    late = framed.probes(world.cluster, b, [{"ts": t0 + 3, "peer": "p-00", "sent": 5, "lost": 1}])[0]
    ProbeFrame.objects.filter(id=late.id).update(id=gap)
    probe_index.update()
    assert gap in _listed(world, "p-00") and _listed(world, "p-00") == _truth("p-00")


def test_a_pass_reads_again_only_the_margins_frames_it_has_not_indexed(world: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """On PostgreSQL the margin below the seen id is read again at every pass (a transaction may commit there late):
    its ids only, and the rows of the ids this process has not indexed yet; a pass by another process (the seen id
    moved past what this one knows) reads it whole."""
    nodes = _nodes(world, 3)
    t0 = math.floor(time.time() / 60) * 60 - 600
    for s in range(0, 40, 5):
        for i, node in enumerate(nodes):
            _post(world, node, t0 + s, [nodes[(i + 1) % 3].hostname])
    rows_read: list[int] = []
    frames = probe_index._frames

    def counting(where: str, params: list[Any]) -> Any:
        found, ids = frames(where, params)
        rows_read.extend(ids.tolist())
        return found, ids

    monkeypatch.setattr(probe_index, "_frames", counting)
    probe_index.update()
    assert len(rows_read) == ProbeFrame.objects.count()
    rows_read.clear()
    _post(world, nodes[0], t0 + 50, [nodes[1].hostname])
    probe_index.update()
    newest = ProbeFrame.objects.order_by("-id").first()
    assert newest is not None and rows_read == [newest.id], "the new frame only, not the margin's again"
    for node in nodes:
        assert _listed(world, node.hostname) == _truth(node.hostname)
    rows_read.clear()
    probe_index._indexed.clear()  # as for another process
    probe_index.update()
    assert len(rows_read) == (ProbeFrame.objects.count() if probe_index.margin() else 0)


def _readers(world: Any, node: Node, tr: TimeRange) -> tuple[Any, ...]:
    c = world.cluster.id
    return (probe_samples.to_node(c, node.hostname, tr, FIELDS),
            probe_samples.to_node_by_sender(c, node.hostname, tr, FIELDS),
            probe_samples.of_node(c, node.id, node.hostname, tr, FIELDS))


def test_the_readers_answer_alike_before_and_after_a_pass(world: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = _nodes(world, 5)
    now = time.time()
    t0 = now - 1200
    for s in range(0, 1200, 10):
        for i, node in enumerate(nodes):
            _post(world, node, t0 + s, [nodes[(i + 1 + s // 10) % 5].hostname, "p-00"] if i else ["p-03"])
    tr = TimeRange(now - 900, now, points=60)
    before = [_readers(world, n, tr) for n in nodes]
    assert before[0][0] is not None and before[0][1] and before[3][2] is not None
    probe_index.update()
    # After the pass nothing is left to search by name: the index alone must give the same answers.
    monkeypatch.setattr(probe_index, "margin", lambda: 0)
    assert ProbeIndexState.objects.get().seen_id == ProbeFrame.objects.order_by("-id").values_list("id", flat=True)[0]
    after = [_readers(world, n, tr) for n in nodes]
    assert after == before


def test_the_ids_pack_and_unpack_exactly() -> None:
    ids = np.array(sorted({0, 1, 7, 2**40, 2**40 + 3, 2**62 - 1}), dtype=np.int64)
    assert probe_index.unpack(probe_index.pack(ids)).tolist() == ids.tolist()
    assert probe_index.unpack(probe_index.pack(np.empty(0, dtype=np.int64))).tolist() == []


def test_retention_drops_the_index_with_its_frames(world: Any, settings: Any) -> None:
    from dashboard.telemetry.tasks import purge_old_samples

    (node,) = _nodes(world, 1)
    # Two days past retention: on PostgreSQL retention drops whole days, so the old day is surely gone.
    old = time.time() - settings.CLUSTERDX["RETENTION_HOURS"] * 3600 - 2 * 86400
    _post(world, node, old, ["p-00"])
    _post(world, node, time.time() - 60, ["p-00"])
    probe_index.update()
    assert ProbeInbound.objects.count() == 2
    purge_old_samples()
    assert [r.ts > datetime.fromtimestamp(old + 3600, UTC) for r in ProbeInbound.objects.all()] == [True]
    assert ProbeFrame.objects.count() == 1
