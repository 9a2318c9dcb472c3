"""The goodput record (dashboard.diagnosis.efficiency) over a chunk in which the run restarted below steps it had
just done: those steps' work was lost, so they are no productive steps (the fuzz found a KeyError here, logged by
the pass and the run's figures never recorded)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from dashboard.diagnosis.efficiency import record_run
from dashboard.diagnosis.models import StepEfficiency
from dashboard.telemetry.models import Run
from tests.server import framed
from tests.server.conftest import World

T0 = 1_700_000_000.0


@pytest.mark.django_db
def test_steps_a_restart_undid_in_the_same_chunk_are_not_recorded(world: World) -> None:
    run = Run.objects.create(cluster=world.cluster, name="r", last_step=4, last_step_at=datetime.fromtimestamp(T0 + 9, UTC))
    # Steps 0-5, then the run restarts from step 3 (a checkpoint of step 2) and does 3 and 4 again: by when each
    # step last ended, 0, 1, 2, 5, 3, 4. Step 5's work was lost in the restart.
    done = [(s, T0 + s) for s in range(6)] + [(3, T0 + 7), (4, T0 + 8)]
    for s, t in done:  # a post a second, as the rank's agent sends them
        framed.steps(world.cluster, None, run, [{"rank": 0, "step": s, "ts": t, "step_time_s": 1.0, "tokens": 100}])
    assert record_run(run, T0 + 100) > 0
    assert sorted(StepEfficiency.objects.filter(run=run).values_list("step", flat=True)) == [0, 1, 2, 3, 4]
