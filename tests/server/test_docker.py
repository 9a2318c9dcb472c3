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
import shlex
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

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
        for name in re.findall(r"env_(?:str|bool|int|float|list|choice)\(\s*\"([A-Z0-9_]+)\"", path.read_text()):
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


def test_the_image_installs_the_browser_bundle_where_the_settings_look() -> None:
    """The build stage runs npm ci on the checked-in lock file and its node_modules land where settings look for
    plotly's basic and cartesian bundles (and pyproject's package data takes them into the installed package)."""
    from django.conf import settings

    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert "COPY dashboard/web/npm/package.json dashboard/web/npm/package-lock.json ./" in text
    assert "RUN npm ci --omit=dev" in text
    target = re.search(r"^COPY --from=browser-deps /deps/node_modules (\S+)$", text, re.M).group(1)
    assert (ROOT / target).resolve() == settings.PLOTLY_CARTESIAN_DIR.parent
    assert text.index("COPY --from=browser-deps") < text.index("RUN pip install .")
    assert settings.PLOTLY_BASIC_DIR.parent == settings.PLOTLY_CARTESIAN_DIR.parent
    lock = json.loads((ROOT / "dashboard/web/npm/package-lock.json").read_text())
    for bundle in (settings.PLOTLY_CARTESIAN_DIR, settings.PLOTLY_BASIC_DIR):
        assert f"npm/node_modules/{bundle.name}/*" in (ROOT / "pyproject.toml").read_text()
        assert "node_modules/" + bundle.name in lock["packages"]


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


# --- the stack as it runs: read-only app containers, a persistent broker, and every other way of running it ---------
APP_SERVICES = ("web", "worker", "beat")
SMOKE = ROOT / "scripts" / "prod-smoke.sh"
SYSTEMD = ROOT / "deploy" / "systemd"
K8S = ROOT / "deploy" / "k8s"
# What scripts/prod-smoke.sh may set differently from compose, each for a reason given in its header.
SMOKE_OVERRIDES = {"DATABASE_URL", "REDIS_URL", "PATH", "CLUSTERDX_ALERTS_ALLOW_PRIVATE", "CLUSTERDX_REDIS_PREFIX"}


def image() -> dict[str, Any]:
    """docker/Dockerfile's user (name, uid, home) and ENV: what every app container runs with besides compose's."""
    text = (ROOT / "docker" / "Dockerfile").read_text()
    useradd = re.search(r"useradd (.*)$", text, re.M).group(1)
    env_block = re.search(r"^ENV ((?:.*\\\n)*.*)$", text, re.M).group(1)
    return {"user": re.search(r"^USER (\S+)$", text, re.M).group(1), "uid": int(re.search(r"--uid (\d+)", useradd).group(1)),
            "home": re.search(r"--home (\S+)", useradd).group(1), "env": dict(re.findall(r"([A-Z0-9_]+)=(\S+)", env_block))}


