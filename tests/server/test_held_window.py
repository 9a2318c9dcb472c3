"""The pass process keeps its window from pass to pass and reads only the rows written since
(dashboard.diagnosis.held): every pass's window must be the one a fresh read of the database gives, also when an
agent replays batches it spooled during an outage (old sample times, stored late) and when a run's ranks change."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import pytest
from django.utils import timezone

from clusterdx import wire
from collectors.sim.model import SimCluster
from collectors.sim.scenario import parse
from dashboard.diagnosis import held, loader
from dashboard.diagnosis.detectors.window import Table, Window
from dashboard.ingest.writer import store_batch
from dashboard.storage import frames as fr
from dashboard.telemetry.models import Node, Rank
from tests.server.conftest import World

pytestmark = pytest.mark.django_db


def _rows(t: Table) -> list[tuple[Any, ...]]:
    """The table's rows in a canonical order (the held window keeps rows in the order they were written)."""
    cols = [np.nan_to_num(t.num[c], nan=-1e300) for c in t.num]
    order = np.lexsort(cols[::-1]) if len(t) else np.empty(0, dtype=int)
    return [tuple(c[i] for c in cols) + tuple(repr(t.obj[c][i]) for c in t.obj) for i in order]


def _feed(world: World, sim: SimCluster, t0: float, seconds: range) -> None:
    """Store the simulator's batches of ``seconds`` after ``t0``, as ingest would."""
    for second in seconds:
        for batch in sim.tick(t0 + second):
            store_batch(world.cluster, wire.validate_batch(batch))


def _same(a: Window, b: Window) -> None:
    assert a.nodes == b.nodes
    for name in ("gpus", "ports", "probes", "steps"):
        assert _rows(getattr(a, name)) == _rows(getattr(b, name)), name
    assert a.hosts == b.hosts and a.last_heard == b.last_heard
    assert [(r.name, r.ranks, r.last_step) for r in a.runs] == [(r.name, r.ranks, r.last_step) for r in b.runs]
    assert a.losses.keys() == b.losses.keys()
    assert all(np.array_equal(a.losses[k], b.losses[k]) for k in a.losses)


def test_each_held_window_is_what_a_fresh_read_gives(world: World) -> None:
    scenario = parse({"cluster": {"nodes": 6, "gpus_per_node": 2, "run": "llm", "seed": 3},
                      "fault": [{"kind": "ecc_storm", "at_s": 8, "node": 2, "gpu": 1, "dbe_after_s": 30}]})
    t0 = time.time() - 300
    sim = SimCluster(scenario, t0)
    spooled: list[dict[str, Any]] = []
    held.forget()
    for second in range(1, 45):
        for batch in sim.tick(t0 + second):
            if batch["host"] == "node-004" and 12 <= second < 18:  # an outage: the agent spools ...
                spooled.append(batch)
            else:
                store_batch(world.cluster, wire.validate_batch(batch))
        if second == 20:  # ... and replays its batches after newer ones were stored (ts inside the window)
            for batch in spooled:
                store_batch(world.cluster, wire.validate_batch(batch))
        if second == 30:  # a rank's meta changes (its dataloader settings): the pass sees the new one
            rank = Rank.objects.get(run__cluster=world.cluster, rank=3)
            rank.meta = {**rank.meta, "dataloader": {"num_workers": 1}}
            rank.save()
        if second % 3:
            continue
        now = t0 + second
        kept = loader.load_window(world.cluster, now, beats=[])
        assert len(kept.gpus) and len(kept.steps)
        held.forget()
        _same(kept, loader.load_window(world.cluster, now, beats=[]))
        if second == 21:
            assert (kept.gpus["node"] == kept.nodes.index("node-004")).sum() > 4 * 2, "the replayed samples"
        if second >= 30:
            run = next(r for r in kept.runs if r.name == "llm")
            assert run.ranks[3].meta["dataloader"] == {"num_workers": 1}


def test_a_pass_at_an_earlier_time_reads_afresh(world: World) -> None:
    scenario = parse({"cluster": {"nodes": 3, "gpus_per_node": 2, "run": "llm", "seed": 4}, "fault": []})
    t0 = time.time() - 300
    sim = SimCluster(scenario, t0)
    _feed(world, sim, t0, range(1, 41))
    held.forget()
    late = loader.load_window(world.cluster, t0 + 40, beats=[])
    early = loader.load_window(world.cluster, t0 + 15, beats=[])  # rows the later window dropped belong to it
    assert early.gpus["ts"].min() < late.gpus["ts"].min()
    held.forget()
    _same(early, loader.load_window(world.cluster, t0 + 15, beats=[]))


