"""A rank that changed node: the server keeps only each rank's current node, so the ingest records the move as an
event (by the single-batch writer and by the group commit alike), and a loss spike right after it is tied to it
(the detector alone over a WindowBuffer, then the real pass over what the ingest stored)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from clusterdx import wire
from dashboard.diagnosis.detectors import run_all
from dashboard.diagnosis.detectors.buffer import WindowBuffer
from tests.server import conftest as server
from tests.server.conftest import World, make_batch, post

world = server.world
_fresh_caches = server._fresh_caches  # autouse: the ingest writer's id caches outlive the rolled-back database

STEP, SPIKE = 0.3, 77


def _steps(first: int, last: int, t0: float) -> list[dict[str, Any]]:
    rng = np.random.default_rng(first)
    return [{"run": "r", "rank": 0, "step": s, "ts": t0 + STEP * (s + 1), "step_time_s": STEP,
             "metrics": {"loss": 5.0 if s == SPIKE else 2.0 - 0.002 * s + float(rng.normal(0, 0.01))}}
            for s in range(first, last)]


def _meta(host: str, ts: float) -> dict[str, Any]:
    return {"run": "r", "rank": 0, "world_size": 2, "ts": ts, "host": host, "gpu_index": 3}


def _moved(t0: float, run: str = "r", at: float | None = None) -> dict[str, Any]:
    return {"ts": t0 + STEP * SPIKE if at is None else at, "kind": "hook", "severity": "warning", "run": run,
            "rank": 0, "gpu_index": 3, "message": "rank 0 of r moved from node-0 to node-5",
            "data": {"moved_from": "node-0", "moved_to": "node-5"}}


def _spikes(buf: WindowBuffer, now: float) -> list[Any]:
    return [d for d in run_all(buf.window(now)) if d.kind == "loss_spike"]


def test_a_loss_spike_right_after_a_rank_changed_node_names_the_move() -> None:
    t0 = 1_760_000_000.0
    now = t0 + STEP * 80 + 0.2

    def run(*events: dict[str, Any]) -> WindowBuffer:
        buf = WindowBuffer()
        buf.add({"host": "node-5", "sent_at": now, "steps": _steps(0, 80, t0), "runs": [_meta("node-5", t0)],
                 "events": list(events)})
        return buf

    (d,) = _spikes(run(_moved(t0)), now)
    assert d.title == f"Loss spike at step {SPIKE} coincides with rank 0 moving from node-0 to node-5"
    assert (d.severity, d.node, d.gpu_index, d.rank) == ("warning", "node-5", 3, 0)
    assert d.evidence["metrics"]["causes"][0]["kind"] == "rank_moved"
    # Another run's move, or one long before the spike, is no cause: the spike stays an unexplained info.
    for other in (_moved(t0, run="other"), _moved(t0, at=t0 + STEP * 10)):
        (d,) = _spikes(run(other), now)
        assert (d.severity, d.title.startswith(f"Loss spike at step {SPIKE}: 5")) == ("info", True)


@pytest.mark.django_db
def test_the_ingest_records_a_rank_that_changed_node_and_the_pass_ties_the_spike_to_it(world: World, client: Any,
                                                                                        caplog: Any) -> None:
    from dashboard.diagnosis.models import Finding
    from dashboard.diagnosis.tasks import run_pass
    from dashboard.ingest.writer import store_group
    from dashboard.telemetry.models import Event, Rank

    now = time.time()
    t0 = now - 1.0 - STEP * 80
    first = make_batch(0, "node-0", gpus=[], steps=_steps(0, 70, t0), runs=[_meta("node-0", t0)])
    assert post(client, first, world.token).status_code == 200
    again = make_batch(1, "node-0", gpus=[], steps=[], runs=[_meta("node-0", t0 + 5)])
    assert post(client, again, world.token).status_code == 200  # metadata resent from the same node: no move
    assert not Event.objects.filter(kind="hook").exists()
    # Restarted on node-5 just before the spike: through the group commit's path this time.
    moved_at = t0 + STEP * 75
    second = make_batch(0, "node-5", gpus=[], steps=_steps(70, 80, t0), runs=[_meta("node-5", moved_at)])
    (out,) = store_group([(world.cluster, wire.validate_batch(second), "")])
    assert out.status == "accepted" and "one by one" not in caplog.text, out  # the set path, not its fallback
    assert Rank.objects.get(run__name="r", rank=0).node.hostname == "node-5"
    (ev,) = Event.objects.filter(kind="hook")
    assert (ev.node.hostname, ev.run.name, ev.rank, ev.gpu_index, ev.severity, ev.data) == (
        "node-5", "r", 0, 3, "warning", {"moved_from": "node-0", "moved_to": "node-5"})
    assert ev.ts.timestamp() == pytest.approx(moved_at, abs=1e-3)
    # And back by the single-batch path: a second event.
    back = make_batch(2, "node-0", gpus=[], steps=[], runs=[_meta("node-0", moved_at + 1)])
    assert post(client, back, world.token).status_code == 200
    assert sorted(Event.objects.filter(kind="hook").values_list("data__moved_to", flat=True)) == ["node-0", "node-5"]

    run_pass(world.cluster, now)
    spike = Finding.objects.get(kind="loss_spike")
    assert spike.subject == f"r/step{SPIKE}" and spike.severity == "warning"
    assert spike.title.startswith(f"Loss spike at step {SPIKE} coincides with rank 0 moving from node-")
