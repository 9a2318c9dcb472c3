"""The step rollup (dashboard.storage.steps): a run's settled steps read from one row per step must be what grouping
their raw rank samples (the step frames) gives, which must be what the posts carried (an independent computation
over the records posted), the run page's history must not change when steps are rolled up, and rank samples that
arrive late for a rolled-up step must be counted by the next pass."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import pytest

from clusterdx import wire
from collectors.sim.model import SimCluster
from collectors.sim.scenario import parse
from dashboard.ingest.writer import store_batch
from dashboard.storage.models import STEP_SPLIT, StepRollup, StepRollupState
from dashboard.storage.steps import SETTLE_S, SETTLE_STEPS, _raw, per_step, roll_up_steps
from dashboard.telemetry.models import Run
from dashboard.web.pages.run_series import step_series
from tests.server.conftest import World

pytestmark = pytest.mark.django_db


def _store(world: World, batches: list[dict[str, Any]]) -> None:
    for b in batches:
        store_batch(world.cluster, wire.validate_batch(b))


def _at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def roll_up(now: datetime) -> int:
    return roll_up_steps(now)  # the step part of the rollup pass (dashboard.storage.rollup.roll_up ends with it)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _expected(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per step, what its records say: the aggregates _raw must give, computed here from the posted records."""
    by: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by.setdefault(r["step"], []).append(r)
    out = []
    for step, mine in sorted(by.items()):
        tokens = [r["tokens"] for r in mine if r.get("tokens") is not None]
        row = {"step": step, "n": len(mine), "ts": _at(max(r["ts"] for r in mine)),
               "tokens": sum(tokens) if tokens else None}
        for key in ("loss", "grad_norm"):
            row[key] = _mean([(r.get("metrics") or {})[key] for r in mine if key in (r.get("metrics") or {})])
        for f in STEP_SPLIT:
            vals = [r[f] for r in mine if r.get(f) is not None]
            row |= {f"{f}__sum": sum(vals) if vals else None, f"{f}__n": len(vals),
                    f"{f}__min": min(vals, default=None), f"{f}__max": max(vals, default=None)}
        out.append(row)
    return out


def _same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [g["step"] for g in got] == [w["step"] for w in want]
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys(), g["step"]
        assert abs((g["ts"] - w["ts"]).total_seconds()) < 1e-5, g["step"]
        for k in w.keys() - {"ts"}:
            assert (g[k] is None) == (w[k] is None) and (w[k] is None or g[k] == pytest.approx(w[k], rel=1e-12)), \
                (g["step"], k, g[k], w[k])


def test_rolled_up_steps_read_as_their_raw_rows_and_late_rows_are_counted(world: World) -> None:
    scenario = parse({"cluster": {"nodes": 3, "gpus_per_node": 2, "run": "llm", "seed": 7, "step_time_s": 0.5}})
    t0 = time.time() - 600
    sim = SimCluster(scenario, t0)
    spooled: list[dict[str, Any]] = []
    posted: list[dict[str, Any]] = []
    for second in range(1, 61):
        batches = sim.tick(t0 + second)
        if 5 <= second < 9:  # node-001 is cut off: its agent spools these seconds and sends them much later
            spooled += [b for b in batches if b["host"] == "node-001"]
            batches = [b for b in batches if b["host"] != "node-001"]
        _store(world, batches)
        posted += [s for b in batches for s in b["steps"]]
    run = Run.objects.get(cluster=world.cluster, name="llm")
    last = int(run.last_step)
    assert last > SETTLE_STEPS + 20
    before = step_series(run, 0, last, 40)

    roll_up(_at(t0 + 61))
    state = StepRollupState.objects.get(run=run)
    assert state.rolled_to == last - SETTLE_STEPS
    assert StepRollup.objects.filter(run=run).count() > 20
    assert per_step(run.id, 0, last) == _raw(run.id, 0, last)  # rolled-up steps read exactly as raw
    _same(_raw(run.id, 0, last), _expected(posted))
    assert step_series(run, 0, last, 40) == before  # the run page's history does not change
    assert step_series(run, 3, last - 5, 7) == step_series(run, 3, last - 5, 7)

    # The replayed rows of the spooled seconds land on steps already rolled up: they count from the next pass on.
    early = [s for b in spooled for s in b["steps"]]
    assert early and max(s["step"] for s in early) <= state.rolled_to
    _store(world, spooled)
    stale = per_step(run.id, 0, last)
    assert stale != _raw(run.id, 0, last)  # until then the rollup lacks them (a pass away)
    roll_up(_at(t0 + 62))
    assert per_step(run.id, 0, last) == _raw(run.id, 0, last)
    _same(per_step(run.id, 0, last), _expected(posted + early))

    # A run that stopped stepping is rolled up to its last step.
    roll_up(_at(run.last_step_at.timestamp() + SETTLE_S + 1))
    assert StepRollupState.objects.get(run=run).rolled_to == last
    assert per_step(run.id, 0, last) == _raw(run.id, 0, last)
    assert StepRollup.objects.filter(run=run).count() == len(_raw(run.id, 0, last))


