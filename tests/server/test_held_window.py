"""The pass process keeps its window from pass to pass and reads only the rows written since
(dashboard.diagnosis.held): every pass's window must be the one a fresh read of the database gives, also when an
agent replays batches it spooled during an outage (old sample times, stored late) and when a run's ranks change."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from clusterdx import wire
from collectors.sim.model import SimCluster
from collectors.sim.scenario import parse
from dashboard.diagnosis import held, loader
from dashboard.diagnosis.detectors.window import Table, Window
from dashboard.ingest.writer import store_batch
from dashboard.telemetry.models import Rank
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
        with late.cursor() as cur:  # a slow writer takes its id now ...
            cur.execute("INSERT INTO telemetry_gpusample (cluster_id, node_id, gpu_index, ts, util_gpu_pct) "
                        "VALUES (%s, %s, 7, %s, 12.5) RETURNING id", [world.cluster.id, node.id, sim_dt(t0 + 5.5)])
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


def test_the_gpu_error_counters_read_packed_are_the_stored_values(world: World) -> None:
    """The pass reads the GPU error counters and flags that are nearly always zero as one cell per row
    (loader.QUIET_GPU): zero, not reported (null) and set values must all come back as stored, held or fresh."""
    from dashboard.diagnosis.detectors.window import GPU_NUM
    from dashboard.telemetry.models import GpuSample

    scenario = parse({"cluster": {"nodes": 3, "gpus_per_node": 2, "run": "llm", "seed": 5},
                      "fault": [{"kind": "ecc_storm", "at_s": 3, "node": 1, "gpu": 0, "dbe_after_s": 6}]})
    t0 = time.time() - 300
    sim = SimCluster(scenario, t0)
    held.forget()
    _feed(world, sim, t0, range(1, 7))
    loader.load_window(world.cluster, t0 + 6, beats=[])  # the rows so far held, the rest a delta
    _feed(world, sim, t0, range(7, 13))
    samples = GpuSample.objects.filter(cluster=world.cluster)
    samples.filter(id__in=list(samples.values_list("id", flat=True)[::3])).update(
        remap_uncorrectable=None, retired_pages_pending=None, nvlink_crc_errors_total=None)
    samples.filter(id__in=list(samples.values_list("id", flat=True)[1::5])).update(
        remap_pending=True, pcie_replay_total=7)
    held.forget()
    w = loader.load_window(world.cluster, t0 + 12, beats=[])
    g = w.gpus
    assert np.any(g["ecc_sbe_volatile"] > 0) and np.any(np.isnan(g["remap_uncorrectable"]))
    assert np.any(g["remap_pending"] == 1) and np.any(g["remap_pending"] == 0)
    got = {(w.nodes[int(g["node"][i])], int(g["gpu"][i]), round(float(g["ts"][i]), 3)):
           [g[c][i] for c in GPU_NUM[3:]] for i in range(len(g))}
    want = {(s.node.hostname, s.gpu_index, round(s.ts.timestamp(), 3)):
            [float("nan") if getattr(s, c) is None else float(getattr(s, c)) for c in GPU_NUM[3:]]
            for s in samples.filter(ts__gte=loader._dt(t0 + 12 - 20)).select_related("node")}
    assert got.keys() == want.keys()
    for k, row in want.items():
        assert np.array_equal(np.array(got[k], dtype=float), np.array(row), equal_nan=True), k


def test_rank_metas_read_again_unchanged_are_not_decoded_again(world: World) -> None:
    """A run's ranks all change in its first second, so for the next minute (loader.RANK_META_LATE_S) every pass
    reads their metas again: the unchanged ones keep the object the last pass decoded, a changed one is new."""
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
    rank = Rank.objects.get(run__cluster=world.cluster, rank=1)
    rank.meta = {**rank.meta, "dataloader": {"num_workers": 3}}
    rank.save()
    second = metas()
    assert second[1]["dataloader"] == {"num_workers": 3} and second[1] is not first[1]
    assert all(second[k] is first[k] for k in (0, 2, 3)), "re-read within the late window, decoded once"
    held.forget()
    loader._rank_meta.clear()
    assert metas() == second, "a fresh read gives the same metas"
