"""dashboard.storage.step_samples: the one module the pages, the live snapshot, the evidence, the goodput record and
"why was step N slow" read step samples through. Its answers against a direct computation over the samples stored
as step frames, a post per node and second as ingest frames them (both databases: the suite runs this file on SQLite
and on PostgreSQL). tests/server/test_sample_readers.py keeps it the one module."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from dashboard.storage import frames as fr
from dashboard.storage import step_samples
from dashboard.telemetry.models import Node, Run
from tests.server import framed
from tests.server.conftest import World

T0 = 1_700_000_000.0
RANKS = 12  # more than one rank group (8), so a rank's reads cross the frames' rank groups
STEPS = 40


@dataclass
class Sample:
    rank: int
    step: int
    ts: float
    step_time_s: float
    data_wait_s: float | None = None
    compute_s: float | None = None
    comm_s: float | None = None
    comm_arrive_s: float | None = None
    tokens: int | None = None


@dataclass
class Steps:
    run: Run
    other: Run  # the same cluster's other run: nothing of it may leak into the first one's answers
    rows: list[Sample]


def _when(step: int, rank: int) -> float:
    # Steps one second apart; within a step the ranks finish a little apart, rank 5 last (the straggler), so a
    # step's end is not its highest rank's time. Step 30 onward the steps come out of order in time: step 30 ends
    # after step 31 (a late write), so "by end" and "by step" orderings differ.
    t = T0 + step + rank * 0.01 + (0.5 if rank == 5 else 0.0)
    return t + (1.6 if step == 30 else 0.0)


def _post(world: World, node: Node, run: Run, rows: list[Sample]) -> None:
    """``rows`` stored as a node's agent posts them: each second's samples of the node's ranks, one post."""
    by: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(int(r.ts), []).append({f.name: getattr(r, f.name) for f in fields(r)})
    for second in sorted(by):
        framed.steps(world.cluster, node, run, by[second])


@pytest.fixture
def steps(world: World) -> Steps:
    node = Node.objects.create(cluster=world.cluster, hostname="node-s")
    node_t = Node.objects.create(cluster=world.cluster, hostname="node-t")
    run = Run.objects.create(cluster=world.cluster, name="r")
    other = Run.objects.create(cluster=world.cluster, name="other")
    rows = [Sample(rank=k, step=s, ts=_when(s, k), step_time_s=1.0 + 0.1 * k + 0.01 * s, data_wait_s=0.05 * (k % 3),
                   compute_s=0.5 + 0.01 * k, comm_s=None if k == 3 else 0.2 + 0.001 * s, comm_arrive_s=0.1 * k,
                   tokens=1000 + k)
            for s in range(STEPS) for k in range(RANKS) if not (k == 7 and s >= 35)]  # rank 7 stops at step 34
    _post(world, node, run, [r for r in rows if r.rank < 8])  # ranks 8-11 on a second node
    _post(world, node_t, run, [r for r in rows if r.rank >= 8])
    _post(world, node, other, [Sample(rank=k, step=s, ts=T0 + s, step_time_s=9.0, tokens=1)
                               for s in range(STEPS + 10) for k in range(2)])
    return Steps(run, other, rows)


@pytest.mark.django_db
def test_bounds_first_ts_and_who_reported(steps: Steps) -> None:
    rid = steps.run.id
    assert step_samples.bounds(rid) == (0, STEPS - 1)
    assert step_samples.bounds(rid, rank=7) == (0, 34)
    assert step_samples.bounds(rid, rank=99) is None
    assert step_samples.first_ts(rid) == pytest.approx(T0)
    assert step_samples.ranks_at(rid, 36) == set(range(RANKS)) - {7}
    assert step_samples.ranks_at(rid, 3) == set(range(RANKS))
    assert step_samples.runs_with_rank([rid, steps.other.id], 7) == {rid}
    assert step_samples.runs_with_rank([rid, steps.other.id], 1) == {rid, steps.other.id}
    assert step_samples.runs_with_rank([], 1) == set()


