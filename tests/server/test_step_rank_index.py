"""One rank's steps are read through the step frames' (run, rank_group, step_hi) index (telemetry 0015), on SQLite and
PostgreSQL: a step frame holds one aligned group of RANK_GROUP ranks (a node's eight), so every reader that asks for
one rank (the run page's rank view, the step rollup, a finding's evidence, the search box, the diagnosis pass's loss)
selects only its group's frames along that index and gets exactly that rank's samples out of them."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from dashboard.diagnosis import held, loader
from dashboard.diagnosis.detectors import Thresholds
from dashboard.diagnosis.models import Finding
from dashboard.storage import frames as fr
from dashboard.storage import steps as rollup
from dashboard.telemetry.models import RANK_GROUP, Run, StepFrame
from dashboard.web import evidence
from dashboard.web.pages import overview, run_series
from tests.server import framed
from tests.server.conftest import World

T0 = 1_700_000_000.0
RANKS, STEPS, RANK = 64, 40, 13
TABLE = StepFrame._meta.db_table


def _steps(world: World) -> Run:
    """RANKS ranks x STEPS steps, posted a node (eight ranks) a second as ingest frames them; every value says whose
    sample it is (step time 1 + rank/100, loss = rank + step/1000)."""
    run = Run.objects.create(cluster=world.cluster, name="wide", last_step=STEPS - 1,
                             last_step_at=datetime.fromtimestamp(T0 + STEPS - 1, UTC))
    for s in range(STEPS):
        for group in range(RANKS // RANK_GROUP):
            framed.steps(world.cluster, None, run, [
                {"rank": r, "step": s, "ts": T0 + s + r / 1000, "step_time_s": 1.0 + r / 100, "compute_s": 0.5,
                 "metrics": {"loss": r + s / 1000}}
                for r in range(group * RANK_GROUP, (group + 1) * RANK_GROUP)])
    return run


def _index(columns: list[str]) -> str:
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, TABLE)
    return next(name for name, c in found.items() if c["index"] and c["columns"] == columns)


def _plan(sql: str) -> str:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # A few hundred frames: PostgreSQL would scan the table. Forbidding that shows the index *can* answer it.
            cursor.execute("SET LOCAL enable_seqscan = off")
            cursor.execute("EXPLAIN " + sql)
            return " | ".join(r[0] for r in cursor.fetchall())
        cursor.execute("EXPLAIN QUERY PLAN " + sql)
        return " | ".join(str(r[-1]) for r in cursor.fetchall())


@pytest.mark.django_db
def test_a_ranks_reads_return_its_samples_by_the_rank_group_index(world: World) -> None:
    run = _steps(world)
    mine = 1.0 + RANK / 100
    finding = Finding(cluster=world.cluster, run=run, rank=RANK, kind="straggler", subject_type="rank",
                      subject=f"{run.name}/rank {RANK}", evidence={"metrics": {"median_step_s": 1.0}})
    held.forget()
    with CaptureQueriesContext(connection) as seen:
        assert run_series.step_bounds(run, RANK) == (0, STEPS - 1)
        raw = rollup._raw(run.id, 0, STEPS - 1, RANK)
        matrix = evidence.step_matrix(finding, T0, T0 + STEPS, ("step_time_s",), RANK)
        stall = evidence._stall(finding, Thresholds(), T0, T0 + STEPS)
        found = overview._rank_results([world.cluster], None, RANK)
        _, losses = loader._steps_and_losses(world.cluster.id, run.id, STEPS - 1, RANK)
    assert [r["step"] for r in raw] == list(range(STEPS)) and {r["n"] for r in raw} == {1}
    assert [r["step_time_s__max"] for r in raw] == [pytest.approx(mine)] * STEPS
    assert [r["loss"] for r in raw] == [pytest.approx(RANK + s / 1000) for s in range(STEPS)]
    assert matrix is not None
    steps, _, ranks, cols = matrix
    assert steps == list(range(STEPS)) and list(ranks) == [RANK]
    assert cols["step_time_s"].tolist() == [[pytest.approx(mine)] * STEPS]
    progress = next(p for p in stall if p["id"] == "progress")
    assert progress["series"][0]["name"] == f"rank {RANK}" and progress["series"][0]["y"] == list(range(STEPS))
    assert [r["label"] for r in found] == [f"{run.name}/rank{RANK}"]
    assert losses[:, 0].tolist() == list(range(STEPS)) and losses[:, 2].tolist() == \
        [pytest.approx(RANK + s / 1000) for s in range(STEPS)]

    group = RANK // RANK_GROUP
    one_rank = [q["sql"] for q in seen.captured_queries
                if TABLE in q["sql"] and re.search(rf'rank_group"? = {group}\b', q["sql"])]
    assert len(one_rank) >= 5, [q["sql"] for q in seen.captured_queries]
    index = _index(["run_id", "rank_group", "step_hi"])
    for sql in one_rank:
        if "%s" in sql or "$1" in sql:
            continue  # a server-side bound statement (the pass on PostgreSQL) cannot be explained as text
        plan = _plan(sql)
        # PostgreSQL's daily partitions each carry the index under a name of their own (..._run_id_rank_group_...).
        assert index in plan or ("rank_group_step_hi" in plan and "Seq Scan" not in plan), (sql, plan)


@pytest.mark.django_db
def test_the_frames_index_the_rank_group_and_not_the_node(world: World) -> None:
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, TABLE)
    columns = [c["columns"] for c in found.values() if c["index"]]
    assert ["run_id", "rank_group", "step_hi"] in columns and ["run_id", "step_hi"] in columns, columns
    assert not any(c[0] == "node_id" for c in columns), columns  # nothing reads steps by node
    # A frame is one rank group's: a post of a node's sixteen ranks makes two frames, each of one group.
    run = Run.objects.create(cluster=world.cluster, name="two")
    made = framed.steps(world.cluster, None, run, [{"rank": r, "step": 3, "ts": T0, "step_time_s": 1.0}
                                                   for r in range(2 * RANK_GROUP)])
    assert sorted((f.rank_group, f.n, f.step_lo, f.step_hi) for f in made) == [(0, 8, 3, 3), (1, 8, 3, 3)]
    assert fr.step_bucket_end(3) == fr.STEP_BUCKET - 1
