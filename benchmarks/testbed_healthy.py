"""No finding on a healthy cluster for minutes: the two-rack network-namespace testbed, agents only, probed and
diagnosed about once a second.

Builds the testbed of tests/netns (two racks of four namespaces behind two bridges joined by an uplink, a separate
management bridge for the agents' batches; ``tests/netns/netns_testbed.py``), runs a real ``clusterdx agent`` in each
node (full-mesh probes: pings every ``--round-s``, a bulk transfer every ``--bulk-period-s``, to its peers in turn;
its rack and leaf switch in its batches), the real server (uvicorn, embedded SQLite in a temporary directory) on the
management bridge, and the diagnosis pass (``run_pass``, what the schedule runs, findings stored as it stores them)
about once a second for ``--minutes``. Prints progress every 10 s; at the end: passes run, every finding opened
(kind / subject / title), probe RTT (each round's median of its pings) p50 / p99 and bulk bandwidth per pair class
(intra-rack, cross-rack), and each agent's CPU share of one core (user + system time from /proc over the span).
Exit status 1 when any finding was opened. Needs root and what the netns tests need (scripts/system-deps.sh).

    sudo .venv/bin/python benchmarks/testbed_healthy.py [--minutes 5] [--round-s 1] [--bulk-period-s 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "netns")]

from netns_testbed import Testbed, remove_stale, why_not  # noqa: E402


def setup_django() -> None:
    if not os.environ.get("DATABASE_URL"):
        os.environ["CLUSTERDX_DATA_DIR"] = tempfile.mkdtemp(prefix="cdx-bench-testbed-")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def _probes(cluster: Any, since: float) -> Any:
    from dashboard.storage import frames

    return frames.read(frames.PROBES, t0=since, cols=("node_id",), objects=("peer",), cluster_id=cluster.id)


def _hosts(cluster: Any) -> dict[int, str]:
    from dashboard.telemetry.models import Node

    return dict(Node.objects.filter(cluster=cluster).values_list("id", "hostname"))


def bulk_rounds_since(cluster: Any, since: float) -> dict[str, int]:
    probes, hosts = _probes(cluster, since), _hosts(cluster)
    probes = probes.where(~np.isnan(probes["bw_gbps"]))
    out: dict[str, set[int]] = {}
    for node, ts in zip(probes["node_id"].tolist(), probes["ts"].tolist(), strict=True):
        out.setdefault(hosts[node], set()).add(int(ts))
    return {h: len(s) for h, s in out.items()}


def pair_classes(cluster: Any, bed: Testbed, since: float) -> dict[str, dict[str, float]]:
    """Per pair class: rounds, RTT p50 / p99 of the rounds' medians, p99 of the rounds' p99, bulk median / min."""
    rack = {n.name: n.rack for n in bed.nodes}
    probes, hosts = _probes(cluster, since), _hosts(cluster)
    rows = zip([hosts[n] for n in probes["node_id"].tolist()], probes.objs["peer"],
               *(probes[c].tolist() for c in ("rtt_ms", "rtt_p99_ms", "bw_gbps", "lost", "sent")), strict=True)
    got: dict[str, dict[str, list[float]]] = {}
    for host, peer, rtt, p99, bw, lost, sent in rows:
        cls = "intra-rack" if rack.get(host) == rack.get(peer) else "cross-rack"
        c = got.setdefault(cls, {"rtt": [], "p99": [], "bw": [], "lost": [], "sent": []})
        for key, value in (("rtt", rtt), ("p99", p99), ("bw", bw), ("lost", lost), ("sent", sent)):
            if value == value:  # NaN: not measured
                c[key].append(float(value))
    out = {}
    for cls, c in sorted(got.items()):
        out[cls] = {"rounds": len(c["rtt"]), "rtt_p50_ms": pct(c["rtt"], 50), "rtt_p99_ms": pct(c["rtt"], 99),
                    "ping_p99_of_p99_ms": pct(c["p99"], 99), "bw_median_gbps": pct(c["bw"], 50),
                    "bw_p1_gbps": pct(c["bw"], 1), "bulk_transfers": len(c["bw"]),
                    "loss": sum(c["lost"]) / max(1.0, sum(c["sent"]))}
    return out


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def cpu_seconds(procs: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, proc in procs.items():
        try:
            t = proc.cpu_times()
            out[name] = t.user + t.system
        except psutil.NoSuchProcess:
            out[name] = float("nan")
    return out


def run(minutes: float, probes: dict[str, float | int], interval_s: float, progress_s: float = 10.0) -> int:
    reason = why_not()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    setup_django()
    from django.conf import settings

    from dashboard import celery
    from dashboard.diagnosis.detectors import KINDS
    from dashboard.diagnosis.models import Finding
    from dashboard.diagnosis.tasks import run_pass
    from dashboard.telemetry import tokens
    from dashboard.telemetry.models import Cluster
    from tests.server.conftest import AsgiServer

    celery.SCHEDULE.pop("diagnosis", None)  # this script runs the pass; a scheduled one would race it
    remove_stale()
    work = Path(tempfile.mkdtemp(prefix="cdx-testbed-healthy-"))
    bed = Testbed(work, racks=2, per_rack=4)
    server = None
    try:
        bed.build()
        settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, bed.bridge_addr]
        cluster = Cluster.objects.create(name=f"testbed-healthy-{int(time.time())}")
        _, token = tokens.create_token(cluster, "testbed agents")
        server = AsgiServer(bed.bridge_addr).start()
        t0 = time.monotonic()
        bed.start_agents(server.url, token, interval_s=interval_s,
                         probes=probes)
        settled = time.time() + 2
        while not ((r := bulk_rounds_since(cluster, settled)) and len(r) == len(bed.nodes) and min(r.values()) >= 3):
            if time.monotonic() - t0 > 120:
                print("agents did not all report bulk rounds within 120 s:\n" +
                      "\n".join(bed.log(f"{n.name}.agent.log", 600) for n in bed.nodes), file=sys.stderr)
                return 2
            time.sleep(0.5)
        settings = dict(line.split(" = ") for line in (work / "node-a.agent.toml").read_text().splitlines()
                        if line.startswith(("round_s", "bulk_bytes", "bulk_period_s")))
        print(f"8 agents up, warm-up {time.monotonic() - t0:.1f} s; watching for {minutes:g} min (probes {settings}, "
              f"batches every {interval_s:g} s)",
              flush=True)
        procs = {n.name: psutil.Process(n.agent.pid) for n in bed.nodes if n.agent is not None}
        cpu0, wall0, since = cpu_seconds(procs), time.monotonic(), time.time()
        passes, pass_s, seen = 0, [], {}
        end, next_progress = wall0 + minutes * 60, wall0 + progress_s
        while time.monotonic() < end:
            started = time.monotonic()
            result = run_pass(cluster)
            pass_s.append(time.monotonic() - started)
            passes += 1
            for d in result.detections:
                seen.setdefault(d.key, (round(time.time() - since, 1), d.title))
            if time.monotonic() >= next_progress:
                next_progress += progress_s
                print(f"  {time.monotonic() - wall0:5.0f} s: {passes} passes, detections seen {len(seen)}"
                      f"{' ' + str(sorted(seen)) if seen else ''}", flush=True)
            time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
        wall = time.monotonic() - wall0
        cpu1 = cpu_seconds(procs)
        opened = list(Finding.objects.filter(cluster=cluster).values_list("kind", "subject", "title", "opened_at"))
        print(f"\npasses: {passes} in {wall:.0f} s (pass p50 {np.percentile(pass_s, 50) * 1000:.0f} ms, "
              f"p99 {np.percentile(pass_s, 99) * 1000:.0f} ms); kinds checked: {len(KINDS)}")
        print(f"findings opened: {len(opened)}")
        for kind, subject, title, at in opened:
            print(f"  {kind} {subject}: {title} (opened {at:%H:%M:%S})")
        for key, (at, title) in sorted(seen.items()):
            print(f"  detection {key} first at {at} s: {title}")
        print("probes over the span (RTT: each round's median of its pings):")
        for cls, c in pair_classes(cluster, bed, since).items():
            print(f"  {cls}: {c['rounds']} rounds, RTT p50 {c['rtt_p50_ms']:.3f} ms, p99 {c['rtt_p99_ms']:.3f} ms "
                  f"(worst pings: p99 of the rounds' p99 {c['ping_p99_of_p99_ms']:.3f} ms), loss {c['loss']:.4f}; "
                  f"bulk {c['bulk_transfers']} transfers, median {c['bw_median_gbps']:.3f} Gb/s, "
                  f"p1 {c['bw_p1_gbps']:.3f} Gb/s")
        shares = {n: (cpu1[n] - cpu0[n]) / wall for n in procs}
        print("agent CPU share of one core: " + ", ".join(f"{n} {s:.2%}" for n, s in shares.items()) +
              f" (mean {np.nanmean(list(shares.values())):.2%}); load average {os.getloadavg()[0]:.1f}")
        return 1 if opened else 0
    finally:
        bed.close()
        if server is not None:
            server.stop()
        left = bed.leftovers()
        if left:
            print(f"left behind: {left}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--round-s", type=float, help="probe round period (default: the testbed's, 1 s)")
    p.add_argument("--bulk-period-s", type=float, help="one bulk transfer per node this often (default: the "
                   "testbed's, 3 s at two racks)")
    p.add_argument("--bulk-bytes", type=int, help="size of each bulk transfer (default: the testbed's, 4 MiB)")
    # Under the probe round: the probes source reports only its newest finished round at each sample, so sampling
    # once a second beside 1 s rounds drops some rounds for good, and always the same kind (the longer bulk ones).
    p.add_argument("--interval-s", type=float, default=0.5, help="agent sample interval")
    args = p.parse_args(argv)
    probes = {k: v for k in ("round_s", "bulk_period_s", "bulk_bytes") if (v := getattr(args, k)) is not None}
    return run(args.minutes, probes, args.interval_s)


if __name__ == "__main__":
    sys.exit(main())
