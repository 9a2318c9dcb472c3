"""Browser benchmark: Chromium on the cluster overview, a node page and a 1,024-rank run page, at scale.

For each cluster size it starts a fresh server (embedded SQLite, or PostgreSQL + Redis with ``--backend pg``), feeds
it with the simulator (N nodes x 8 GPUs at 1 Hz, plus one run of ``--ranks`` ranks spread over those nodes), then
drives Debian's chromium through Playwright and prints, per page:

* first paint: from navigation start to the moment the page's main chart element holds plotly data
  (``document.getElementById(ID).data`` non-empty) or, for a chart drawn on a canvas of its own, says it has drawn
  (``data-painted``), measured inside the page; the ids come from the templates at run time (a preference table
  below, else the first ``class="chart"`` element) and are printed;
* snapshot bytes: the first websocket frame (the live snapshot);
* JSON API bytes: every /api/ response the page fetched while loading (uncompressed body);
* main-thread busy share while live frames arrive: Chrome DevTools Protocol ``Performance.getMetrics``
  TaskDuration over a ``--window`` second window (plus the long-task sum from a PerformanceObserver).

Goals (issue 10, at 2,048 nodes): first paint < 2 s, main thread < 50 % busy, snapshot < 2 MB.

    python benchmarks/browser.py                                   # 64 and 512 nodes, embedded
    python benchmarks/browser.py --nodes 64,512,2048 --seconds 30
    python benchmarks/browser.py --nodes 512 --backend pg --pg-url postgresql://postgres@127.0.0.1:5432/cdx_b

The simulator's batches are built ahead (a few distinct seconds per node, as JSON with placeholder timestamps), so
the feeder only substitutes the time and the sequence number and posts: at 2,048 nodes it must not compete with the
server and the browser for the CPU. Everything stops by itself (timeouts on every wait; the server is terminated).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.ingest import manage, pct  # noqa: E402
from collectors.sim.model import SimCluster, node_name  # noqa: E402
from collectors.sim.scenario import parse  # noqa: E402
from collectors.sim.sender import wait_for_server  # noqa: E402

CHROMIUM = os.environ.get("CLUSTERDX_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
TEMPLATES = ROOT / "dashboard" / "web" / "templates" / "web"
USER, PASSWORD = "bench", "bench-password-not-secret"
GOAL_PAINT_S, GOAL_BUSY, GOAL_SNAPSHOT_BYTES = 2.0, 0.50, 2 * 1024 * 1024


@dataclass(frozen=True)
class PageSpec:
    key: str
    path: str  # format fields: cluster, host, run_id
    template: str
    prefer: tuple[str, ...]  # chart element ids, best first; the first one present in the template is waited on


PAGES = (
    PageSpec("overview", "/clusters/{cluster}/", "cluster.html", ("healthmap", "timeline")),
    PageSpec("node", "/clusters/{cluster}/nodes/{host}/", "node.html", ("chart-util", "chart-power", "chart-temp")),
    PageSpec("run", "/runs/{run_id}/", "run.html", ("steps", "rank-heatmap", "heatmap", "ranks")),
)


class _Ids(HTMLParser):
    """Element ids of a template, and which of them are chart containers (class ``chart``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.charts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.append(a["id"] or "")
            if "chart" in (a.get("class") or "").split():
                self.charts.append(a["id"] or "")


def markers(spec: PageSpec, override: list[str] | None = None) -> tuple[list[str], str]:
    """The ids to wait on (the first one is "first paint"), and where they came from."""
    if override:
        return override, "--marker"
    try:
        parser = _Ids()
        parser.feed((TEMPLATES / spec.template).read_text())
    except OSError:
        return list(spec.prefer), "table (template unreadable)"
    chosen = [i for i in spec.prefer if i in parser.ids]
    if chosen:
        return chosen, f"{spec.template} (preferred ids)"
    return parser.charts[:3], f"{spec.template} (first chart elements)"


# -----------------------------------------------------------------------------------------------------------------
# The feed: simulator batches built ahead as JSON text, posted at 1 Hz per node.

_T_BASE = 1_234_560_000.25  # placeholder timestamps: _T_BASE + k for built second k (unique in the JSON text)
_SEQ = 987_654_321


class _Telemetry(SimCluster):
    """The N nodes' own telemetry (GPUs, host, ports, probes, topology): the run is simulated separately."""

    def _advance_steps(self, now: float) -> None:
        pass

    def _beats(self, now: float, n: int) -> list[dict[str, Any]]:
        return []

    def _run_meta(self, now: float, n: int) -> list[dict[str, Any]]:
        return []


def _ts(t: float) -> str:
    return json.dumps(t)


class Feed:
    """Posts every node's batch once a second (uncompressed: gzip would cost the feeder a core at 2,048 nodes)."""

    def __init__(self, base: str, token: str, nodes: int, gpus: int, ranks: int, variants: int = 4,
                 progress: bool = True) -> None:
        self.nodes, self.progress = nodes, progress
        self.netloc = base.split("://", 1)[1]
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self.run_name = f"bench-{ranks}"
        self.run_nodes = max(1, ranks // gpus)
        self.outcomes: Counter[str] = Counter()
        self.latencies: list[float] = []
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.pool = ThreadPoolExecutor(max_workers=min(64, max(16, nodes // 8)), thread_name_prefix="feed")
        self.local = threading.local()
        tele = _Telemetry(parse({"cluster": {"nodes": nodes, "gpus_per_node": gpus, "seed": 3}}), _T_BASE)
        self.templates: list[list[str]] = []  # [variant][node] -> JSON text without its closing brace
        for k in range(variants):
            texts = []
            for b in tele.tick(_T_BASE + k):
                for empty in ("events", "steps", "runs", "beats"):
                    if not b[empty]:
                        del b[empty]
                b["seq"] = _SEQ
                texts.append(json.dumps(b, separators=(",", ":"))[:-1])
            self.templates.append(texts)
        self.run = SimCluster(parse({"cluster": {"nodes": self.run_nodes, "gpus_per_node": gpus, "seed": 4,
                                                 "run": self.run_name, "step_time_s": 0.8}}), time.time())
        self.seq = 0
        self.pending = 0  # posts submitted and not answered: bounded to about one second's worth
        self.thread = threading.Thread(target=self._loop, daemon=True, name="feed")

    def start(self) -> Feed:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(10)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def bodies(self, now: float) -> list[bytes]:
        """This second's batch per node: a template with the time and seq put in, and the run's records merged
        into the batch of the node its ranks sit on (rank host ``node-(i mod N)``)."""
        extra: dict[int, dict[str, list[Any]]] = {}
        for rb in self.run.tick(now):
            host = int(rb["host"].rsplit("-", 1)[1]) % self.nodes
            into = extra.setdefault(host, {"steps": [], "runs": [], "beats": [], "events": []})
            for meta in rb["runs"]:
                meta["host"] = node_name(host)
            for key in into:
                into[key] += rb[key]
        variant = self.templates[self.seq % len(self.templates)]
        old_ts, new_ts = _ts(_T_BASE + self.seq % len(self.templates)), _ts(now)
        out = []
        for n, text in enumerate(variant):
            text = text.replace(old_ts, new_ts).replace(f'"seq":{_SEQ}', f'"seq":{self.seq}', 1)
            more = {k: v for k, v in extra.get(n, {}).items() if v}
            if more:
                text += "," + json.dumps(more, separators=(",", ":"))[1:-1]
            out.append((text + "}").encode())
        self.seq += 1
        return out

    def _loop(self) -> None:
        start = next_t = time.monotonic()
        while not self.stop_event.is_set():
            bodies = self.bodies(time.time())
            with self.lock:
                behind = self.pending > self.nodes
                self.pending += 0 if behind else len(bodies)
                if behind:  # the server is more than a second behind: drop this second, as an agent spools
                    self.outcomes["skipped_feeder_behind"] += len(bodies)
            for body in [] if behind else bodies:
                self.pool.submit(self._post, body)
            next_t += 1.0
            if self.progress and self.seq % 10 == 0:
                print(f"    [feed] {time.monotonic() - start:4.0f} s  {self.summary()}", flush=True)
            self.stop_event.wait(max(0.0, next_t - time.monotonic()))

    def _post(self, body: bytes) -> None:
        t0 = time.perf_counter()
        if self.stop_event.is_set():
            with self.lock:
                self.pending -= 1
            return
        try:
            conn = getattr(self.local, "conn", None) or http.client.HTTPConnection(self.netloc, timeout=30)
            self.local.conn = conn
            conn.request("POST", "/api/v1/ingest", body=body, headers=self.headers)
            response = conn.getresponse()
            payload = response.read()
            outcome = json.loads(payload).get("status", "?") if response.status == 200 else f"http_{response.status}"
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.local.conn = None
            outcome = f"error_{type(exc).__name__}"
        with self.lock:
            self.pending -= 1
            self.outcomes[outcome] += 1
            self.latencies.append(time.perf_counter() - t0)

    def summary(self) -> str:
        with self.lock:
            offered, ok = self.seq * self.nodes, self.outcomes["accepted"]
            lat = list(self.latencies[-5000:])
        other = {k: v for k, v in self.outcomes.items() if k != "accepted"}
        return (f"offered {offered}, accepted {ok} ({ok / max(1, offered):.3f}), ingest p50 "
                f"{1000 * pct(lat, 50):.0f} ms p99 {1000 * pct(lat, 99):.0f} ms{f', other {other}' if other else ''}")


# -----------------------------------------------------------------------------------------------------------------
# The server.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_env(args: argparse.Namespace, data_dir: str) -> dict[str, str]:
    env = {**os.environ, "CLUSTERDX_DATA_DIR": data_dir, "DJANGO_SETTINGS_MODULE": "dashboard.settings"}
    for name in ("DATABASE_URL", "REDIS_URL"):
        env.pop(name, None)
    if args.backend == "pg":
        env.update(DATABASE_URL=args.pg_url, REDIS_URL=args.redis_url, CLUSTERDX_REDIS_PREFIX=f"bb{os.getpid()}")
    return env


def reset_pg(url: str) -> None:
    import psycopg

    base, name = url.rsplit("/", 1)
    with psycopg.connect(base + "/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def shell(env: dict[str, str], code: str) -> str:
    out = subprocess.run([sys.executable, "manage.py", "shell", "-c", code], env=env, cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip().splitlines()[-1]


def create_user(env: dict[str, str], cluster: str) -> None:
    shell(env, "from django.contrib.auth.models import User; from dashboard.telemetry.models import Cluster;"
               f"u = User.objects.create_user({USER!r}, password={PASSWORD!r});"
               f"Cluster.objects.get(name={cluster!r}).members.add(u); print('ok')")


def run_id(env: dict[str, str], cluster: str, name: str) -> int:
    return int(shell(env, "from dashboard.telemetry.models import Run;"
                          f"print(Run.objects.get(cluster__name={cluster!r}, name={name!r}).id)"))


# -----------------------------------------------------------------------------------------------------------------
# The browser side.

# Runs in the page before its own scripts: records, against navigation start (performance.now()), when each marker
# element first holds a plotly trace with data, and sums long tasks (a cross-check of the CDP busy share).
PAINT_JS = """
(() => {
  const ids = %s;
  const out = window.__cdx = {marks: {}, longtask_ms: 0, longtasks: 0};
  try {
    new PerformanceObserver((list) => { for (const e of list.getEntries()) { out.longtask_ms += e.duration;
      out.longtasks += 1; } }).observe({type: "longtask", buffered: true});
  } catch (e) {}
  const filled = (t) => ["x", "y", "z"].some((k) => t && t[k] && t[k].length > 0);
  // A chart drawn on a canvas of its own (the overview's health map) says so in data-painted.
  const painted = (el) => (Array.isArray(el.data) && el.data.some(filled)) || Boolean(el.dataset.painted);
  const until = performance.now() + 120000;
  function poll() {
    for (const id of ids) {
      if (id in out.marks) continue;
      const el = document.getElementById(id);
      if (el && painted(el)) out.marks[id] = performance.now();
    }
    if (Object.keys(out.marks).length < ids.length && performance.now() < until) requestAnimationFrame(poll);
  }
  requestAnimationFrame(poll);
})();
"""


# What the page waited on before its first paint: the document, each script and API call (start and end, ms since
# navigation start), the DOMContentLoaded handlers, and the first frame of the live socket as the page saw it.
TIMELINE_JS = """
(() => {
  const out = [];
  const nav = performance.getEntriesByType("navigation")[0];
  if (nav) {
    out.push([nav.requestStart, nav.responseEnd, "document"]);
    out.push([nav.domInteractive, nav.domContentLoadedEventEnd, "DOMContentLoaded"]);
  }
  for (const r of performance.getEntriesByType("resource")) {
    if (!["script", "fetch", "xmlhttprequest", "link", "css"].includes(r.initiatorType)) continue;
    const path = new URL(r.name).pathname;
    out.push([r.startTime, r.responseEnd, `${r.initiatorType} ${path.length > 60 ? path.slice(0, 57) + "..." : path}`]);
  }
  for (const [id, t] of Object.entries((window.__cdx || {}).marks || {})) out.push([t, t, `painted #${id}`]);
  for (const m of performance.getEntriesByType("mark")) out.push([m.startTime, m.startTime, `mark ${m.name}`]);
  return out.sort((a, b) => a[0] - b[0]);
})()
"""


@dataclass
class Load:
    page: str
    marker: str | None
    paint_ms: float | None
    marks: dict[str, float]
    snapshot_bytes: int | None
    api_bytes: int
    api_requests: int
    busy: float | None = None  # main-thread busy share over the window
    script: float | None = None  # of which JavaScript
    longtask_ms: float | None = None
    frames: int = 0  # live frames received during the window
    frame_bytes: int = 0
    errors: list[str] = field(default_factory=list)
    hot: list[tuple[str, float]] = field(default_factory=list)  # --profile: (function, self ms) over the window
    hot_load: list[tuple[str, float]] = field(default_factory=list)  # --profile: the same from navigation to paint
    timeline: list[tuple[float, float, str]] = field(default_factory=list)  # (start ms, end ms, what) until paint


def hot_functions(profile: dict[str, Any], top: int = 12) -> list[tuple[str, float]]:
    """Self time per function (name file:line) of a CDP ``Profiler.stop`` profile, largest first: samples times the
    interval after each, summed over the nodes that name the same function."""
    nodes = {n["id"]: n for n in profile["nodes"]}
    self_us: Counter[str] = Counter()
    deltas = profile.get("timeDeltas") or []
    for i, node_id in enumerate(profile.get("samples") or []):
        frame = nodes[node_id]["callFrame"]
        url = frame.get("url", "").rsplit("/", 1)[-1]
        name = f"{frame.get('functionName') or '(anonymous)'} {url}:{frame.get('lineNumber', -1) + 1}" if url \
            else frame.get("functionName") or "(program)"
        self_us[name] += deltas[i + 1] if i + 1 < len(deltas) else 0
    return [(name, us / 1000) for name, us in self_us.most_common(top) if name not in ("(idle)",)]


def sign_in(context: Any, base: str) -> None:
    page = context.new_page()
    page.goto(f"{base}/login/?next=/", timeout=60_000)
    page.fill("input[name=username]", USER)
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_load_state("load", timeout=60_000)
    if "/login/" in page.url:
        raise RuntimeError("could not sign in")
    page.close()


def metrics(cdp: Any) -> dict[str, float]:
    return {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}


def load_page(context: Any, url: str, key: str, ids: list[str], paint_timeout_s: float, window_s: float,
              profile: bool = False) -> Load:
    """One navigation: first paint, snapshot and API bytes; with ``window_s`` also the busy share while live (and with
    ``profile`` a sampling CPU profile of that window: where the busy share goes)."""
    page = context.new_page()
    page.add_init_script(PAINT_JS % json.dumps(ids))
    frames: list[tuple[float, int]] = []  # (monotonic time, bytes), all sockets
    firsts: list[int] = []
    responses: list[Any] = []
    errors: list[str] = []

    def on_socket(ws: Any) -> None:
        seen = [False]

        def on_frame(payload: str | bytes) -> None:
            size = len(payload) if isinstance(payload, bytes) else len(payload.encode())
            frames.append((time.monotonic(), size))
            if not seen[0]:
                seen[0] = True
                firsts.append(size)
        ws.on("framereceived", on_frame)

    page.on("websocket", on_socket)
    page.on("response", lambda r: responses.append(r) if "/api/" in r.url else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)[:200]))
    cdp = context.new_cdp_session(page)
    cdp.send("Performance.enable", {"timeDomain": "timeTicks"})
    if profile:  # where the main thread's time goes before the first paint (the live window is sampled below)
        cdp.send("Profiler.enable")
        cdp.send("Profiler.setSamplingInterval", {"interval": 500})
        cdp.send("Profiler.start")
    page.goto(url, wait_until="commit", timeout=60_000)
    main = ids[0] if ids else None
    paint = None
    if main:
        try:
            page.wait_for_function(f"() => {json.dumps(main)} in ((window.__cdx || {{}}).marks || {{}})",
                                   timeout=paint_timeout_s * 1000, polling=100)
        except Exception as exc:  # a stub page, or one that never draws: reported, not fatal
            errors.append(f"no data in #{main} after {paint_timeout_s:g} s ({type(exc).__name__})")
    hot_load = hot_functions(cdp.send("Profiler.stop")["profile"]) if profile else []
    timeline = [tuple(e) for e in page.evaluate(TIMELINE_JS)]
    page.wait_for_timeout(1000)  # let the first API answers land
    deadline = time.monotonic() + paint_timeout_s
    while not firsts and time.monotonic() < deadline:  # and the snapshot, however late
        page.wait_for_timeout(100)
    if not firsts:
        errors.append(f"no websocket frame within {paint_timeout_s:g} s")
    state = page.evaluate("window.__cdx || {marks: {}}")
    paint = state["marks"].get(main) if main else None
    load = Load(key, main, paint, state["marks"], firsts[0] if firsts else None, 0, 0, errors=errors,
                hot_load=hot_load, timeline=timeline)
    if window_s > 0:
        if profile:
            cdp.send("Profiler.enable")
            cdp.send("Profiler.setSamplingInterval", {"interval": 500})
            cdp.send("Profiler.start")
        m0, lt0, t0 = metrics(cdp), state.get("longtask_ms", 0.0), time.monotonic()
        page.wait_for_timeout(window_s * 1000)
        m1 = metrics(cdp)
        if profile:
            load.hot = hot_functions(cdp.send("Profiler.stop")["profile"])
        elapsed = m1["Timestamp"] - m0["Timestamp"]
        load.busy = (m1["TaskDuration"] - m0["TaskDuration"]) / elapsed
        load.script = (m1["ScriptDuration"] - m0["ScriptDuration"]) / elapsed
        load.longtask_ms = page.evaluate("(window.__cdx || {}).longtask_ms || 0") - lt0
        window = [s for t, s in frames if t >= t0]
        load.frames, load.frame_bytes = len(window), sum(window)
    for r in list(responses):
        try:
            if "json" in (r.headers.get("content-type") or ""):
                load.api_bytes += len(r.body())
                load.api_requests += 1
        except Exception:  # a response whose body is gone (redirect, aborted): not JSON the page used
            pass
    page.close()
    return load


def measure(base: str, where: dict[str, Any], args: argparse.Namespace, overrides: dict[str, list[str]]) -> list[Load]:
    from playwright.sync_api import sync_playwright

    out: list[Load] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            # bypass_csp: the pages forbid eval, which Playwright's wait_for_function uses (the pages' own code is unchanged)
            context = browser.new_context(viewport={"width": 1400, "height": 1100}, bypass_csp=True)
            sign_in(context, base)
            for spec in PAGES:
                ids, source = markers(spec, overrides.get(spec.key))
                url = base + spec.path.format(**where)
                print(f"  {spec.key}: {url}  waiting on #{ids[0] if ids else '(none)'} "
                      f"(also {', '.join('#' + i for i in ids[1:]) or 'nothing'}; from {source})", flush=True)
                for i in range(args.loads):
                    last = i == args.loads - 1
                    load = load_page(context, url, spec.key, ids, args.paint_timeout, args.window if last else 0,
                                     profile=args.profile and last)
                    out.append(load)
                    print(f"    load {i + 1}/{args.loads}: paint {_ms(load.paint_ms)}  snapshot "
                          f"{_mb(load.snapshot_bytes)}  API {_mb(load.api_bytes)} in {load.api_requests} requests"
                          + (f"  busy {100 * load.busy:.0f}% (script {100 * (load.script or 0):.0f}%, long tasks "
                             f"{load.longtask_ms:.0f} ms) over {args.window:g} s with {load.frames} live frames "
                             f"({_mb(load.frame_bytes)})" if load.busy is not None else "")
                          + (f"  other marks {', '.join(f'#{k} {v:.0f} ms' for k, v in load.marks.items() if k != load.marker)}"
                             if len(load.marks) > 1 else "")
                          + (f"  ERRORS {load.errors}" if load.errors else ""), flush=True)
                    if args.timeline:
                        for start, end, what in load.timeline:
                            print(f"        {start:7.0f} -> {end:7.0f} ms  {what}", flush=True)
                    if load.hot_load:
                        print("      hottest before paint (self ms): "
                              + "; ".join(f"{name} {ms:.0f} ms" for name, ms in load.hot_load), flush=True)
        finally:
            browser.close()
    return out


# -----------------------------------------------------------------------------------------------------------------
# One scale, and the report.


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.0f} ms"


def _mb(v: float | None) -> str:
    return "—" if v is None else f"{v / 2**20:.2f} MB"


def one_scale(nodes: int, args: argparse.Namespace, overrides: dict[str, list[str]]) -> dict[str, Any]:
    data_dir = tempfile.mkdtemp(prefix="cdx-browser-bench-")
    env = server_env(args, data_dir)
    if args.backend == "pg":
        reset_pg(args.pg_url)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    print(f"==> {nodes} nodes x {args.gpus_per_node} GPUs ({args.backend}): starting the server on {base}", flush=True)
    server = subprocess.Popen([sys.executable, "-m", "clusterdx", "server", "--port", str(port),
                               "--workers", str(args.workers)], env=env, cwd=ROOT)
    feed = None
    try:
        if not wait_for_server(base, 120):
            raise RuntimeError("the server did not start within 120 s")
        cluster = "bench"
        token = manage(env, "token", "create", cluster).strip().splitlines()[-1].split()[-1]
        create_user(env, cluster)
        t0 = time.monotonic()
        feed = Feed(base, token, nodes, args.gpus_per_node, args.ranks, progress=True)
        print(f"  built {len(feed.templates)} seconds of batches per node in {time.monotonic() - t0:.1f} s; feeding "
              f"{args.seconds:g} s before measuring (run {feed.run_name!r} on {min(nodes, feed.run_nodes)} nodes)",
              flush=True)
        feed.start()
        time.sleep(args.seconds)
        load1, load5, _ = os.getloadavg()
        print(f"  measuring; machine load average {load1:.1f} (5 min {load5:.1f}) on {os.cpu_count()} CPUs: the "
              "server, the feeder and chromium share them, and anything else running skews the times", flush=True)
        where = {"cluster": cluster, "host": node_name(nodes // 2), "run_id": run_id(env, cluster, feed.run_name)}
        loads = measure(base, where, args, overrides)
        ingest = feed.summary()
    finally:
        if feed is not None:
            feed.stop()
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        shutil.rmtree(data_dir, ignore_errors=True)  # the embedded database of a few minutes' feed
    print(f"  ingest while measuring: {ingest}", flush=True)
    return {"nodes": nodes, "ingest": ingest, "loads": [vars(x) for x in loads]}


def rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for spec in PAGES:
        loads = [x for x in result["loads"] if x["page"] == spec.key]
        if not loads:
            continue
        paints = [x["paint_ms"] for x in loads if x["paint_ms"] is not None]
        live = loads[-1]
        out.append({
            "nodes": result["nodes"], "page": spec.key, "marker": live["marker"], "loads": len(loads),
            "painted": len(paints), "paint_p50_ms": pct(paints, 50) if paints else None,
            "paint_max_ms": max(paints) if paints else None,
            "snapshot_bytes": max((x["snapshot_bytes"] or 0 for x in loads), default=0) or None,
            "api_bytes": pct([x["api_bytes"] for x in loads], 50), "busy": live["busy"], "script": live["script"],
            "frames": live["frames"],
        })
    return out


def table(all_rows: list[dict[str, Any]], window_s: float) -> str:
    head = (f"{'nodes':>5}  {'page':<8}  {'waits on':<12}  {'paint p50':>9}  {'paint max':>9}  {'snapshot':>9}  "
            f"{'API JSON':>9}  {'busy':>5}  {'script':>6}  {'frames':>6}  goals (paint/2 s, busy/50%, snapshot/2 MB)")
    lines = [head, "-" * len(head)]
    for r in all_rows:
        ratios = []
        if r["paint_p50_ms"] is not None:
            ratios.append(f"{r['paint_p50_ms'] / 1000 / GOAL_PAINT_S:.2f}")
        else:
            ratios.append("n/a")
        ratios.append("n/a" if r["busy"] is None else f"{r['busy'] / GOAL_BUSY:.2f}")
        ratios.append("n/a" if r["snapshot_bytes"] is None else f"{r['snapshot_bytes'] / GOAL_SNAPSHOT_BYTES:.2f}")
        ok = all(x != "n/a" and float(x) < 1 for x in ratios)
        lines.append(
            f"{r['nodes']:>5}  {r['page']:<8}  {('#' + r['marker']) if r['marker'] else '—':<12}  "
            f"{_s(r['paint_p50_ms']):>9}  {_s(r['paint_max_ms']):>9}  {_mb(r['snapshot_bytes']):>9}  "
            f"{_mb(r['api_bytes']):>9}  {_pct(r['busy']):>5}  {_pct(r['script']):>6}  "
            f"{r['frames'] / window_s:>4.1f}/s  {' '.join(ratios)}  {'met' if ok else 'NOT met'}"
            + (f"  ({r['painted']}/{r['loads']} loads painted)" if r["painted"] < r["loads"] else ""))
    return "\n".join(lines)


def _s(ms: float | None) -> str:
    return "—" if ms is None else f"{ms / 1000:.2f} s"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.0f}%"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="64,512", help="comma-separated cluster sizes (default 64,512)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--ranks", type=int, default=1024, help="ranks of the simulated run (default 1024)")
    p.add_argument("--seconds", type=float, default=30, help="seconds of feed before measuring (history to draw)")
    p.add_argument("--loads", type=int, default=3, help="navigations per page (first paint percentiles)")
    p.add_argument("--window", type=float, default=10, help="seconds of live frames for the busy share")
    p.add_argument("--paint-timeout", type=float, default=30, help="seconds to wait for a page's chart")
    p.add_argument("--marker", action="append", default=[], metavar="PAGE=ID[,ID]",
                   help="override the chart ids a page is waited on, e.g. run=rank-heatmap")
    p.add_argument("--backend", choices=["embedded", "pg"], default="embedded")
    p.add_argument("--pg-url", default=os.environ.get("CLUSTERDX_BENCH_DATABASE_URL",
                                                      "postgresql://postgres@127.0.0.1:5432/clusterdx_browser_bench"),
                   help="PostgreSQL database to DROP and recreate (pg backend)")
    p.add_argument("--redis-url", default=os.environ.get("CLUSTERDX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/14"))
    p.add_argument("--workers", type=int, default=1, help="ASGI workers (pg backend only)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--profile", action="store_true",
                   help="sample the main thread during the busy window and print each page's hottest functions")
    p.add_argument("--timeline", action="store_true",
                   help="print what each load waited on before its first paint (document, scripts, API calls)")
    args = p.parse_args(argv)
    sizes = [int(x) for x in re.split(r"[,\s]+", args.nodes.strip()) if x]
    overrides = {}
    for item in args.marker:
        key, _, ids = item.partition("=")
        if key not in {s.key for s in PAGES} or not ids:
            p.error(f"--marker {item!r}: expected one of {', '.join(s.key for s in PAGES)}=ID[,ID]")
        overrides[key] = ids.split(",")
    results = []
    for n in sizes:
        try:
            results.append(one_scale(n, args, overrides))
        except Exception as exc:  # one scale failing (a server that could not keep up) must not lose the others
            print(f"  {n} nodes FAILED: {type(exc).__name__}: {exc}", flush=True)
            results.append({"nodes": n, "ingest": "", "loads": [], "error": f"{type(exc).__name__}: {exc}"})
    all_rows = [r for res in results for r in rows(res)]
    print()
    print(f"Browser benchmark ({args.backend}; {args.gpus_per_node} GPUs per node, a {args.ranks}-rank run; first "
          f"paint over {args.loads} loads, busy share over {args.window:g} s of live frames)")
    print(table(all_rows, args.window))
    print(f"goals at 2,048 nodes: first paint < {GOAL_PAINT_S:g} s, main thread < {100 * GOAL_BUSY:.0f}% busy, "
          f"snapshot < {GOAL_SNAPSHOT_BYTES // 2**20} MB (ratios < 1 meet them)")
    for res in results:
        print(f"  {res['nodes']:>5} nodes: ingest {res['ingest'] or res.get('error')}")
    for res in results if args.profile else []:
        for load in res["loads"]:
            if load.get("hot"):
                print(f"  {res['nodes']:>5} nodes, {load['page']}: self time over the {args.window:g} s window: "
                      + "; ".join(f"{name} {ms:.0f} ms" for name, ms in load["hot"]))
    if args.json:
        args.json.write_text(json.dumps({"results": results, "rows": all_rows}, indent=1))
    return 0 if all_rows and not any(r.get("error") for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
