"""Ingest benchmark: N simulated nodes (8 GPUs each, 1 Hz) post to a real server; a browser-like websocket watches.

Prints accepted GPU samples/s (and the ratio to the offered load), ingest latency p50/p99, sample-to-browser
latency p50/p99 (sample timestamp -> websocket frame received) and the server's CPU use.

    python benchmarks/ingest.py --nodes 64 --seconds 30                  # embedded default (SQLite)
    python benchmarks/ingest.py --nodes 512 --seconds 30 --backend pg    # PostgreSQL + Redis on 127.0.0.1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
from websockets.sync.client import connect

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collectors.sim.model import SimCluster  # noqa: E402
from collectors.sim.scenario import parse  # noqa: E402
from collectors.sim.sender import Sender, wait_for_server  # noqa: E402

PG_URL = os.environ.get("CLUSTERDX_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/clusterdx_bench")
REDIS_URL = os.environ.get("CLUSTERDX_TEST_REDIS_URL", "redis://127.0.0.1:6379/13")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def server_env(backend: str, data_dir: str) -> dict[str, str]:
    env = {**os.environ, "CLUSTERDX_DATA_DIR": data_dir, "DJANGO_SETTINGS_MODULE": "dashboard.settings"}
    env.pop("DATABASE_URL", None)
    env.pop("REDIS_URL", None)
    if backend == "pg":
        env.update(DATABASE_URL=PG_URL, REDIS_URL=REDIS_URL, CLUSTERDX_REDIS_PREFIX=f"bench{os.getpid()}")
    return env


def reset_pg() -> None:
    import psycopg

    base, name = PG_URL.rsplit("/", 1)
    with psycopg.connect(base + "/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def manage(env: dict[str, str], *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "clusterdx", *args], env=env, cwd=ROOT, capture_output=True,
                         text=True, check=True)
    return out.stdout


def login_cookie(base: str, user: str, password: str) -> str:
    with httpx.Client(base_url=base) as client:
        client.get("/login/")
        csrf = client.cookies["csrftoken"]
        r = client.post("/login/", data={"username": user, "password": password, "csrfmiddlewaretoken": csrf},
                        headers={"Referer": base + "/login/"})
        assert r.status_code in (200, 302), r.status_code
        return "; ".join(f"{k}={v}" for k, v in client.cookies.items())


def watch(base: str, cookie: str, cluster_id: int, stop: threading.Event, lat: list[float]) -> None:
    port = base.rsplit(":", 1)[1]
    with connect(f"ws://127.0.0.1:{port}/ws/live/?cluster={cluster_id}",
                 additional_headers={"Cookie": cookie, "Origin": base}, max_size=2**26) as ws:
        ws.recv(timeout=10)  # snapshot
        while not stop.is_set():
            try:
                frame = json.loads(ws.recv(timeout=1))
            except TimeoutError:
                continue
            now = time.time()
            lat.extend(now - row[2] for row in frame.get("gpus", []))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--backend", choices=["embedded", "pg"], default="embedded")
    p.add_argument("--workers", type=int, default=1, help="ASGI workers (pg backend only)")
    p.add_argument("--threads", type=int, default=32, help="sender threads")
    args = p.parse_args()

    data_dir = tempfile.mkdtemp(prefix="cdx-bench-")
    env = server_env(args.backend, data_dir)
    if args.backend == "pg":
        reset_pg()
    print(f"==> {args.backend}: starting the server (it migrates), creating a user and a token", flush=True)
    port = 18000 + os.getpid() % 1000
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "clusterdx", "server", "--port", str(port),
                               "--workers", str(args.workers)], env=env, cwd=ROOT)
    try:
        if not wait_for_server(base, 60):
            print("server did not start")
            return 1
        token = manage(env, "token", "create", "bench").strip().splitlines()[-1]
        cluster_id = int(subprocess.run(
            [sys.executable, "manage.py", "shell", "-c",
             "from django.contrib.auth.models import User; from dashboard.telemetry.models import Cluster;"
             "User.objects.create_superuser('bench', password='bench-password');"
             "print(Cluster.objects.get(name='bench').id)"],
            env=env, cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        cookie = login_cookie(base, "bench", "bench-password")
        stop, browser_lat = threading.Event(), []
        watcher = threading.Thread(target=watch, args=(base, cookie, cluster_id, stop, browser_lat), daemon=True)
        watcher.start()

        scenario = parse({"cluster": {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "seed": 3}})
        sim = SimCluster(scenario, time.time(), agent_prefix=f"bench{os.getpid()}")
        sender = Sender(base, token, threads=args.threads)
        proc = psutil.Process(server.pid)
        children = proc.children(recursive=True)
        cpu0 = sum(x.cpu_times().user + x.cpu_times().system for x in [proc, *children])
        print(f"==> {args.nodes} nodes x {args.gpus_per_node} GPUs at 1 Hz for {args.seconds:.0f} s", flush=True)
        t0 = time.monotonic()
        next_tick = t0 + 1
        ticks = 0
        while time.monotonic() - t0 < args.seconds:
            time.sleep(max(0.0, next_tick - time.monotonic()))
            next_tick += 1
            sender.send(sim.tick(time.time()))
            ticks += 1
            if ticks % 10 == 0:
                print(f"  {ticks:4d} s  posted {sum(sender.stats.outcomes.values())}", flush=True)
        sender.close()
        wall = time.monotonic() - t0
        cpu1 = sum(x.cpu_times().user + x.cpu_times().system for x in [proc, *children])
        time.sleep(1.0)
        stop.set()
        watcher.join(5)
    finally:
        server.terminate()
        server.wait(20)

    outcomes = sender.stats.outcomes
    accepted = outcomes["accepted"]
    offered = ticks * args.nodes
    lat = sender.stats.latencies_s
    gpu_rate = accepted * args.gpus_per_node / wall
    print()
    print(f"backend={args.backend} nodes={args.nodes} gpus={args.nodes * args.gpus_per_node} workers={args.workers}")
    print(f"batches: offered {offered}, accepted {accepted} ({accepted / max(1, offered):.3f} of offered), "
          f"other outcomes {dict((k, v) for k, v in outcomes.items() if k != 'accepted')}")
    print(f"accepted GPU samples/s: {gpu_rate:,.0f} (offered {args.nodes * args.gpus_per_node:,}/s, "
          f"ratio {gpu_rate / (args.nodes * args.gpus_per_node):.3f})")
    print(f"ingest latency: p50 {1000 * pct(lat, 50):.1f} ms  p90 {1000 * pct(lat, 90):.1f} ms  "
          f"p99 {1000 * pct(lat, 99):.1f} ms  max {1000 * max(lat, default=0):.1f} ms")
    print(f"sample-to-browser: p50 {1000 * pct(browser_lat, 50):.0f} ms  p99 {1000 * pct(browser_lat, 99):.0f} ms "
          f"({len(browser_lat)} GPU rows seen; {len(browser_lat) / max(1, accepted * args.gpus_per_node):.3f} of accepted)")
    print(f"server CPU: {100 * (cpu1 - cpu0) / wall:.0f}% of one core")
    if lat:
        print(f"mean ingest latency {1000 * statistics.mean(lat):.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
