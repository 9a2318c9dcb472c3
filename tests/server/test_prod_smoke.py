"""The production stack of docker/compose.yaml, started for real by scripts/prod-smoke.sh: Caddy (TLS) in front of
`clusterdx server --workers 2`, two Celery workers and one beat, as the image's unprivileged user with the checkout
(the image's /app) read-only and only the declared volumes writable, on PostgreSQL + Redis.

Driven like an operator and an agent would: a token and a webhook endpoint from the CLI inside the stack, a simulated
Xid through the real ingest endpoint, an open finding, a signed webhook verified with the Standard Webhooks library;
retention sent by beat and run by a worker; and across the two web workers, one batch stored once and a live update
crossing from one worker's ingest to the other's websocket.

Runs in the suite's PostgreSQL + Redis pass only (the embedded pass has no Redis to scale out on); needs root, as
Docker does, for the system user and the mount namespace.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import pwd
import re
import shutil
import signal
import ssl
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from django.conf import settings
from websockets.sync.client import connect

from tests.alerts.alerts_support import Receiver
from tests.conftest import port_open, service_missing
from tests.server.conftest import make_batch
from tests.server.test_affinity import _cpus_of_threads

# django_db: pytest-django creates the test database only for tests that ask for one. The stack's rows are committed
# by other processes; the module fixture flushes them at the end, as transactional tests do.
pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db]
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "prod-smoke.sh"
PASSWORD = "smoke test passphrase 1"


@dataclass
class Stack:
    state: Path
    proc: subprocess.Popen[bytes]
    plan: dict[str, Any]

    @property
    def pids(self) -> dict[str, int]:
        return {name: int(pid) for name, pid in (line.split() for line in (self.state / "pids").read_text().splitlines())}

    def service(self, name: str) -> dict[str, Any]:
        return next(s for s in self.plan["services"] if s["name"] == name.split(".")[0])

    @property
    def web_url(self) -> str:
        return f"http://127.0.0.1:{self.plan['web_port']}"

    @property
    def https_url(self) -> str:
        return f"https://localhost:{self.service('caddy')['https_port']}"

    @property
    def ca_file(self) -> Path:
        return Path(self.service("caddy")["env"]["XDG_DATA_HOME"]) / "caddy/pki/authorities/local/root.crt"

    def exec(self, *argv: str, stdin: str | None = None) -> str:
        """`docker compose exec web ARGV`: inside the stack, as its user, with web's environment."""
        out = subprocess.run([str(SCRIPT), "exec", str(self.state), *argv], input=stdin, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    def log(self, name: str) -> str:
        return (self.state / "logs" / f"{name}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n" + "\n".join(p.read_text(errors="replace").splitlines()[-25:])
                         for p in sorted((self.state / "logs").glob("*.log")))

    def web_workers(self) -> list[psutil.Process]:
        master = psutil.Process(self.pids["web"])
        return [c for c in master.children() if "spawn_main" in " ".join(c.cmdline())]


def _require_services() -> None:
    if not (settings.DATABASE_URL and settings.REDIS_URL):
        pytest.skip("needs DATABASE_URL (PostgreSQL) and REDIS_URL: the production stack runs in the suite's "
                    "PostgreSQL + Redis pass")
    from urllib.parse import urlsplit

    for url in (settings.DATABASE_URL, settings.REDIS_URL):
        parts = urlsplit(url)
        if not port_open(parts.hostname or "127.0.0.1", parts.port or (5432 if "postgres" in url else 6379)):
            service_missing(f"{parts.scheme} at {parts.hostname}:{parts.port} is not reachable")
    if os.geteuid() != 0:
        service_missing("the production smoke test needs root, as Docker does (a system user, a mount namespace)")
    for tool in ("caddy", "unshare", "setpriv", "nsenter", "useradd"):
        if shutil.which(tool) is None:
            service_missing(f"{tool} is not installed (scripts/system-deps.sh installs caddy; util-linux the rest)")


def wait_until(done: Callable[[], Any], what: str, stack: Stack | None = None, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := done()):
        if stack is not None and stack.proc.poll() is not None:
            raise AssertionError(f"the stack exited while waiting for {what}\n{stack.logs()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{stack.logs() if stack else ''}")
        time.sleep(0.1)
    return result


def seed_retention(state: Path) -> None:
    """An event older than retention, and beat's schedule on its volume saying retention last ran one interval ago: as
    after a beat restart, beat sends it at once (its interval is 10 minutes; a fresh schedule would wait that long)."""
    from celery.beat import PersistentScheduler
    from django.utils import timezone

    from dashboard.celery import SCHEDULE, app
    from dashboard.telemetry.models import Cluster, Event, Node

    cluster = Cluster.objects.create(name="smoke-old")
    node = Node.objects.create(cluster=cluster, hostname="node-old")
    # An event: a table retention deletes row by row on every backend (time-partitioned series drop whole days).
    Event.objects.create(cluster=cluster, node=node, ts=timezone.now() - timedelta(hours=100), kind="xid",
                         severity="critical", code=79)
    volume = state / "volumes" / "data"
    volume.mkdir(parents=True)
    beat = PersistentScheduler(app=app, schedule_filename=str(volume / "celerybeat-schedule"))
    beat.schedule["retention"].last_run_at = app.now() - timedelta(seconds=SCHEDULE["retention"][1] + 1)
    beat.sync()
    beat.close()


@pytest.fixture(scope="module")
def stack(django_db_setup: None, django_db_blocker: Any) -> Iterator[Stack]:
    _require_services()
    db = settings.DATABASES["default"]
    prefix = f"{settings.CHANNEL_LAYERS['default']['CONFIG'].get('prefix', 'cdx')}smoke{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "REDIS_URL": settings.REDIS_URL, "CLUSTERDX_REDIS_PREFIX": prefix,
           "DATABASE_URL": f"postgresql://{db['USER']}:{db['PASSWORD']}@{db['HOST'] or '127.0.0.1'}:"
                           f"{db['PORT'] or 5432}/{db['NAME']}"}
    # Not pytest's tmp_path: the service user must reach the state directory (pytest's are root's, 0700).
    state = Path(tempfile.mkdtemp(prefix="cdx-smoke-"))
    state.chmod(0o711)
    stack: Stack | None = None
    try:
        with django_db_blocker.unblock():
            seed_retention(state)
            proc = subprocess.Popen([str(SCRIPT), "serve", str(state)], env=env, start_new_session=True,
                                    stdout=(state / "serve.log").open("wb"), stderr=subprocess.STDOUT)
            stack = Stack(state, proc, {})
            wait_until(lambda: (state / "ready").exists(), "the stack to start", stack, timeout=120)
            stack.plan = json.loads((state / "plan.json").read_text())
            wait_until(stack.ca_file.is_file, "Caddy's internal CA", stack)
            yield stack
    finally:
        try:
            if stack is not None:
                _stop(stack)
            with django_db_blocker.unblock():
                _forget(prefix)
        finally:
            shutil.rmtree(state, ignore_errors=True)


def _stop(stack: Stack) -> None:
    """SIGTERM to the launcher, which stops every service (TERM, then KILL after 20 s); what it left is killed."""
    if stack.proc.poll() is None:
        os.killpg(stack.proc.pid, signal.SIGTERM)
        try:
            stack.proc.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(stack.proc.pid, signal.SIGKILL)
            stack.proc.wait(10)
    uid = pwd.getpwnam(stack.plan["user"]).pw_uid if stack.plan else None
    for pid in stack.pids.values() if (stack.state / "pids").exists() else ():
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            if psutil.Process(pid).uids().real == uid:  # still ours, not a reused pid
                os.killpg(pid, signal.SIGKILL)  # each service is its own session (setsid): its group id is its pid


def _forget(prefix: str) -> None:
    """Leave the database and Redis as the next module expects them: empty (what transactional tests do)."""
    import redis
    from django.core.management import call_command

    call_command("flush", interactive=False, verbosity=0)
    client = redis.Redis.from_url(settings.REDIS_URL)
    keys = list(client.scan_iter(f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture(scope="module")
def token(stack: Stack) -> str:
    """The operator's path (docs/deploy.md), inside the stack: a cluster, then a token for its agents."""
    stack.exec("clusterdx", "cluster", "create", "smoke", "--interconnect", "eth")
    out = stack.exec("clusterdx", "token", "create", "smoke", "--name", "agents")
    return out.strip().splitlines()[-1]  # the secret is printed once, alone on the last line


@pytest.fixture(scope="module")
def signed_in(stack: Stack, token: str) -> dict[str, Any]:
    """A member (made with the CLI, as docs/deploy.md does) signed in through Caddy's TLS, as a browser: the login
    page, then the form with its CSRF token."""
    from dashboard.telemetry.models import Cluster

    stack.exec("clusterdx", "user", "add", "ops", "--email", "ops@example.com", "--password-file", "-",
               stdin=PASSWORD + "\n")
    stack.exec("clusterdx", "cluster", "add-member", "smoke", "ops", "--role", "member")
    tls = ssl.create_default_context(cafile=str(stack.ca_file))
    with httpx.Client(base_url=stack.https_url, verify=tls, timeout=30) as browser:
        page = browser.get("/login/")
        csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
        signed = browser.post("/login/", data={"username": "ops", "password": PASSWORD, "csrfmiddlewaretoken": csrf},
                              headers={"Referer": f"{stack.https_url}/login/", "Origin": stack.https_url})
        home = browser.get("/")
        plain = httpx.get(f"http://127.0.0.1:{stack.service('caddy')['http_port']}/login/", headers={"Host": "localhost"})
    return {"page": page, "signed": signed, "home": home, "plain": plain,
            "cookie": f"sessionid={signed.cookies['sessionid']}", "cluster": Cluster.objects.get(name="smoke")}


def test_it_runs_the_compose_commands_as_the_image_user_with_the_app_read_only(stack: Stack) -> None:
    uid = pwd.getpwnam(stack.plan["user"]).pw_uid
    assert uid != 0
    pids = stack.pids
    assert sorted(pids) == ["beat", "caddy", "web", "worker.1", "worker.2"]
    for name, pid in pids.items():
        proc, service = psutil.Process(pid), stack.service(name)
        cmdline = proc.cmdline()
        # Python entry points run as `python /venv/bin/NAME ARGS`: the script's name is the command compose gives.
        if cmdline[0].endswith("python") or "python3" in Path(cmdline[0]).name:
            cmdline = [Path(cmdline[1]).name, *cmdline[2:]]
        assert cmdline == service["argv"], name
        assert proc.environ() == service["env"], f"{name}: exactly compose's environment (and the listed overrides)"
        assert proc.cwd() == stack.plan["workdir"]
        for p in [proc, *proc.children(recursive=True)]:
            assert (p.uids().real, p.uids().effective, p.gids().real) == (uid, uid, pwd.getpwuid(uid).pw_gid), name
        mounts = {line.split()[4]: line.split()[5] for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()}
        assert mounts[stack.plan["root"]].split(",")[0] == "ro", f"{name} sees the application directory read-only"
        for volume in service["volumes"]:
            assert mounts[volume["target"]].split(",")[0] == "rw"
    assert len(stack.web_workers()) == 2, "clusterdx server --workers 2"
    if len(os.sched_getaffinity(0)) >= 2:  # each worker's threads on a CPU of its own (dashboard/affinity.py)
        def pinned() -> bool:
            held = [_cpus_of_threads(w.pid) for w in stack.web_workers()]
            return all(len(h) == 1 and len(next(iter(h))) == 1 for h in held) and held[0] != held[1]

        # A worker pins itself as its lifespan starts, and the port answers once the first worker is up: the second
        # may still be starting when the stack is first reached.
        wait_until(pinned, "each web worker's threads on a CPU of its own", stack, timeout=30)
    # Inside the stack, the application directory refuses writes even to root; the data volume takes the user's.
    probe = ["nsenter", "--target", str(pids["web"]), "--mount", "--", "touch", f"{stack.plan['root']}/.smoke-probe"]
    refused = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0 and "Read-only file system" in refused.stderr
    stack.exec("touch", "/var/lib/clusterdx/probe")
    assert (stack.state / "volumes/data/probe").stat().st_uid == uid
    # Beat keeps its schedule on the volume (the image's /app is read-only and root's).
    schedule = list((stack.state / "volumes/data").glob("celerybeat-schedule*"))  # dbm adds suffixes of its own
    assert schedule and all(f.stat().st_uid == uid for f in schedule)
    wait_until(lambda: "Sending due task" in stack.log("beat"), "beat to send its first task", stack)
    assert not (ROOT / "celerybeat-schedule").exists()


def test_a_simulated_xid_opens_a_finding_and_a_signed_webhook_is_delivered(stack: Stack, token: str) -> None:
    from collectors.sim.model import SimCluster
    from collectors.sim.scenario import parse
    from collectors.sim.sender import Sender
    from dashboard.diagnosis.models import Finding

    receiver = Receiver()
    try:
        out = stack.exec("python", "manage.py", "alerts", "add", "--cluster", "smoke", "--kind", "webhook",
                         "--url", receiver.url, "--name", "oncall")
        receiver.secret = re.search(r"secret \(shown once\): (\S+)", out).group(1)
        scenario = parse({"cluster": {"nodes": 2, "gpus_per_node": 2, "run": "smoke-run", "seed": 3},
                          "fault": [{"kind": "xid", "at_s": 2, "node": 1, "gpu": 0, "code": 79}]})
        t0 = time.time() - 8
        sim, sender = SimCluster(scenario, t0), Sender(stack.web_url, token, threads=2)
        try:
            outcomes = [o for s in range(1, 9) for o in sender.send_and_wait(sim.tick(t0 + s))]
        finally:
            sender.close()
        assert set(outcomes) == {"accepted"}, outcomes

        def xid_delivered() -> dict[str, Any] | None:
            for r in receiver.requests:
                data = r.json().get("data") or {}
                findings = data.get("findings") or [data.get("finding") or {}]
                if any(f.get("subject") == "node-001/gpu0" for f in findings):
                    return r.json() | {"verified": r.verified}
            return None

        # Beat's diagnosis pass (every 5 s) opens it, a worker delivers it.
        delivered = wait_until(xid_delivered, "the webhook for the Xid", stack, timeout=60)
        assert delivered["verified"] is True, "signed with the endpoint's secret (Standard Webhooks)"
        finding = Finding.objects.get(cluster__name="smoke", kind="failing_gpu", subject="node-001/gpu0")
        assert finding.state == "open" and "fallen off the bus" in finding.title
    finally:
        receiver.stop()


def test_beat_sends_retention_and_a_worker_runs_it(stack: Stack) -> None:
    from dashboard.telemetry.models import Event

    wait_until(lambda: not Event.objects.filter(cluster__name="smoke-old").exists(), "retention", stack)
    assert "Sending due task retention (dashboard.telemetry.tasks.purge_old_samples)" in stack.log("beat")
    ran = re.compile(r"Task dashboard\.telemetry\.tasks\.purge_old_samples\[[-0-9a-f]+\] succeeded in [0-9.]+s")
    wait_until(lambda: any(ran.search(stack.log(w)) for w in ("worker.1", "worker.2")), "the worker's log", stack)


def test_the_tls_front_sends_hsts_and_secure_cookies(stack: Stack, signed_in: dict[str, Any]) -> None:
    page, signed, home, plain = signed_in["page"], signed_in["signed"], signed_in["home"], signed_in["plain"]
    assert page.status_code == 200 and page.headers["Strict-Transport-Security"].startswith("max-age=31536000")
    assert "secure" in page.headers["Set-Cookie"].lower(), "the CSRF cookie only over TLS"
    assert signed.status_code == 302, signed.text[:500]
    session = next(c for c in signed.headers.get_list("Set-Cookie") if c.startswith("sessionid="))
    assert "secure" in session.lower() and "httponly" in session.lower()
    assert home.status_code == 200 and "smoke" in home.text
    assert plain.status_code in (301, 308) and plain.headers["Location"].startswith("https://localhost")


def _conn_on(stack: Stack, worker: int | None, avoid: int | None = None) -> tuple[http.client.HTTPConnection, int]:
    """A keep-alive connection to the web port that the kernel handed to worker ``worker`` (or to any worker but
    ``avoid``). The workers share one listening socket; which one accepts a connection is the kernel's choice."""
    held = []
    for _ in range(60):
        conn = http.client.HTTPConnection("127.0.0.1", stack.plan["web_port"], timeout=30)
        conn.connect()
        owner = _owner(stack, conn.sock.getsockname()[1])
        if (worker is None and owner != avoid) or owner == worker:
            for other in held:
                other.close()
            return conn, owner
        held.append(conn)  # kept open so the next connect is a new one
    raise AssertionError("60 connections, all on one web worker")


def _owner(stack: Stack, client_port: int) -> int:
    def find() -> int | None:
        for worker in stack.web_workers():
            for c in worker.net_connections(kind="tcp"):
                if c.raddr and c.raddr.port == client_port and c.laddr.port == stack.plan["web_port"]:
                    return worker.pid
        return None

    return wait_until(find, "the connection to be accepted", stack, timeout=10)


def _post(conn: http.client.HTTPConnection, token: str, batch: dict[str, Any]) -> str:
    conn.request("POST", "/api/v1/ingest", json.dumps(batch), {"Authorization": f"Bearer {token}",
                                                              "Content-Type": "application/json"})
    reply = conn.getresponse()
    body = json.loads(reply.read())
    assert reply.status == 200, body
    return str(body["status"])


def test_two_web_workers_store_a_batch_once_and_share_live_updates(stack: Stack, token: str,
                                                                   signed_in: dict[str, Any]) -> None:
    from dashboard.telemetry.models import AgentBatch

    cluster = signed_in["cluster"]
    headers = {"Origin": "https://localhost", "Cookie": signed_in["cookie"]}
    with connect(f"ws://127.0.0.1:{stack.plan['web_port']}/ws/live/?cluster={cluster.id}", additional_headers=headers,
                 open_timeout=30) as ws:
        ws_worker = _owner(stack, ws.socket.getsockname()[1])
        assert json.loads(ws.recv(timeout=30))["type"] == "snapshot"
        other, other_worker = _conn_on(stack, None, avoid=ws_worker)
        same, _ = _conn_on(stack, ws_worker)
        assert {ws_worker, other_worker} == {p.pid for p in stack.web_workers()}

        # Posted to the other worker, the batch reaches this worker's websocket through Redis.
        batch = make_batch(seq=1, host="node-x")
        batch["gpus"][0]["util_gpu_pct"] = 12.25
        assert _post(other, token, batch) == "accepted"
        assert _post(same, token, batch) == "duplicate"

        def seen() -> bool:
            frame = json.loads(ws.recv(timeout=30))
            return any(g[0] == "node-x" and 12.25 in g for g in frame.get("gpus", []))

        wait_until(seen, "the live update on the other worker's websocket", stack, timeout=30)

        # The same batch posted to both workers at once: one accepts it, the other answers duplicate.
        twin = make_batch(seq=2, host="node-x")
        answers: list[str] = []
        threads = [threading.Thread(target=lambda c=c: answers.append(_post(c, token, twin))) for c in (other, same)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(answers) == ["accepted", "duplicate"]
        assert AgentBatch.objects.filter(agent_id="agent-node-x").count() == 2

        # /metrics on either worker counts both workers' batches (a scrape lands on any one of them): 2 accepted and
        # 2 duplicates here, plus whatever the module's other tests posted, the same from both sides.
        seen = [_accepted_counts(conn) for conn in (other, same)]
        assert seen[0] == seen[1], seen
        assert seen[0].get("accepted", 0) >= 2 and seen[0].get("duplicate", 0) >= 2, seen
        other.close()
        same.close()


def _accepted_counts(conn: http.client.HTTPConnection) -> dict[str, float]:
    conn.request("GET", "/metrics", headers={"Host": "localhost"})  # ALLOWED_HOSTS: the TLS name
    reply = conn.getresponse()
    text = reply.read().decode()
    assert reply.status == 200, text[:300]
    pattern = re.compile(r'^clusterdx_ingest_accepted_batches_total\{status="(\w+)"\} (\S+)$', re.M)
    return {m.group(1): float(m.group(2)) for m in pattern.finditer(text)}


def test_a_run_page_on_one_worker_gets_the_steps_posted_to_the_other(stack: Stack, token: str,
                                                                       signed_in: dict[str, Any]) -> None:
    """The publishers build a run's step deltas only while a run page watches it; the watch is in Redis, so the
    worker that stores a batch knows of a page open on the other worker."""
    from dashboard.telemetry.models import Run

    headers = {"Origin": "https://localhost", "Cookie": signed_in["cookie"]}
    first, _ = _conn_on(stack, None)
    assert _post(first, token, {**make_batch(seq=0, host="node-w"), "steps": [
        {"run": "watched-run", "rank": 0, "step": 1, "ts": time.time(), "step_time_s": 1.0}]}) == "accepted"
    first.close()
    run = Run.objects.get(name="watched-run")
    with connect(f"ws://127.0.0.1:{stack.plan['web_port']}/ws/live/?run={run.id}", additional_headers=headers,
                 open_timeout=30) as ws:
        ws_worker = _owner(stack, ws.socket.getsockname()[1])
        assert json.loads(ws.recv(timeout=30))["type"] == "snapshot"
        other, _ = _conn_on(stack, None, avoid=ws_worker)
        assert _post(other, token, {**make_batch(seq=1, host="node-w"), "steps": [
            {"run": "watched-run", "rank": 0, "step": 2, "ts": time.time(), "step_time_s": 1.0}]}) == "accepted"

        def seen() -> bool:
            return any(s[0] == 2 for s in json.loads(ws.recv(timeout=30)).get("steps", []))

        wait_until(seen, "the step posted to the other worker on this worker's run page", stack, timeout=30)
        other.close()
