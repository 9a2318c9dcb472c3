"""Fault-injection suite for the diagnosis: precision, recall, time-to-detect, false findings on healthy runs.

Runs the simulator in-process in *simulated* time (one tick per simulated second, no sleeping) and feeds its wire
batches to the same window the server builds, then to the detectors, with the findings lifecycle's hysteresis.

    python benchmarks/diagnosis.py                      # 8 and 64 nodes x 3 seeds, 512 nodes x 1 seed, healthy hour
    python benchmarks/diagnosis.py --sizes 8 --seeds 5  # quicker
    python benchmarks/diagnosis.py --db-pass 512 2048   # also: passes against the database at 512 and 2,048 nodes
    python benchmarks/diagnosis.py --sizes --healthy-sizes --big 0 --db-pass 2048 --db-live-s 30  # under ingest

Scoring. Each case injects one fault; the expected finding is (kind, subject). A finding opened during the case
with that key is a true positive; any other finding opened is a false positive (a consequence that should have been
folded into its root cause counts against precision too). Recall: faults whose expected finding opened. Time to
detect: from when the fault becomes *visible in the data* (the first affected step for rank faults, the first
batch after the injection for node/GPU/link faults, the moment the next step was due for a hang, the step at which
the missed checkpoint was due) to the pass that opened the finding.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collectors.sim.model import SimCluster, node_name
from collectors.sim.scenario import Fault, Scenario, parse
from dashboard.diagnosis.detectors import Thresholds, run_all
from dashboard.diagnosis.detectors.buffer import WindowBuffer

T0 = 1_750_000_000.0
RUN = "bench"
CLEAR_AFTER_S = 30.0  # as the lifecycle: a finding resolves after its condition is gone this long
KINDS = ("data_starvation", "straggler", "slow_link", "slow_link_bw", "link_flap", "ecc_storm", "xid", "xid_dbe",
         "node_down", "hang", "nccl_socket_fallback", "nccl_env_drift", "checkpoint_stop", "memory_pressure",
         "rank_killed", "rank_frozen", "loader_stuck")


def make_fault(kind: str, rng: random.Random, nodes: int, gpus: int) -> dict[str, Any]:
    """A fault of ``kind`` on a random subject with a random (realistic) strength."""
    at = rng.randint(30, 45)
    rank, node, gpu = rng.randrange(nodes * gpus), rng.randrange(nodes), rng.randrange(gpus)
    f: dict[str, Any] = {"kind": kind, "at_s": at}
    if kind == "data_starvation":
        f.update(rank=rank, magnitude=rng.uniform(0.15, 0.8))
    elif kind == "straggler":
        f.update(rank=rank, magnitude=rng.uniform(0.15, 0.6))
    elif kind == "slow_link":
        f.update(node=node, magnitude=rng.uniform(0.3, 5.0))
    elif kind == "slow_link_bw":
        f.update(kind="slow_link", node=node, magnitude=rng.uniform(1.0, 4.0), mode="bandwidth")
    elif kind == "link_flap":
        f.update(node=node)
    elif kind == "ecc_storm":
        f.update(node=node, gpu=gpu, dbe_after_s=rng.randint(5, 30))
    elif kind == "xid":
        f.update(node=node, gpu=gpu, code=79)
    elif kind == "xid_dbe":
        f.update(kind="xid", node=node, gpu=gpu, code=rng.choice([48, 94, 95, 63, 74, 119]))
    elif kind in ("node_down", "nccl_socket_fallback"):
        f.update(node=node)
    elif kind in ("nccl_env_drift", "memory_pressure"):
        f.update(rank=rank)
        if kind == "memory_pressure":
            f["magnitude"] = rng.uniform(0.93, 0.99)
    elif kind in ("rank_killed", "rank_frozen", "loader_stuck"):
        f.update(rank=rank)
        if kind == "rank_killed":  # NCCL survivors wait in the collective; gloo's die of the lost peer
            f["survivors"] = rng.choice(["wait", "crash"])
    elif kind == "checkpoint_stop":
        f["at_s"] = 75 + rng.randint(0, 10)  # after two checkpoints (every 20 steps): the cadence is known
    return f


def expected_key(f: Fault) -> tuple[str, str]:
    if f.kind in ("data_starvation", "straggler", "memory_pressure"):
        return f.kind, f"{RUN}/rank{f.rank}"
    if f.kind == "nccl_env_drift":
        return "nccl_config", f"{RUN}/rank{f.rank}"
    if f.kind in ("rank_killed", "rank_frozen"):
        return "rank_down", f"{RUN}/rank{f.rank}"
    if f.kind == "loader_stuck":
        return "hang", f"{RUN}/rank{f.rank}"
    if f.kind in ("slow_link", "link_flap"):
        return "slow_link", node_name(f.node or 0)
    if f.kind in ("ecc_storm", "xid"):
        return "failing_gpu", f"{node_name(f.node or 0)}/gpu{f.gpu}"
    if f.kind == "node_down":
        return "node_down", node_name(f.node or 0)
    if f.kind == "nccl_socket_fallback":
        return "nccl_config", node_name(f.node or 0)
    if f.kind == "hang":
        return "hang", RUN
    if f.kind == "checkpoint_stop":
        return "checkpoint_overdue", RUN
    raise ValueError(f.kind)


class Visibility:
    """When the fault first shows in the data the server receives."""

    def __init__(self, f: Fault, s: Scenario) -> None:
        self.f, self.s = f, s
        self.start = T0 + f.at_s
        self.at: float | None = None
        self.last_step_end = 0.0
        self.step_times: list[float] = []

    def see(self, now: float, batches: list[dict[str, Any]]) -> None:
        if self.at is not None:
            return
        steps = [st for b in batches for st in b["steps"]]
        for st in steps:
            self._step(st)
        if self.at is None and self.f.kind not in ("data_starvation", "straggler", "memory_pressure", "hang",
                                                   "loader_stuck", "checkpoint_stop") and now >= self.start:
            self.at = now
        if self.f.kind in ("hang", "loader_stuck") and now >= self.start and self.step_times:
            due = self.last_step_end + statistics.median(self.step_times[-20:])
            if now >= due and not any(st["ts"] > self.start for st in steps):
                self.at = due

    def _step(self, st: dict[str, Any]) -> None:
        f = self.f
        begin = st["ts"] - st["step_time_s"]
        if st["rank"] == 0 and st["ts"] <= self.start:
            self.last_step_end = max(self.last_step_end, st["ts"])
            self.step_times.append(st["step_time_s"])
        mine = st["rank"] == f.rank
        started = f.kind in ("data_starvation", "straggler") and mine and begin >= self.start
        near_oom = f.kind == "memory_pressure" and mine and st["mem_allocated_bytes"] >= 0.9 * st["mem_total_bytes"]
        if started or near_oom:
            self.at = st["ts"] if self.at is None else min(self.at, st["ts"])
        elif f.kind == "checkpoint_stop" and st["rank"] == 0 and st["ts"] >= self.start and \
                st["step"] % self.s.checkpoint_every == 0:
            self.at = st["ts"]


@dataclass
class CaseResult:
    name: str
    nodes: int
    expected: tuple[str, str] | None
    opened: list[tuple[float, str, str]] = field(default_factory=list)
    visible_at: float | None = None
    pass_ms: list[float] = field(default_factory=list)
    sim_s: float = 0.0

    @property
    def detected_at(self) -> float | None:
        return next((t for t, k, s in self.opened if (k, s) == self.expected), None)

    @property
    def false(self) -> list[tuple[float, str, str]]:
        return [o for o in self.opened if (o[1], o[2]) != self.expected]


def run_case(scenario: Scenario, seconds: int, interval: float, t: Thresholds, name: str) -> CaseResult:
    sim = SimCluster(scenario, T0)
    buf = WindowBuffer()
    fault = scenario.faults[0] if scenario.faults else None
    res = CaseResult(name, scenario.nodes, expected_key(fault) if fault else None, sim_s=seconds)
    vis = Visibility(fault, scenario) if fault else None
    open_keys: dict[tuple[str, str], float] = {}  # key -> last time seen
    next_pass = T0 + interval
    for i in range(1, seconds + 1):
        now = T0 + i
        batches = sim.tick(now)
        if vis:
            vis.see(now, batches)
        for b in batches:
            buf.add(b)
        if now + 1e-9 < next_pass:
            continue
        next_pass += interval
        a = time.perf_counter()
        keys = {d.key for d in run_all(buf.window(now), t)}
        res.pass_ms.append(1000 * (time.perf_counter() - a))
        for key in keys:
            if key not in open_keys:
                res.opened.append((now, *key))
            open_keys[key] = now
        for key in [k for k, seen in open_keys.items() if now - seen >= CLEAR_AFTER_S]:
            del open_keys[key]
    res.visible_at = vis.at if vis else None
    return res


def scenario_for(kind: str | None, nodes: int, gpus: int, seed: int) -> tuple[Scenario, int]:
    rng = random.Random(f"{kind}-{nodes}-{seed}")
    faults = [make_fault(kind, rng, nodes, gpus)] if kind else []
    cluster: dict[str, Any] = {"nodes": nodes, "gpus_per_node": gpus, "run": RUN, "seed": seed,
                               "step_time_s": rng.choice([0.5, 0.8, 1.2])}
    if kind == "checkpoint_stop":
        cluster["checkpoint_every"] = 20
    seconds = (faults[0]["at_s"] + 45) if faults else 0
    if kind == "checkpoint_stop":
        seconds += 40
    return parse({"cluster": cluster, "fault": faults}), seconds


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))]


def report(results: list[CaseResult], healthy: list[CaseResult]) -> dict[str, float]:
    tp = sum(1 for r in results if r.detected_at is not None)
    fp = sum(len(r.false) for r in results)
    ttd = [r.detected_at - r.visible_at for r in results if r.detected_at is not None and r.visible_at is not None]
    hours = sum(h.sim_s for h in healthy) / 3600
    false_h = sum(len(h.opened) for h in healthy)
    print(f"\n{'kind':<22}{'cases':>6}{'recall':>8}{'false':>7}{'ttd p50':>9}{'ttd p90':>9}")
    for kind in sorted({r.name for r in results}):
        rs = [r for r in results if r.name == kind]
        tt = [r.detected_at - r.visible_at for r in rs if r.detected_at is not None and r.visible_at is not None]
        print(f"{kind:<22}{len(rs):>6}{sum(r.detected_at is not None for r in rs) / len(rs):>8.2f}"
              f"{sum(len(r.false) for r in rs):>7}{pct(tt, 0.5):>8.1f}s{pct(tt, 0.9):>8.1f}s")
    for r in results:
        if r.detected_at is None or r.false:
            got = [(round(t - T0), k, s) for t, k, s in r.opened]
            print(f"  ! {r.name} @{r.nodes} nodes: expected {r.expected}, opened {got}")
    for h in healthy:
        for t, k, s in h.opened:
            print(f"  ! healthy {h.nodes} nodes: false {k} {s} at {t - T0:.0f} s")
    out = {"cases": len(results), "precision": tp / (tp + fp) if tp + fp else 1.0,
           "recall": tp / len(results) if results else float("nan"),
           "ttd_p50_s": pct(ttd, 0.5), "ttd_p90_s": pct(ttd, 0.9), "healthy_hours": hours,
           "false_per_hour": false_h / hours if hours else float("nan")}
    print(f"\nprecision {out['precision']:.3f}  recall {out['recall']:.3f}  time-to-detect p50 {out['ttd_p50_s']:.1f} s "
          f"p90 {out['ttd_p90_s']:.1f} s  ({len(results)} fault cases)")
    print(f"healthy: {false_h} false finding(s) in {hours:.2f} simulated hours = {out['false_per_hour']:.2f} per hour")
    return out


def db_pass(nodes: int, seconds: int, keep: bool = False, passes: int = 20, profile: bool = False,
            ingest_s: int = 0, live_s: int = 0, every: int = 5, check: bool = False) -> None:
    """Feed ``seconds`` of a ``nodes``-node cluster through the real ingest writer and time the diagnosis pass.
    ``keep``: store into a cluster named ``bench-<nodes>-kept`` once and time the pass on it in later runs (with
    ``CLUSTERDX_DATA_DIR`` or ``DATABASE_URL`` pointing at the same database), to iterate on the read alone.

    The pass process keeps its window between passes (dashboard.diagnosis.held): the first pass reads the whole
    window (cold), the next ones only what was written since, which on a database nobody writes to is nothing.
    ``live_s``: then go on storing the simulator's batches for that many seconds with a pass every ``every``
    simulated seconds at the simulated time, as the server does under ingest (needs a cluster stored by this run);
    ``check``: compare each of those windows with a fresh read of the database."""
    import tempfile

    if not os.environ.get("DATABASE_URL") and not (keep and os.environ.get("CLUSTERDX_DATA_DIR")):
        tmp = tempfile.mkdtemp(prefix="cdx-bench-")
        os.environ["CLUSTERDX_DATA_DIR"] = tmp
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    from clusterdx import wire
    from dashboard.diagnosis import held
    from dashboard.diagnosis.tasks import run_pass
    from dashboard.ingest.writer import store_batch
    from dashboard.storage import frames
    from dashboard.telemetry.models import Cluster, GpuFrame

    call_command("migrate", verbosity=0)
    name = f"bench-{nodes}-kept" if keep else f"bench-{nodes}-{int(time.time())}"
    cluster, _ = Cluster.objects.get_or_create(name=name)
    sim, start = None, 0.0
    if not GpuFrame.objects.filter(cluster=cluster).exists():  # new, or kept from a feed that failed
        scenario, _ = scenario_for(None, nodes, 8, 1)
        start = time.time() - seconds - live_s - 5
        sim = SimCluster(scenario, start)
        a = time.perf_counter()
        for i in range(1, seconds + 1):
            for b in sim.tick(start + i):
                store_batch(cluster, wire.validate_batch(b))
        print(f"db: stored {seconds} s of {nodes} nodes x 8 GPUs in {time.perf_counter() - a:.0f} s", flush=True)
    now = frames.newest(frames.GPUS, cluster_id=cluster.id)
    held.forget()
    took = []
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(run_pass, cluster, now)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(35)
        held.forget()
    for _ in range(passes):
        res = run_pass(cluster, now)
        took.append(res.timings_s)
    backend = connection.vendor
    _print_passes(f"db pass ({backend}) at {nodes} nodes / {nodes * 8} GPUs, first (cold)", took[:1])
    _print_passes(f"db pass ({backend}) at {nodes} nodes / {nodes * 8} GPUs, then (held, no new rows)", took[1:])
    if live_s and sim is not None:
        live = []
        a = time.perf_counter()
        for i in range(seconds + 1, seconds + live_s + 1):
            for b in sim.tick(start + i):
                store_batch(cluster, wire.validate_batch(b))
            if (i - seconds) % every == 0:
                res = run_pass(cluster, start + i)
                live.append(res.timings_s)
                if check:
                    _check_held(cluster, start + i)
        _print_passes(f"db pass ({backend}) at {nodes} nodes / {nodes * 8} GPUs, under ingest (every {every} s)",
                      live)
        print(f"  ({live_s} s stored beside them in {time.perf_counter() - a:.0f} s"
              f"{'; every held window equal to a fresh read' if check else ''})", flush=True)
    if ingest_s:
        ingest_beside_pass(cluster, nodes, now, ingest_s)


def _print_passes(what: str, took: list[dict[str, float]]) -> None:
    if not took:
        return
    print(f"{what}:", flush=True)
    for key in ("load", "detect", "reconcile", "total"):
        vals = [tk[key] * 1000 for tk in took]
        print(f"  {key:<9} p50 {pct(vals, 0.5):7.0f} ms  max {max(vals):7.0f} ms  ({len(vals)} passes)", flush=True)


def _check_held(cluster: Any, now: float) -> None:
    """The held window is the one a fresh read of the database gives (the rows, in any order)."""
    import numpy as np

    from dashboard.diagnosis import held
    from dashboard.diagnosis.loader import load_window

    def rows(w: Any, name: str) -> list[tuple[Any, ...]]:
        t = getattr(w, name)
        cols = [np.nan_to_num(t.num[c], nan=-1e300) for c in t.num]
        order = np.lexsort(cols[::-1]) if len(t) else np.empty(0, dtype=int)
        return sorted(zip(*(c[order].tolist() for c in cols), *(map(repr, t.obj[c][order]) for c in t.obj),
                          strict=True))

    kept = load_window(cluster, now, [])
    keep = dict(held._series)
    held.forget()
    fresh = load_window(cluster, now, [])
    for name in ("gpus", "ports", "probes", "steps"):
        assert rows(kept, name) == rows(fresh, name), f"held {name} differ from a fresh read at {now}"
    held._series.clear()
    held._series.update(keep)


def ingest_beside_pass(cluster: Any, nodes: int, now: float, seconds: int) -> None:
    """Does a pass delay ingest? The same pre-validated batches stored one by one (the ingest writer, as a request
    does) with no pass running, with passes in a thread of this process (the embedded server before: the pass held
    the GIL beside ingest), and with passes in the pass's own process (dashboard.diagnosis.offload, the embedded
    default now). Prints the store latency p50 / p99 of each; the ratio to "none" is the delay a pass causes."""
    import threading

    from clusterdx import wire
    from dashboard.diagnosis import offload
    from dashboard.diagnosis.tasks import detect, thresholds
    from dashboard.ingest.writer import store_batch

    scenario, _ = scenario_for(None, nodes, 8, 1)
    base: dict[str, float] = {}
    for k, mode in enumerate(("none", "thread", "process")):
        sim = SimCluster(scenario, now + 1000 * (k + 1))
        batches = []
        for i in range(1, seconds + 1):
            for b in sim.tick(now + 1000 * (k + 1) + i):
                b["seq"] = 10_000_000 * (k + 1) + int(time.time()) % 1_000_000 * 4 + i  # fresh: never a duplicate
                batches.append(wire.validate_batch(b))
        stop, passes = threading.Event(), [0]

        def passes_in_thread(stop: threading.Event = stop, passes: list[int] = passes) -> None:
            from django.db import connection as conn

            while not stop.is_set():
                detect(cluster, now, thresholds())
                passes[0] += 1
            conn.close()

        def passes_in_process(stop: threading.Event = stop, passes: list[int] = passes) -> None:
            while not stop.is_set():
                offload.pool().submit(offload._child_detect, cluster.id, now, thresholds(), []).result()
                passes[0] += 1

        runner = {"thread": passes_in_thread, "process": passes_in_process}.get(mode)
        if mode == "process":
            offload.pool().submit(os.getpid).result()  # started (Django imported) before the clock runs
        worker = threading.Thread(target=runner, daemon=True) if runner else None
        if worker:
            worker.start()
            time.sleep(0.5)
        lat = []
        for b in batches:
            a = time.perf_counter()
            store_batch(cluster, b)
            lat.append(1000 * (time.perf_counter() - a))
        stop.set()
        if worker:
            worker.join(120)
        base.setdefault("p99", pct(lat, 0.99))
        print(f"ingest beside the pass ({mode:<7}): {len(lat)} batches, store p50 {pct(lat, 0.5):6.1f} ms  p99 "
              f"{pct(lat, 0.99):6.1f} ms  (p99 / no pass: {pct(lat, 0.99) / base['p99']:.2f}; {passes[0]} passes "
              "meanwhile)", flush=True)
    offload.shutdown(wait=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="*", default=[8, 64], help="node counts for every fault kind")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--big", type=int, default=512, help="also run every kind once at this size (0: skip)")
    p.add_argument("--kinds", nargs="+", default=list(KINDS))
    p.add_argument("--interval", type=float, default=1.0, help="seconds between passes (server: DIAGNOSIS_INTERVAL_S)")
    p.add_argument("--healthy-s", type=int, default=3600, help="healthy run length at the smallest size")
    p.add_argument("--healthy-sizes", type=int, nargs="*", default=[8, 64])
    p.add_argument("--db-pass", type=int, nargs="*", default=[],
                   help="time the database-backed pass at these many nodes (e.g. 512 2048; the backend: DATABASE_URL)")
    p.add_argument("--db-seconds", type=int, default=22)
    p.add_argument("--db-passes", type=int, default=20, help="passes timed per size (p50 / p99)")
    p.add_argument("--db-keep", action="store_true", help="store once into a kept cluster and reuse it")
    p.add_argument("--db-profile", action="store_true", help="print a cProfile of one pass first")
    p.add_argument("--db-live-s", type=int, default=0,
                   help="then store this many more seconds with a pass every --db-every simulated seconds")
    p.add_argument("--db-every", type=int, default=5, help="simulated seconds between passes under --db-live-s")
    p.add_argument("--db-check", action="store_true", help="compare each --db-live-s window with a fresh read")
    p.add_argument("--db-ingest-s", type=int, default=0,
                   help="also store this many seconds of batches beside passes (none / thread / own process)")
    args = p.parse_args()
    t = Thresholds()
    results, healthy = [], []
    started = time.perf_counter()
    plan = [(k, n, s) for n in args.sizes for k in args.kinds for s in range(1, args.seeds + 1)]
    plan += [(k, args.big, 1) for k in args.kinds] if args.big else []
    for kind, nodes, seed in plan:
        scenario, seconds = scenario_for(kind, nodes, 8, seed)
        results.append(run_case(scenario, seconds, args.interval, t, kind))
    for i, nodes in enumerate(args.healthy_sizes):
        scenario, _ = scenario_for(None, nodes, 8, 11 + i)
        seconds = args.healthy_s if i == 0 else max(300, args.healthy_s // (nodes // args.healthy_sizes[0]))
        healthy.append(run_case(scenario, seconds, args.interval, t, "healthy"))
    if results or healthy:
        report(results, healthy)
    for size in sorted({r.nodes for r in results}):
        ms = [m for r in results if r.nodes == size for m in r.pass_ms]
        print(f"pure detector pass at {size:4d} nodes: p50 {pct(ms, 0.5):6.1f} ms  p99 {pct(ms, 0.99):6.1f} ms")
    print(f"(pass every {args.interval:g} simulated s; wall time {time.perf_counter() - started:.0f} s)")
    for nodes in args.db_pass:
        db_pass(nodes, args.db_seconds, args.db_keep, args.db_passes, args.db_profile, args.db_ingest_s,
                args.db_live_s, args.db_every, args.db_check)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