def defaults(value: str) -> str:
    """Compose's ${NAME:-default} with nothing set."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))


def compose_env(compose: dict, name: str) -> dict[str, str]:
    return {k: defaults(v) for k, v in compose["services"][name]["environment"].items()}


def test_app_containers_are_read_only_and_write_only_their_volumes(compose: dict) -> None:
    for name in APP_SERVICES:
        service = compose["services"][name]
        assert service["read_only"] is True and service["tmpfs"] == ["/tmp"], name
        assert service["volumes"] == [f"data:{image()['env']['CLUSTERDX_DATA_DIR']}"], "named, so Docker copies in "\
            "the image's directory owned by its user"
        assert "data" in compose["volumes"]
    beat = compose["services"]["beat"]["command"]
    schedule = beat[beat.index("--schedule") + 1]
    assert Path(schedule).parent == Path(image()["env"]["CLUSTERDX_DATA_DIR"]), "beat writes its schedule to the volume"


def test_redis_keeps_the_broker_queue_across_restarts(compose: dict) -> None:
    redis = compose["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] in ("everysec", "always")
    assert redis["volumes"] == ["redisdata:/data"] and "redisdata" in compose["volumes"]


def test_worker_and_beat_start_after_web_has_migrated(compose: dict) -> None:
    services = compose["services"]
    web = build_parser().parse_args(services["web"]["command"][1:])
    assert f"('127.0.0.1', {web.port})" in " ".join(services["web"]["healthcheck"]["test"])
    for name in ("worker", "beat"):
        assert services[name]["depends_on"]["web"] == {"condition": "service_healthy"}
        assert {"postgres", "redis"} <= set(services[name]["depends_on"])


@pytest.fixture(scope="module")
def smoke_plan() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLUSTERDX_")}
    env |= {"DATABASE_URL": "postgresql://smoke@db/x", "REDIS_URL": "redis://smoke:6379/1"}
    out = subprocess.run([str(SMOKE), "plan"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_smoke_script_runs_what_compose_runs(compose: dict, smoke_plan: dict) -> None:
    img = image()
    assert (smoke_plan["user"], smoke_plan["home"]) == (img["user"], img["home"])
    services = {s["name"]: s for s in smoke_plan["services"]}
    assert set(services) == {*APP_SERVICES, "caddy"}
    names = [s["name"] for s in smoke_plan["services"]]
    assert names.index("web") < min(names.index("worker"), names.index("beat")), "compose's depends_on order"
    for name in APP_SERVICES:
        planned, declared = services[name], compose["services"][name]
        assert planned["argv"] == [defaults(a) for a in declared["command"]], name
        assert planned["replicas"] == (declared.get("deploy") or {}).get("replicas", 1)
        assert [f"{v['source']}:{v['target']}" for v in planned["volumes"]] == declared["volumes"]
        assert (planned["tmpfs"], planned["read_only"]) == (declared["tmpfs"], declared["read_only"])
        expected = img["env"] | compose_env(compose, name) | {"HOME": img["home"]}
        changed = {k for k in set(planned["env"]) | set(expected) if planned["env"].get(k) != expected.get(k)}
        assert changed <= SMOKE_OVERRIDES and set(expected) <= set(planned["env"]), (name, changed)
    assert set(smoke_plan["overrides"]) <= SMOKE_OVERRIDES
    header = SMOKE.read_text().split("set -euo pipefail")[0]
    assert all(name in header for name in SMOKE_OVERRIDES), "every difference from compose is explained"
    caddy = services["caddy"]
    assert compose_env(compose, "caddy").items() <= caddy["env"].items()
    assert smoke_plan["secrets"] == {name: f"/run/secrets/{name}" for name in compose["secrets"]}


def unit(name: str) -> dict[str, dict[str, list[str]]]:
    """A systemd unit file as section -> key -> values (a key may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in (SYSTEMD / name).read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, value = line.split("=", 1)
        current.setdefault(key, []).append(value)
    return sections


def env_file() -> dict[str, str]:
    lines = (SYSTEMD / "clusterdx.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def test_systemd_units_run_the_compose_commands_hardened(compose: dict) -> None:
    img, env = image(), env_file()
    # The image's ENV and compose's variables, but pip's (nothing is installed at run time) and uvicorn's trusted
    # proxies (web listens on 127.0.0.1, where the proxy is: uvicorn's default already trusts it).
    assert set(env) == set(img["env"]) - {"PIP_NO_CACHE_DIR"} | set(compose_env(compose, "beat"))
    assert env["SITE_URL"] == env["CSRF_TRUSTED_ORIGINS"] == f"https://{env['ALLOWED_HOSTS']}"
    for key in ("CLUSTERDX_RETENTION_HOURS", "CLUSTERDX_GPU_HOUR_PRICE_USD", "DJANGO_SETTINGS_MODULE"):
        assert env[key] == {**img["env"], **compose_env(compose, "beat")}[key]
    for name in APP_SERVICES:
        service = unit(f"clusterdx-{name}.service")["Service"]
        (exec_start,) = service["ExecStart"]
        argv = exec_start.split()
        argv[0] = Path(argv[0]).name
        expected = [a.replace(img["env"]["CLUSTERDX_DATA_DIR"], env["CLUSTERDX_DATA_DIR"])
                    for a in compose["services"][name]["command"]]
        if name == "web":
            expected[expected.index("--host") + 1] = "127.0.0.1"  # behind the proxy on the same host
        assert argv == expected, name
        assert service["User"] == service["Group"] == [img["user"]]
        assert service["EnvironmentFile"] == ["/etc/clusterdx/server.env"]
        # Read-only but the state directory (compose: a read-only image and the data volume; /tmp private).
        assert f"/var/lib/{service['StateDirectory'][0]}" == env["CLUSTERDX_DATA_DIR"] == service["WorkingDirectory"][0]
        for key, value in {"ProtectSystem": "strict", "PrivateTmp": "yes", "NoNewPrivileges": "yes",
                           "ProtectHome": "yes", "CapabilityBoundingSet": ""}.items():
            assert service[key] == [value], (name, key)
        if name != "web":
            assert "clusterdx-web.service" in unit(f"clusterdx-{name}.service")["Unit"]["After"][0]


def k8s() -> dict[tuple[str, str], dict]:
    docs = [d for path in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]
    return {(d["kind"], d.get("metadata", {}).get("name", "")): d for d in docs}


# Where a pod must differ from compose's container: compose's web container is its host's only one and pins its
# workers to CPUs; pods share nodes, so theirs pin only when the kubelet gives them a cpuset (dashboard/affinity.py).
K8S_DIFFERS = {("web", "CLUSTERDX_PIN_CPU"): "auto"}


def test_kubernetes_manifests_run_the_compose_commands(compose: dict) -> None:
    img, manifests = image(), k8s()
    kustomization = manifests[("Kustomization", "")]
    assert set(kustomization["resources"]) == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    config = manifests[("ConfigMap", "clusterdx-env")]["data"]
    for name in APP_SERVICES:
        deployment = manifests[("Deployment", name)]["spec"]
        pod = deployment["template"]["spec"]
        (container,) = pod["containers"]
        assert container["command"] == compose["services"][name]["command"], name
        assert container["image"] == compose["services"][name]["image"]
        given = set(config) | {e["name"] for e in container["env"]}
        assert given == set(compose_env(compose, name)), name
        assert next(e for e in container["env"] if e["name"] == "DATABASE_URL")["valueFrom"]["secretKeyRef"]
        for key, value in compose_env(compose, name).items():
            if "localhost" not in value and key not in ("DATABASE_URL", "REDIS_URL"):
                value = K8S_DIFFERS.get((name, key), value)
                assert {**config, **{e["name"]: e.get("value") for e in container["env"]}}[key] == value, key
        assert pod["securityContext"]["runAsUser"] == img["uid"] and pod["securityContext"]["runAsNonRoot"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert set(mounts) == {"/tmp", img["env"]["CLUSTERDX_DATA_DIR"], str(Path(config["SECRET_KEY_FILE"]).parent)}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[mounts[str(Path(config["SECRET_KEY_FILE"]).parent)]]["secret"]["secretName"]
        replicas = (compose["services"][name].get("deploy") or {}).get("replicas", 1)
        assert deployment["replicas"] == replicas
    beat = manifests[("Deployment", "beat")]["spec"]
    assert beat["replicas"] == 1 and beat["strategy"] == {"type": "Recreate"}, "exactly one beat, even mid-rollout"
    data = next(v for v in beat["template"]["spec"]["volumes"] if v["name"] == "data")
    assert data["persistentVolumeClaim"]["claimName"] in {n for k, n in manifests if k == "PersistentVolumeClaim"}
    web = manifests[("Deployment", "web")]["spec"]["template"]["spec"]["containers"][0]
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(web)
    assert "livenessProbe" in manifests[("Deployment", "worker")]["spec"]["template"]["spec"]["containers"][0]
    (port,) = web["ports"]
    assert [str(port["containerPort"])] == compose["services"]["web"]["expose"]
    service = manifests[("Service", "web")]["spec"]
    assert service["ports"][0]["targetPort"] == port["name"]
    ingress = manifests[("Ingress", "clusterdx")]["spec"]
    assert ingress["tls"] and ingress["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"] == "web"
    assert config["SITE_URL"] == config["CSRF_TRUSTED_ORIGINS"] == f"https://{ingress['rules'][0]['host']}"


def test_every_command_in_the_deploy_guide_exists() -> None:
    """docs/deploy.md's commands parse with the real parsers: `clusterdx ...` and `manage.py alerts ...`."""
    from dashboard.alerts.management.commands.alerts import Command

    blocks = re.findall(r"```sh\n(.*?)```", (ROOT / "docs" / "deploy.md").read_text(), re.S)
    lines = [line.split(" #")[0] for block in blocks for line in block.splitlines()]
    parser, alerts = build_parser(), Command().create_parser("manage.py", "alerts")
    seen = []
    for line in lines:
        for rest in re.findall(r"(?:(?:\bweb|\bcdx|--) |/bin/)clusterdx ([^|>]*)", line):
            argv = shlex.split(rest)
            try:
                parser.parse_args(argv)
            except SystemExit:
                pytest.fail(f"docs/deploy.md: `clusterdx {rest.strip()}` is not a valid command")
            seen.append(" ".join(argv[:2]))
        for rest in re.findall(r"(?:manage\.py|django-admin) alerts ([^|>]*)", line):
            alerts.parse_args(shlex.split(rest))
            seen.append("alerts")
    assert {"user add", "cluster create", "cluster add-member", "token create", "agent --config", "alerts"} <= set(seen)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_knows_every_directive_of_the_units(tmp_path: Path) -> None:
    """`systemd-analyze verify` on copies whose ExecStart is /usr/bin/true (the real one is installed by the operator):
    a misspelt hardening key is only a warning to systemd, and a silently unhardened service."""
    for path in SYSTEMD.glob("*.service"):
        (tmp_path / path.name).write_text(re.sub(r"/opt/clusterdx/bin/\S+", "/usr/bin/true", path.read_text()))
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", *sorted(map(str, tmp_path.glob("*.service")))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr
