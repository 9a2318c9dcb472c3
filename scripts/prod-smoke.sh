#!/usr/bin/env bash
# The production stack of docker/compose.yaml, run for real without a Docker engine: the same commands, user,
# environment and volumes, read from compose.yaml and docker/Dockerfile (the one source of truth), on the PostgreSQL
# and Redis of this machine.
#
#   scripts/prod-smoke.sh                 run the smoke test (tests/server/test_prod_smoke.py) against a fresh stack
#   scripts/prod-smoke.sh plan            print what would run (JSON): services, argv, env, user, volumes, start order
#   scripts/prod-smoke.sh serve STATE     start the stack in the foreground, state and logs under STATE; STATE/ready
#                                         appears when every service is up; SIGTERM stops it all
#   scripts/prod-smoke.sh exec STATE CMD  run CMD inside the running stack as its user, with web's environment
#                                         (the `docker compose exec web CMD` of this stack)
#
# How the container is stood in for (needs root, like Docker does):
# - user: the image's USER (`clusterdx`), created here as a system user; every process runs as it through setpriv,
#   with no capabilities and no_new_privs;
# - read-only image: a private mount namespace (unshare -m) in which the checkout (the stand-in for /app, the
#   virtual environment included) is a read-only bind mount. A read-only copy would prove less: the processes would
#   not run the code under test, and a copy owned by root is unwritable by the user anyway, read-only or not;
# - volumes: each named volume of an app service is a directory under STATE/volumes owned by the user and
#   bind-mounted at the compose target (e.g. /var/lib/clusterdx); the secret is on a tmpfs at /run/secrets.
#   /tmp is the host's (compose's is a tmpfs); the rest of the file system is the host's, unwritable by the user;
# - Caddy: docker/Caddyfile with its upstream and ports swapped for this machine's, its data on the caddy_data volume.
#
# What differs from compose, and why (the plan lists it under "overrides"; test_docker.py checks nothing else does):
# DATABASE_URL and REDIS_URL (the services' hostnames do not exist here), web's --port and Caddy's ports (free ones:
# several stacks share this machine), CLUSTERDX_REDIS_PREFIX (one Redis shared with other runs),
# CLUSTERDX_ALERTS_ALLOW_PRIVATE=1 (the test's webhook receiver is on loopback), PATH (the virtual environment
# stands in for the image's /usr/local/bin).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}