@pytest.mark.django_db
def test_one_step_and_the_steps_before_it(steps: Steps) -> None:
    rid = steps.run.id
    got = step_samples.at_step(rid, 12, ("rank", "ts", "step_time_s", "node__hostname"))
    assert [r["rank"] for r in got] == list(range(RANKS))
    assert all(isinstance(r["ts"], float) for r in got)
    assert [r["ts"] for r in got] == pytest.approx([_when(12, k) for k in range(RANKS)])
    assert [r["node__hostname"] for r in got] == ["node-s"] * 8 + ["node-t"] * 4
    before = step_samples.before(rid, 20, 5, ("step", "step_time_s"))
    want = sorted((r.step, r.step_time_s) for r in steps.rows if 15 <= r.step < 20)
    assert np.allclose(np.array(sorted(before)), np.array(want))


@pytest.mark.django_db
def test_cells_of_every_rank_and_of_one(steps: Steps) -> None:
    rid = steps.run.id
    got = step_samples.cells(rid, 30, 37, ("step_time_s", "comm_s"))
    want = sorted((r.rank, r.step, r.step_time_s, r.comm_s) for r in steps.rows if 30 <= r.step <= 37)
    assert sorted(got, key=lambda c: (c[0], c[1])) == want
    # Rank 9 lives in the second rank group; rank 7 has no steps past 34.
    assert sorted(step_samples.cells(rid, 30, 37, ("step_time_s",), rank=9)) == [
        (9, s, pytest.approx(1.9 + 0.01 * s)) for s in range(30, 38)]
    assert [c[1] for c in sorted(step_samples.cells(rid, 30, 37, (), rank=7))] == [30, 31, 32, 33, 34]


@pytest.mark.django_db
def test_a_ranks_progress_and_the_steps_ends(steps: Steps) -> None:
    rid = steps.run.id
    prog = step_samples.rank_progress(rid, 5, T0 + 10, T0 + 20, 0, 15)
    want = [(r.step, r.ts) for r in sorted(steps.rows, key=lambda r: r.step)
            if r.rank == 5 and T0 + 10 <= r.ts <= T0 + 20 and r.step <= 15]
    assert prog == [(s, pytest.approx(t)) for s, t in want] and prog
    ends = step_samples.step_ends(rid, T0 + 20, T0 + 33, newest=4)
    in_range = {r.step for r in steps.rows if T0 + 20 <= r.ts <= T0 + 33}
    newest = sorted(in_range)[-4:]
    want_ends = [(s, max(r.ts for r in steps.rows
                         if r.step == s and T0 + 20 <= r.ts <= T0 + 33)) for s in newest]
    assert ends == [(s, pytest.approx(t)) for s, t in want_ends]


def _agg(rows: list[Sample], step: int) -> dict[str, float]:
    mine = [r for r in rows if r.step == step]
    comm = [r.comm_s for r in mine if r.comm_s is not None]  # AVG skips NULLs
    return {"end": max(r.ts for r in mine), "n": len(mine), "tokens": sum(r.tokens or 0 for r in mine),
            "step_time_s": float(np.mean([r.step_time_s for r in mine])),
            "step_time_max_s": max(r.step_time_s for r in mine), "comm_s": float(np.mean(comm))}


@pytest.mark.django_db
def test_per_step_aggregates_by_name_in_either_order(steps: Steps) -> None:
    rid = steps.run.id
    names = ("end", "n", "tokens", "step_time_s", "step_time_max_s", "comm_s")
    # The names "step_time_s" and "comm_s" are the columns they aggregate: the ORM refuses such an annotation,
    # which the module must hide.
    got = step_samples.per_step(rid, names, after_step=27)
    assert [g["step"] for g in got] == list(range(28, STEPS))
    for g in got:
        want = _agg(steps.rows, g["step"])
        assert {k: g[k] for k in names} == pytest.approx(want), g["step"]
    by_end = step_samples.per_step(rid, ("end",), after_step=27, by="end")
    assert [g["step"] for g in by_end][:4] == [28, 29, 31, 30]  # step 30 finished after 31
    assert [g["end"] for g in by_end] == sorted(g["end"] for g in by_end)
    window = step_samples.per_step(rid, ("n",), since=T0 + 10.2, until=T0 + 12.2)
    want_w: dict[int, int] = {}
    for r in steps.rows:
        if T0 + 10.2 < r.ts <= T0 + 12.2:
            want_w[r.step] = want_w.get(r.step, 0) + 1
    assert {g["step"]: g["n"] for g in window} == want_w
    assert step_samples.per_step(steps.other.id, ("tokens",), after_step=45) == [
        {"step": s, "tokens": 2} for s in range(46, 50)]