def test_a_rank_view_and_an_unrolled_run_read_raw(world: World) -> None:
    scenario = parse({"cluster": {"nodes": 2, "gpus_per_node": 2, "run": "short", "seed": 8}})
    t0 = time.time() - 120
    sim = SimCluster(scenario, t0)
    posted: list[dict[str, Any]] = []
    for second in range(1, 21):
        batches = sim.tick(t0 + second)
        _store(world, batches)
        posted += [s for b in batches for s in b["steps"]]
    run = Run.objects.get(cluster=world.cluster, name="short")
    roll_up(_at(t0 + 21))  # fewer than SETTLE_STEPS steps: nothing settled yet
    assert not StepRollup.objects.filter(run=run).exists()
    last = int(run.last_step)
    assert per_step(run.id, 0, last) == _raw(run.id, 0, last)
    assert per_step(run.id, 0, last, rank=1) == _raw(run.id, 0, last, rank=1)
    assert all(r["n"] == 1 for r in per_step(run.id, 0, last, rank=1))
    _same(per_step(run.id, 0, last), _expected(posted))
    _same(per_step(run.id, 0, last, rank=1), _expected([s for s in posted if s["rank"] == 1]))


def _reference_figures(run: Run, s: dict[str, Any], a: int, b: int, world: int) -> tuple[Any, Any]:
    """A bucket's MFU and goodput as a diagnosis pass figures them: one Window of its last 16 steps (one row per
    step: the mean step time over ranks, every rank's tokens) handed to efficiency_figures."""
    import numpy as np

    from dashboard.diagnosis.detectors.steps import efficiency_figures
    from dashboard.diagnosis.detectors.window import GPU_NUM, PORT_NUM, PROBE_NUM, STEP_NUM, RunInfo, Table, Window

    part = {k: v[max(a, b - 16):b] for k, v in s.items()}
    n = len(part["step"])
    step_time = part["step_time_s__sum"] / part["step_time_s__n"]
    num = {c: np.full(n, np.nan) for c in STEP_NUM}
    num |= {"run": np.zeros(n), "rank": np.zeros(n), "step": part["step"], "ts": part["ts"],
            "step_time_s": step_time, "tokens": part["tokens"]}

    def empty(cols: tuple[str, ...]) -> Table:
        return Table({c: np.empty(0) for c in cols})

    w = Window(float(np.nanmax(part["ts"])), [], Table(num), empty(GPU_NUM), empty(PORT_NUM), empty(PROBE_NUM),
               [], {}, [RunInfo(run.name, world, run.meta or {}, {})], {})
    fig = efficiency_figures(w, 0)
    return (fig["mfu"], fig["goodput"]) if fig else (None, None)


