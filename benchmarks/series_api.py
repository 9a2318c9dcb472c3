"""The node page's series API (``/api/v1/clusters/<c>/nodes/<host>/series``): server time per answer, by section.

The node page cannot draw before this answer arrives, so its time is part of every first paint (issue 10). The
simulator's batches (8 GPUs, 8 ranks, host, ports, probes per node-second) are stored through the real group writer
for ``--minutes``, then ``node_series`` answers ``--repeat`` times for each range; printed: p50 / p95 wall ms of the
whole answer, each section's p50 (GPUs, throttle bands, host, NFS, ports, probes), and the JSON size.

    python benchmarks/series_api.py                        # embedded SQLite in a temporary directory
    python benchmarks/series_api.py --backend pg           # PostgreSQL (CLUSTERDX_BENCH_DATABASE_URL)
    python benchmarks/series_api.py --minutes 30 --ranges 15m,1h
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ingest_inproc import _bodies, _setup, _validate


def _feed(nodes: int, minutes: int) -> Any:
    from dashboard.ingest.writer import clear_caches, store_group
    from dashboard.telemetry.models import Cluster, Node

    cluster = Cluster.objects.create(name=f"series-{time.time_ns()}")
    clear_caches()
    seconds = minutes * 60
    t0 = time.perf_counter()
    for i, bodies in enumerate(_bodies(nodes, seconds, prefix=f"s{time.time_ns()}")):
        outcomes = store_group([(cluster, *_validate(b)) for b in bodies])
        assert all(getattr(o, "status", None) == "accepted" for o in outcomes), outcomes
        if (i + 1) % 300 == 0:
            print(f"  stored {i + 1}/{seconds} s of {nodes} nodes ({time.perf_counter() - t0:.0f} s)", flush=True)
    return Node.objects.filter(cluster=cluster).order_by("hostname").first()


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn(*args)
    return out, (time.perf_counter() - t) * 1000


def measure(node: Any, range_name: str, repeat: int, points: int) -> dict[str, Any]:
    from dashboard.web.pages import node_series as ns
    from dashboard.web.series import RANGES, TimeRange, tiered

    sections = {"gpus": lambda tr: ns.gpu_series(node, tr, None), "throttle": lambda tr: ns.throttle_bands(node, tr, None),
                "host": lambda tr: ns.host_series(node, tr), "nfs": lambda tr: ns.nfs_series(node, tr),
                "ports": lambda tr: ns.port_series(node, tr), "probes": lambda tr: ns.probe_series(node, tr)}
    whole, parts, size = [], {k: [] for k in sections}, 0
    for _ in range(repeat):
        now = time.time()
        tr = TimeRange(now - RANGES[range_name], now, points)
        body, ms = _timed(ns.node_series, node, tr, None)
        whole.append(ms)
        size = len(json.dumps(body, separators=(",", ":")))
        tt = tiered(tr)
        for name, fn in sections.items():
            parts[name].append(_timed(fn, tt)[1])
    return {"range": range_name, "p50_ms": statistics.median(whole),
            "p95_ms": sorted(whole)[max(0, round(0.95 * len(whole)) - 1)], "json_kb": size / 1024,
            "parts_p50_ms": {k: statistics.median(v) for k, v in parts.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["sqlite", "pg"], default="sqlite")
    ap.add_argument("--nodes", type=int, default=2, help="nodes fed (the answer is for one of them)")
    ap.add_argument("--minutes", type=int, default=16, help="minutes of 1 Hz history stored before measuring")
    ap.add_argument("--ranges", default="15m,1h")
    ap.add_argument("--points", type=int, default=1400, help="buckets per series (the page asks its width in px)")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    _setup(args.backend)
    print(f"==> storing {args.minutes} min of {args.nodes} nodes x 8 GPUs at 1 Hz ({args.backend})", flush=True)
    node = _feed(args.nodes, args.minutes)
    print(f"\nnode_series for {node.hostname}, {args.points} points, {args.repeat} answers per range ({args.backend})")
    print(f"{'range':>6}  {'p50':>8}  {'p95':>8}  {'JSON':>8}  sections (p50 ms)")
    for name in args.ranges.split(","):
        r = measure(node, name, args.repeat, args.points)
        parts = ", ".join(f"{k} {v:.0f}" for k, v in r["parts_p50_ms"].items())
        print(f"{name:>6}  {r['p50_ms']:6.0f} ms  {r['p95_ms']:6.0f} ms  {r['json_kb']:5.0f} KB  {parts}")


if __name__ == "__main__":
    main()
