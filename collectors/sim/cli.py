"""``clusterdx simulate``: a simulated cluster (N nodes x G GPUs, one DDP run) posting to a server in real time."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

from collectors.sim.model import SimCluster
from collectors.sim.scenario import FAULT_KINDS, ScenarioError, load
from collectors.sim.sender import Sender, wait_for_server


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default="http://127.0.0.1:8000", help="server base URL")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--token", help="ingest token (visible in ps; prefer --token-file)")
    tok.add_argument("--token-file", type=Path, help="file holding the ingest token")
    p.add_argument("--scenario", type=Path, help="TOML scenario file (faults to inject); see --list-faults")
    p.add_argument("--nodes", type=int, help="override [cluster] nodes")
    p.add_argument("--gpus-per-node", type=int, help="override [cluster] gpus_per_node")
    p.add_argument("--seed", type=int, help="override [cluster] seed")
    p.add_argument("--run", help="override [cluster] run name")
    p.add_argument("--duration", type=float, default=0, help="seconds to run (0 = until interrupted)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between samples per node")
    p.add_argument("--send-interval", type=float, default=0.0,
                   help="post each node's samples at most every S seconds (default: every sample, or as the server asks)")
    p.add_argument("--list-faults", action="store_true", help="print the fault kinds and exit")


def run_simulation(sim: SimCluster, sender: Sender, interval: float, duration: float,
                   stop: threading.Event | None = None, progress: bool = True) -> None:
    stop = stop or threading.Event()
    start = time.time()
    next_tick = time.monotonic() + interval
    ticks = 0
    while not stop.is_set() and (duration <= 0 or time.time() - start < duration):
        time.sleep(max(0.0, next_tick - time.monotonic()))
        next_tick += interval  # drift-free: the schedule, not the work, sets the pace
        sender.send(sim.tick(time.time()))
        ticks += 1
        if progress and ticks % 10 == 0:
            o = sender.stats.outcomes
            print(f"  t={time.time() - start:5.0f}s step {sim.step:6d}  accepted {o['accepted']}"
                  f"  failed {sum(v for k, v in o.items() if k not in ('accepted', 'duplicate', 'renumbered'))}", flush=True)


def main(args: argparse.Namespace) -> int:
    if args.list_faults:
        for kind, (target, what) in FAULT_KINDS.items():
            print(f"{kind:<22} [{target}] {what}")
        return 0
    token = args.token or (args.token_file.read_text().strip() if args.token_file else None)
    if not token:
        print("error: give --token-file (or --token); create one with `clusterdx token create CLUSTER`", file=sys.stderr)
        return 2
    try:
        scenario = load(args.scenario, nodes=args.nodes, gpus_per_node=args.gpus_per_node, seed=args.seed, run=args.run)
    except (ScenarioError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not wait_for_server(args.server, 30):
        print(f"error: no clusterdx server answers at {args.server}", file=sys.stderr)
        return 1
    print(f"==> simulating {scenario.nodes} nodes x {scenario.gpus_per_node} GPUs, run {scenario.run!r}, "
          f"{len(scenario.faults)} fault(s), posting to {args.server}", flush=True)
    sender = Sender(args.server, token, threads=min(32, max(4, scenario.nodes // 8)), send_interval_s=args.send_interval)
    try:
        run_simulation(SimCluster(scenario, time.time()), sender, args.interval, args.duration)
    finally:
        sender.close()
    return 0