@pytest.mark.django_db(transaction=True)
def test_a_row_that_commits_after_higher_ids_is_read_by_the_next_pass(world: World) -> None:
    """PostgreSQL hands ids out at insert time: a transaction that commits late (another web worker's group commit)
    leaves a gap below ids a pass has seen. The pass reads that hole again until it fills."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("SQLite has one writer: ids commit in order")
    scenario = parse({"cluster": {"nodes": 2, "gpus_per_node": 2, "run": "llm", "seed": 4}, "fault": []})
    t0 = time.time() - 300
    sim = SimCluster(scenario, t0)

    _feed(world, sim, t0, range(1, 6))
    held.forget()
    loader.load_window(world.cluster, t0 + 5, beats=[])
    node = world.cluster.nodes.get(hostname="node-000")
    late = connection.copy()
    try:
        late.set_autocommit(False)
        sample = np.full((1, len(fr.GPUS.numbers)), np.nan)
        sample[0, [fr.GPUS.col("ts"), fr.GPUS.col("index"), fr.GPUS.col("util_gpu_pct")]] = [t0 + 5.5, 7, 12.5]
        with late.cursor() as cur:  # a slow writer takes its id now ...
            cur.execute("INSERT INTO telemetry_gpuframe (cluster_id, node_id, ts, n, layout, data) "
                        "VALUES (%s, %s, %s, 1, %s, %s) RETURNING id",
                        [world.cluster.id, node.id, sim_dt(t0 + 5.5), fr.GPUS.layout, fr.pack(sample)])
            (late_id,) = cur.fetchone()
        _feed(world, sim, t0, range(6, 9))  # ... others commit higher ids
        seen = loader.load_window(world.cluster, t0 + 8, beats=[])
        assert not (seen.gpus["gpu"] == 7).any()
        late.commit()  # ... and it commits after the pass saw them
    finally:
        late.close()
    got = loader.load_window(world.cluster, t0 + 9, beats=[])
    assert list(got.gpus["util_gpu_pct"][got.gpus["gpu"] == 7]) == [12.5], f"row {late_id} read from its hole"
    held.forget()
    _same(got, loader.load_window(world.cluster, t0 + 9, beats=[]))


def sim_dt(ts: float) -> Any:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(ts, tz=UTC)


def test_the_gpu_columns_the_pass_reads_are_the_stored_values(world: World) -> None:
    """Zero, not reported (null) and set values of every GPU column the detectors read come back as stored, held
    or fresh, whichever frames they were stored in."""
    from dashboard.diagnosis.detectors.window import GPU_NUM
    from dashboard.telemetry.models import Node
    from tests.server import framed

    t0 = time.time() - 300
    nodes = [Node.objects.create(cluster=world.cluster, hostname=f"g-{i}") for i in range(3)]
    rng = np.random.default_rng(7)
    stored: dict[tuple[str, int, float], list[float]] = {}

    def post(second: int) -> None:
        for node in nodes:
            samples = []
            for gpu in range(2):
                values = {c: [None, 0.0, float(rng.integers(1, 1000))][int(rng.integers(0, 3))] for c in GPU_NUM[3:]}
                for flag in ("retired_pages_pending", "remap_pending", "remap_failure"):
                    values[flag] = None if values[flag] is None else bool(values[flag])
                samples.append({"ts": t0 + second, "index": gpu, **values})
                stored[(node.hostname, gpu, t0 + second)] = [
                    float("nan") if values[c] is None else float(values[c]) for c in GPU_NUM[3:]]
            framed.gpus(world.cluster, node, samples)

    held.forget()
    for second in range(1, 7):
        post(second)
    loader.load_window(world.cluster, t0 + 6, beats=[])  # the frames so far held, the rest a delta
    for second in range(7, 13):
        post(second)
    for fresh in (False, True):
        if fresh:
            held.forget()
        w = loader.load_window(world.cluster, t0 + 12, beats=[])
        g = w.gpus
        got = {(w.nodes[int(g["node"][i])], int(g["gpu"][i]), float(g["ts"][i])):
               [g[c][i] for c in GPU_NUM[3:]] for i in range(len(g))}
        assert got.keys() == stored.keys()
        for k, row in stored.items():
            assert np.array_equal(np.array(got[k], dtype=float), np.array(row), equal_nan=True), (fresh, k)


def test_rank_metas_read_again_unchanged_are_not_decoded_again(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass reads again only the metas whose ``updated_at`` moved (every change stamps it), and decodes only a text
    that changed: the unchanged ones keep the object the last pass decoded, a changed one is new."""
    scenario = parse({"cluster": {"nodes": 2, "gpus_per_node": 2, "run": "llm", "seed": 6}, "fault": []})
    t0 = time.time() - 300
    sim = SimCluster(scenario, t0)
    held.forget()
    _feed(world, sim, t0, range(1, 6))

    def metas() -> dict[int, dict[str, Any]]:
        run = next(r for r in loader.load_window(world.cluster, t0 + 5, beats=[]).runs if r.name == "llm")
        return {k: r.meta for k, r in run.ranks.items()}

    first = metas()
    assert len(first) == 4 and all(first.values())
    read: list[int] = []  # the ranks whose metas a pass reads again
    rows = loader._rows

    def reading(model: Any, columns: list[str], where: str, params: list[Any]) -> Any:
        if model is Rank:
            read.extend(params)
        return rows(model, columns, where, params)

    monkeypatch.setattr(loader, "_rows", reading)
    assert metas() == first and read == [], "nothing changed: no meta read again"
    rank = Rank.objects.get(run__cluster=world.cluster, rank=1)
    rank.meta = {**rank.meta, "dataloader": {"num_workers": 3}}
    rank.save()
    second = metas()
    assert read == [rank.id], "only the changed rank's meta is read"
    assert second[1]["dataloader"] == {"num_workers": 3} and second[1] is not first[1]
    assert all(second[k] is first[k] for k in (0, 2, 3)), "not changed: not read, not decoded again"
    Rank.objects.filter(run__cluster=world.cluster, rank=2).update(updated_at=timezone.now())  # stamped, same meta
    third = metas()
    assert third == second and all(third[k] is second[k] for k in range(4)), "read again, the same text: kept"
    held.forget()
    loader._rank_meta.clear()
    assert metas() == second, "a fresh read gives the same metas"


