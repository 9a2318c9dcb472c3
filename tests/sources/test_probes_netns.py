"""Probes across real network namespaces: a rate-limited node shows in the bulk probe, not in idle RTT.

Three namespaces on a private bridge (10.77.x.0/24, no uplink): ``a`` probes, ``b`` and ``c`` answer, and ``c``'s
link is limited with ``tbf`` in both directions. Everything the test creates is removed, even when it fails.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.netns

REPO = Path(__file__).resolve().parents[2]
NODE = Path(__file__).with_name("netns_node.py")
RATE = "100mbit"


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs {tool} (apt-get install -y iproute2)"
    return None


@dataclass
class Net:
    tag: str
    subnet: str
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)

    def ns(self, node: str) -> str:
        return f"cdx{self.tag}{node}"

    def addr(self, index: int) -> str:
        return f"{self.subnet}.{index}"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _cleanup(net: Net) -> None:
    for ns in net.namespaces:  # deleting a namespace deletes the veth ends inside it, and so their peers
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
    for link in net.links:
        subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=10)


def _build(net: Net) -> None:
    bridge = f"cdx{net.tag}br"
    _ip("link", "add", bridge, "type", "bridge")
    net.links.append(bridge)
    _ip("link", "set", bridge, "up")
    for index, node in enumerate("abc", start=1):
        ns, host_end = net.ns(node), f"cdx{net.tag}{node}h"
        _ip("netns", "add", ns)
        net.namespaces.append(ns)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", f"cdx{net.tag}{node}n")
        net.links.append(host_end)
        _ip("link", "set", f"cdx{net.tag}{node}n", "netns", ns)
        _ip("link", "set", host_end, "master", bridge, "up")
        _ip("-n", ns, "link", "set", f"cdx{net.tag}{node}n", "name", "eth0")
        _ip("-n", ns, "addr", "add", f"{net.addr(index)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
    # Node c's link, both ways: the host end shapes what enters c, the namespace end what leaves it.
    tbf = ["root", "tbf", "rate", RATE, "burst", "64kb", "latency", "50ms"]
    subprocess.run(["tc", "qdisc", "add", "dev", f"cdx{net.tag}ch", *tbf], check=True, capture_output=True)
    subprocess.run(["ip", "netns", "exec", net.ns("c"), "tc", "qdisc", "add", "dev", "eth0", *tbf], check=True,
                   capture_output=True)


@pytest.fixture
def net() -> Iterator[Net]:
    why = _why_not()
    if why:
        pytest.skip(why)
    pid = os.getpid()
    net = Net(tag=f"{pid % 10000:04d}", subnet=f"10.77.{200 + pid % 50}")
    _cleanup(Net(net.tag, net.subnet, [net.ns(n) for n in "abc"], [f"cdx{net.tag}br"]))  # a crashed earlier run
    try:
        _build(net)
    except subprocess.CalledProcessError as exc:
        _cleanup(net)
        pytest.skip(f"cannot build namespaces here: {exc.stderr.decode(errors='replace').strip()}")
    try:
        yield net
    finally:
        _cleanup(net)


def _in_ns(net: Net, node: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", net.ns(node), sys.executable, str(NODE), *args]


def test_a_rate_limited_link_shows_in_bulk_bandwidth_not_in_idle_rtt(net: Net) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    servers = [subprocess.Popen(_in_ns(net, node, "serve", net.addr(index), "8651"), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, cwd=REPO)
               for index, node in ((2, "b"), (3, "c"))]
    try:
        for server in servers:
            assert server.stdout is not None and server.stdout.readline().strip() == b"ready"
        options = {"peers": [f"node-b={net.addr(2)}:8651", f"node-c={net.addr(3)}:8651"], "listen": False,
                   "self_name": "node-a", "round_s": 0.2, "pings_per_peer": 5, "timeout_s": 1.0,
                   "bulk_bytes": 2 << 20, "bulk_period_s": 0, "bulk_timeout_s": 5.0}
        probe = subprocess.run(_in_ns(net, "a", "probe", json.dumps(options)), capture_output=True, env=env,
                               cwd=REPO, timeout=30)
    finally:
        for server in servers:
            server.communicate(timeout=10)
    assert probe.returncode == 0, probe.stderr.decode(errors="replace")
    records = json.loads(probe.stdout)
    bw = {r["peer"]: r["bw_gbps"] for r in records if r.get("bw_gbps") is not None}
    rtt = {peer: statistics.median(r["rtt_ms"] for r in records if r["peer"] == peer) for peer in bw}
    print(f"bw_gbps={bw} idle_rtt_ms={rtt}")
    assert all(r["lost"] == 0 for r in records)
    assert sorted(bw) == ["node-b", "node-c"]
    # 100 Mb/s is 0.1 Gb/s; a veth without a limit moves gigabits.
    assert bw["node-c"] < 0.12
    assert bw["node-c"] < bw["node-b"] / 4
    # Idle round trips to the limited node stay sub-millisecond-ish: the limit is invisible without load.
    assert rtt["node-c"] < max(2.0, 4 * rtt["node-b"])
