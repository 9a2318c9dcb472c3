"""Issue 12 (items 7, 8, 12, 14): body limits before Django, HTTPS settings and the Content-Security-Policy, secrets at
rest, login throttling, and a removed member's websocket. Real uvicorn, raw sockets, real subprocesses and Chromium."""

from __future__ import annotations

import io
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from websockets.exceptions import ConnectionClosed

from tests.server.conftest import AsgiServer, World
from tests.server.test_live import recv_json, ws_connect

ROOT = Path(__file__).resolve().parents[2]
MB = 1024 * 1024


# --- item 7: body limits ahead of Django, and the ingest token before the body -------------------------------------
def _rchar() -> int:
    """Bytes this process has read through read()/recv() so far: the server runs in a thread of this process."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def _open(server: AsgiServer, head: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(head.replace("\n", "\r\n").encode())
    return sock


def _status(sock: socket.socket, timeout: float = 5) -> int | None:
    """The status code of the answer, or None when none came within ``timeout`` (the server is still reading)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return int(data.split()[1]) if data.startswith(b"HTTP/1.1 ") else None


def _push(sock: socket.socket, total: int) -> int:
    """Send up to ``total`` zero bytes; returns how many went out before the peer stopped taking them."""
    block, sent = b"\0" * (256 * 1024), 0
    sock.settimeout(2)
    try:
        while sent < total:
            sent += sock.send(block[: total - sent])
    except OSError:  # reset, broken pipe, or a full window that nobody drains (timeout)
        pass
    return sent


def test_a_huge_declared_body_is_refused_before_it_is_read(asgi_server: AsgiServer) -> None:
    before = _rchar()
    with _open(asgi_server, f"POST /login/ HTTP/1.1\nHost: 127.0.0.1\nContent-Type: application/x-www-form-urlencoded\n"
                            f"Content-Length: {100 * MB}\n\n") as sock:
        assert _status(sock) == 413, "refused from the headers, without waiting for 100 MB"
        pushed = _push(sock, 100 * MB)
    read = _rchar() - before
    assert read < 8 * MB, f"the server read {read} bytes of a refused body (the client pushed {pushed})"
    assert pushed < 50 * MB, "the connection is closed after the refusal, not drained"


def test_a_chunked_body_is_cut_off_at_the_limit(asgi_server: AsgiServer, settings: Any) -> None:
    settings.CLUSTERDX = {**settings.CLUSTERDX, "MAX_BODY_BYTES": 64 * 1024}
    with _open(asgi_server, "POST /login/ HTTP/1.1\nHost: 127.0.0.1\nContent-Type: application/x-www-form-urlencoded\n"
                            "Transfer-Encoding: chunked\n\n") as sock:
        chunk = b"a" * 16 * 1024
        for _ in range(5):  # 80 KiB in five chunks, no terminating chunk: the server must not wait for the rest
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        assert _status(sock) == 413
    # Under the limit, a body still reaches Django (the login form answers, no 413).
    with _open(asgi_server, "POST /login/ HTTP/1.1\nHost: 127.0.0.1\nContent-Type: application/x-www-form-urlencoded\n"
                            "Transfer-Encoding: chunked\nConnection: close\n\n") as sock:
        sock.sendall(b"5\r\na=bcd\r\n0\r\n\r\n")
        assert _status(sock) == 403  # CSRF: the raw socket has no token; the point is that Django got the body


def test_ingest_refuses_a_bad_token_without_reading_the_body(asgi_server: AsgiServer, world: World) -> None:
    head = ("POST /api/v1/ingest HTTP/1.1\nHost: 127.0.0.1\nContent-Type: application/json\n"
            "Authorization: Bearer {token}\nContent-Length: 4000000\n\n")
    with _open(asgi_server, head.format(token="cdx_bogus_0000")) as sock:
        assert _status(sock) == 401, "an unknown token is answered before the 4 MB body"
    # A good token still waits for, reads and judges the body.
    with _open(asgi_server, head.format(token=world.token)) as sock:
        assert _status(sock, timeout=0.5) is None
        sock.sendall(b"x" * 4_000_000)
        assert _status(sock) == 400


