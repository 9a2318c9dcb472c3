"""A four-node cluster on one machine: network namespaces on a private bridge, an agent and a gloo DDP rank per node.

    bed = Testbed(workdir)            # names carry this process's id, so a crashed run's leftovers are found
    bed.build()                       # 4 namespaces node-a..d (10.77.X.1-4), veths on a bridge (10.77.X.254)
    bed.start_agents(url, token)      # a real `clusterdx agent` per node: probes to the 3 others, hooks socket
    bed.start_job("run-1")            # one gloo DDP rank per node with trainer_hooks.Monitor + the comm hook
    bed.add_delay("node-d", 30)       # faults: NFQUEUE delay on what enters a node, tbf rate limit, kill, stop
    bed.close()                       # every process, namespace, link (and so every qdisc and iptables rule)

Nothing leaves the machine: the bridge has no uplink and the namespaces no default route; the server listens on
the bridge's own address. Each process runs in its own UTS namespace named after its node, so agent and hooks
both report the node's name (``socket.gethostname()``) as a real node would, and is bound to the life of the
process that started it (``setpriv --pdeathsig KILL``): a test killed outright leaves no process behind, and
:func:`remove_stale` takes down the namespaces and links a crashed run left.

Everything here is Django-free (plain subprocess and ``ip``/``tc``/``iptables``), so a benchmark can use it too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PREFIX = "cdxt"  # + owner pid + node letter; interface names stay under IFNAMSIZ (15)
NODES = ("a", "b", "c", "d")
PROBE_PORT = 8651
HOOK_ADDR = "127.0.0.1:8650"
MASTER_PORT = 29500
_NAME = re.compile(rf"^{PREFIX}(\d+)(?:[a-d]h?|br)$")
TOOLS = ("ip", "tc", "iptables", "unshare", "setpriv", "cc")


def why_not() -> str | None:
    """Why the testbed cannot run here, or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"needs {', '.join(missing)} (scripts/system-deps.sh: apt-get install -y iproute2 iptables gcc)"
    if not Path("/usr/include/libnetfilter_queue/libnetfilter_queue.h").exists():
        return "needs libnetfilter_queue headers (apt-get install -y libnetfilter-queue-dev)"
    return None


