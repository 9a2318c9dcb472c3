"""The hook socket listens on the node's loopback only: a datagram from another address is refused, and listening
on a non-loopback address takes an explicit ``allow_remote = true`` (with a warning)."""

from __future__ import annotations

import json
import logging
import socket
import time
from typing import Any

import pytest

from collectors.agent import registry
from collectors.agent.config import AgentConfig, ConfigError, build
from collectors.agent.hooks import HookSource
from collectors.agent.source import Collected

BASE = {"server": "https://dx.example", "token_file": "/etc/clusterdx/token"}
SOURCES = tuple(registry.SOURCES)


def node_address() -> str | None:
    """This machine's address on its default route (no packet is sent), or None on a machine with loopback only."""
    for target in ("198.51.100.1", "10.255.255.254"):  # documentation / private addresses: never reached
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((target, 9))
            except OSError:
                continue
            addr = str(s.getsockname()[0])
        if not addr.startswith("127.") and addr != "0.0.0.0":
            return addr
    return None


def gram(step: int, **lists: Any) -> bytes:
    return json.dumps({"v": 1, "host": "n1", "pid": 7, "steps": [
        {"run": "r", "rank": 0, "step": step, "ts": time.time(), "step_time_s": 0.5}], **lists}).encode()


def send_from(source_ip: str, dest: tuple[str, int], payload: bytes) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((source_ip, 0))
        s.sendto(payload, dest)


def drain(src: HookSource, want_steps: int) -> Collected:
    out = Collected()
    deadline = time.monotonic() + 10
    while len(out.steps) < want_steps and time.monotonic() < deadline:
        time.sleep(0.02)
        src.collect(time.time(), out)
    return out


def test_it_listens_on_loopback_by_default() -> None:
    assert HookSource().addr == ("127.0.0.1", 8650)
    assert "hooks" not in AgentConfig().sources  # nothing in the config: the source's own default applies
    src = HookSource(addr="127.0.0.1:0")
    assert src.start() is None
    try:
        assert src.addr[0] == "127.0.0.1"
    finally:
        src.close()


def test_the_default_socket_refuses_a_datagram_from_a_non_loopback_source() -> None:
    ip = node_address()
    if ip is None:
        pytest.skip("this machine has no address besides loopback")
    src = HookSource(addr="127.0.0.1:0")
    assert src.start() is None
    try:
        # Linux delivers a datagram from the node's own address to 127.0.0.1 (and, with route_localnet=1 as
        # kube-proxy sets it, from other hosts too): the source address is what the agent must check.
        send_from(ip, src.addr, gram(1))
        send_from("127.0.0.1", src.addr, gram(2))
        out = drain(src, 1)
    finally:
        src.close()
    assert [s["step"] for s in out.steps] == [2]
    assert out.dropped == {"hook_remote_refused": 1}


def test_a_non_loopback_address_needs_allow_remote_in_the_config() -> None:
    with pytest.raises(ConfigError) as info:
        build({**BASE, "sources": {"hooks": {"addr": "0.0.0.0:8650"}}}, {}, SOURCES)
    assert info.value.problems == [
        "sources.hooks.addr: 0.0.0.0 is not a loopback address, so any machine that reaches this node could send "
        "records as its training jobs; keep 127.0.0.1:8650 (pods on the host network reach it) or set "
        "allow_remote = true and firewall the port"]
    for addr in ("127.0.0.1:8650", "[::1]:8650", "localhost:8650", ":8650"):
        build({**BASE, "sources": {"hooks": {"addr": addr}}}, {}, SOURCES)
    cfg = build({**BASE, "sources": {"hooks": {"addr": "0.0.0.0:8650", "allow_remote": True}}}, {}, SOURCES)
    assert cfg.sources["hooks"]["allow_remote"] is True
    with pytest.raises(ConfigError) as info:
        build({**BASE, "sources": {"hooks": {"addr": "0.0.0.0:8650", "allow_remote": "yes"}}}, {}, SOURCES)
    assert info.value.problems == ["sources.hooks.allow_remote: expected true or false, got 'yes'"]


def test_the_source_itself_will_not_listen_remotely_unless_allowed(caplog: pytest.LogCaptureFixture) -> None:
    refused = HookSource(addr="0.0.0.0:0")
    assert refused.start() == "0.0.0.0 is not a loopback address; set allow_remote = true to listen on it"
    ip = node_address()
    if ip is None:
        pytest.skip("this machine has no address besides loopback")
    src = HookSource(addr="0.0.0.0:0", allow_remote=True)
    with caplog.at_level(logging.WARNING, logger="clusterdx.agent.hooks"):
        assert src.start() is None
    try:
        assert "allow_remote" in caplog.text and "0.0.0.0" in caplog.text
        send_from(ip, (ip, src.addr[1]), gram(3))
        out = drain(src, 1)
    finally:
        src.close()
    assert [s["step"] for s in out.steps] == [3]


def test_a_datagram_may_not_carry_node_events_such_as_an_xid() -> None:
    src = HookSource(addr="127.0.0.1:0")
    xid = {"ts": time.time(), "kind": "xid", "code": 79, "gpu_index": 0, "severity": "critical"}
    ckpt = {"ts": time.time(), "kind": "checkpoint", "run": "r", "rank": 0, "step": 4}
    src.accept(gram(4, events=[xid]), ("127.0.0.1", 1))
    src.accept(gram(5, events=[ckpt]), ("127.0.0.1", 1))
    out = Collected()
    src.collect(time.time(), out)
    assert [s["step"] for s in out.steps] == [5] and [e["kind"] for e in out.events] == ["checkpoint"]
    assert out.dropped == {"hook_bad_datagram": 1}