def test_a_runs_ranks_are_the_same_object_while_unchanged_and_what_is_worked_out_of_them_follows_a_change(
        world: World) -> None:
    """The loader hands a run the same HeldRanks from pass to pass while none of its rank rows changed, so the
    detectors' memo of it (window.of_ranks) lives on; a change (a rank moved to another node) gives a new object,
    whose memo is worked out afresh, as a plain dict's always is. Read-only: a detector cannot write into it."""
    from dashboard.diagnosis.detectors import _active_ranks
    from dashboard.diagnosis.detectors.window import HeldRanks

    scenario = parse({"cluster": {"nodes": 2, "gpus_per_node": 2, "run": "llm", "seed": 6}, "fault": []})
    t0 = time.time() - 300
    sim = SimCluster(scenario, t0)
    held.forget()
    _feed(world, sim, t0, range(1, 6))

    def window() -> Window:
        return loader.load_window(world.cluster, t0 + 5, beats=[])

    w1 = window()
    ranks = w1.runs[0].ranks
    assert isinstance(ranks, HeldRanks) and len(ranks) == 4
    with pytest.raises(TypeError):
        ranks[9] = ranks[0]
    on_host, gpus = _active_ranks(w1)
    w2 = window()
    assert w2.runs[0].ranks is ranks and _active_ranks(w2)[0] is on_host, "unchanged: the same ranks, the same memo"
    moved = Rank.objects.get(run__cluster=world.cluster, rank=3)
    other = Node.objects.exclude(id=moved.node_id).get(cluster=world.cluster)
    Rank.objects.filter(id=moved.id).update(node=other, updated_at=timezone.now())
    w3 = window()
    assert w3.runs[0].ranks is not ranks and w3.runs[0].ranks[3].node == other.hostname
    on_host3, gpus3 = _active_ranks(w3)
    plain = dataclasses.replace(w3, runs=[dataclasses.replace(w3.runs[0], ranks=dict(w3.runs[0].ranks))])
    assert (on_host3, gpus3) == _active_ranks(plain) != (on_host, gpus), "worked out afresh, as for a plain dict"
    assert "llm/rank3" in on_host3[other.hostname]


