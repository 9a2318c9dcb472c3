"""Frames (dashboard.storage.frames): a post's GPU samples, steps and probes stored as packed matrices.

What must hold: a frame reads back exactly the values its records carried (None as NaN, a bool as 0 or 1, the object
fields as sent); the frames a post makes respect the boundaries every query relies on (an aligned 10 s window, and
for steps one run, one rank group and one step bucket), with ``ts`` the oldest sample's and ``step_lo`` / ``step_hi``
its steps' bounds; a frame of an older layout reads into today's; the layouts follow the wire; and the rows stored
before frames existed are framed by the backfill migration.
"""

from __future__ import annotations

import importlib
import math
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
from django.db import connection

from clusterdx import blocks, wire
from dashboard.ingest.writer import store_group
from dashboard.storage import frames as fr
from dashboard.telemetry import models as m

pytestmark = pytest.mark.django_db(transaction=True)


def _sim(nodes: int, seconds: int, start: float) -> list[list[dict[str, Any]]]:
    from collectors.sim.model import SimCluster
    from collectors.sim.scenario import parse

    sim = SimCluster(parse({"cluster": {"nodes": nodes, "gpus_per_node": 8, "seed": 5}}), start)
    seq: dict[str, int] = {}
    out = []
    for t in range(seconds):
        tick = []
        for b in sim.tick(start + t):
            seq[b["host"]] = seq.get(b["host"], 0) + 1
            tick.append(wire.validate_batch({**b, "seq": seq[b["host"]]}))
        out.append(tick)
    return out


def _store(cluster: m.Cluster, batches: list[dict[str, Any]]) -> None:
    outcomes = store_group([(cluster, b, "") for b in batches])
    assert all(not isinstance(o, Exception) for o in outcomes), outcomes


def _expected(kind: fr.Kind, batches: list[dict[str, Any]]) -> tuple[np.ndarray, dict[str, list[Any]]]:
    recs = [r for b in batches for r in b[kind.name]]
    mat = np.array([[math.nan if r[c] is None else float(r[c]) for c in kind.numbers] for r in recs])
    return mat, {f: [r[f] for r in recs] for f in kind.objects}


def _canonical(mat: np.ndarray) -> np.ndarray:
    """Rows sorted, so two matrices of the same samples compare equal whatever the frames' order."""
    return mat[np.lexsort(np.nan_to_num(mat, nan=-1e300).T[::-1])] if len(mat) else mat


def test_it_reads_back_exactly_what_the_records_carried(world: Any) -> None:
    batches = [b for tick in _sim(6, 4, time.time() - 30) for b in tick]
    _store(world.cluster, batches)
    for kind in fr.KINDS.values():
        got = fr.read(kind, cluster_id=world.cluster.id, objects=kind.objects)
        want, objs = _expected(kind, batches)
        assert len(want), kind.name
        assert np.array_equal(_canonical(got.mat), _canonical(want), equal_nan=True), kind.name
        # The object fields as sent, in the same order as the numbers (matched through the rows' sort).
        order_got, order_want = (np.lexsort(np.nan_to_num(x, nan=-1e300).T[::-1]) for x in (got.mat, want))
        for f in kind.objects:
            assert [got.objs[f][i] for i in order_got] == [objs[f][i] for i in order_want], (kind.name, f)


def _frames(kind: fr.Kind) -> list[dict[str, Any]]:
    return list(kind.model.objects.order_by("id").values())


def test_a_post_spread_over_a_window_edge_makes_a_frame_each_side(world: Any) -> None:
    edge = math.floor(time.time() / fr.FRAME_S) * fr.FRAME_S - 60
    base = {"v": 1, "agent_id": "a1", "seq": 1, "host": "n1", "sent_at": edge + 2}
    times = [edge - 2, edge - 1, edge, edge + 1]
    batch = wire.validate_batch({**base, "gpus": [{"ts": t, "index": i, "util_gpu_pct": float(i)}
                                                   for t in times for i in range(2)],
                                 "probes": [{"ts": t, "peer": f"p{i}", "sent": 5, "lost": i} for i, t in enumerate(times)]})
    _store(world.cluster, [batch])
    gpu = _frames(fr.GPUS)
    assert [(f["ts"].timestamp(), f["n"]) for f in gpu] == [(edge - 2, 4), (edge, 4)]
    probes = _frames(fr.PROBES)
    assert [(f["ts"].timestamp(), f["n"], f["peers"]) for f in probes] == [(edge - 2, 2, " p0 p1 "),
                                                                             (edge, 2, " p2 p3 ")]
    # Each frame's samples lie in its window, its ts is the oldest of them.
    for f in gpu:
        mat, _ = fr.unpack(fr.GPUS, f["layout"], f["n"], f["data"])
        ts = mat[:, fr.GPUS.col("ts")]
        assert ts.min() == f["ts"].timestamp()
        assert (np.floor(ts / fr.FRAME_S) == np.floor(ts[0] / fr.FRAME_S)).all()


