"""Pairwise probes on 127.0.0.1: responders on several ports, a stopped one, a frozen one, bulk, rotation."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clusterdx import wire
from collectors.agent.source import Collected
from collectors.sources.probe_responder import BULK, ECHO, LENGTH, Responder
from collectors.sources.probes import ProbeSource, parse_peer, percentile

FAST = {"round_s": 0.05, "timeout_s": 0.3, "pings_per_peer": 4, "bulk_bytes": 0, "listen": False,
        "self_name": "me"}


@pytest.fixture
def responders() -> Iterator[list[Responder]]:
    started = []
    for _ in range(3):
        r = Responder("127.0.0.1", 0)
        r.start()
        started.append(r)
    yield started
    for r in started:
        r.stop()


def _peers(responders: list[Responder]) -> list[str]:
    return [f"node-{i}=127.0.0.1:{r.port}" for i, r in enumerate(responders)]


def _next_round(source: ProbeSource, timeout: float = 10.0) -> dict[str, dict[str, Any]]:
    """The next round the worker finishes, by peer; every record checked against the wire format."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = Collected()
        source.collect(time.time(), out)
        if out.probes:
            return {wire.validate(wire.Probe, p)["peer"]: p for p in out.probes}
        time.sleep(0.01)
    raise AssertionError("no probe round finished in time")


def test_it_measures_rtt_to_every_peer(responders: list[Responder]) -> None:
    source = ProbeSource(peers=_peers(responders), **FAST)
    assert source.start() is None
    try:
        probes = _next_round(source)
    finally:
        source.close()
    assert sorted(probes) == ["node-0", "node-1", "node-2"]
    for probe in probes.values():
        assert (probe["sent"], probe["lost"]) == (4, 0)
        assert 0 < probe["rtt_ms"] <= probe["rtt_p99_ms"] < 300
        assert "bw_gbps" not in probe


def test_a_stopped_responder_shows_as_loss(responders: list[Responder]) -> None:
    source = ProbeSource(peers=_peers(responders), **FAST)
    assert source.start() is None
    try:
        assert _next_round(source)["node-1"]["lost"] == 0
        responders[1].stop()  # closes the kept-open connection, then refuses new ones
        _next_round(source)  # the round that was running when it stopped
        probes = _next_round(source)
    finally:
        source.close()
    assert (probes["node-1"]["sent"], probes["node-1"]["lost"]) == (4, 4)
    assert "rtt_ms" not in probes["node-1"]
    assert probes["node-0"]["lost"] == probes["node-2"]["lost"] == 0


def test_a_frozen_peer_times_out_as_loss_within_the_timeout() -> None:
    frozen = socket.create_server(("127.0.0.1", 0))  # connections queue in the backlog; nothing ever answers
    try:
        source = ProbeSource(peers=[f"frozen=127.0.0.1:{frozen.getsockname()[1]}"], **{**FAST, "timeout_s": 0.1})
        assert source.start() is None
        started = time.monotonic()
        probes = _next_round(source)
        elapsed = time.monotonic() - started
        source.close()
    finally:
        frozen.close()
    assert (probes["frozen"]["sent"], probes["frozen"]["lost"]) == (4, 4)
    assert elapsed < 2.0  # two timeouts, then the rest are counted lost without waiting for each


def test_a_bulk_transfer_measures_bandwidth(responders: list[Responder]) -> None:
    options = {**FAST, "bulk_bytes": 4 << 20, "bulk_period_s": 0}
    source = ProbeSource(peers=_peers(responders[:2]), **options)
    assert source.start() is None
    try:
        seen: dict[str, float] = {}
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:
            for peer, probe in _next_round(source).items():
                if "bw_gbps" in probe:
                    seen[peer] = probe["bw_gbps"]
    finally:
        source.close()
    assert sorted(seen) == ["node-0", "node-1"]  # in turn, one peer per bulk period
    assert all(bw > 0.05 for bw in seen.values())  # loopback moves gigabits; 50 Mb/s would mean it is broken


def test_many_peers_are_probed_in_a_rotating_sample(responders: list[Responder]) -> None:
    peers = [f"n{i}=127.0.0.1:{responders[i % 3].port}" for i in range(7)]
    source = ProbeSource(peers=peers, **{**FAST, "max_peers_per_round": 3})
    assert source.start() is None
    try:
        rounds = [sorted(_next_round(source)) for _ in range(3)]
    finally:
        source.close()
    assert all(len(r) == 3 for r in rounds)
    assert rounds[0] != rounds[1]
    assert {p for r in rounds for p in r} == {f"n{i}" for i in range(7)}