def _layout(mat: np.ndarray, by_sample: bool) -> np.ndarray:
    """A delta's matrix (a row per field) as the frame reads give it (``by_sample``: a transposed view of a row per
    sample) or as the row tables' reads do."""
    return np.ascontiguousarray(mat.T).T if by_sample else mat


@pytest.mark.parametrize("by_sample", [False, True])
def test_rows_leaving_mixed_with_rows_staying_are_dropped_in_place_in_order(monkeypatch: pytest.MonkeyPatch,
                                                                           by_sample: bool) -> None:
    """Each post holds its node's last 4 s, so the rows leaving the window are mixed with rows that stay, over the
    buffer's front: they are dropped where they are (no new buffers for the whole window), the order of the rows
    that stay kept, and the held rows are exactly those of every row read that are in the window. Once the window
    stops growing, the rows move back to the buffers' start in place rather than to new buffers. The same whether
    the delta comes a row per field or a row per sample, and across the steps its copy is made in."""
    monkeypatch.setattr(held, "COPY_ROWS", 64)
    rng = np.random.default_rng(7)
    series = held.Series(at=1, strict=False)
    shifts = 0
    shift = held.Series._shift

    def counted(self: held.Series) -> None:
        nonlocal shifts
        shifts += 1
        shift(self)

    monkeypatch.setattr(held.Series, "_shift", counted)
    every_id, every_ts, every_obj = [], [], []
    next_id, buffers, last = 1, 0, None
    for second in range(4, 200, 2):
        # 2 s of posts from 50 nodes, each with its last 4 samples (ids in commit order, ts up to 4 s old)
        ts = np.concatenate([second - rng.uniform(0, 2) - np.arange(4)[::-1] for _ in range(50)])
        ids = np.arange(next_id, next_id + len(ts), dtype=np.int64)
        objs = [np.array([f"row {i}" for i in ids], dtype=object)]
        next_id += len(ts)
        every_id += ids.tolist()
        every_ts += ts.tolist()
        every_obj += objs[0].tolist()
        bound = second - 30.0  # a 30 s window
        if series.top >= 0:  # the delta read also returns the held top row
            at = every_id.index(series.top)
            ids = np.r_[series.top, ids]
            ts = np.r_[every_ts[at], ts]
            objs = [np.r_[np.array([every_obj[at]], dtype=object), objs[0]]]
        assert series.merge(ids, _layout(np.vstack([ids.astype(float), ts]), by_sample), objs, bound)
        want = [i for i, t in zip(every_id, every_ts, strict=True) if t >= bound]
        assert series.ids.tolist() == want  # exactly the window, in the order written
        assert series.mat[1].min() >= bound and series.objs[0].tolist() == [f"row {i}" for i in want]
        buffers += series._mat is not last
        last = series._mat
    # 98 passes, each dropping rows mixed with rows that stay: new buffers only as the window grew (doubling)
    assert buffers <= 3 and shifts, (buffers, shifts)  # (87 new buffers when every pass copied the window)
    assert (series._objs[0][:series.lo] == None).all()  # noqa: E711 (element-wise): nothing left behind is kept


def test_a_merged_hole_does_not_hold_a_row_twice() -> None:
    """Past MAX_HOLES, neighbouring holes merge, and a merged hole reads again rows held already (ids between the
    holes): each is held once, and a row of the hole read for the first time is added."""
    series = held.Series(at=1, strict=False)
    ids = np.array([1, 2, 3, 5, 6, 8, 9, 10], dtype=np.int64)
    assert series.merge(ids, _layout(np.vstack([ids.astype(float), ids + 100.0]), True), [], 0.0)
    series.holes = [(4, 7, time.monotonic())]  # 4 and 7 unseen; 5 and 6 held, inside the merged hole
    got = np.array([10, 5, 6, 7, 11], dtype=np.int64)  # the top row again, the hole's rows, a new one
    assert series.merge(got, np.vstack([got.astype(float), got + 100.0]), [], 0.0)
    assert sorted(series.ids.tolist()) == [1, 2, 3, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(series.mat[1].tolist()) == [i + 100.0 for i in [1, 2, 3, 5, 6, 7, 8, 9, 10, 11]]
