"""Ingest benchmark: N simulated nodes (8 GPUs, 8 ranks, host, ports, probes each) sample at 1 Hz and post to a real
server at the send interval it advertises; a browser-like websocket client watches the cluster.

The simulator's batches are built and gzip-compressed before the run (one body per node and send interval, records
stamped with the times they will be sent at), so during the run the generator only posts bytes: an async HTTP client
(aiohttp: about 0.15 ms of CPU per post here, httpx's async client 3 ms) over a bounded connection pool. A 429 or 503
is retried after its ``Retry-After``, as the agent does.

Prints the accepted share of the offered node-seconds, ingest latency p50/p99 (from the moment a node's post is due
to its answer), sample-to-browser p50/p99 (sample time -> websocket frame), server CPU per node-second and peak RSS
(psutil, the server's process tree), the generator's own CPU, and the server's ``/metrics`` when it serves one.

An agent keeps its own one-second schedule from the moment it started (collectors/agent/agent.py), so a fleet's
posts arrive spread over each second, not together: node ``n`` samples and posts at its own phase within the second
(:func:`phase`; ``--burst`` sends every node's post at the top of the second instead, the worst case). Ingest latency
counts from the post's own moment, sample-to-browser from the moment its node took the sample.

    python benchmarks/ingest.py                                           # 2,048 nodes x 60 s, embedded (SQLite)
    python benchmarks/ingest.py --nodes 512 --seconds 30 --backend pg     # PostgreSQL + Redis on 127.0.0.1
    python benchmarks/ingest.py --nodes 128 --send-interval 5             # post every 5 s even if not asked to
    python benchmarks/ingest.py --nodes 256 --seconds 20 --profile /tmp/ingest.txt   # where the server's CPU goes

``--profile`` samples the server (py-spy, ``pip install py-spy``) over the run, as collapsed stacks: one
``frame;frame;... count`` a line, for flamegraph tools or a few lines of Python that sum the counts by frame.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil
from websockets.sync.client import connect

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clusterdx import blocks  # noqa: E402
from clusterdx.wire import WIRE_VERSION  # noqa: E402
from collectors.agent.delivery import advised_interval  # noqa: E402
from collectors.sim.model import SimCluster, node_name, node_place  # noqa: E402
from collectors.sim.scenario import parse  # noqa: E402
from collectors.sim.sender import merge, wait_for_server  # noqa: E402

PG_URL = os.environ.get("CLUSTERDX_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/clusterdx_bench")
REDIS_URL = os.environ.get("CLUSTERDX_TEST_REDIS_URL", "redis://127.0.0.1:6379/13")
RETRYABLE = (429, 503)


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
        # The web workers and the Celery worker (the diagnosis pass, rollups, retention) sum their /metrics here.
        metrics_dir = Path(data_dir) / "metrics"
        metrics_dir.mkdir()
        env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
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


def django_shell(env: dict[str, str], code: str) -> str:
    """The last line ``code`` prints, run by ``manage.py shell`` against the server's database and settings."""
    out = subprocess.run([sys.executable, "manage.py", "shell", "-c", code], env=env, cwd=ROOT, check=True,
                         capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def findings_by_kind(env: dict[str, str]) -> dict[str, int]:
    """Findings the server opened on the benchmark's cluster, by kind (open or since resolved)."""
    try:
        return json.loads(django_shell(
            env, "import json; from django.db.models import Count; from dashboard.diagnosis.models import Finding;"
                 "print(json.dumps(dict(Finding.objects.filter(cluster__name='bench').values_list('kind')"
                 ".annotate(n=Count('id')).order_by('kind'))))"))
    except (subprocess.CalledProcessError, ValueError, IndexError) as exc:
        return {f"(could not read: {exc})": 0}


def login_cookie(base: str, user: str, password: str) -> str:
    with httpx.Client(base_url=base) as client:
        client.get("/login/")
        csrf = client.cookies["csrftoken"]
        r = client.post("/login/", data={"username": user, "password": password, "csrfmiddlewaretoken": csrf},
                        headers={"Referer": base + "/login/"})
        assert r.status_code in (200, 302), r.status_code
        return "; ".join(f"{k}={v}" for k, v in client.cookies.items())


def phase(node: int, burst: bool = False) -> float:
    """Where in each second node ``node`` samples and posts: spread evenly over the second (the golden ratio's
    fractions), as agents started at arbitrary moments are; 0 for every node with ``--burst``."""
    return 0.0 if burst else (node * 0.6180339887) % 1.0


def watch(base: str, cookie: str, cluster_id: int, stop: threading.Event, lat: list[float],
          failed: list[str], burst: bool = False) -> None:
    """Like a browser on the cluster's page; ``failed`` gets why it stopped early (a closed socket, a bad frame), so a
    run whose watcher died says so instead of printing the few latencies it saw."""
    port = base.rsplit(":", 1)[1]
    try:
        with connect(f"ws://127.0.0.1:{port}/ws/live/?cluster={cluster_id}",
                     additional_headers={"Cookie": cookie, "Origin": base}, max_size=2**26) as ws:
            ws.recv(timeout=10)  # snapshot
            while not stop.is_set():
                try:
                    frame = json.loads(ws.recv(timeout=1))
                except TimeoutError:
                    continue
                now = time.time()
                # The simulator stamps every node's sample at the top of the second; its node took it at its phase.
                lat.extend(now - row[2] - phase(int(row[0].rsplit("-", 1)[1]), burst) for row in frame.get("gpus", []))
    except Exception as exc:
        failed.append(f"{time.strftime('%H:%M:%S')} {exc!r}")


class ServerWatch(threading.Thread):
    """CPU seconds and peak RSS of the server's process trees (the web server's and, on PostgreSQL, the Celery
    worker's; workers come and go: each pid's last reading counts)."""

    def __init__(self, *pids: int) -> None:
        super().__init__(daemon=True)
        self.roots = [psutil.Process(pid) for pid in pids]
        self.cpu: dict[int, float] = {}
        self.peak_rss = 0
        self.stop = threading.Event()

    def cpu_s(self) -> float:
        self.sample()
        return sum(self.cpu.values())

    def sample(self) -> None:
        rss = 0
        procs = []
        for root in self.roots:
            try:
                procs += [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        for proc in procs:
            try:
                times = proc.cpu_times()
                rss += proc.memory_info().rss
            except psutil.NoSuchProcess:
                continue
            self.cpu[proc.pid] = times.user + times.system
        self.peak_rss = max(self.peak_rss, rss)

    def run(self) -> None:
        while not self.stop.wait(0.5):
            self.sample()


def database_cpu() -> dict[int, float]:
    """CPU seconds of every PostgreSQL and Redis process on this machine, by pid: on the PostgreSQL backend the
    database does part of the work SQLite does inside the embedded server, so the run prints it beside the server's
    own. (A backend that exits during the run takes its seconds with it; the server's connections live as long.)"""
    seconds = {}
    for proc in psutil.process_iter(["name", "cpu_times"]):
        if proc.info["name"] in ("postgres", "redis-server") and proc.info["cpu_times"] is not None:
            seconds[proc.pid] = proc.info["cpu_times"].user + proc.info["cpu_times"].system
    return seconds


@dataclass
class Post:
    node: int
    seconds: int  # node-seconds (1 Hz samples) this body carries
    body: bytes


@dataclass
class Plan:
    start: float  # wall time of the first sample
    period_s: int
    by_second: list[list[Post]]  # the posts due right after each second's sample
    node_seconds: int = 0  # the samples the posts carry, offered
    raw_bytes: int = 0


def build(nodes: int, gpus: int, seconds: int, period_s: int, prefix: str, start: float, wire_version: int = 2) -> Plan:
    """Every node's bodies for the run: ``period_s`` seconds of samples each, node ``n`` offset by ``n % period_s`` so
    the posts spread evenly over the seconds, each numbered after the warm-up's seq 0.

    A node whose last period began within the run samples on until that period ends (up to ``period_s - 1``
    seconds past the run) and posts it then, as its agent would: posted at the run's last second, every node's
    remainder made a burst of up to 3/4 of the fleet in one second, 5 % of all posts, which alone set the p99."""
    sim = SimCluster(parse({"cluster": {"nodes": nodes, "gpus_per_node": gpus, "seed": 3}}), start,
                     agent_prefix=prefix)
    plan = Plan(start, period_s, [[] for _ in range(seconds + period_s - 1)])
    open_periods: list[list[dict[str, Any]]] = [[] for _ in range(nodes)]
    seq = [1] * nodes
    for t in range(seconds + period_s - 1):
        for batch in sim.tick(start + t):
            n = int(batch["host"].rsplit("-", 1)[1])
            if t < seconds or open_periods[n]:  # past the run: only to complete the node's last period
                open_periods[n].append(batch)
        for n in range(nodes):
            if (t + n) % period_s == period_s - 1 and open_periods[n]:
                for part in merge(open_periods[n]):
                    body = {**part, "seq": seq[n]}
                    # Version 2: the agent's own encoder (wire_version = 2 in agent.toml).
                    raw = json.dumps(blocks.encode_batch(body) if wire_version == 2 else body,
                                     separators=(",", ":")).encode()
                    plan.raw_bytes += len(raw)
                    plan.by_second[t].append(Post(n, len(open_periods[n]), gzip.compress(raw, 1)))
                    plan.node_seconds += len(open_periods[n])
                    seq[n] += 1
                open_periods[n] = []
    return plan


@dataclass
class Results:
    outcomes: Counter[str] = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)
    accepted_node_s: int = 0
    retries: int = 0
    resent: int = 0  # posts sent again after the server closed their connection unanswered
    unanswered: int = 0  # posts still waiting for an answer when the drain ended
    adverts: Counter[float] = field(default_factory=Counter)


class Generator:
    def __init__(self, base: str, token: str, connections: int, drain_s: float, burst: bool = False) -> None:
        self.base, self.connections, self.burst = base, connections, burst
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json",
                        "Content-Encoding": "gzip"}
        self.session: aiohttp.ClientSession | None = None
        self.results = Results()
        self.drain_s = drain_s
        self.deadline = math.inf
        self.in_flight = 0

    async def open(self) -> None:
        # The pool bound: as many connections as workers; the rest wait in the generator (their latency counts).
        self.session = aiohttp.ClientSession(
            self.base, connector=aiohttp.TCPConnector(limit=self.connections), headers=self.headers,
            timeout=aiohttp.ClientTimeout(total=None, sock_read=60), skip_auto_headers=("Content-Type",))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def request(self, body: bytes) -> tuple[int, dict[str, Any], str | None]:
        assert self.session is not None
        async with self.session.post("/api/v1/ingest", data=body) as response:
            return response.status, _json(await response.read()), response.headers.get("Retry-After")

    async def post(self, post: Post, due: float) -> int:
        """POST until answered (429 and 503 are retried after Retry-After, until the deadline); returns the status."""
        while True:
            try:
                status, answer, retry_after = await self.request(post.body)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                # A kept-alive connection the server closed as the post went out (uvicorn closes one idle 5 s, as
                # between the warm-up and the run): unanswered, so sent again, as an agent sends its spooled batch
                # again; the (cluster, agent, seq) ledger stores it once.
                if time.time() < self.deadline:
                    self.results.resent += 1
                    continue
                self.results.outcomes[f"error_{type(exc).__name__}"] += 1
                return 0
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                self.results.outcomes[f"error_{type(exc).__name__}"] += 1
                return 0
            advert = advised_interval(answer)
            if advert is not None:
                self.results.adverts[advert] += 1
            if status in RETRYABLE and time.time() < self.deadline:
                self.results.retries += 1
                await asyncio.sleep(float(retry_after or 1))
                continue
            break
        outcome = answer.get("status") if status == 200 else f"http_{status}"
        self.results.outcomes[str(outcome)] += 1
        self.results.latencies_s.append(time.time() - due)
        if outcome == "accepted":
            self.results.accepted_node_s += post.seconds
        return status

    async def run(self, plan: Plan) -> None:
        """Queue each second's posts when due; ``connections`` workers post them, oldest first. The backlog of a
        server that falls behind is a plain queue here (cheap), and what is left at the deadline is counted."""
        self.deadline = plan.start + len(plan.by_second) + self.drain_s  # the run's last periods end past it
        queue: asyncio.Queue[tuple[Post, float]] = asyncio.Queue()
        workers = [asyncio.create_task(self.worker(queue)) for _ in range(self.connections)]
        queued = seen = 0
        for t, posts in enumerate(plan.by_second):
            # Each node's post just after its sample, at the node's phase within the second.
            for post in sorted(posts, key=lambda p: phase(p.node, self.burst)):
                due = plan.start + t + phase(post.node, self.burst) + 0.05
                await asyncio.sleep(max(0.0, due - time.time()))
                queue.put_nowait((post, due))
            queued += len(posts)
            if t % 10 == 9 or t == len(plan.by_second) - 1:
                # The slice's own p99 too: whether the run's tail is a steady backlog or a few stalls.
                recent = self.results.latencies_s[seen:]
                seen = len(self.results.latencies_s)
                print(f"  {t + 1:4d} s  queued {queued}, answered {sum(self.results.outcomes.values())}, "
                      f"accepted {self.results.accepted_node_s} node-s; these 10 s: ingest p50 "
                      f"{1000 * pct(recent, 50):.0f} ms, p99 {1000 * pct(recent, 99):.0f} ms", flush=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(queue.join(), timeout=max(1.0, self.deadline - time.time()))
        # Still unanswered at the deadline: the server fell that far behind. Counted, not left to fail at close.
        self.results.unanswered = queue.qsize() + self.in_flight
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)

    async def worker(self, queue: asyncio.Queue[tuple[Post, float]]) -> None:
        while True:
            post, due = await queue.get()
            self.in_flight += 1
            try:
                await self.post(post, due)
            finally:
                self.in_flight -= 1
                queue.task_done()