def run(*args: str, check: bool = True, timeout: float = 15) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def build_delay_program(out_dir: Path) -> Path:
    """Compiles nfq_delay.c (user-space packet delay: this kernel has no netem)."""
    binary = out_dir / "nfq_delay"
    run("cc", "-O2", "-Wall", "-o", str(binary), str(HERE / "nfq_delay.c"), "-lnetfilter_queue", "-lnfnetlink",
        timeout=60)
    return binary


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process still in ``ns`` (only processes a testbed started run there), then delete it."""
    pids = run("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    run("ip", "netns", "del", ns, check=False)


def remove_stale() -> list[str]:
    """Namespaces and links of testbeds whose owning process is gone (a crashed or killed test run)."""
    removed = []
    namespaces = [line.split()[0] for line in run("ip", "netns", "list", check=False).stdout.splitlines() if line]
    links = [line.split(":")[1].strip().split("@")[0]
             for line in run("ip", "-o", "link", "show", check=False).stdout.splitlines() if line.count(":") >= 2]
    for name in namespaces + links:
        match = _NAME.match(name)
        if not match or _alive(int(match.group(1))):
            continue
        if name in namespaces:
            _kill_namespace(name)
        else:
            run("ip", "link", "del", name, check=False)
        removed.append(name)
    return removed


def _bits(rate: str) -> int:
    """ "100mbit" -> 100_000_000 (tc's decimal units)."""
    match = re.fullmatch(r"(\d+)([kmg]?)bit", rate.lower())
    if not match:
        raise ValueError(f"rate {rate!r}: expected e.g. 100mbit or 1gbit")
    return int(match.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[match.group(2)]


def _free_subnet(seed: int) -> int:
    """A 10.77.X.0/24 no interface on the host uses (two testbeds at once must not share routes)."""
    used = set(re.findall(r"inet 10\.77\.(\d+)\.", run("ip", "-4", "-o", "addr", "show").stdout))
    for i in range(100):
        x = 100 + (seed + i) % 100
        if str(x) not in used:
            return x
    raise RuntimeError("no free 10.77.X.0/24 for the testbed")


@dataclass
class Node:
    name: str  # node-a: the host name its agent and its rank report
    ns: str
    addr: str
    veth: str  # the host end, on the bridge
    agent: subprocess.Popen[bytes] | None = None
    rank: subprocess.Popen[bytes] | None = None
    delay: subprocess.Popen[bytes] | None = None


class Testbed:
    __test__ = False  # a helper, not a test class (its name starts with "Test")

    def __init__(self, workdir: Path, owner: int | None = None) -> None:
        self.workdir = workdir
        self.tag = f"{PREFIX}{owner or os.getpid()}"
        self.subnet = 0
        self.bridge = f"{self.tag}br"
        self.nodes: list[Node] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.built: list[tuple[str, str]] = []  # ("netns" | "link", name), in creation order

    @property
    def bridge_addr(self) -> str:
        return f"10.77.{self.subnet}.254"

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    # -- network ----------------------------------------------------------------------------------------------------
    def build(self, link_rate: str | None = "1gbit") -> None:
        """``link_rate``: every node's link is shaped to this (both ways). Unshaped, a veth moves whatever the CPU
        can copy, so on a busy two-core machine a bulk probe measures the scheduler, not the link; shaped, the link
        is the bottleneck, as on a real cluster, and a fault is a change of one node's rate."""
        self.subnet = _free_subnet(os.getpid())
        run("ip", "link", "add", self.bridge, "type", "bridge")
        self.built.append(("link", self.bridge))
        run("ip", "addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        for i, letter in enumerate(NODES, start=1):
            node = Node(f"node-{letter}", f"{self.tag}{letter}", f"10.77.{self.subnet}.{i}", f"{self.tag}{letter}h")
            run("ip", "netns", "add", node.ns)
            self.built.append(("netns", node.ns))
            run("ip", "link", "add", node.veth, "type", "veth", "peer", "name", f"{self.tag}{letter}n")
            self.built.append(("link", node.veth))
            run("ip", "link", "set", f"{self.tag}{letter}n", "netns", node.ns)
            run("ip", "link", "set", node.veth, "master", self.bridge, "up")
            run("ip", "-n", node.ns, "link", "set", f"{self.tag}{letter}n", "name", "eth0")
            run("ip", "-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", "eth0")
            run("ip", "-n", node.ns, "link", "set", "eth0", "up")
            run("ip", "-n", node.ns, "link", "set", "lo", "up")
            self.nodes.append(node)
            if link_rate:
                self.limit_rate(node.name, link_rate)

    def close(self) -> None:
        """Every process, then every namespace (their veths, qdiscs and iptables rules go with them), then links."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()  # SIGKILL also ends a SIGSTOPped process
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        for kind, name in reversed(self.built):
            if kind == "netns":
                _kill_namespace(name)
            else:
                run("ip", "link", "del", name, check=False)
        self.built.clear()

    def leftovers(self) -> list[str]:
        """Namespaces and links of this testbed still present (for the tests' cleanup check)."""
        names = run("ip", "netns", "list", check=False).stdout + run("ip", "-o", "link", "show", check=False).stdout
        return sorted(set(re.findall(rf"\b{self.tag}(?:[a-d]h?|br)\b", names)))

    # -- processes --------------------------------------------------------------------------------------------------
    def spawn(self, node: Node, argv: list[str], log: str, env: dict[str, str] | None = None,
              stdin: int | None = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
        """``argv`` inside the node: its namespace, its host name, dying with this process. ``exec`` all the way
        down, so the Popen's pid is the program's own (a signal to it reaches the program, not a wrapper)."""
        cmd = ["ip", "netns", "exec", node.ns, "setpriv", "--pdeathsig", "KILL", "unshare", "--uts", "--",
               "sh", "-c", 'hostname "$0" && exec "$@"', node.name, *argv]
        full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
        with open(self.workdir / log, "ab") as out:
            proc = subprocess.Popen(cmd, stdin=stdin, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=REPO)
        self.procs.append(proc)
        return proc

    def log(self, name: str, tail: int = 3000) -> str:
        path = self.workdir / name
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def start_agents(self, server: str, token: str, interval_s: float = 0.5) -> None:
        token_file = self.workdir / "token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        for node in self.nodes:
            config = self.workdir / f"{node.name}.agent.toml"
            config.write_text(self._agent_config(node, server, token_file, interval_s))
            node.agent = self.spawn(node, [sys.executable, "-m", "clusterdx", "agent", "--config", str(config)],
                                    f"{node.name}.agent.log")

    def _agent_config(self, node: Node, server: str, token_file: Path, interval_s: float) -> str:
        peers = [f"{n.name}={n.addr}:{PROBE_PORT}" for n in self.nodes]
        # Short probe rounds and a bulk transfer every second: a slow link is named within seconds, and the bulk
        # traffic (4 MiB per node per second, the default size) stays far below what the veths carry.
        return "\n".join([
            f'server = "{server}"', f'token_file = "{token_file}"', f'agent_id = "{node.name}"',
            f'host = "{node.name}"', f"interval_s = {interval_s}",
            f'spool_path = "{self.workdir / (node.name + ".spool.sqlite3")}"',
            "backoff_initial_s = 0.2", "backoff_max_s = 1.0", "http_timeout_s = 5.0",
            *(f"[sources.{s}]\nenabled = false" for s in ("gpu", "ib", "kmsg", "nccl")),
            f'[sources.hooks]\naddr = "{HOOK_ADDR}"',
            "[sources.host]",
            "[sources.probes]", f"peers = {json.dumps(peers)}", f'self_name = "{node.name}"',
            f'listen_host = "{node.addr}"', f"port = {PROBE_PORT}", "round_s = 1.0", "pings_per_peer = 4",
            "timeout_s = 1.0", "max_round_s = 3.0", f"bulk_bytes = {4 << 20}", "bulk_period_s = 1.0",
            "bulk_timeout_s = 5.0", "",
        ])

    def start_job(self, run_name: str, *, compute_s: float = 0.05, collective_timeout_s: float = 120.0) -> None:
        """One rank per node, rank i on the i-th node, rank 0 (the rendezvous) on node-a."""
        for rank, node in enumerate(self.nodes):
            env = {"RANK": str(rank), "WORLD_SIZE": str(len(self.nodes)), "LOCAL_RANK": "0",
                   "MASTER_ADDR": self.nodes[0].addr, "MASTER_PORT": str(MASTER_PORT), "GLOO_SOCKET_IFNAME": "eth0",
                   "CLUSTERDX_AGENT_ADDR": HOOK_ADDR, "CLUSTERDX_RUN": run_name, "CLUSTERDX_HOOK_TRANSPORT": "agent"}
            argv = [sys.executable, str(HERE / "netns_rank.py"), "--compute-s", str(compute_s),
                    "--slow-file", str(self.workdir / "slow-data.rank{rank}"),
                    "--collective-timeout-s", str(collective_timeout_s)]
            node.rank = self.spawn(node, argv, f"{node.name}.rank.log", env=env)

    # -- faults -----------------------------------------------------------------------------------------------------
    def add_delay(self, name: str, delay_ms: float, program: Path, queue: int = 0) -> None:
        """Hold every packet *entering* the node for ``delay_ms`` (holding outgoing ones would count against the
        sender's socket buffer and collapse its throughput instead of adding latency). ``--queue-bypass``: without
        the program, packets pass undelayed."""
        node = self.node(name)
        node.delay = self.spawn(node, [str(program), str(queue), str(delay_ms)], f"{node.name}.delay.log",
                                stdin=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while "ready" not in self.log(f"{node.name}.delay.log"):
            if node.delay.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nfq_delay did not start: {self.log(f'{node.name}.delay.log')}")
            time.sleep(0.02)
        run("ip", "netns", "exec", node.ns, "iptables", "-A", "INPUT", "-i", "eth0", "-j", "NFQUEUE",
            "--queue-num", str(queue), "--queue-bypass")

    def limit_rate(self, name: str, rate: str = "100mbit") -> None:
        """tbf both ways: the bridge end of the veth shapes what enters the node, the namespace end what leaves.
        Replaces the link's rate if it has one."""
        node = self.node(name)
        # The bucket must hold at least one timer tick of traffic at the rate, or the rate is never reached.
        burst = max(32 << 10, _bits(rate) // 8 // 250)
        tbf = ["root", "tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]
        run("tc", "qdisc", "replace", "dev", node.veth, *tbf)
        run("ip", "netns", "exec", node.ns, "tc", "qdisc", "replace", "dev", "eth0", *tbf)

    def slow_loader(self, rank: int, delay_s: float) -> None:
        """From now on, rank ``rank``'s DataLoader takes ``delay_s`` per batch (a slow filesystem behind it)."""
        tmp = self.workdir / f"slow-data.rank{rank}.tmp"
        tmp.write_text(str(delay_s))
        tmp.replace(self.workdir / f"slow-data.rank{rank}")

    def signal_rank(self, name: str, sig: signal.Signals) -> None:
        rank = self.node(name).rank
        assert rank is not None and rank.poll() is None, f"the rank on {name} is not running"
        os.kill(rank.pid, sig)
