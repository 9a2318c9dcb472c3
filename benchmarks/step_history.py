"""The run page's whole-run step history (``/api/v1/runs/<id>/steps``) read from raw step frames and from the step
rollup (dashboard.storage.steps), for a long run.

Stores ``--ranks`` x ``--steps`` step samples of one run straight into the step frames, as ingest would have left
them (a frame per node of eight ranks and step, a step a second, built by dashboard.storage.frames; loss on rank 0),
then times ``step_series`` over the whole run (``--points`` buckets) ``--repeat`` times with nothing rolled up, runs
the rollup pass (its time printed), and times it again. Printed: p50 / p95 ms of each, the ratio, the pass's rows and
seconds, the rank x step heatmap of the whole run (read from raw frames), and one rank's first and last step (the
rank page's bounds, a search of its rank group's frames).

    python benchmarks/step_history.py                              # embedded SQLite, 1,024 ranks x 1,800 steps
    python benchmarks/step_history.py --backend pg --steps 7200    # PostgreSQL (CLUSTERDX_BENCH_DATABASE_URL)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ingest_inproc import _setup

FRAMES_PER_STATEMENT = 500


def _frames(run_id: int, ranks: int, step: int, ts: float, rng: random.Random, steps: int) -> list[object]:
    """One step's frames: a frame per node (eight ranks), as its agent's post of that second makes it."""
    import numpy as np

    from dashboard.storage import frames as fr

    k = fr.STEPS
    mat = np.full((ranks, len(k.numbers)), np.nan)
    compute = 0.8 + np.array([rng.random() for _ in range(ranks)]) / 20
    for col, v in {"rank": np.arange(ranks), "step": step, "ts": ts, "step_time_s": 1.0, "data_wait_s": 0.01,
                   "compute_s": compute, "comm_s": 0.19 - compute / 10, "comm_arrive_s": 0.8, "tokens": 4096}.items():
        mat[:, k.col(col)] = v
    metrics: list[object] = [None] * ranks
    metrics[0] = {"loss": 3.0 - step / steps, "grad_norm": 1.0 + rng.random() / 10}
    out = []
    for lo in range(0, ranks, fr.RANK_GROUP):
        part = slice(lo, lo + fr.RANK_GROUP)
        objs = fr.objects(k, {"metrics": metrics[part]})
        out += fr.build(k, mat[part], objs, [run_id] * len(mat[part]))
    return out


def _store(ranks: int, steps: int) -> tuple[object, float]:
    """A run of ``ranks`` x ``steps`` samples ending now (a step a second); returns (the run, the last step's
    time)."""
    from django.db import transaction

    from dashboard.telemetry.models import Cluster, Run, StepFrame

    cluster = Cluster.objects.create(name=f"steps-{time.time_ns()}")
    end = time.time() - 1
    run = Run.objects.create(cluster=cluster, name="long", last_step=steps - 1,
                             last_step_at=datetime.fromtimestamp(end, UTC), world_size=ranks)
    rng = random.Random(5)
    a = time.perf_counter()
    batch: list[object] = []
    with transaction.atomic():
        for step in range(steps):
            ts = end - (steps - 1 - step)
            batch += [StepFrame(cluster_id=cluster.id, run_id=run.id, ts=datetime.fromtimestamp(b.ts, UTC),
                                rank_group=b.rank_group, step_lo=b.step_lo, step_hi=b.step_hi, n=b.n, data=b.data)
                      for b in _frames(run.id, ranks, step, ts, rng, steps)]
            if len(batch) >= FRAMES_PER_STATEMENT:
                StepFrame.objects.bulk_create(batch)
                batch = []
            if (step + 1) % 300 == 0:
                print(f"  stored {step + 1}/{steps} steps x {ranks} ranks ({time.perf_counter() - a:.0f} s)",
                      flush=True)
        StepFrame.objects.bulk_create(batch)
    return run, end


def _time(run: object, last: int, points: int, repeat: int) -> list[float]:
    from dashboard.web.pages.run_series import step_series

    out = []
    for _ in range(repeat):
        a = time.perf_counter()
        step_series(run, 0, last, points)  # type: ignore[arg-type]
        out.append(1000 * (time.perf_counter() - a))
    return out


def _pct(v: list[float], q: float) -> float:
    return sorted(v)[min(len(v) - 1, int(q * len(v)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["sqlite", "pg"], default="sqlite")
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=1800)
    ap.add_argument("--points", type=int, default=1400, help="buckets (the page asks its width in px)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    _setup(args.backend)
    print(f"==> storing {args.steps} steps x {args.ranks} ranks ({args.backend})", flush=True)
    run, end = _store(args.ranks, args.steps)
    last = args.steps - 1

    from dashboard.storage.steps import roll_up_steps

    raw = _time(run, last, args.points, args.repeat)
    a = time.perf_counter()
    written = roll_up_steps(datetime.fromtimestamp(end + 1, UTC))
    pass_s = time.perf_counter() - a
    rolled = _time(run, last, args.points, args.repeat)
    a = time.perf_counter()
    again = roll_up_steps(datetime.fromtimestamp(end + 2, UTC))
    idle_s = time.perf_counter() - a
    print(f"\nstep history of {args.ranks} ranks x {args.steps} steps, {args.points} points ({args.backend})")
    print(f"  raw frames    p50 {statistics.median(raw):8.0f} ms  p95 {_pct(raw, 0.95):8.0f} ms")
    print(f"  step rollup   p50 {statistics.median(rolled):8.0f} ms  p95 {_pct(rolled, 0.95):8.0f} ms  "
          f"({statistics.median(raw) / statistics.median(rolled):.1f}x faster)")
    print(f"  rollup pass: {written} steps in {pass_s:.1f} s (backfill); the next pass {again} rows in {idle_s:.2f} s")
    from dashboard.web.pages.run_series import MAX_HEATMAP_COLS, heatmap

    heat = []
    for _ in range(args.repeat):
        a = time.perf_counter()
        heatmap(run, "compute_s", 0, last, MAX_HEATMAP_COLS)  # type: ignore[arg-type]
        heat.append(1000 * (time.perf_counter() - a))
    print(f"  rank x step heatmap ({MAX_HEATMAP_COLS} columns, raw frames)  p50 {statistics.median(heat):8.0f} ms  "
          f"p95 {_pct(heat, 0.95):8.0f} ms")
    from dashboard.storage.step_samples import bounds

    one = []
    for _ in range(args.repeat):
        a = time.perf_counter()
        bounds(run.id, args.ranks - 1)  # type: ignore[attr-defined]
        one.append(1000 * (time.perf_counter() - a))
    print(f"  one rank's first and last step  p50 {statistics.median(one):8.1f} ms  p95 {_pct(one, 0.95):8.1f} ms")


if __name__ == "__main__":
    main()
