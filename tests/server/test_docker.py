"""No Docker engine runs here, so check what can be checked: the compose file parses, every command and variable in
it is one the code actually has, and its TLS front (docker/Caddyfile) is held in step with it — and, where Debian's
`caddy` is installed (scripts/system-deps.sh), that Caddyfile is validated and run for real in front of a stand-in web
service: TLS from the internal CA, :80 only redirecting, an 8 MB ingest body and a websocket passing through."""

from __future__ import annotations

import argparse
import hashlib
import http.client
import inspect
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from clusterdx.cli import build_parser
from tests.conftest import free_port, reply_json

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker" / "compose.yaml"
CADDYFILE = ROOT / "docker" / "Caddyfile"
CADDY = shutil.which("caddy")
needs_caddy = pytest.mark.skipif(CADDY is None, reason="caddy is not installed (scripts/system-deps.sh installs it)")
# Variables of the app services read by something other than dashboard/settings.py: uvicorn's trusted proxies.
READ_BY_UVICORN = {"FORWARDED_ALLOW_IPS"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def read_by_code() -> set[str]:
    """Environment variables the server reads (settings use env_* helpers; *_FILE variants come with env_str)."""
    names: set[str] = set()
    for path in (ROOT / "dashboard").rglob("*.py"):
        for name in re.findall(r"env_(?:str|bool|int|float|list)\(\s*\"([A-Z0-9_]+)\"", path.read_text()):
            names |= {name, f"{name}_FILE"}
    return names


def caddy_directives() -> str:
    """The Caddyfile without its comments: what Caddy reads."""
    return "\n".join(line.split("#", 1)[0].rstrip() for line in CADDYFILE.read_text().splitlines())


def caddy_upstream() -> tuple[str, int]:
    (upstream,) = re.findall(r"^\s*reverse_proxy\s+(\S+)\s*$", caddy_directives(), re.M)
    host, port = upstream.rsplit(":", 1)
    return host, int(port)


def test_the_stack_has_every_service(compose: dict) -> None:
    assert set(compose["services"]) == {"postgres", "redis", "web", "worker", "beat", "caddy"}
    for name in ("web", "worker", "beat"):
        assert compose["services"][name]["image"] == "clusterdx/server:latest"


def test_every_variable_is_one_the_settings_read(compose: dict) -> None:
    known = read_by_code()
    for name in ("web", "worker", "beat"):
        env = compose["services"][name]["environment"]
        unknown = set(env) - known - READ_BY_UVICORN
        assert not unknown, f"{name} sets variables nothing reads: {unknown}"
        assert {"DATABASE_URL", "REDIS_URL", "SECRET_KEY_FILE"} <= set(env)
    import uvicorn.config

    assert all(name in inspect.getsource(uvicorn.config) for name in READ_BY_UVICORN)


def test_only_caddy_is_published_and_web_trusts_its_forwarded_headers(compose: dict) -> None:
    services = compose["services"]
    assert {name for name, service in services.items() if service.get("ports")} == {"caddy"}
    assert {"443:443", "80:80"} <= set(services["caddy"]["ports"])
    # Without it uvicorn ignores X-Forwarded-For from Caddy's address: every client would look like Caddy.
    assert services["web"]["environment"]["FORWARDED_ALLOW_IPS"] == "*"


def test_caddy_mounts_the_caddyfile_and_keeps_its_certificates(compose: dict) -> None:
    caddy = compose["services"]["caddy"]
    assert caddy["image"] == "caddy:2"
    assert "./Caddyfile:/etc/caddy/Caddyfile:ro" in caddy["volumes"]
    assert (COMPOSE.parent / "Caddyfile").is_file()
    assert "caddy_data:/data" in [v.split("#")[0].strip() for v in caddy["volumes"]]
    assert "caddy_data" in compose["volumes"]


def test_the_site_is_https_on_the_name_caddy_serves(compose: dict) -> None:
    hostname = compose["services"]["caddy"]["environment"]["CLUSTERDX_HOSTNAME"]
    assert hostname == "${CLUSTERDX_HOSTNAME:-localhost}"
    for name in ("web", "worker", "beat"):
        env = compose["services"][name]["environment"]
        assert env["SITE_URL"] == env["CSRF_TRUSTED_ORIGINS"] == f"https://{hostname}"
        assert env["ALLOWED_HOSTS"] == hostname


def test_the_caddyfile_proxies_to_the_port_web_listens_on(compose: dict) -> None:
    host, port = caddy_upstream()
    web = compose["services"][host]
    args = build_parser().parse_args(web["command"][1:])
    assert (args.host, args.port) == ("0.0.0.0", port)
    assert [str(port)] == web["expose"]


def test_caddy_reads_exactly_the_variables_compose_gives_it(compose: dict) -> None:
    given = set(compose["services"]["caddy"]["environment"])
    read = set(re.findall(r"\{\$([A-Z0-9_]+)", caddy_directives()))
    assert given == read == {"CLUSTERDX_HOSTNAME", "CLUSTERDX_TLS"}


def test_hsts_and_body_limits_are_left_to_django() -> None:
    """Django sends HSTS from an https SITE_URL and answers oversized bodies with a 413 and the reason."""
    directives = caddy_directives().lower()
    for left_to_django in ("strict-transport-security", "request_body", "max_size", "timeouts", "header "):
        assert left_to_django not in directives


def test_every_command_exists(compose: dict) -> None:
    parser = build_parser()
    for name in ("web", "worker"):
        command = compose["services"][name]["command"]
        assert command[0] == "clusterdx"
        args = parser.parse_args(command[1:])
        assert isinstance(args, argparse.Namespace) and callable(args._main)
    beat = compose["services"]["beat"]["command"]
    assert beat[:3] == ["celery", "-A", "dashboard.celery"]
    from dashboard.celery import app

    assert app.conf.beat_schedule, "beat has something to schedule"


def test_the_dockerfile_copies_every_package() -> None:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    for package in ("clusterdx", "dashboard", "collectors", "trainer_hooks"):
        assert f"COPY {package} ./{package}" in text
        assert (ROOT / package).is_dir()
    cmd = re.search(r'CMD \[(.*)\]', text).group(1)
    assert build_parser().parse_args([a.strip(' "') for a in cmd.split(",")][1:])


def caddy_env(home: Path) -> dict[str, str]:
    """No CLUSTERDX_* of ours, and Caddy's data (its CA, made by `validate` too) under ``home``, not the user's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLUSTERDX_")}
    return env | {"HOME": str(home), "XDG_DATA_HOME": str(home / "data"), "XDG_CONFIG_HOME": str(home / "cfg")}


def adapt(home: Path, tls: str | None) -> dict:
    env = caddy_env(home) | ({"CLUSTERDX_TLS": tls} if tls else {})
    out = subprocess.run([CADDY, "adapt", "--config", str(CADDYFILE), "--adapter", "caddyfile"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@needs_caddy
def test_caddy_validates_and_adapts_every_certificate_choice(tmp_path: Path) -> None:
    internal, acme = adapt(tmp_path, None), adapt(tmp_path, "ops@example.com")
    files = adapt(tmp_path, "/certs/cert.pem /certs/key.pem")
    (server,) = internal["apps"]["http"]["servers"].values()
    assert server["listen"] == [":443"]
    # No server timeouts set: Caddy's defaults put no limit on reading a body or writing a response.
    assert not {"read_timeout", "write_timeout"} & set(server)
    issuers = [i["module"] for p in internal["apps"]["tls"]["automation"]["policies"] for i in p["issuers"]]
    assert issuers == ["internal"]
    assert acme["apps"]["tls"]["automation"]["policies"][0]["issuers"][0] == {"email": "ops@example.com",
                                                                              "module": "acme"}
    (loaded,) = files["apps"]["tls"]["certificates"]["load_files"]
    assert (loaded["certificate"], loaded["key"]) == ("/certs/cert.pem", "/certs/key.pem")
    out = subprocess.run([CADDY, "validate", "--config", str(CADDYFILE), "--adapter", "caddyfile"], env=caddy_env(tmp_path),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Valid configuration" in out.stdout + out.stderr, out.stderr


class StandInWeb(BaseHTTPRequestHandler):
    """The web service's place: answers with what it received; echoes the bytes of an upgraded connection."""

    protocol_version = "HTTP/1.1"
    seen: list[str] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append(self.path)
        reply_json(self, 200, {"headers": dict(self.headers), "sha256": hashlib.sha256(body).hexdigest()})

    def do_GET(self) -> None:
        self.seen.append(self.path)
        if self.headers.get("Upgrade", "").lower() != "websocket":
            reply_json(self, 200, {"headers": dict(self.headers)})
            return
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.end_headers()
        self.wfile.flush()
        while data := self.connection.recv(65536):
            self.connection.sendall(data)
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def front(tmp_path: Path) -> Iterator[tuple[int, int, ssl.SSLContext]]:
    """docker/Caddyfile run by the real caddy, its upstream and ports swapped for free ones on this machine."""
    web = ThreadingHTTPServer(("127.0.0.1", 0), StandInWeb)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    http_port, https_port = free_port(), free_port()
    text = CADDYFILE.read_text()
    assert text.count("reverse_proxy web:8000\n") == text.count("\tskip_install_trust\n") == 1
    text = text.replace("reverse_proxy web:8000", f"reverse_proxy 127.0.0.1:{web.server_address[1]}")
    text = text.replace("\tskip_install_trust\n", f"\tskip_install_trust\n\tadmin off\n\thttp_port {http_port}\n"
                        f"\thttps_port {https_port}\n")
    (tmp_path / "Caddyfile").write_text(text)
    caddy = subprocess.Popen([CADDY, "run", "--config", "Caddyfile", "--adapter", "caddyfile"], cwd=tmp_path,
                             env=caddy_env(tmp_path),
                             stdout=subprocess.DEVNULL, stderr=(tmp_path / "caddy.log").open("w"))
    root = tmp_path / "data" / "caddy" / "pki" / "authorities" / "local" / "root.crt"
    deadline = time.monotonic() + 60  # generous: it only has to generate its CA and a certificate
    try:
        while True:
            assert caddy.poll() is None, (tmp_path / "caddy.log").read_text()
            if root.is_file():
                context = ssl.create_default_context(cafile=str(root))
                try:
                    with socket.create_connection(("127.0.0.1", https_port), timeout=5) as raw:
                        context.wrap_socket(raw, server_hostname="localhost").close()
                    break
                except (OSError, ssl.SSLError):
                    pass
            assert time.monotonic() < deadline, (tmp_path / "caddy.log").read_text()
            time.sleep(0.1)
        StandInWeb.seen = []
        yield http_port, https_port, context
    finally:
        caddy.terminate()
        caddy.wait(timeout=30)
        web.shutdown()


@needs_caddy
def test_caddy_passes_an_8_mb_batch_over_tls_with_its_own_forwarded_headers(front: tuple) -> None:
    _, https_port, context = front
    body = os.urandom(8 * 1024 * 1024)  # incompressible, the ingest limit
    conn = http.client.HTTPSConnection("127.0.0.1", https_port, context=context, timeout=60)
    conn.sock = context.wrap_socket(socket.create_connection(("127.0.0.1", https_port)), server_hostname="localhost")
    conn.request("POST", "/api/v1/ingest", body, {"Host": "localhost", "Content-Type": "application/octet-stream",
                                                  "X-Forwarded-Proto": "http", "X-Forwarded-For": "203.0.113.9"})
    reply = conn.getresponse()
    answer = json.loads(reply.read())
    assert reply.status == 200 and answer["sha256"] == hashlib.sha256(body).hexdigest()
    # A client's X-Forwarded-* are replaced, so Django's SECURE_PROXY_SSL_HEADER and uvicorn's client address hold.
    assert answer["headers"]["X-Forwarded-Proto"] == "https"
    assert answer["headers"]["X-Forwarded-For"] == "127.0.0.1"
    assert answer["headers"]["Host"] == "localhost"
    assert reply.getheader("Strict-Transport-Security") is None  # Django's to send, once


@needs_caddy
def test_plain_http_only_redirects(front: tuple) -> None:
    http_port, https_port, _ = front
    conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=30)
    conn.request("POST", "/api/v1/ingest?x=1", b"{}", {"Host": "localhost"})
    reply = conn.getresponse()
    assert reply.status in (301, 308)
    # Caddy names the https port only when the request's Host did; in the stack it is 443 anyway.
    assert re.fullmatch(rf"https://localhost(:{https_port})?/api/v1/ingest\?x=1", reply.getheader("Location"))
    assert StandInWeb.seen == []


@needs_caddy
def test_websockets_pass_through(front: tuple) -> None:
    _, https_port, context = front
    with context.wrap_socket(socket.create_connection(("127.0.0.1", https_port), timeout=30),
                             server_hostname="localhost") as sock:
        sock.sendall(b"GET /ws/live/ HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 101")
        sock.sendall(b"frame bytes")
        echoed = b""
        while len(echoed) < len(b"frame bytes"):
            echoed += sock.recv(4096)
        assert echoed == b"frame bytes"
    assert StandInWeb.seen == ["/ws/live/"]
