"""A small cluster on one machine: network namespaces on private bridges, an agent and a gloo DDP rank per node.

    bed = Testbed(workdir)            # names carry this process's id, so a crashed run's leftovers are found
    bed.build()                       # 4 namespaces node-a..d (10.77.X.1-4), veths on a bridge (10.77.X.254)
    bed.start_agents(url, token)      # a real `clusterdx agent` per node: probes to the 3 others, hooks socket
    bed.start_job("run-1")            # one gloo DDP rank per node with trainer_hooks.Monitor + the comm hook
    bed.add_delay("node-d", 30)       # faults: NFQUEUE delay on what enters a node, tbf rate limit, kill, stop
    bed.close()                       # every process, namespace, link (and so every qdisc and iptables rule)

Two racks (``Testbed(workdir, racks=2, per_rack=4)``): node-a..d on rack-1's bridge, node-e..h on rack-2's, the two
bridges joined by one veth pair, the *uplink* (``limit_uplink`` shapes it): every cross-rack pair crosses it, no
intra-rack pair does. The nodes' data network (eth0, 10.77.X.0/24, the probes) is one broadcast domain across both
racks; the agents post to the server over a separate management network (mgmt0 on a third bridge, 10.78.X.0/24,
the server on 10.78.X.254), as on a real cluster's out-of-band network, so shaping the uplink slows the node-to-node
traffic and never the agents' batches. Each agent reports its rack and leaf switch (``[topology]``).

Nothing leaves the machine: the bridges have no uplink to the host's network and the namespaces no default route;
the server listens on the host's own address on the bridge the agents post over (:attr:`Testbed.bridge_addr`).
Each process runs in its own UTS namespace named after its node, so agent and hooks both report the node's name
(``socket.gethostname()``) as a real node would, and is bound to the life of the process that started it
(``setpriv --pdeathsig KILL``): a test killed outright leaves no process behind, and :func:`remove_stale` takes
down the namespaces and links a crashed run left.

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
if str(REPO) not in sys.path:  # a benchmark imports this module by its folder
    sys.path.insert(0, str(REPO))
from tests import network_lock  # noqa: E402

HERE = Path(__file__).resolve().parent
PREFIX = "cdxt"  # + owner pid + node letter; interface names stay under IFNAMSIZ (15)
NODES = "abcdefghijklmnopqrstuvwxyz"  # node letters, in order
PROBE_PORT = 8651
HOOK_ADDR = "127.0.0.1:8650"
MASTER_PORT = 29500
# What a testbed creates, after its prefix and owner pid: a node's namespace (letter), the host ends of its data and
# management veths (letter + h / m), the bridge (br), the rack bridges (r1, r2...), the uplink's ends (u1, u2) and the
# management bridge (mg). The namespace ends (letter + n / o) are renamed inside the namespace.
_SUFFIX = r"(?:[a-z][hmno]?|br|r\d|u\d|mg)"
_NAME = re.compile(rf"^{PREFIX}(\d+){_SUFFIX}$")
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
    namespaces = [line.split()[0] for line in run("ip", "netns", "list", check=False).stdout.splitlines() if line]
    links = [line.split(":")[1].strip().split("@")[0]
             for line in run("ip", "-o", "link", "show", check=False).stdout.splitlines() if line.count(":") >= 2]
    stale = [name for name in namespaces + links if (m := _NAME.match(name)) and not _alive(int(m.group(1)))]
    if not stale:
        return []
    with network_lock.changing():
        for name in stale:
            if name in namespaces:
                _kill_namespace(name)
            else:
                run("ip", "link", "del", name, check=False)
    return stale


def _bits(rate: str) -> int:
    """ "100mbit" -> 100_000_000 (tc's decimal units)."""
    match = re.fullmatch(r"(\d+)([kmg]?)bit", rate.lower())
    if not match:
        raise ValueError(f"rate {rate!r}: expected e.g. 100mbit or 1gbit")
    return int(match.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[match.group(2)]


def _tbf(rate: str) -> list[str]:
    # The bucket must hold at least one timer tick of traffic at the rate, or the rate is never reached.
    burst = max(32 << 10, _bits(rate) // 8 // 250)
    return ["root", "tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]


def _shape(prefix: tuple[str, ...], dev: str, rate: str) -> None:
    """A new tbf at ``rate`` on ``dev`` (run under ``prefix``: a namespace's ``ip netns exec``), replacing any: the
    old qdisc is deleted and a new one added, not changed in place. CI runs twice found a node cut off entirely
    (every probe to it lost, its agent silent, its rank stopped) for the 30 s after ``tc qdisc replace`` turned its
    1 Gb/s tbf into a 100 Mb/s one, and a replace of a tbf by a tbf is the kernel's tbf_change on the live qdisc and
    its queue; a new qdisc starts from a full bucket and an empty queue (the packets queued in the old one are
    dropped, as a cable swap would, and TCP sends them again)."""
    run(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)  # none yet on a new link
    run(*prefix, "tc", "qdisc", "add", "dev", dev, *_tbf(rate))


def _free_subnet(seed: int) -> int:
    """An X such that no interface on the host uses 10.77.X.0/24 or 10.78.X.0/24 (the data and management networks;
    two testbeds at once must not share routes)."""
    used = set(re.findall(r"inet 10\.7[78]\.(\d+)\.", run("ip", "-4", "-o", "addr", "show").stdout))
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
    rack: str = ""  # rack-1.. and its leaf switch leaf-1.. on a racked testbed; "" on the single bridge
    switch: str = ""
    agent: subprocess.Popen[bytes] | None = None
    rank: subprocess.Popen[bytes] | None = None
    delay: subprocess.Popen[bytes] | None = None


class Testbed:
    __test__ = False  # a helper, not a test class (its name starts with "Test")

    def __init__(self, workdir: Path, owner: int | None = None, *, racks: int = 1, per_rack: int = 4) -> None:
        """``racks`` > 1: that many racks of ``per_rack`` nodes, a bridge each, joined through the uplink (two racks:
        one veth pair; more would need a spine this bed does not model)."""
        if not 1 <= racks <= 2 or not 1 <= racks * per_rack <= len(NODES):
            raise ValueError(f"racks={racks}, per_rack={per_rack}: one or two racks of at most {len(NODES)} nodes")
        self.workdir = workdir
        self.tag = f"{PREFIX}{owner or os.getpid()}"
        self.racks, self.per_rack = racks, per_rack
        self.subnet = 0
        self.bridge = f"{self.tag}br" if racks == 1 else f"{self.tag}mg"  # the one the agents post over
        self.uplink = (f"{self.tag}u1", f"{self.tag}u2") if racks == 2 else None
        self.nodes: list[Node] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.built: list[tuple[str, str]] = []  # ("netns" | "link", name), in creation order

    @property
    def bridge_addr(self) -> str:
        """The host's address on the bridge the agents post over: where the server listens."""
        return f"10.77.{self.subnet}.254" if self.racks == 1 else f"10.78.{self.subnet}.254"

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    # -- network ----------------------------------------------------------------------------------------------------
    def build(self, link_rate: str | None = "1gbit") -> None:
        """``link_rate``: every node's link is shaped to this (both ways). Unshaped, a veth moves whatever the CPU
        can copy, so on a busy two-core machine a bulk probe measures the scheduler, not the link; shaped, the link
        is the bottleneck, as on a real cluster, and a fault is a change of one node's rate."""
        with network_lock.changing():  # the host's namespace gains the bridge's address (and loses it at close)
            self._build(link_rate)

    def _build(self, link_rate: str | None) -> None:
        self.subnet = _free_subnet(os.getpid())
        self._bridge(self.bridge, self.bridge_addr)
        racks = [self.bridge] if self.racks == 1 else [self._bridge(f"{self.tag}r{r}") for r in (1, 2)]
        if self.uplink:
            # The uplink: a veth pair between the rack bridges. tbf on one end shapes what crosses towards the other
            # rack, so shaping both ends slows every cross-rack pair both ways, and no pair inside a rack.
            run("ip", "link", "add", self.uplink[0], "type", "veth", "peer", "name", self.uplink[1])
            self.built.append(("link", self.uplink[0]))
            for end, bridge in zip(self.uplink, racks, strict=True):
                run("ip", "link", "set", end, "master", bridge, "up")
        for i, letter in enumerate(NODES[:self.racks * self.per_rack], start=1):
            rack = (i - 1) // self.per_rack + 1
            node = Node(f"node-{letter}", f"{self.tag}{letter}", f"10.77.{self.subnet}.{i}", f"{self.tag}{letter}h",
                        *((f"rack-{rack}", f"leaf-{rack}") if self.racks > 1 else ("", "")))
            run("ip", "netns", "add", node.ns)
            self.built.append(("netns", node.ns))
            self._veth(node, node.veth, f"{self.tag}{letter}n", racks[rack - 1], "eth0", node.addr)
            if self.racks > 1:
                self._veth(node, f"{self.tag}{letter}m", f"{self.tag}{letter}o", self.bridge, "mgmt0",
                           f"10.78.{self.subnet}.{i}")
            run("ip", "-n", node.ns, "link", "set", "lo", "up")
            self.nodes.append(node)
            if link_rate:
                self.limit_rate(node.name, link_rate)

    def _bridge(self, name: str, addr: str | None = None) -> str:
        run("ip", "link", "add", name, "type", "bridge")
        self.built.append(("link", name))
        if addr:
            run("ip", "addr", "add", f"{addr}/24", "dev", name)
        run("ip", "link", "set", name, "up")
        return name

    def _veth(self, node: Node, host_end: str, ns_end: str, bridge: str, ifname: str, addr: str) -> None:
        run("ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        self.built.append(("link", host_end))
        run("ip", "link", "set", ns_end, "netns", node.ns)
        run("ip", "link", "set", host_end, "master", bridge, "up")
        run("ip", "-n", node.ns, "link", "set", ns_end, "name", ifname)
        run("ip", "-n", node.ns, "addr", "add", f"{addr}/24", "dev", ifname)
        run("ip", "-n", node.ns, "link", "set", ifname, "up")

    def close(self) -> None:
        """Every process, then every namespace (their veths, qdiscs and iptables rules go with them), then links."""
        with network_lock.changing():
            self._close()

    def _close(self) -> None:
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
        return sorted(set(re.findall(rf"\b{self.tag}{_SUFFIX}\b", names)))

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

    def start_agents(self, server: str, token: str, interval_s: float = 0.5,
                     probes: dict[str, float | int] | None = None, ib_roots: dict[str, Path] | None = None) -> None:
        """``probes``: settings of the probes source over the testbed's (``{"bulk_bytes": 0}``: pings only).
        ``ib_roots``: node -> a stand-in ``/sys/class/infiniband`` tree its IB source reads (the source is off on the
        others: the namespaces have no HCA)."""
        token_file = self.workdir / "token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        for node in self.nodes:
            config = self.workdir / f"{node.name}.agent.toml"
            text = self._agent_config(node, server, token_file, interval_s, probes or {})
            if node.name in (ib_roots or {}):
                text = text.replace("[sources.ib]\nenabled = false", f'[sources.ib]\nroot = "{(ib_roots or {})[node.name]}"')
            config.write_text(text)
            node.agent = self.spawn(node, [sys.executable, "-m", "clusterdx", "agent", "--config", str(config)],
                                    f"{node.name}.agent.log")

    def _agent_config(self, node: Node, server: str, token_file: Path, interval_s: float,
                      probes: dict[str, float | int] | None = None) -> str:
        # Every other node is a static peer: a full mesh (seven peers at eight nodes, one round each second). The
        # server's plan (same leaf + a cross-leaf sample rotating each minute) would take minutes to reach a given
        # cross-rack pair here, and needs host names the namespaces can resolve.
        peers = [f"{n.name}={n.addr}:{PROBE_PORT}" for n in self.nodes]
        # Short probe rounds and a bulk transfer every second: a slow link is named within seconds, and the bulk
        # traffic (4 MiB per node per second, the default size) stays far below what the veths carry. Two racks:
        # every 3 s. Agents started together probe in step, each sending its n-th transfer to its n-th peer, so at
        # eight nodes several transfers arrive at one node at once and each measures a share of its 1 Gb/s: every
        # second, some node was named narrow within minutes (benchmarks/testbed_healthy.py), every 3 s none was.
        # 4 MiB stays well above the links' tbf bucket (500 KB at 1 Gb/s), which a small transfer measures instead.
        # ... and each node's round a little longer than the one before: agents started together otherwise probe in
        # the same 30 ms of every second for good, and two of them sending to one node measure half its link each
        # time (detectors/paths.py leaves such contended transfers out; the node rule does not yet).
        round_s = 1.0 if self.racks == 1 else round(1.0 + 0.013 * self.nodes.index(node), 3)
        settings: dict[str, float | int] = {"round_s": round_s, "pings_per_peer": 4, "timeout_s": 1.0, "max_round_s": 3.0,
                                            "bulk_bytes": 4 << 20, "bulk_period_s": 1.0 if self.racks == 1 else 3.0,
                                            "bulk_timeout_s": 5.0, **(probes or {})}
        topology = [f'[topology]\nrack = "{node.rack}"\nswitch = "{node.switch}"'] if node.rack else []
        return "\n".join([
            f'server = "{server}"', f'token_file = "{token_file}"', f'agent_id = "{node.name}"',
            f'host = "{node.name}"', f"interval_s = {interval_s}",
            f'spool_path = "{self.workdir / (node.name + ".spool.sqlite3")}"',
            "backoff_initial_s = 0.2", "backoff_max_s = 1.0", "http_timeout_s = 5.0",
            *(f"[sources.{s}]\nenabled = false" for s in ("gpu", "ib", "kmsg", "nccl")),
            f'[sources.hooks]\naddr = "{HOOK_ADDR}"',
            "[sources.host]",
            "[sources.probes]", f"peers = {json.dumps(peers)}", f'self_name = "{node.name}"',
            f'listen_host = "{node.addr}"', f"port = {PROBE_PORT}", *(f"{k} = {v}" for k, v in settings.items()),
            *topology, "",
        ])

    def start_job(self, run_name: str, *, compute_s: float = 0.05, collective_timeout_s: float = 120.0,
                  env: dict[int, dict[str, str]] | None = None) -> None:
        """One rank per node, rank i on the i-th node, rank 0 (the rendezvous) on node-a. ``env``: extra variables
        by rank (an NCCL_* setting the hooks report as the rank's run metadata)."""
        for rank, node in enumerate(self.nodes):
            rank_env = {"RANK": str(rank), "WORLD_SIZE": str(len(self.nodes)), "LOCAL_RANK": "0",
                        "MASTER_ADDR": self.nodes[0].addr, "MASTER_PORT": str(MASTER_PORT),
                        "GLOO_SOCKET_IFNAME": "eth0", "CLUSTERDX_AGENT_ADDR": HOOK_ADDR, "CLUSTERDX_RUN": run_name,
                        "CLUSTERDX_HOOK_TRANSPORT": "agent", **(env or {}).get(rank, {})}
            argv = [sys.executable, str(HERE / "netns_rank.py"), "--compute-s", str(compute_s),
                    "--slow-file", str(self.workdir / "slow-data.rank{rank}"),
                    "--collective-timeout-s", str(collective_timeout_s)]
            node.rank = self.spawn(node, argv, f"{node.name}.rank.log", env=rank_env)

    # -- faults -----------------------------------------------------------------------------------------------------
    def add_delay(self, name: str, delay_ms: float, program: Path, queue: int = 0, source: str | None = None) -> None:
        """Hold every packet *entering* the node for ``delay_ms`` (holding outgoing ones would count against the
        sender's socket buffer and collapse its throughput instead of adding latency). ``--queue-bypass``: without
        the program, packets pass undelayed. ``source``: only what that node sends in (one path: both directions of
        the pair's round trip are delayed, every other pair of both nodes stays fast)."""
        node = self.node(name)
        log = f"{node.name}.delay{queue}.log"
        node.delay = self.spawn(node, [str(program), str(queue), str(delay_ms)], log, stdin=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while "ready" not in self.log(log):
            if node.delay.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nfq_delay did not start: {self.log(log)}")
            time.sleep(0.02)
        match = ["-s", self.node(source).addr] if source else []
        run("ip", "netns", "exec", node.ns, "iptables", "-A", "INPUT", "-i", "eth0", *match, "-j", "NFQUEUE",
            "--queue-num", str(queue), "--queue-bypass")

    def limit_rate(self, name: str, rate: str = "100mbit") -> None:
        """tbf both ways: the bridge end of the veth shapes what enters the node, the namespace end what leaves.
        Replaces the link's rate if it has one (:func:`_shape`). :meth:`links` prints what each qdisc did."""
        node = self.node(name)
        for prefix, dev in (((), node.veth), (("ip", "netns", "exec", node.ns), "eth0")):
            _shape(prefix, dev, rate)

    def links(self) -> list[str]:
        """Each node's shaped link, both ends: the qdisc's rate and what it sent, dropped, held back and holds now
        (``tc -s qdisc``), for failure messages: a link that stopped sending shows it here."""
        out = []
        for node in self.nodes:
            for end, prefix, dev in (("switch side", (), node.veth),
                                     ("node side", ("ip", "netns", "exec", node.ns), "eth0")):
                text = run(*prefix, "tc", "-s", "qdisc", "show", "dev", dev, "root", check=False).stdout
                out.append(f"  link {node.name} {end}: {' '.join(text.split())}")
        return out

    def limit_uplink(self, rate: str = "100mbit") -> None:
        """tbf on both ends of the uplink between the racks: every cross-rack pair shares ``rate`` each way."""
        if not self.uplink:
            raise RuntimeError("a single-bridge testbed has no uplink (Testbed(..., racks=2))")
        for end in self.uplink:
            _shape((), end, rate)

    def slow_loader(self, rank: int, delay_s: float) -> None:
        """From now on, rank ``rank``'s DataLoader takes ``delay_s`` per batch (a slow filesystem behind it)."""
        tmp = self.workdir / f"slow-data.rank{rank}.tmp"
        tmp.write_text(str(delay_s))
        tmp.replace(self.workdir / f"slow-data.rank{rank}")

    def signal_rank(self, name: str, sig: signal.Signals) -> None:
        rank = self.node(name).rank
        assert rank is not None and rank.poll() is None, f"the rank on {name} is not running"
        os.kill(rank.pid, sig)

    def cut_off(self, name: str) -> None:
        """Take the node's links down at the switch side (the bridge ends of its veths), as a pulled cable or a dead
        switch port does: the node's interfaces lose carrier, its processes keep running, and nothing it sends or
        is sent reaches anyone (no reset, no ICMP: its peers only see timeouts)."""
        node = self.node(name)
        ends = [node.veth] + ([node.veth[:-1] + "m"] if self.racks > 1 else [])
        for end in ends:
            run("ip", "link", "set", end, "down")