@pytest.mark.django_db
def test_rank_rows_and_bucket_means(steps: Steps) -> None:
    rid = steps.run.id
    rows = step_samples.rank_rows(rid, 37, ("step_time_s",))
    want = [[r.step, r.rank, r.ts, r.step_time_s]
            for r in sorted(steps.rows, key=lambda r: (r.step, r.rank)) if r.step > 37]
    assert rows == [pytest.approx(w) for w in want]
    got = step_samples.bucket_means(rid, "compute_s", 10, 29, 5)
    want_b: dict[tuple[int, int], list[float]] = {}
    for r in steps.rows:
        if 10 <= r.step <= 29:
            want_b.setdefault((r.rank, (r.step - 10) // 5), []).append(r.compute_s)
    assert got.shape == (len(want_b), 3)
    assert {(int(k), int(b)): v for k, b, v in got} == pytest.approx(
        {kb: float(np.mean(v)) for kb, v in want_b.items()})
    with pytest.raises(ValueError):
        step_samples.bucket_means(rid, "step_time_s; DROP TABLE x", 0, 1, 1)


@pytest.mark.django_db
def test_recent_matrix_reads_several_runs_at_once(steps: Steps) -> None:
    mat = step_samples.recent_matrix([(steps.run.id, 36), (steps.other.id, 47)], ("step", "ts", "step_time_s"))
    cols = sorted(zip(*mat.tolist(), strict=True))
    want = sorted([(float(steps.run.id), float(r.step), r.ts, r.step_time_s)
                   for r in steps.rows if r.step > 36]
                  + [(float(steps.other.id), float(s), T0 + s, 9.0) for s in (48, 49) for _ in range(2)])
    assert cols == [pytest.approx(w) for w in want]


def _long(world: World) -> tuple[Run, list[Sample]]:
    """A run over many step buckets with a gap: rank 0 steps 0-700 and 5,000-5,063; rank 1 stops at step 10; rank 2
    runs steps 300-320 only and sends no data wait; rank 9 (the second rank group) steps 0-5."""
    node = Node.objects.create(cluster=world.cluster, hostname="node-l")
    run = Run.objects.create(cluster=world.cluster, name="long")
    spans = {0: [*range(701), *range(5000, 5064)], 1: range(11), 2: range(300, 321), 9: range(6)}
    rows = [Sample(rank=k, step=s, ts=T0 + s + 0.01 * k, step_time_s=1.0 + 0.001 * s + 0.1 * k,
                   data_wait_s=None if k == 2 else 0.01 * k, compute_s=0.5, tokens=10 + k)
            for k, steps in spans.items() for s in steps]
    _post(world, node, run, rows)
    return run, rows


@pytest.mark.django_db
def test_a_ranks_first_and_last_steps_are_found_across_buckets_and_gaps(world: World, steps: Steps) -> None:
    run, rows = _long(world)
    rid = run.id
    assert step_samples.bounds(rid) == (0, 5063)
    with CaptureQueriesContext(connection) as seen:
        assert step_samples.bounds(rid, rank=0) == (0, 5063)
    assert len(seen.captured_queries) == 4  # from each end: the group's edge, then its frames there
    assert step_samples.bounds(rid, rank=1) == (0, 10)  # the group went on for 5,000 steps past it
    assert step_samples.bounds(rid, rank=2) == (300, 320)  # started late, stopped early
    assert step_samples.bounds(rid, rank=9) == (0, 5)
    assert step_samples.bounds(rid, rank=3) is None and step_samples.bounds(rid, rank=8) is None
    assert step_samples.runs_with_rank([rid, steps.run.id, steps.other.id], 2) == {rid, steps.run.id}
    assert step_samples.runs_with_rank([rid, steps.run.id, steps.other.id], 9) == {rid, steps.run.id}
    assert step_samples.runs_with_rank([rid, steps.other.id], 3) == set()
    assert step_samples.ranks_at(rid, 5) == {0, 1, 9} and step_samples.ranks_at(rid, 5000) == {0}
    assert step_samples.first_ts(rid) == pytest.approx(min(r.ts for r in rows))


@pytest.mark.django_db
def test_aggregates_do_not_depend_on_how_the_frames_were_chunked(world: World, monkeypatch: Any) -> None:
    run, rows = _long(world)
    names = tuple(step_samples.AGGREGATES)
    whole = step_samples.per_step(run.id, names, after_step=-1)
    means = step_samples.bucket_means(run.id, "data_wait_s", 0, 5063, 100)
    ends = step_samples.step_ends(run.id, T0 + 250, T0 + 5010, newest=30)
    assert len(fr.STEPS.model.objects.filter(run=run)) > 20  # many frames, over 80 step buckets
    monkeypatch.setattr(step_samples, "CHUNK", 2)
    assert step_samples.per_step(run.id, names, after_step=-1) == whole  # exactly: a step is summed in one order
    assert np.array_equal(step_samples.bucket_means(run.id, "data_wait_s", 0, 5063, 100), means, equal_nan=True)
    assert step_samples.step_ends(run.id, T0 + 250, T0 + 5010, newest=30) == ends
    # ... and are what the samples say.
    assert [g["step"] for g in whole] == sorted({r.step for r in rows})
    for g in whole:
        mine = [r for r in rows if r.step == g["step"]]
        assert g["n"] == len(mine) and g["tokens"] == sum(r.tokens or 0 for r in mine)
        assert isinstance(g["tokens"], int) and isinstance(g["n"], int) and isinstance(g["step"], int)
        assert g["end"] == pytest.approx(max(r.ts for r in mine))
        assert g["step_time_s"] == pytest.approx(np.mean([r.step_time_s for r in mine]))
        assert g["step_time_max_s"] == pytest.approx(max(r.step_time_s for r in mine))
        waits = [r.data_wait_s for r in mine if r.data_wait_s is not None]
        assert g["data_wait_s"] == (pytest.approx(np.mean(waits)) if waits else None)
        assert g["comm_s"] is None  # no rank sent one: SQL's AVG of nulls
    want: dict[tuple[int, int], list[float]] = {}
    for r in rows:
        want.setdefault((r.rank, r.step // 100), []).extend([] if r.data_wait_s is None else [r.data_wait_s])
    assert [(int(k), int(b)) for k, b, _ in means] == sorted(want)  # by rank then bucket, a rank's empty ones too
    for (k, b), v in zip(sorted(want), means[:, 2].tolist(), strict=True):
        assert (np.isnan(v) and not want[(k, b)]) or v == pytest.approx(np.mean(want[(k, b)])), (k, b)
    assert ends == [(s, pytest.approx(max(r.ts for r in rows if r.step == s and r.ts <= T0 + 5010)))
                    for s in sorted({r.step for r in rows if T0 + 250 <= r.ts <= T0 + 5010})[-30:]]


@pytest.mark.django_db
def test_each_read_is_one_query(steps: Steps) -> None:
    rid = steps.run.id
    reads = [lambda: step_samples.recent_matrix([(rid, 30), (steps.other.id, 40)], ("step", "ts")),
             lambda: step_samples.per_step(rid, ("end", "n"), after_step=30),
             lambda: step_samples.cells(rid, 30, 37, ("comm_s",), rank=9),
             lambda: step_samples.rank_rows(rid, 30, ("tokens",)),
             lambda: step_samples.bucket_means(rid, "compute_s", 0, 39, 4),
             lambda: step_samples.first_ts(rid)]
    for read in reads:
        with CaptureQueriesContext(connection) as seen:
            assert read() is not None
        assert len(seen.captured_queries) == 1, [q["sql"] for q in seen.captured_queries]
    with CaptureQueriesContext(connection) as seen:
        step_samples.at_step(rid, 12, ("rank", "node__hostname"))
    assert len(seen.captured_queries) == 2  # the frames, then their few nodes' names
