"""One rank's step samples are read through the (run, rank / 8, step) index (migration telemetry 0014), on SQLite and
PostgreSQL: every reader that asks for one rank (the run page's rank view, the step rollup, a finding's evidence, the
search box, the diagnosis pass's loss) gets exactly that rank's rows, and names the index's expression so the planner
can use it (an expression index is used only when the query's expression is the index's)."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from dashboard.diagnosis import held, loader
from dashboard.diagnosis.detectors import Thresholds
from dashboard.diagnosis.models import Finding
from dashboard.storage import steps as rollup
from dashboard.telemetry.models import RANK_GROUP, Run, StepSample
from dashboard.web import evidence
from dashboard.web.pages import overview, run_series
from tests.server.conftest import World

T0 = 1_700_000_000.0
RANKS, STEPS, RANK = 64, 40, 13
INDEX = "telemetry_step_rank_group"


def _steps(world: World) -> Run:
    """RANKS ranks x STEPS steps; every value says whose row it is (step time 1 + rank/100, loss = rank + step/1000)."""
    run = Run.objects.create(cluster=world.cluster, name="wide", last_step=STEPS - 1,
                             last_step_at=datetime.fromtimestamp(T0 + STEPS - 1, UTC))
    StepSample.objects.bulk_create([
        StepSample(cluster=world.cluster, run=run, rank=r, step=s, ts=datetime.fromtimestamp(T0 + s + r / 1000, UTC),
                   step_time_s=1.0 + r / 100, compute_s=0.5, metrics={"loss": r + s / 1000})
        for s in range(STEPS) for r in range(RANKS)], batch_size=2000)
    return run


def _plan(sql: str) -> str:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # A few thousand rows: PostgreSQL would scan the table. Forbidding that shows the index *can* answer it.
            cursor.execute("SET LOCAL enable_seqscan = off")
            cursor.execute("EXPLAIN " + sql)
            return " | ".join(r[0] for r in cursor.fetchall())
        cursor.execute("EXPLAIN QUERY PLAN " + sql)
        return " | ".join(str(r[-1]) for r in cursor.fetchall())


@pytest.mark.django_db
def test_a_ranks_reads_return_its_rows_by_the_rank_group_index(world: World) -> None:
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
    assert matrix is not None
    steps, _, ranks, cols = matrix
    assert steps == list(range(STEPS)) and list(ranks) == [RANK]
    assert cols["step_time_s"].tolist() == [[pytest.approx(mine)] * STEPS]
    progress = next(p for p in stall if p["id"] == "progress")
    assert progress["series"][0]["name"] == f"rank {RANK}" and progress["series"][0]["y"] == list(range(STEPS))
    assert [r["label"] for r in found] == [f"{run.name}/rank{RANK}"]
    assert losses[:, 0].tolist() == list(range(STEPS)) and losses[:, 2].tolist() == \
        [pytest.approx(RANK + s / 1000) for s in range(STEPS)]

    one_rank = [q["sql"] for q in seen.captured_queries
                if "telemetry_stepsample" in q["sql"] and re.search(rf'rank"? (\+ 0\) )?= {RANK}\b', q["sql"])]
    assert len(one_rank) >= 5, [q["sql"] for q in seen.captured_queries]
    for sql in one_rank:
        assert f"/ {RANK_GROUP})" in sql, sql  # the index's expression, as the index has it
        if "%s" in sql or "$1" in sql:
            continue  # a server-side bound statement (the pass on PostgreSQL) cannot be explained as text
        plan = _plan(sql)
        # PostgreSQL's daily partitions each carry the index under a name of their own (..._run_id_expr_step_idx).
        assert INDEX in plan or (f"((rank / {RANK_GROUP}) =" in plan and "Seq Scan" not in plan), (sql, plan)


@pytest.mark.django_db
def test_the_index_exists_as_migrated_and_the_per_rank_index_is_gone(world: World) -> None:
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, StepSample._meta.db_table)
    assert INDEX in found and found[INDEX]["index"]
    columns = [c["columns"] for c in found.values() if c["index"]]
    assert ["run_id", "rank", "step"] not in columns and ["node_id"] not in columns, columns