def _json(payload: bytes) -> dict[str, Any]:
    try:
        answer = json.loads(payload)
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


async def warm_up(gen: Generator, nodes: int, prefix: str) -> float | None:
    """Seq 0 of every node, just before the run, with one host sample: registers the nodes as agents starting do
    (heard from now, not minutes before their data: the server rightly names a node down that registered and then
    said nothing through the build), opens the connections, and returns the send interval the server then asks for
    (None: it does not advertise)."""
    now = time.time()
    per_rack = parse({"cluster": {"nodes": nodes}}).nodes_per_rack
    heads = [{"v": WIRE_VERSION, "agent_id": f"{prefix}-{node_name(n)}", "seq": 0, "host": node_name(n),
              "sent_at": now, "topology": node_place(n, per_rack), "hosts": [{"ts": now, "cpu_pct": 1.0}]}
             for n in range(nodes)]
    posts = [Post(n, 0, gzip.compress(json.dumps(h).encode(), 1)) for n, h in enumerate(heads)]
    await gen.open()
    await asyncio.gather(*(gen.post(p, now) for p in posts))
    _, answer, _ = await gen.request(posts[0].body)  # a duplicate: the advert as of now
    gen.results = Results()
    return advised_interval(answer)


def scrape(base: str) -> dict[str, float] | str:
    """The server's own counters by name (labels included, histogram buckets too), or why there are none."""
    try:
        r = httpx.get(base + "/metrics", timeout=10)
    except httpx.HTTPError as exc:
        return str(exc)
    if r.status_code != 200:
        return f"HTTP {r.status_code} (none served)"
    return parse_metrics(r.text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus's text format, clusterdx's own series only."""
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in text.splitlines()
                                                      if line.startswith("clusterdx_") and "_created" not in line)}


def print_metrics(got: dict[str, float] | str) -> dict[str, float]:
    """Prints the server's own counters but the histograms' buckets; returns them all, for the goals' summary."""
    if isinstance(got, str):
        print(f"/metrics: {got}")
        return {}
    print("/metrics (server):")
    for name, value in got.items():
        if "_bucket{" not in name:
            print(f"  {name} {value}")
    return got


PASS = "clusterdx_diagnosis_pass_seconds"
PARTS = 'clusterdx_diagnosis_pass_part_seconds_total{part="'  # each part's counter, up to its name


def passes_in_run(before: dict[str, float], after: dict[str, float]) -> tuple[int, float | None, str]:
    """The diagnosis passes that ended during the timed run: how many, their mean and how many took at most 1 s
    (from the histogram's buckets). The passes of the warm-up and the drain are left out: the first, on a cold
    process, reads every rank's metadata and the whole window at once, and is printed with all the others."""
    n = int(after.get(f"{PASS}_count", 0.0) - before.get(f"{PASS}_count", 0.0))
    if not n:
        return 0, None, "no pass ended during the run"
    mean = (after[f"{PASS}_sum"] - before.get(f"{PASS}_sum", 0.0)) / n
    le1 = [k for k in after if k.startswith(f"{PASS}_bucket{{") and 'le="1.0"' in k]
    within = int(after[le1[0]] - before.get(le1[0], 0.0)) if le1 else None
    parts = {k[len(PARTS):-2]: (after[k] - before.get(k, 0.0)) / n for k in after if k.startswith(PARTS)}
    return n, mean, f"{n} ended during the run, mean {mean:.2f} s" + (
        f", {within} of them within 1 s" if within is not None else "") + (
        f" (on average: {', '.join(f'{part} {s:.2f} s' for part, s in parts.items())})" if parts else "")


def goals(accepted: float, ingest_p99_s: float, browser_p99_s: float | None, cpu_ms: float,
          pass_mean_s: float | None, rss_mib: float) -> list[str]:
    """The scale goal's checks (issue 11) against this run's numbers, one line each: met or not, never hidden. The
    diagnosis pass is judged by the mean of the passes that ended during the run (:func:`passes_in_run`)."""
    def line(name: str, value: str, goal: str, ok: bool | None) -> str:
        verdict = "no data" if ok is None else "met" if ok else "NOT met"
        return f"  {name:<28} {value:>12}   goal {goal:<12} {verdict}"

    return [
        line("accepted of offered", f"{accepted:.3f}", "1.000", accepted >= 0.9995),
        line("ingest latency p99", f"{ingest_p99_s:.2f} s", "< 1 s", ingest_p99_s < 1.0),
        line("sample-to-browser p99", "-" if browser_p99_s is None else f"{browser_p99_s:.2f} s", "< 2 s",
             None if browser_p99_s is None else browser_p99_s < 2.0),
        line("server CPU per node-second", f"{cpu_ms:.2f} ms", "<= 0.5 ms", cpu_ms <= 0.5),
        line("diagnosis pass, mean in run", "-" if pass_mean_s is None else f"{pass_mean_s:.2f} s", "< 1 s",
             None if pass_mean_s is None else pass_mean_s < 1.0),
        line("server peak RSS", f"{rss_mib:.0f} MiB", "printed", True),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2048)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--backend", choices=["embedded", "pg"], default="embedded")
    p.add_argument("--workers", type=int, default=1, help="ASGI workers (pg backend only)")
    p.add_argument("--threads", "--connections", dest="connections", type=int, default=64,
                   help="HTTP connections the generator keeps open (its pool bound)")
    p.add_argument("--send-interval", type=float, default=0.0,
                   help="post each node at most every S seconds even if the server asks for less")
    p.add_argument("--drain", type=float, default=15.0, help="seconds after the run to finish retries")
    p.add_argument("--burst", action="store_true",
                   help="every node posts at the top of the second (the worst case), not at its own phase")
    # 2, as the agent sends by default (collectors/agent/config.py); 1 to measure what older agents cost.
    p.add_argument("--pin", choices=["on", "auto", "off"], default="on",
                   help="CLUSTERDX_PIN_CPU for the server: each web worker's threads on a CPU of its own "
                   "(dashboard/affinity.py); on, as compose's one web container (auto would not pin this machine, "
                   "a container that sees all its host's CPUs)")
    p.add_argument("--wire", type=int, choices=[1, 2], default=2,
                   help="the wire version the batches are sent in (2, the agent's default: column blocks, "
                        "clusterdx.blocks; 1: rows)")
    p.add_argument("--profile", metavar="PATH",
                   help="sample the server's process tree with py-spy over the run (pip install py-spy); written "
                        "as collapsed stacks (one 'frame;frame;... count' a line) to PATH")
    p.add_argument("--profile-native", action="store_true",
                   help="with --profile: on-CPU stacks of every thread with native frames (where C code spends it)")
    p.add_argument("--profile-threads", action="store_true",
                   help="with --profile: every thread, idle ones included, one stack root per thread (where each "
                        "thread's wall time goes: the group writer waiting for batches, for the GIL, on the disk)")
    args = p.parse_args()
    seconds = int(args.seconds)

    data_dir = tempfile.mkdtemp(prefix="cdx-bench-")
    env = server_env(args.backend, data_dir)
    env["CLUSTERDX_PIN_CPU"] = args.pin
    if args.backend == "pg":
        reset_pg()
    print(f"==> {args.backend}: starting the server (it migrates), creating a user and a token; log {data_dir}/server.log",
          flush=True)
    port = 18000 + os.getpid() % 1000
    base = f"http://127.0.0.1:{port}"
    log = open(Path(data_dir) / "server.log", "wb")  # noqa: SIM115 - open for the server's whole life
    server = subprocess.Popen([sys.executable, "-m", "clusterdx", "server", "--port", str(port),
                               "--workers", str(args.workers)], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    prefix = f"bench{os.getpid()}"
    stop, browser_lat, watch_failed = threading.Event(), [], []
    me = psutil.Process()
    worker: subprocess.Popen | None = None
    try:
        if not wait_for_server(base, 90):
            print("server did not start")
            return 1
        if args.backend == "pg":
            # As the production stack runs it (docker/compose.yaml): a Celery worker, and its beat, which schedules
            # the diagnosis pass, the rollups and the probe index. Started once the server has migrated.
            worker = subprocess.Popen([sys.executable, "-m", "clusterdx", "worker", "--beat", "--concurrency", "2"],
                                      env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        token = manage(env, "token", "create", "bench").strip().splitlines()[-1]
        cluster_id = int(django_shell(
            env, "from django.contrib.auth.models import User; from dashboard.telemetry.models import Cluster;"
                 "User.objects.create_superuser('bench', password='bench-password');"
                 "print(Cluster.objects.get(name='bench').id)"))
        cookie = login_cookie(base, "bench", "bench-password")
        gen = Generator(base, token, args.connections, args.drain, args.burst)
        loop = asyncio.new_event_loop()
        # The period from the server's own rule for this many nodes; the warm-up just before the run checks it.
        planned = float(django_shell(env, f"from dashboard.ingest.views import _interval; print(_interval({args.nodes}))"))
        period = max(1, math.ceil(max(planned, args.send_interval)))
        print(f"==> the server's rule for {args.nodes} nodes: a post every {planned:g} s; each node posts every "
              f"{period} s", flush=True)

        # Calibrate the build on one second of the whole cluster, then stamp the run to start once it is built.
        # (Three seconds: the first carries every rank's run metadata and costs several times a later one.)
        t_cal = time.perf_counter()
        build(args.nodes, args.gpus_per_node, 3, period, prefix + "x", time.time())
        per_s = (time.perf_counter() - t_cal) / 3
        # Twice the estimate: on a shared machine the build's pace varies, and an overrun makes the first posts late.
        start = math.ceil(time.time() + per_s * seconds * 2 + 10)
        print(f"==> building {args.nodes * seconds:,} node-seconds of batches (~{per_s * seconds:.0f} s)", flush=True)
        plan = build(args.nodes, args.gpus_per_node, seconds, period, prefix, start, args.wire)
        sizes = [len(p.body) for posts in plan.by_second for p in posts]
        late = time.time() - start
        if late > 0:
            print(f"!! the build overran by {late:.1f} s: the first posts are that late", flush=True)

        time.sleep(max(0.0, start - 8 - time.time()))
        advert = loop.run_until_complete(warm_up(gen, args.nodes, prefix))
        print(f"==> warm-up: every node registered; the server asks for a post every "
              f"{advert if advert is not None else '(not advertised)'} s", flush=True)
        if advert is not None and advert > period:
            print(f"!! the server asks for {advert:g} s, more than the {period} s built", flush=True)
        watcher = threading.Thread(target=watch, args=(base, cookie, cluster_id, stop, browser_lat, watch_failed,
                                                      args.burst),
                                   daemon=True)
        watcher.start()
        server_watch = ServerWatch(server.pid, *([worker.pid] if worker else []))
        server_watch.start()
        time.sleep(max(0.0, start - 0.5 - time.time()))  # CPU and wall time count from the run's start
        before = scrape(base)
        spy = None
        if args.profile:
            # --gil: only the thread holding the GIL, so the samples count CPU spent in Python, not threads waiting
            # on a socket; --nonblocking: the server is not paused to read its stacks.
            # --profile-threads: --idle --threads instead, every thread's wall time.
            spy_bin = Path(sys.executable).with_name("py-spy")
            # --profile-native: on-CPU stacks of every thread with their C frames (SQLite, compression), pausing the
            # server to read them (py-spy cannot read native frames without): a costlier, coarser look.
            mode = (["--idle", "--threads", "--nonblocking"] if args.profile_threads else
                    ["--threads", "--native"] if args.profile_native else ["--gil", "--nonblocking"])
            try:
                spy = subprocess.Popen([str(spy_bin) if spy_bin.exists() else "py-spy", "record", "--pid",
                                        str(server.pid), "--subprocesses", *mode, "--rate", "50",
                                        "--format", "raw", "--duration", str(seconds), "-o", args.profile],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            except FileNotFoundError:
                print("!! --profile needs py-spy (pip install py-spy); running without it", flush=True)
        cpu0, me0, db0 = server_watch.cpu_s(), sum(me.cpu_times()[:2]), database_cpu()
        print(f"==> {args.nodes} nodes x {args.gpus_per_node} GPUs at 1 Hz for {seconds} s", flush=True)
        t0 = time.monotonic()
        loop.run_until_complete(gen.run(plan))
        wall = time.monotonic() - t0
        cpu1, me1, db1 = server_watch.cpu_s(), sum(me.cpu_times()[:2]), database_cpu()
        after = scrape(base)
        time.sleep(1.0)
        stop.set()
        watcher.join(5)
        server_watch.stop.set()
        if spy is not None:
            spy.wait(30)
        metrics = print_metrics(scrape(base))
        findings = findings_by_kind(env)
        loop.run_until_complete(gen.close())
    finally:
        for proc in (server, worker):
            if proc is not None:
                proc.terminate()
                proc.wait(30)
        log.close()

    res = gen.results
    offered = plan.node_seconds
    lat = res.latencies_s
    print()
    print(f"backend={args.backend} nodes={args.nodes} gpus={args.nodes * args.gpus_per_node} workers={args.workers} "
          f"send_interval={period}s connections={args.connections} wire={args.wire} pin={args.pin}")
    print(f"bodies: {len(sizes):,}, gzip mean {sum(sizes) / max(1, len(sizes)) / 1024:.1f} KiB "
          f"({plan.raw_bytes / max(1, sum(sizes)):.1f}x compressed)")
    print(f"node-seconds: offered {offered:,}, accepted {res.accepted_node_s:,} "
          f"({res.accepted_node_s / max(1, offered):.3f} of offered); answers {dict(res.outcomes)}; "
          f"{res.retries} retried after 429/503, {res.resent} resent after a dropped connection; "
          f"{res.unanswered} posts unanswered {args.drain:g} s after the end")
    print(f"adverts seen during the run: {dict(res.adverts) or 'none'}"
          + ("  !! the server asked for more than the generator used" if any(a > period for a in res.adverts) else ""))
    print(f"ingest latency (due -> answer): p50 {1000 * pct(lat, 50):.0f} ms  p90 {1000 * pct(lat, 90):.0f} ms  "
          f"p99 {1000 * pct(lat, 99):.0f} ms  max {1000 * max(lat, default=0):.0f} ms")
    print(f"sample-to-browser: p50 {1000 * pct(browser_lat, 50):.0f} ms  p99 {1000 * pct(browser_lat, 99):.0f} ms "
          f"({len(browser_lat):,} GPU rows seen)")
    for why in watch_failed:
        print(f"!! the websocket watcher stopped early: {why}")
    # The simulated cluster is healthy: every finding but cluster_silent (the server itself behind) is a false alarm.
    print(f"findings opened during the run (a healthy cluster): {findings or 'none'}")
    node_s = max(1, res.accepted_node_s)
    print(f"server CPU: {1000 * (cpu1 - cpu0) / node_s:.2f} ms per accepted node-second "
          f"({100 * (cpu1 - cpu0) / wall:.0f}% of one core over {wall:.0f} s); peak RSS "
          f"{server_watch.peak_rss / 2**20:.0f} MiB")
    if args.backend == "pg":
        db_s = sum(t - db0.get(pid, 0.0) for pid, t in db1.items())
        print(f"database CPU (every postgres and redis-server process): {1000 * db_s / node_s:.2f} ms per node-second "
              f"({100 * db_s / wall:.0f}% of one core); server and database together "
              f"{1000 * (cpu1 - cpu0 + db_s) / node_s:.2f} ms")
    print(f"generator CPU: {1000 * (me1 - me0) / node_s:.2f} ms per node-second ({100 * (me1 - me0) / wall:.0f}% of "
          "one core, the websocket watcher included)")
    passes = metrics.get(f"{PASS}_count", 0.0)
    _, run_mean, run_passes = passes_in_run(before if isinstance(before, dict) else {},
                                            after if isinstance(after, dict) else {})
    print(f"diagnosis passes: {run_passes}; all {passes:.0f} since the server started (warm-up and drain "
          f"included), mean {metrics[f'{PASS}_sum'] / passes if passes else float('nan'):.2f} s")
    print(f"goals (issue 11, at 2,048 nodes for 60 s; this run: {args.nodes} nodes for {seconds} s):")
    for text in goals(res.accepted_node_s / max(1, offered), pct(lat, 99),
                      pct(browser_lat, 99) if browser_lat else None, 1000 * (cpu1 - cpu0) / node_s,
                      run_mean, server_watch.peak_rss / 2**20):
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
