"""benchmarks/ingest.py ends with the scale goal's checks: each one met or not by this run's numbers, never hidden."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_ingest", ROOT / "benchmarks" / "ingest.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _verdicts(lines: list[str]) -> list[str]:
    return [next(v for v in ("NOT met", "no data", "met") if line.endswith(v)) for line in lines]


def test_each_goal_is_judged_by_the_run_numbers() -> None:
    goals = _bench().goals
    assert _verdicts(goals(1.0, 0.4, 1.2, 0.45, 0.8, 300)) == ["met"] * 6
    missed = goals(0.484, 30.45, 31.6, 1.71, 2.47, 632)  # this stop's 2,048-node run
    assert _verdicts(missed) == ["NOT met"] * 5 + ["met"], missed
    assert "0.484" in missed[0] and "30.45 s" in missed[1] and "1.71 ms" in missed[3] and "632 MiB" in missed[5]
    assert _verdicts(goals(0.9991, 0.4, 1.2, 0.45, 0.8, 300))[0] == "NOT met", "0.999 of offered is not all of it"
    assert _verdicts(goals(1.0, 0.4, None, 0.45, None, 300)) == ["met", "met", "no data", "met", "no data", "met"]


def test_the_pass_goal_counts_the_passes_of_the_run_only() -> None:
    """Read from the server's own /metrics text, scraped as the run starts and as it ends: the warm-up's cold first
    pass (3 s here) is not one of the run's; their bucket counts say how many of the run's took at most 1 s."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from dashboard import metrics

    bench = _bench()
    registry = CollectorRegistry()
    hist = Histogram(bench.PASS, "passes", registry=registry, buckets=(0.5, 1.0, 2.5, 5.0))
    assert metrics.DIAGNOSIS_PART_SECONDS._name == bench.PASS.replace("_seconds", "_part_seconds")  # the server's
    parts = Counter(metrics.DIAGNOSIS_PART_SECONDS._name, "parts", ["part"], registry=registry)

    def scraped() -> dict[str, float]:
        return bench.parse_metrics(generate_latest(registry).decode())

    assert bench.passes_in_run({}, scraped()) == (0, None, "no pass ended during the run")
    hist.observe(3.0)  # warm-up
    before = scraped()
    for took in (0.8, 0.9, 1.3):
        hist.observe(took)
        parts.labels("load").inc(took * 0.75)
        parts.labels("detect").inc(took * 0.25)
    n, mean, text = bench.passes_in_run(before, scraped())
    assert (n, round(mean, 3)) == (3, 1.0)
    assert text == ("3 ended during the run, mean 1.00 s, 2 of them within 1 s (on average: load 0.75 s, "
                    "detect 0.25 s)")


def test_the_plan_is_built_in_the_wire_version_asked_for() -> None:
    import gzip
    import json
    import time

    build = _bench().build
    for version in (1, 2):
        plan = build(2, 8, 2, 1, f"v{version}", time.time(), version)
        bodies = [json.loads(gzip.decompress(p.body)) for posts in plan.by_second for p in posts]
        assert bodies and {b["v"] for b in bodies} == {version}
        gpus = [b["gpus"] for b in bodies]
        assert all(isinstance(g, list if version == 1 else dict) for g in gpus)


def test_the_nodes_post_spread_over_the_second_as_a_fleet_does() -> None:
    """Agents keep their own schedule from when they started, so a fleet's posts spread over each second: every tenth
    of a second gets a tenth of 2,048 nodes (within 2 %), each node always at the same phase; --burst puts all at 0."""
    import numpy as np

    phase = _bench().phase
    phases = np.array([phase(n) for n in range(2048)])
    assert ((phases >= 0) & (phases < 1)).all() and phase(7) == phase(7)
    per_tenth = np.bincount((phases * 10).astype(int), minlength=10)
    assert len(per_tenth) == 10 and np.abs(per_tenth - 204.8).max() < 0.02 * 2048, per_tenth
    assert {phase(n, burst=True) for n in range(64)} == {0.0}


def test_the_run_ends_without_a_burst() -> None:
    """Each second carries a period's share of the fleet's posts, each a whole period: a node whose last period began
    in the run samples on and posts it when it ends, not with every other node's at the run's last second."""
    import time

    nodes, seconds, period = 16, 10, 4
    plan = _bench().build(nodes, 1, seconds, period, "end", time.time())
    per_second = [len(posts) for posts in plan.by_second]
    carried = [p.seconds for posts in plan.by_second for p in posts]
    assert sum(carried) == plan.node_seconds >= nodes * seconds
    assert max(per_second) == nodes // period, per_second
    assert set(carried[nodes:]) == {period}, "past each node's first (phase-shortened) post, every post is a period"
    assert len(per_second) == seconds + period - 1 and per_second[-1] > 0
