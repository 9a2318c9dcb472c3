"""Wire benchmark: microseconds to turn a batch's bytes into a validated batch, the reference path
(``json.loads`` + ``wire.validate_batch``) against the compiled one (``wire.parse_batch``, msgspec types generated
from the same declarations).

Batches are the simulator's: one node of 8 GPUs and 8 ranks (host, port, probes, steps and beats: what a node sends
each second), the same with its run metadata (sent at start and on changes), and one node of 64 GPUs. Prints CPU
p50 / p99 per batch and the ratios; the refused-batch line shows what a bad batch costs (the compiled path hands it
to the reference path, which words the error).

    python benchmarks/wire.py                  # 2000 rounds per case
    python benchmarks/wire.py --rounds 20000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clusterdx import wire  # noqa: E402
from collectors.sim.model import SimCluster  # noqa: E402
from collectors.sim.scenario import parse  # noqa: E402


def sim_batch(gpus: int, with_runs: bool = False) -> bytes:
    """The second tick's batch of a one-node cluster (the first has no finished steps yet); ``with_runs`` adds the
    run metadata the first tick carries (sent at start and on changes, so rare: a large batch, not a typical one)."""
    sim = SimCluster(parse({"cluster": {"nodes": 1, "gpus_per_node": gpus, "seed": 3}}), 1_764_000_000.0)
    first = sim.tick(1_764_000_001.0)[0]
    batch = sim.tick(1_764_000_002.0)[0]
    if with_runs:
        batch["runs"] = first["runs"]
    return json.dumps(batch).encode()


def timed(fn: Callable[[bytes], Any], body: bytes, rounds: int) -> list[float]:
    """CPU microseconds per call, one sample per call (after a warm-up). Thread CPU time, not wall time: on a shared
    machine a preempted call would otherwise count another process's time."""
    for _ in range(min(rounds, 200)):
        fn(body)
    out = []
    clock = time.thread_time_ns
    for _ in range(rounds):
        start = clock()
        fn(body)
        out.append((clock() - start) / 1000)
    return out


def refusing(fn: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def call(body: bytes) -> None:
        try:
            fn(body)
        except ValueError:
            return
        raise AssertionError("the broken batch was accepted")

    return call


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args()

    def reference(body: bytes) -> dict[str, Any]:
        return wire.validate_batch(json.loads(body))

    cases = []
    for name, body in (("8 GPUs + 8 ranks", sim_batch(8)), ("64 GPUs + 64 ranks", sim_batch(64)),
                       ("8 + 8, run metadata", sim_batch(8, with_runs=True))):
        assert json.dumps(wire.parse_batch(body)) == json.dumps(reference(body)), "the two paths disagree"
        cases.append((name, body))
    bad = json.loads(cases[0][1])
    bad["gpus"][7]["power_w"] = "hot"
    cases.append(("8 GPUs, refused", json.dumps(bad).encode()))

    print(f"{'batch':<20} {'bytes':>7} {'path (CPU time)':<22} {'p50 µs':>9} {'p99 µs':>9} {'mean µs':>9}")
    for name, body in cases:
        refused = "refused" in name
        rows = [("json.loads+validate", timed(refusing(reference) if refused else reference, body, args.rounds)),
                ("parse_batch", timed(refusing(wire.parse_batch) if refused else wire.parse_batch, body, args.rounds))]
        if not refused:
            rows.insert(1, ("  json.loads alone", timed(json.loads, body, args.rounds)))
        for label, samples in rows:
            print(f"{name:<20} {len(body):>7} {label:<22} {pct(samples, 50):>9.1f} {pct(samples, 99):>9.1f} "
                  f"{statistics.fmean(samples):>9.1f}")
        old, new = statistics.fmean(rows[0][1]), statistics.fmean(rows[-1][1])
        print(f"{name:<20} {'':>7} {'ratio old/new (mean)':<22} {old / new:>9.2f}x   "
              f"p50 {pct(rows[0][1], 50) / pct(rows[-1][1], 50):.2f}x\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