def test_the_history_s_mfu_and_goodput_are_a_pass_s_figures_per_bucket(world: World) -> None:
    """Every bucket's MFU and goodput (computed for all buckets at once) equal what efficiency_figures gives for that
    bucket's last steps, through gaps in the steps and steps without tokens."""
    import numpy as np

    from dashboard.web.pages.run_series import _per_step

    def edited(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Gaps in the steps, steps without tokens, and steps a window may or may not include."""
        for b in batches:
            b["steps"] = [st for st in b["steps"] if st["step"] not in {*range(20, 28), 40}]
            for st in b["steps"]:
                if st["step"] in (30, 31):
                    st["tokens"] = None
                if st["step"] < 20:
                    st["step_time_s"] = 3.0
        return batches

    scenario = parse({"cluster": {"nodes": 2, "gpus_per_node": 2, "run": "mfu", "seed": 9, "step_time_s": 0.4}})
    t0 = time.time() - 300
    sim = SimCluster(scenario, t0)
    for second in range(1, 51):
        _store(world, edited(sim.tick(t0 + second)))
    run = Run.objects.get(cluster=world.cluster, name="mfu")
    run.meta = {**(run.meta or {}), "flops_per_token": 6 * 7e9, "peak_flops": 989e12}
    run.save()
    last = int(run.last_step)
    s = _per_step(run, 0, last, None)
    for points in (3, 7, 16, 40, last + 1):  # 3: a bucket whose last 16 rows span more than 16 steps
        got = step_series(run, 0, last, points)
        width = got["bucket_steps"]
        bucket = ((s["step"] - 0) // width).astype(int)
        starts = np.flatnonzero(np.r_[True, np.diff(bucket) != 0])
        ends = np.r_[starts[1:], len(bucket)]
        want = [_reference_figures(run, s, a, b, 4) for a, b in zip(starts, ends, strict=True)]
        assert list(zip(got["mfu"], got["goodput"], strict=True)) == want, points
        assert any(m is not None for m, _ in want) and any(g is not None for _, g in want)


def test_the_seen_id_moves_onto_the_frames_and_late_frames_are_found_by_it(world: World) -> None:
    import importlib

    from django.apps import apps

    from dashboard.storage.models import RollupState
    from dashboard.telemetry.models import StepFrame
    from tests.server import framed

    t0 = time.time() - 3600
    run = Run.objects.create(cluster=world.cluster, name="m", last_step=99, last_step_at=_at(t0 + 99))
    for s in range(100):  # rank 0 alone, a post a second
        framed.steps(world.cluster, None, run, [{"rank": 0, "step": s, "ts": t0 + s, "step_time_s": 1.0}])
    # A pass before the upgrade kept a StepSample id: far above every frame's (a frame holds many samples).
    RollupState.objects.update_or_create(pk=1, defaults={"step_seen_id": 10**9})
    importlib.import_module("dashboard.storage.migrations.0004_step_seen_frames").to_frames(apps, None)
    newest = StepFrame.objects.order_by("-id").values_list("id", flat=True).first()
    assert RollupState.objects.get(pk=1).step_seen_id == newest
    roll_up(_at(t0 + 99 + SETTLE_S + 1))
    assert StepRollupState.objects.get(run=run).rolled_to == 99
    assert StepRollup.objects.get(run=run, step=3).n == 1
    framed.steps(world.cluster, None, run, [{"rank": 1, "step": 3, "ts": t0 + 3.5, "step_time_s": 2.0}])  # late
    roll_up(_at(t0 + 99 + SETTLE_S + 2))
    three = StepRollup.objects.get(run=run, step=3)
    assert (three.n, three.step_time_s_sum, three.step_time_s_max) == (2, 3.0, 2.0)
    assert RollupState.objects.get(pk=1).step_seen_id == StepFrame.objects.order_by("-id").values_list(
        "id", flat=True).first() > newest