def test_steps_are_framed_by_run_rank_group_and_step_bucket(world: Any) -> None:
    t = math.floor(time.time() / fr.FRAME_S) * fr.FRAME_S - 60
    steps = [{"run": run, "rank": rank, "step": step, "ts": t + 1, "step_time_s": 1.0,
              "metrics": {"loss": 2.5} if rank == 0 else None}
             for run in ("r1", "r2") for rank in (0, 7, 8) for step in (fr.STEP_BUCKET - 1, fr.STEP_BUCKET)]
    batch = wire.validate_batch({"v": 1, "agent_id": "a1", "seq": 1, "host": "n1", "sent_at": t + 2, "steps": steps})
    _store(world.cluster, [batch])
    runs = dict(m.Run.objects.values_list("name", "id"))
    got = {}
    for f in _frames(fr.STEPS):
        mat, objs = fr.unpack(fr.STEPS, f["layout"], f["n"], f["data"])
        ranks, nums = mat[:, fr.STEPS.col("rank")], mat[:, fr.STEPS.col("step")]
        assert (ranks // fr.RANK_GROUP == f["rank_group"]).all()
        assert (nums.min(), nums.max()) == (f["step_lo"], f["step_hi"])
        assert len(set(nums // fr.STEP_BUCKET)) == 1
        got[(f["run_id"], f["rank_group"], f["step_lo"])] = sorted(ranks.astype(int).tolist())
        assert objs.get("metrics", [None] * f["n"]) == [{"loss": 2.5} if r == 0 else None for r in ranks]
    b = fr.STEP_BUCKET
    assert got == {(runs[r], g, s): ([0, 7] if g == 0 else [8]) for r in ("r1", "r2") for g in (0, 1)
                   for s in (b - 1, b)}


def test_a_frame_of_an_older_layout_reads_into_todays() -> None:
    old = ("ts", "sent", "lost")
    kind = replace(fr.PROBES, layouts=(old, fr.PROBES.numbers))
    mat = np.array([[100.0, 5.0, 1.0], [101.0, 5.0, 0.0]])
    got, objs = fr.unpack(kind, 0, 2, fr.pack(mat, {"peer": ["a", "b"]}))
    assert got.shape == (2, len(fr.PROBES.numbers))
    assert got[:, kind.col("lost")].tolist() == [1.0, 0.0]
    assert np.isnan(got[:, kind.col("rtt_ms")]).all()
    assert objs == {"peer": ["a", "b"]}
    rows = fr.decode(kind, [(2, 0, fr.pack(mat)), (1, 1, fr.pack(np.arange(6.0).reshape(1, 6)))])
    assert rows["sent"].tolist() == [5.0, 5.0, 1.0] and np.isnan(rows["bw_gbps"][:2]).all()


def test_a_read_builds_only_the_object_fields_it_asks_for() -> None:
    """The diagnosis pass asks a step frame for its groups and never its metrics; the frames' other texts are
    skipped, whatever they hold, and the fields asked for read the same as from a read of them all."""
    width = len(fr.STEPS.numbers)
    metrics = [{"loss": 2.5, "grad_norm": 1.0}, {"loss": 2.4, "nested": {"deep": [1, 2]}}]
    frames = [(2, fr.STEPS.layout, fr.pack(np.zeros((2, width)), {"metrics": metrics, "groups": ["tp0", None]})),
              (1, fr.STEPS.layout, fr.pack(np.ones((1, width)))),  # no texts at all
              (1, fr.STEPS.layout, fr.pack(np.ones((1, width)), {"metrics": [{"loss": 1.0}]}))]  # no groups
    every = fr.decode(fr.STEPS, frames, (), fr.STEPS.objects)
    groups = fr.decode(fr.STEPS, frames, (), ("groups",))
    assert set(groups.objs) == {"groups"}
    assert groups.objs["groups"] == every.objs["groups"] == ["tp0", None, None, None]
    assert every.objs["metrics"] == [*metrics, None, {"loss": 1.0}]
    assert fr.decode(fr.STEPS, frames, (), ("metrics",)).objs == {"metrics": every.objs["metrics"]}


def test_the_layouts_follow_the_wire() -> None:
    """A field added to a framed wire record must come with a new layout (appended), or stored frames would be read
    with the wrong columns; the object fields must be fields the wire has."""
    for kind in fr.KINDS.values():
        lay = blocks.LAYOUTS[kind.name]
        assert kind.numbers == tuple(c.name for c in lay.numbers), kind.name
        assert set(kind.objects) <= set(lay.others), kind.name


def test_the_backfill_frames_the_rows_stored_before_frames(world: Any) -> None:
    """Migration 0016 on rows as the server stored them before frames: the tables of that time are made from the
    migration state (0018 dropped them), filled, framed, and dropped again."""
    from django.db.migrations.loader import MigrationLoader

    old = MigrationLoader(connection).project_state(("telemetry", "0016_frames_backfill")).apps
    models = [old.get_model("telemetry", name) for name in ("GpuSample", "StepSample", "Probe")]
    with connection.schema_editor() as editor:
        for model in models:
            editor.create_model(model)
    try:
        _backfill_rows(world, *models)
    finally:
        with connection.schema_editor() as editor:
            for model in models:
                editor.delete_model(model)


def _backfill_rows(world: Any, gpu_row: Any, step_row: Any, probe_row: Any) -> None:
    node = m.Node.objects.create(cluster=world.cluster, hostname="old-1")
    run = m.Run.objects.create(cluster=world.cluster, name="old-run")
    t0 = math.floor(time.time() / fr.FRAME_S) * fr.FRAME_S - 3600

    def dt(t: float) -> datetime:
        return datetime.fromtimestamp(t, UTC)

    c, n = world.cluster.id, node.id
    gpu_row.objects.bulk_create([
        gpu_row(cluster_id=c, node_id=n, gpu_index=g, ts=dt(t0 + s), util_gpu_pct=10.0 * g + s,
                retired_pages_pending=bool(s % 2), throttle_reasons=["sw_thermal"] if g else [])
        for s in range(25) for g in range(2)])
    step_row.objects.bulk_create([
        step_row(cluster_id=c, run_id=run.id, node_id=n, rank=r, step=s, ts=dt(t0 + s), step_time_s=1.0 + r,
                 metrics={"loss": 1.0 / (s + 1)}) for s in range(70) for r in (0, 9)])
    probe_row.objects.bulk_create([probe_row(cluster_id=c, node_id=n, peer=f"p{s % 3}", ts=dt(t0 + s), sent=5,
                                             lost=s % 2, rtt_ms=0.1 * s) for s in range(15)])
    backfill = importlib.import_module("dashboard.telemetry.migrations.0016_frames_backfill").backfill
    with connection.schema_editor() as editor:
        backfill(None, editor)
    gpus = fr.read(fr.GPUS, node_id=node.id, objects=("throttle_reasons",))
    assert len(gpus) == 50
    order = np.lexsort((gpus["index"], gpus["ts"]))
    assert gpus["util_gpu_pct"][order].tolist() == [10.0 * g + s for s in range(25) for g in range(2)]
    assert gpus["retired_pages_pending"][order].tolist() == [float(s % 2) for s in range(25) for g in range(2)]
    assert [gpus.objs["throttle_reasons"][i] for i in order] == [["sw_thermal"] if g else [] for s in range(25)
                                                                 for g in range(2)]
    assert {f.ts.timestamp() // fr.FRAME_S for f in m.GpuFrame.objects.all()} == {t0 // 10, t0 // 10 + 1, t0 // 10 + 2}
    steps = fr.read(fr.STEPS, run_id=run.id, cols=("run_id",), objects=("metrics",))
    assert len(steps) == 140 and set(steps["run_id"].tolist()) == {run.id}
    assert sorted(zip(steps["step"].tolist(), steps["rank"].tolist(), strict=True)) == \
        [(float(s), float(r)) for s in range(70) for r in (0, 9)]
    assert m.StepFrame.objects.filter(step_lo__lt=fr.STEP_BUCKET, step_hi__gte=fr.STEP_BUCKET).count() == 0
    probes = fr.read(fr.PROBES, node_id=node.id, objects=("peer",))
    assert sorted(zip(probes["ts"].tolist(), probes.objs["peer"], strict=True)) == \
        [(t0 + s, f"p{s % 3}") for s in range(15)]
    assert {f.peers for f in m.ProbeFrame.objects.all()} == {" p0 p1 p2 "}


def test_a_group_is_framed_as_its_posts_would_be_one_by_one() -> None:
    """build_group (the group writer's: one pass of numpy for all its posts) gives each post exactly the frames build
    gives it alone, never a frame mixing posts, and skips a post without samples of the kind."""
    t = math.floor(time.time() / fr.FRAME_S) * fr.FRAME_S - 60
    rng = np.random.default_rng(4)

    def post(n: int, start: float) -> fr.Part:
        mat = np.full((n, len(fr.STEPS.numbers)), np.nan)
        mat[:, fr.STEPS.col("ts")] = start + np.sort(rng.uniform(0, 25, n))
        mat[:, fr.STEPS.col("rank")] = rng.integers(0, 20, n)
        mat[:, fr.STEPS.col("step")] = rng.integers(60, 70, n)
        mat[:, fr.STEPS.col("step_time_s")] = rng.uniform(0, 2, n)
        objs = {"metrics": [{"loss": float(i)} if i % 3 else None for i in range(n)]}
        return mat, objs, list(rng.integers(1, 3, n))

    parts = [post(12, t), post(0, t), post(7, t + 3), post(30, t - 20)]
    got = fr.build_group(fr.STEPS, parts)
    assert [i for i, _ in got] == sorted(i for i, _ in got) and 1 not in {i for i, _ in got}
    for i, part in enumerate(parts):
        mine = [b for j, b in got if j == i]
        assert mine == fr.build(fr.STEPS, *part), i
        assert sum(b.n for b in mine) == len(part[0])