plan() {  # plan STATE|-: the JSON plan, from compose.yaml + Dockerfile + the environment
  "$PY" - "$ROOT" "$1" <<'PY'
import json, os, re, socket, sys
from pathlib import Path

import yaml

root, state = Path(sys.argv[1]), sys.argv[2]
compose = yaml.safe_load((root / "docker/compose.yaml").read_text())
dockerfile = (root / "docker/Dockerfile").read_text()
user = re.search(r"^USER (\S+)$", dockerfile, re.M).group(1)
home = re.search(r"useradd .*--home (\S+)", dockerfile).group(1)
env_block = re.search(r"^ENV ((?:.*\\\n)*.*)$", dockerfile, re.M).group(1)
image_env = dict(re.findall(r"([A-Z0-9_]+)=(\S+)", env_block))


def interpolate(value: str) -> str:
    """Compose's ${NAME:-default}, from this environment."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: os.environ.get(m.group(1)) or m.group(2), str(value))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def order(services: dict) -> list[str]:
    done: list[str] = []
    def visit(name: str) -> None:
        if name in done or name not in services:
            return
        for dep in services[name].get("depends_on") or {}:
            visit(dep)
        done.append(name)
    for name in services:
        visit(name)
    return done


svcs = compose["services"]
app = {n: s for n, s in svcs.items() if s.get("image") == svcs["web"]["image"]}
web_port = free_port() if state != "-" else 8000
overrides = {
    "DATABASE_URL": os.environ.get("DATABASE_URL", ""),
    "REDIS_URL": os.environ.get("REDIS_URL", ""),
    "PATH": f"{root}/.venv/bin:/usr/local/bin:/usr/bin:/bin",
    "CLUSTERDX_ALERTS_ALLOW_PRIVATE": "1",
}
if os.environ.get("CLUSTERDX_REDIS_PREFIX"):
    overrides["CLUSTERDX_REDIS_PREFIX"] = os.environ["CLUSTERDX_REDIS_PREFIX"]
services = []
for name in order({n: s for n, s in svcs.items() if n in app or n == "caddy"}):
    s = svcs[name]
    if name == "caddy":
        volumes = {v.split(":")[1]: v.split(":")[0] for v in s["volumes"] if not v.startswith(".")}
        env = {k: interpolate(v) for k, v in s["environment"].items()}
        where = {target: f"{state}/volumes/{source}" if state != "-" else target for target, source in volumes.items()}
        env |= {"XDG_DATA_HOME": where["/data"], "XDG_CONFIG_HOME": where["/config"], "HOME": home,
                "PATH": overrides["PATH"]}
        services.append({"name": name, "replicas": 1, "env": env, "volumes": [], "caddy": True,
                         "argv": ["caddy", "run", "--config", f"{state}/Caddyfile", "--adapter", "caddyfile"],
                         "https_port": free_port() if state != "-" else 443,
                         "http_port": free_port() if state != "-" else 80})
        continue
    argv = [interpolate(a) for a in s["command"]]
    if "--port" in argv:
        argv[argv.index("--port") + 1] = str(web_port)
    env = image_env | {k: interpolate(v) for k, v in s["environment"].items()} | {"HOME": home} | overrides
    volumes = [{"source": v.split(":")[0], "target": v.split(":")[1]} for v in s.get("volumes", [])]
    services.append({"name": name, "replicas": int((s.get("deploy") or {}).get("replicas", 1)), "argv": argv,
                     "env": env, "volumes": volumes, "tmpfs": s.get("tmpfs", []), "read_only": s.get("read_only")})
secrets = {name: "/run/secrets/" + name for s in app.values() for name in s.get("secrets", [])}
print(json.dumps({"root": str(root), "user": user, "home": home, "workdir": str(root), "web_port": web_port,
                  "secrets": secrets, "services": services, "python_prefix": os.path.realpath(sys.base_prefix),
                  "overrides": sorted(overrides)}, indent=1))
PY
}

launcher() {  # launcher STATE: write STATE/stack.sh (run inside the mount namespace) and STATE/exec.sh from the plan
  "$PY" - "$1" <<'PY'
import json, shlex, sys
from pathlib import Path

state = Path(sys.argv[1])
plan = json.loads((state / "plan.json").read_text())
q = shlex.quote
user = plan["user"]
as_user = f"setpriv --reuid={user} --regid={user} --init-groups --inh-caps=-all --bounding-set=-all --no-new-privs"
web = next(s for s in plan["services"] if s["name"] == "web")
lines = [
    "set -euo pipefail",
    "umask 022",  # Docker's: the mount points made below must be passable, and the services get the usual default
    f"STATE={q(str(state))}",
    # The image is read-only: the checkout (code and virtual environment) is mounted read-only for every process.
    f"mount --bind {q(plan['root'])} {q(plan['root'])}",
    f"mount -o remount,bind,ro {q(plan['root'])}",
    # The interpreter the virtual environment points at may sit under a directory the user cannot enter (/root):
    # here only, put an empty tmpfs over that directory and the interpreter's prefix back, read-only.
    f"prefix={q(plan['python_prefix'])}; d=''",
    "for p in $(tr / ' ' <<< \"${prefix#/}\"); do d=\"$d/$p\"",
    f"  if ! {as_user} test -x \"$d\"; then",
    "    mkdir -p \"$STATE/mnt/prefix\"; mount --bind \"$prefix\" \"$STATE/mnt/prefix\"",
    "    mount -t tmpfs -o mode=0755,size=1m tmpfs \"$d\"; mkdir -p \"$prefix\"",
    "    mount --bind \"$STATE/mnt/prefix\" \"$prefix\"; mount -o remount,bind,ro \"$prefix\"; break",
    "  fi",
    "done",
]
targets = {v["target"]: v["source"] for s in plan["services"] for v in s["volumes"]}
for target, source in sorted(targets.items()):
    lines.append(f"mount --bind \"$STATE/volumes/{source}\" {q(target)}")
lines.append("mount -t tmpfs -o mode=0755,size=1m tmpfs /run/secrets")
for name, path in plan["secrets"].items():
    lines.append(f"install -m 0444 \"$STATE/secrets/{name}\" {q(path)}")
lines += [
    "pids=()",
    "stop() { trap - TERM INT EXIT; for p in \"${pids[@]}\"; do kill -TERM -- -\"$p\" 2>/dev/null || true; done",
    "  for _ in $(seq 100); do alive=0; for p in \"${pids[@]}\"; do kill -0 -- -\"$p\" 2>/dev/null && alive=1; done",
    "    [ $alive = 0 ] && break; sleep 0.2; done",
    "  for p in \"${pids[@]}\"; do kill -KILL -- -\"$p\" 2>/dev/null || true; done; exit 0; }",
    "trap stop TERM INT EXIT",
    "wait_port() { until (exec 3<>/dev/tcp/127.0.0.1/$1) 2>/dev/null; do",
    "  kill -0 \"$2\" 2>/dev/null || { echo \"!! $3 exited; see $STATE/logs/$3.log\" >&2; exit 1; }; sleep 0.2; done; }",
]
ready = []
for s in plan["services"]:
    env = " ".join(q(f"{k}={v}") for k, v in sorted(s["env"].items()))
    for i in range(s["replicas"]):
        name = s["name"] if s["replicas"] == 1 else f"{s['name']}.{i + 1}"
        lines += [f"setsid {as_user} env -i -C {q(plan['workdir'])} {env} {shlex.join(s['argv'])} "
                  f"> \"$STATE/logs/{name}.log\" 2>&1 &",
                  f"pids+=($!); echo \"{name} $!\" >> \"$STATE/pids\""]
        if s["name"] == "web":  # worker and beat depend on a healthy web: the migrations are applied
            lines.append(f"wait_port {plan['web_port']} $! {name}")
        if s.get("caddy"):
            ready.append(f"wait_port {s['https_port']} $! {name}")
lines += ready + ["touch \"$STATE/ready\"", "wait"]
(state / "stack.sh").write_text("\n".join(lines) + "\n")
env = " ".join(q(f"{k}={v}") for k, v in sorted(web["env"].items()))
(state / "exec.sh").write_text(
    "set -euo pipefail\n"
    f"pid=$(awk '$1 == \"web\" {{print $2}}' {q(str(state / 'pids'))})\n"
    f"exec nsenter --target \"$pid\" --mount -- {as_user} env -i -C {q(plan['workdir'])} {env} \"$@\"\n")
PY
}

serve() {
  local state=$1
  [ "$(id -u)" = 0 ] || { echo "error: needs root (a system user and a mount namespace, as Docker would)" >&2; exit 2; }
  [ -n "${DATABASE_URL:-}" ] && [ -n "${REDIS_URL:-}" ] || { echo "error: set DATABASE_URL and REDIS_URL" >&2; exit 2; }
  # Private by default: the plan and the launcher hold DATABASE_URL, secrets/ the secret key. The user only needs to
  # pass through STATE and volumes/ (to Caddy's volumes) and to read the Caddyfile.
  umask 077
  mkdir -p "$state"/{logs,secrets,volumes,mnt}
  state=$(cd "$state" && pwd)
  chmod 0711 "$state" "$state/volumes"
  plan "$state" > "$state/plan.json"
  local user home
  user=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["user"])' "$state/plan.json")
  home=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["home"])' "$state/plan.json")
  # As the image's `useradd --system`; another run may be creating it at the same moment.
  id -u "$user" >/dev/null 2>&1 || useradd --system --user-group --home-dir "$home" --no-create-home \
    --shell /usr/sbin/nologin "$user" || id -u "$user" >/dev/null
  "$PY" - "$state" "$ROOT/docker/Caddyfile" <<'PY'
import json, os, secrets, shutil, sys
from pathlib import Path

state, caddyfile = Path(sys.argv[1]), Path(sys.argv[2])
plan = json.loads((state / "plan.json").read_text())
owner = shutil.chown
for s in plan["services"]:
    for v in s["volumes"]:
        path = state / "volumes" / v["source"]
        path.mkdir(mode=0o700, exist_ok=True)
        for sub in [path, *path.rglob("*")]:  # what a test put there first belongs to the user, as Docker's copy-up
            owner(sub, plan["user"], plan["user"])
        Path(v["target"]).mkdir(parents=True, exist_ok=True)  # the mount point only; the host's stays empty
    if s.get("caddy"):
        for key in ("XDG_DATA_HOME", "XDG_CONFIG_HOME"):
            Path(s["env"][key]).mkdir(mode=0o700, parents=True, exist_ok=True)
            owner(s["env"][key], plan["user"], plan["user"])
        text = caddyfile.read_text()
        assert text.count("reverse_proxy web:8000\n") == text.count("\tskip_install_trust\n") == 1
        text = text.replace("reverse_proxy web:8000", f"reverse_proxy 127.0.0.1:{plan['web_port']}")
        text = text.replace("\tskip_install_trust\n", f"\tskip_install_trust\n\tadmin off\n\thttp_port {s['http_port']}"
                            f"\n\thttps_port {s['https_port']}\n")
        (state / "Caddyfile").write_text(text)
        os.chmod(state / "Caddyfile", 0o644)
for name in plan["secrets"]:
    (state / "secrets" / name).write_text(secrets.token_urlsafe(50))
os.makedirs("/run/secrets", exist_ok=True)
PY
  setpriv --reuid="$user" --regid="$user" --init-groups test -r "$state/Caddyfile" || {
    echo "error: user $user cannot reach $state (a parent directory is private); choose one it can pass through" >&2
    exit 2; }
  launcher "$state"
  : > "$state/pids"
  exec unshare --mount --propagation private bash "$state/stack.sh"
}

case "${1:-test}" in
  plan) plan - ;;
  serve) [ $# = 2 ] || { echo "usage: $0 serve STATE" >&2; exit 2; }; serve "$2" ;;
  exec) [ $# -ge 3 ] || { echo "usage: $0 exec STATE CMD..." >&2; exit 2; }; state=$2; shift 2
        exec bash "$state/exec.sh" "$@" ;;
  test) shift || true
        export DATABASE_URL="${DATABASE_URL:-postgresql://postgres@127.0.0.1:5432/clusterdx}"
        export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379/14}"
        export CLUSTERDX_REDIS_PREFIX="${CLUSTERDX_REDIS_PREFIX:-cdxsmoke$$}"
        export CLUSTERDX_DATA_DIR="${CLUSTERDX_DATA_DIR:-$ROOT/var/prod-smoke}"
        cd "$ROOT" && exec "$PY" -m pytest -p no:cacheprovider -q tests/server/test_prod_smoke.py "$@" ;;
  *) echo "usage: $0 [test|plan|serve STATE|exec STATE CMD...]" >&2; exit 2 ;;
esac