# --- item 8: HTTPS settings and the Content-Security-Policy --------------------------------------------------------
def _settings_in_subprocess(tmp_path: Path, env: dict[str, str], code: str) -> dict[str, Any]:
    script = "import django, json, os\nos.environ['DJANGO_SETTINGS_MODULE'] = 'dashboard.settings'\ndjango.setup()\n"
    full_env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "SITE_URL", "DEBUG")}
    full_env.update({"CLUSTERDX_DATA_DIR": str(tmp_path / "data"), **env})
    out = subprocess.run([sys.executable, "-c", script + textwrap.dedent(code)], env=full_env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


HTTPS_PROBE = """
from django.conf import settings as s
from django.test import Client
r = Client().get('/login/', HTTP_X_FORWARDED_PROTO='https')
print(json.dumps({'session': s.SESSION_COOKIE_SECURE, 'csrf': s.CSRF_COOKIE_SECURE, 'hsts': s.SECURE_HSTS_SECONDS,
                  'proxy': s.SECURE_PROXY_SSL_HEADER, 'sts': r.headers.get('Strict-Transport-Security'),
                  'cookie_secure': bool(r.cookies['csrftoken']['secure']), 'csp': r.headers.get('Content-Security-Policy')}))
"""


def test_an_https_site_gets_secure_cookies_hsts_and_the_proxy_header(tmp_path: Path) -> None:
    got = _settings_in_subprocess(tmp_path, {"SITE_URL": "https://dx.example.org", "DEBUG": "false"}, HTTPS_PROBE)
    assert got["session"] is got["csrf"] is got["cookie_secure"] is True
    assert got["hsts"] == 31_536_000 and got["sts"] == "max-age=31536000"
    assert got["proxy"] == ["HTTP_X_FORWARDED_PROTO", "https"]
    assert "script-src 'self';" in got["csp"] and "connect-src 'self' wss://" in got["csp"]
    # Plain HTTP (the embedded default) keeps cookies usable over http and sends no HSTS; the CSP stays.
    plain = _settings_in_subprocess(tmp_path, {}, HTTPS_PROBE)
    assert (plain["session"], plain["csrf"], plain["hsts"], plain["proxy"], plain["sts"]) == (False, False, 0, None, None)
    assert "script-src 'self';" in plain["csp"] and "connect-src 'self' ws://testserver;" in plain["csp"]


def test_every_page_carries_a_csp_without_inline_scripts(client: Any, world: World) -> None:
    client.force_login(world.owner)
    for path in ("/login/", "/", f"/clusters/{world.cluster.name}/", "/doctor/"):
        policy = client.get(path).headers["Content-Security-Policy"]
        directives = dict([*d.strip().split(" ", 1), ""][:2] for d in policy.split(";"))
        assert directives["script-src"].split() == ["'self'"], policy
        assert directives["object-src"] == "'none'" and directives["frame-ancestors"] == "'none'"
        assert directives["base-uri"] == "'none'" and directives["form-action"] == "'self'"
        assert "ws://testserver" in directives["connect-src"]


CSP_PROBE = "window.__csp = []; document.addEventListener('securitypolicyviolation', " \
            "(e) => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI + ' ' + e.sourceFile + ':' + e.lineNumber));"


def _poll(page: Any, predicate: str, timeout: float = 15) -> None:
    """page.wait_for_function evaluates strings with eval(), which the policy forbids: poll with evaluate instead."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(predicate):
        assert time.monotonic() < deadline, f"timed out waiting for {predicate}"
        time.sleep(0.1)


@pytest.mark.browser
def test_the_pages_draw_under_the_csp_without_a_violation(asgi_server: AsgiServer, world: World, page: Any) -> None:
    from dashboard.telemetry.models import Run
    from tests.server.test_diagnosis_pass import Feed

    Feed(world, [{"kind": "straggler", "at_s": 2, "rank": 3, "magnitude": 0.6}], nodes=2).run(15)
    run = Run.objects.get(name="llm")
    # The shared fixture's page bypasses the policy (Playwright's waits use eval); this one enforces it.
    strict = page.context.browser.new_page(viewport={"width": 1400, "height": 1100}, bypass_csp=False)
    errors: list[str] = []
    strict.on("pageerror", lambda exc: errors.append(str(exc)))
    strict.add_init_script(CSP_PROBE)
    name = world.cluster.name
    strict.goto(f"{asgi_server.url}/login/?next=/clusters/{name}/")
    strict.fill("input[name=username]", world.owner.username)
    strict.fill("input[name=password]", world.password)
    strict.click("button[type=submit]")
    strict.wait_for_url(f"{asgi_server.url}/clusters/{name}/")
    for path in (f"/clusters/{name}/", f"/runs/{run.id}/", f"/clusters/{name}/nodes/node-000/", f"/clusters/{name}/findings/",
                 f"/clusters/{name}/links/"):
        response = strict.goto(f"{asgi_server.url}{path}")
        assert response is not None and "script-src 'self';" in response.headers["content-security-policy"]
        _poll(strict, "() => (document.getElementById('live-status') || {}).textContent === 'live'")
        if "/findings/" not in path:  # the charts drew (plotly ran under the policy)
            _poll(strict, "() => document.querySelectorAll('.js-plotly-plot .main-svg').length > 0")
        if "/links/" in path:  # WebGL traces (the link matrix past 64 nodes; pages on the basic or cartesian bundle have none)
            drawn = strict.evaluate("""async () => { const d = document.createElement('div'); document.body.appendChild(d);
                await Plotly.newPlot(d, [{type: 'scattergl', mode: 'lines', x: [1, 2, 3], y: [3, 1, 2]}]);
                return d.querySelectorAll('canvas.gl-canvas-context').length; }""")
            assert drawn == 1, "scattergl drew through WebGL (regl) without 'unsafe-eval'"
        assert strict.evaluate("() => window.__csp") == [], path
        assert errors == [], path


# --- item 12: secrets at rest --------------------------------------------------------------------------------------
def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


FIRST_SEEN = """
import json, os, stat, sys
from pathlib import Path
secret = Path(os.environ['CLUSTERDX_DATA_DIR']) / 'secret_key'
seen = []
def hook(event, args):
    # Runs before every audited call (open, chmod, rename ...): the first mode the key file is ever seen with.
    if not seen and os.path.lexists(secret):
        seen.append(stat.S_IMODE(os.lstat(secret).st_mode))
sys.addaudithook(hook)
os.umask(0o022)
import django
os.environ['DJANGO_SETTINGS_MODULE'] = 'dashboard.settings'
django.setup()
from django.db import connection
with connection.cursor() as c:
    c.execute('CREATE TABLE IF NOT EXISTS t (x int)')
    c.execute('INSERT INTO t VALUES (1)')
print(json.dumps({'first_seen': seen[0] if seen else None}))
"""


def test_the_data_dir_key_and_database_are_private_from_the_first_byte(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY")}
    env["CLUSTERDX_DATA_DIR"] = str(data)
    out = subprocess.run([sys.executable, "-c", FIRST_SEEN], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1])["first_seen"] == 0o600, "the key is never readable by others"
    assert _mode(data) == 0o700
    assert _mode(data / "secret_key") == 0o600
    db_files = sorted(p.name for p in data.glob("clusterdx.sqlite3*"))
    assert "clusterdx.sqlite3" in db_files
    assert {p: oct(_mode(data / p)) for p in db_files} == {p: oct(0o600) for p in db_files}


def test_a_data_dir_left_open_by_an_older_version_is_closed_at_start(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    (data / "secret_key").write_text("k" * 50)
    (data / "clusterdx.sqlite3").write_bytes(b"")
    for p in (data, data / "secret_key", data / "clusterdx.sqlite3"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    _settings_in_subprocess(tmp_path, {}, "print(json.dumps({}))")
    assert (_mode(data), _mode(data / "secret_key"), _mode(data / "clusterdx.sqlite3")) == (0o700, 0o600, 0o600)


def _alerts_add(*args: str, stdin: str | None = None) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    old = sys.stdin
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    try:
        call_command("alerts", "add", "--cluster", "prod-a", "--kind", "pagerduty", *args, stdout=out, stderr=err)
    finally:
        sys.stdin = old
    return out.getvalue(), err.getvalue()


def test_alerts_add_takes_the_secret_from_a_file_or_stdin(world: World, tmp_path: Path) -> None:
    from dashboard.alerts.models import Endpoint

    key_file = tmp_path / "routing-key"
    key_file.write_text("f" * 32 + "\n")
    out, err = _alerts_add("--secret-file", str(key_file))
    assert Endpoint.objects.get().secret == "f" * 32 and "f" * 32 not in out and err == ""
    _alerts_add("--secret-file", "-", stdin="s" * 32 + "\n")
    assert Endpoint.objects.order_by("id").last().secret == "s" * 32
    # The old flag still works, with a warning: the secret was visible in `ps` while the command ran.
    _, err = _alerts_add("--secret", "a" * 32)
    assert "deprecated" in err and "--secret-file" in err and "a" * 32 not in err


# --- item 14: login throttling and a removed member's websocket ----------------------------------------------------
@pytest.fixture
def fresh_throttle(world: World) -> Iterator[None]:
    from dashboard import security

    for ip in ("127.0.0.1", "10.9.8.7"):
        security.reset_login_failures(world.owner.username, ip)
    yield
    for ip in ("127.0.0.1", "10.9.8.7"):
        security.reset_login_failures(world.owner.username, ip)


def test_ten_failed_sign_ins_lock_that_user_from_that_address(client: Any, world: World, fresh_throttle: None) -> None:
    wrong = {"username": world.owner.username, "password": "wrong"}
    for _ in range(10):
        assert client.post("/login/", wrong).status_code == 200  # the form again, with its error
    locked = client.post("/login/", {"username": world.owner.username, "password": world.password})
    assert locked.status_code == 429, "even the right password: the guessing stops here"
    assert "Too many failed sign-ins" in locked.content.decode() and int(locked.headers["Retry-After"]) > 0
    assert "_auth_user_id" not in client.session
    # The same user from another address, and another user from this one, are not locked out.
    other_ip = client.post("/login/", {"username": world.owner.username, "password": world.password},
                           REMOTE_ADDR="10.9.8.7")
    assert other_ip.status_code == 302
    client.logout()
    assert client.post("/login/", {"username": world.teammate.username, "password": world.password}).status_code == 302


def test_a_successful_sign_in_clears_the_failures(client: Any, world: World, fresh_throttle: None) -> None:
    for _ in range(9):
        client.post("/login/", {"username": world.owner.username, "password": "wrong"})
    assert client.post("/login/", {"username": world.owner.username, "password": world.password}).status_code == 302
    client.logout()
    for _ in range(9):
        assert client.post("/login/", {"username": world.owner.username, "password": "wrong"}).status_code == 200
    assert client.post("/login/", {"username": world.owner.username, "password": world.password}).status_code == 302


def test_a_removed_member_loses_the_live_stream(asgi_server: AsgiServer, world: World, client: Any,
                                                settings: Any) -> None:
    from tests.server.conftest import session_cookie

    settings.CLUSTERDX = {**settings.CLUSTERDX, "LIVE_ACCESS_RECHECK_S": 0.2}
    path = f"/ws/live/?cluster={world.cluster.id}"
    with ws_connect(asgi_server, path, session_cookie(client, world.teammate)) as bob, \
            ws_connect(asgi_server, path, session_cookie(client, world.owner)) as alice:
        assert recv_json(bob)["type"] == "snapshot" and recv_json(alice)["type"] == "snapshot"
        world.cluster.members.remove(world.teammate)
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                recv_json(bob, timeout=10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4403
        with pytest.raises(TimeoutError):  # a member keeps hers (no frame comes: nothing is ingested)
            alice.recv(timeout=1)
