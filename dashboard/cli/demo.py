"""``clusterdx demo``: the whole thing on the embedded default — server, a demo user, and a simulated cluster
(4 nodes x 8 GPUs, one run, scripted faults) posting over real HTTP with the real wire format."""

from __future__ import annotations

import argparse
import secrets
import threading
from pathlib import Path

DEFAULT_SCENARIO = Path(__file__).resolve().parents[2] / "collectors" / "sim" / "scenarios" / "demo.toml"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--scenario", type=Path, default=DEFAULT_SCENARIO, help="simulator scenario (TOML)")
    p.add_argument("--nodes", type=int, help="override the scenario's node count")
    p.add_argument("--duration", type=float, default=0, help="stop after this many seconds (0 = run until Ctrl-C)")


def _prepare(scenario_run: str) -> tuple[str, str, int]:
    from django.contrib.auth import get_user_model

    from dashboard.telemetry import tokens
    from dashboard.telemetry.models import Cluster, IngestToken, Membership, Role, Run

    password = secrets.token_urlsafe(9)
    user, _ = get_user_model().objects.get_or_create(username="demo")
    user.set_password(password)
    user.save()
    cluster, _ = Cluster.objects.get_or_create(name="demo")
    Membership.objects.update_or_create(cluster=cluster, user=user, defaults={"role": Role.OWNER})
    IngestToken.objects.filter(cluster=cluster, name="demo-simulator", revoked_at=None).delete()
    _, token = tokens.create_token(cluster, "demo-simulator")
    run, _ = Run.objects.get_or_create(cluster=cluster, name=scenario_run)
    return password, token, run.id


def main(args: argparse.Namespace) -> int:
    from dashboard.cli import migrate, setup_django

    setup_django()
    migrate()
    import time

    import uvicorn

    from collectors.sim.cli import run_simulation
    from collectors.sim.model import SimCluster
    from collectors.sim.scenario import load
    from collectors.sim.sender import Sender, wait_for_server

    scenario = load(args.scenario, nodes=args.nodes)
    password, token, run_id = _prepare(scenario.run)
    base = f"http://{args.host}:{args.port}"
    stop = threading.Event()

    def simulate() -> None:
        if not wait_for_server(base, 60):
            print("!! the server did not come up; the simulator is not running", flush=True)
            return
        print(f"==> simulated cluster: {scenario.nodes} nodes x {scenario.gpus_per_node} GPUs, run "
              f"{scenario.run!r}, {len(scenario.faults)} scripted fault(s)", flush=True)
        print(f"\n    Open {base}/clusters/demo/  and sign in as  demo / {password}"
              f"\n    (the run: {base}/runs/{run_id}/)\n", flush=True)
        sender = Sender(base, token, threads=4)
        try:
            run_simulation(SimCluster(scenario, time.time()), sender, 1.0, args.duration, stop, progress=True)
        finally:
            sender.close()
        if args.duration:
            server.should_exit = True

    print(f"==> starting the server on {base} (embedded: SQLite, in-process live updates)", flush=True)
    config = uvicorn.Config("dashboard.asgi:application", host=args.host, port=args.port, lifespan="on",
                            log_level="warning", ws="websockets-sansio")
    server = uvicorn.Server(config)
    threading.Thread(target=simulate, name="simulator", daemon=True).start()
    try:
        server.run()
    finally:
        stop.set()
    return 0
