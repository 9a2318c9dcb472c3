"""The CPU of a diagnosis pass that reads a kept cluster's newest seconds as a delta, as a pass under ingest does.

A pass process holds its window between passes (dashboard.diagnosis.held) and reads only the rows written since.
This times that read and the detectors on a cluster stored once by ``benchmarks/diagnosis.py --db-keep`` (no ingest
needed): after one whole-window pass, each pass first drops the held rows of the newest ``--delta`` seconds (the rows
with an id at or above the first one stamped in them), so it reads them again as its delta.

    python benchmarks/diagnosis.py --sizes --healthy-sizes --big 0 --db-pass 2048 --db-keep   # once: store
    python benchmarks/diagnosis_delta.py 2048                     # then: 5 passes, each with 5 s of new rows
    python benchmarks/diagnosis_delta.py 2048 --check             # and compare the held window with a fresh read
    python benchmarks/diagnosis_delta.py 2048 --run-started       # passes in a run's first minute (below)
    python benchmarks/diagnosis_delta.py 2048 --beats             # the ranks' beats in the live state too

The backend and database are the environment's (``CLUSTERDX_DATA_DIR`` or ``DATABASE_URL``, as for the store).
Times are this process's CPU (``time.process_time``): PostgreSQL's own work is not in them; the split between
reading and detecting follows the wall time's split.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def trim(delta_s: float, now: float) -> int:
    """Forget the held rows of the newest ``delta_s`` seconds; returns how many. Ids follow the order rows were
    written in, so the rows at or above the first id stamped in those seconds are exactly what the next pass reads."""
    from dashboard.diagnosis import held

    n = 0
    for key, s in held._series.items():
        ids = s.ids
        ts = s.mat[2 if key[2][0] == "steps" else s.at]  # steps are held by step number: their ts is row 2
        late = ts > now - delta_s
        if not late.any():
            continue
        keep = ids < ids[late].min()
        n += int((~keep).sum())
        s._move(keep, 0)
        s.top = int(s.ids.max())
        s.holes = []
    return n


def put_beats(cluster: Any) -> int:
    """One beat per rank of the cluster's runs, heard now, "step": what 2,048 nodes' agents keep in the live state."""
    from dashboard.live.state import get_state
    from dashboard.telemetry.models import Rank

    by_host: dict[str, list[dict[str, Any]]] = {}
    for run, rank, host in Rank.objects.filter(run__cluster=cluster).values_list("run__name", "rank",
                                                                                "node__hostname"):
        by_host.setdefault(host or "", []).append({"run": run, "rank": rank, "ts": time.time(), "state": "step",
                                                   "state_s": 0.5, "step": 0})
    get_state().record_beats_hosts(cluster.id, by_host)
    return sum(map(len, by_host.values()))


class GcTime:
    """CPU seconds the cyclic collector took, and its full collections, while counting."""

    def __init__(self) -> None:
        self.seconds, self.full, self._start = 0.0, 0, 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.process_time()
        else:
            self.seconds += time.process_time() - self._start
            self.full += info["generation"] == 2


def check(cluster: Any, now: float, t: Any) -> None:
    """The held window and its detections are those of a fresh read of the database (rows in any order)."""
    import numpy as np

    from dashboard.diagnosis import held
    from dashboard.diagnosis.detectors import run_all
    from dashboard.diagnosis.loader import load_window

    kept = load_window(cluster, now, [])
    series = dict(held._series)
    held.forget()
    fresh = load_window(cluster, now, [])
    held._series.update(series)
    for name in ("gpus", "ports", "probes", "steps"):
        x, y = getattr(kept, name), getattr(fresh, name)
        assert list(x.num) == list(y.num) and list(x.obj) == list(y.obj), name
        kx = np.lexsort([np.nan_to_num(x.num[c], nan=-1e300) for c in x.num][::-1])
        ky = np.lexsort([np.nan_to_num(y.num[c], nan=-1e300) for c in y.num][::-1])
        for c in x.num:
            assert np.array_equal(x.num[c][kx], y.num[c][ky], equal_nan=True), f"held {name}.{c} differ"
        for c in x.obj:
            assert list(map(repr, x.obj[c][kx])) == list(map(repr, y.obj[c][ky])), f"held {name}.{c} differ"
    assert sorted(map(repr, run_all(kept, t))) == sorted(map(repr, run_all(fresh, t))), "detections differ"
    print("held window and its detections equal to a fresh read's", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("nodes", type=int, help="the kept cluster's size (bench-<nodes>-kept)")
    p.add_argument("--delta", type=float, default=5.0, help="seconds of new rows each pass reads")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--profile", help="write a cProfile of the last pass here")
    p.add_argument("--check", action="store_true", help="then compare the held window with a fresh read")
    p.add_argument("--run-started", action="store_true",
                   help="stamp every rank of the kept runs as just updated, as a run's first second does: each pass "
                        "is then within the minute in which the pass reads their metas again (loader._ranks)")
    p.add_argument("--beats", action="store_true",
                   help="put a beat for every rank of the kept runs in the live state (as their agents keep it, "
                        "Redis where REDIS_URL is set) and let each pass read the live state as the worker's does; by "
                        "default the passes are handed no beats")
    args = p.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
    import django

    django.setup()
    import numpy as np
    from django.db import connection

    from dashboard.diagnosis import held
    from dashboard.diagnosis.tasks import detect, thresholds
    from dashboard.storage import frames
    from dashboard.telemetry.models import Cluster, Rank

    cluster = Cluster.objects.get(name=f"bench-{args.nodes}-kept")
    if args.run_started:
        from datetime import UTC, datetime

        n = Rank.objects.filter(run__cluster=cluster).update(updated_at=datetime.now(tz=UTC))
        print(f"{n} ranks stamped as just updated", flush=True)
    now = frames.newest(frames.GPUS, cluster_id=cluster.id)
    t = thresholds()
    beats: list[dict[str, Any]] | None = []
    if args.beats:
        beats = None  # the loader reads the live state
        print(f"{put_beats(cluster)} beats put in the live state", flush=True)
    held.forget()
    a = time.process_time()
    detect(cluster, now, t, beats)
    print(f"first pass (whole window): {time.process_time() - a:.2f} s CPU", flush=True)
    collector = GcTime()
    load, total = [], []
    for i in range(args.passes):
        rows = trim(args.delta, now)
        prof = cProfile.Profile() if args.profile and i == args.passes - 1 else None
        collector.seconds, collector.full = 0.0, 0
        if prof:
            prof.enable()
        a = time.process_time()
        _, wall = detect(cluster, now, t, beats)
        cpu = time.process_time() - a
        if prof:
            prof.disable()
            prof.dump_stats(args.profile)
        load.append(cpu * wall["load"] / (wall["load"] + wall["detect"]))
        total.append(cpu)
        print(f"pass {i}: {rows} new rows, {cpu:.3f} s CPU (reading {load[-1]:.3f} s, detectors "
              f"{cpu - load[-1]:.3f} s; collector {collector.seconds:.3f} s, {collector.full} full)", flush=True)
    print(f"{connection.vendor} {args.nodes} nodes, {args.delta:g} s of new rows: p50 {np.median(total):.3f} s CPU "
          f"(reading {np.median(load):.3f} s, detectors {np.median(np.subtract(total, load)):.3f} s), max "
          f"{max(total):.3f} s; load average {os.getloadavg()[0]:.1f}", flush=True)
    if args.check:
        check(cluster, now, t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