def test_the_peers_file_is_reread_and_self_is_skipped(tmp_path: Path, responders: list[Responder]) -> None:
    peers_file = tmp_path / "peers"
    peers_file.write_text(f"# the cluster\nme=127.0.0.1:{responders[0].port}\nb=127.0.0.1:{responders[1].port}\n")
    source = ProbeSource(peers_file=str(peers_file), **FAST)
    assert [p.label for p in source.peers()] == ["b"]
    peers_file.write_text(f"b=127.0.0.1:{responders[1].port}  # still here\nc=127.0.0.1:{responders[2].port}\n")
    assert [p.label for p in source.peers()] == ["b", "c"]


def test_the_responder_runs_alongside_and_reports_a_busy_port(responders: list[Responder]) -> None:
    source = ProbeSource(peers=_peers(responders[:1]), **{**FAST, "listen": True, "listen_host": "127.0.0.1",
                                                          "port": 0})
    assert source.start() is None
    assert source.listening_port > 0
    busy = ProbeSource(**{**FAST, "listen": True, "listen_host": "127.0.0.1", "port": source.listening_port})
    assert busy.start() == "no peers configured and no responder"
    source.close()
    with_peers = ProbeSource(peers=_peers(responders[:1]), **{**FAST, "listen": True, "listen_host": "127.0.0.1",
                                                              "port": responders[0].port})
    assert with_peers.start() is None  # probing still works; the note says what is missing
    out = Collected()
    with_peers.collect(time.time(), out)
    with_peers.close()
    assert out.events[0]["kind"] == "agent"
    assert "cannot listen" in out.events[0]["message"]
    wire.validate(wire.Event, out.events[0])


def test_the_responder_enforces_its_protocol_and_bounds() -> None:
    responder = Responder("127.0.0.1", 0, max_conns=2, max_bulk_bytes=1000)
    responder.start()
    address = ("127.0.0.1", responder.port)
    try:
        with socket.create_connection(address, timeout=2) as sock:
            sock.sendall(BULK + LENGTH.pack(1001))  # over the bound: cut off
            assert _recv(sock, 8) == b""
        with socket.create_connection(address, timeout=2) as sock:
            sock.sendall(b"X")  # unknown mode
            assert _recv(sock, 8) == b""
        with socket.create_connection(address, timeout=2) as sock:
            sock.sendall(BULK + LENGTH.pack(1000) + bytes(1000) + BULK + LENGTH.pack(3) + b"abc")
            assert _recv(sock, 16) == LENGTH.pack(1000) + LENGTH.pack(3)  # two requests on one connection
        held = [socket.create_connection(address, timeout=2) for _ in range(3)]
        for sock in held:
            sock.sendall(ECHO + b"ping")
        answers = [_recv(sock, 4) for sock in held]
        assert answers == [b"ping", b"ping", b""]  # the third connection is over max_conns
        for sock in held:
            sock.close()
    finally:
        responder.stop()


def test_peer_parsing_and_percentile() -> None:
    assert parse_peer("node-1") == parse_peer("node-1:8651")
    assert parse_peer("gpu7=10.0.0.7:9000").label == "gpu7"
    assert parse_peer("[fd00::5]:9000").host == "fd00::5"
    assert parse_peer("[fd00::5]").label == "fd00--5"  # a valid wire host name label
    with pytest.raises(ValueError, match="bad peer"):
        parse_peer("node-1:0")
    with pytest.raises(ValueError):
        parse_peer("node-1:http")
    assert percentile([5.0, 1.0, 3.0], 0.5) == 3.0
    assert percentile([1.0, 2.0, 3.0, 100.0], 0.99) == 100.0


def _recv(sock: socket.socket, n: int) -> bytes:
    """Up to n bytes; what came before the peer closed (or reset) the connection."""
    data = b""
    try:
        while len(data) < n and (chunk := sock.recv(n - len(data))):
            data += chunk
    except ConnectionResetError:
        pass
    return data



def test_every_round_finished_between_two_collects_is_reported(responders: list[Responder]) -> None:
    """A slow collect (or rounds as frequent as samples) must not lose a round: each is reported once."""
    source = ProbeSource(peers=_peers(responders[:1]), **FAST)
    assert source.start() is None
    try:
        deadline = time.monotonic() + 10
        while source._round < 3 and time.monotonic() < deadline:  # three rounds, none collected yet
            time.sleep(0.01)
        out = Collected()
        source.collect(time.time(), out)
        again = Collected()
        source.collect(time.time(), again)
    finally:
        source.close()
    assert len(out.probes) >= 3, out.probes
    assert len({p["ts"] for p in out.probes}) == len(out.probes), "each round once"
    assert not {p["ts"] for p in again.probes} & {p["ts"] for p in out.probes}
