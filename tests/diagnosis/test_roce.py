"""RDMA congestion from the port counters: which storm is a finding, on which subject, with which fix.

Four nodes send one port sample a second for ten seconds (counters as deltas, as the agent's IB source sends
them); ``deltas(host, second)`` says what each sample carries on top of a healthy RoCE port's background.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from dashboard.diagnosis.detectors import Thresholds, run_all
from dashboard.diagnosis.detectors.buffer import WindowBuffer

T0 = 1_760_000_000.0
NODES = ("node-a", "node-b", "node-c", "node-d")
BACKGROUND = {"port_xmit_data": 10**9, "port_xmit_wait": 20_000, "hw.np_cnp_sent": 40, "hw.rp_cnp_handled": 30}

Deltas = Callable[[str, int], dict[str, int]]


def window(deltas: Deltas, fabric: str = "roce", seconds: int = 10) -> Any:
    buf = WindowBuffer(interconnect=fabric)
    for sec in range(seconds):
        ts = T0 + sec
        for host in NODES:
            counters = {**BACKGROUND, **deltas(host, sec)}
            buf.add({"host": host, "sent_at": ts, "ports": [
                {"ts": ts, "device": "mlx5_0", "port": 1, "state": "ACTIVE", "rate_gbps": 400.0,
                 "link_layer": "Ethernet" if fabric == "roce" else "InfiniBand", "interval_s": 1.0,
                 "counters": counters}]})
    return buf.window(T0 + seconds - 1)


def congestion(deltas: Deltas, fabric: str = "roce") -> list[Any]:
    return [d for d in run_all(window(deltas, fabric), Thresholds()) if d.kind == "congestion"]


def on(host: str, counters: dict[str, int], since: int = 0) -> Deltas:
    return lambda h, sec: counters if h == host and sec >= since else {}


@pytest.mark.parametrize(("deltas", "expected"), [
    pytest.param(lambda h, s: {}, [], id="healthy background: nothing"),
    pytest.param(on("node-b", {"hw.packet_seq_err": 300, "hw.out_of_sequence": 200}),
                 [("node", "node-b", "error", ["loss"])], id="retransmit storm on one node"),
    pytest.param(on("node-c", {"hw.local_ack_timeout_err": 2}), [("node", "node-c", "error", ["timeouts"])],
                 id="local ACK timeouts"),
    pytest.param(on("node-d", {"hw.np_cnp_sent": 80_000}), [("node", "node-d", "warning", ["ecn"])],
                 id="sustained CNPs"),
    pytest.param(on("node-a", {"port_xmit_wait": 50_000_000}), [("node", "node-a", "warning", ["xmit_wait"])],
                 id="one port paused far beyond the others"),
    pytest.param(lambda h, s: {"hw.out_of_sequence": 500} if h != "node-d" else {},
                 [("cluster", "cluster", "error", ["loss"])], id="most nodes at once: the fabric"),
    pytest.param(on("node-b", {"hw.packet_seq_err": 3000}, since=9), [], id="one burst: not a storm"),
    pytest.param(on("node-b", {"hw.packet_seq_err": 3000}, since=7), [("node", "node-b", "error", ["loss"])],
                 id="three samples of a fresh storm: named"),
])
def test_it_names_the_congested_subject(deltas: Deltas, expected: list[tuple[str, str, str, list[str]]]) -> None:
    got = congestion(deltas)
    assert [(d.subject_type, d.subject, d.severity, d.evidence["metrics"]["classes"]) for d in got] == expected


def test_the_roce_fix_names_pfc_ecn_and_nccl_settings() -> None:
    (d,) = congestion(on("node-b", {"hw.packet_seq_err": 300, "hw.local_ack_timeout_err": 1}))
    for words in ("PFC", "ECN", "NCCL_IB_TC", "NCCL_IB_GID_INDEX", "NCCL_IB_TIMEOUT"):
        assert words in d.action, words
    m = d.evidence["metrics"]
    assert m["worst"] == "timeouts" and m["fabric"] == "roce"
    (port,) = m["ports"]
    # The newest 6 s: seven samples, the first one's delta (before the span) left out, six one-second intervals.
    assert port["port"] == "mlx5_0:1" and port["counters"]["hw.packet_seq_err"] == 6 * 300
    assert port["per_s"]["loss"] == 300.0
    assert d.evidence["series"]["loss"][-1] == 300


def test_on_infiniband_the_fix_is_the_fabric_not_pfc() -> None:
    (d,) = congestion(on("node-b", {"hw.out_of_sequence": 500}), fabric="ib")
    assert "ibdiagnet" in d.action and "PFC" not in d.action and d.evidence["metrics"]["fabric"] == "ib"


def test_a_threshold_can_be_raised_in_settings() -> None:
    w = window(on("node-b", {"hw.packet_seq_err": 300}))
    assert [d for d in run_all(w, Thresholds(extra={"congestion_loss_per_s": 1000.0})) if d.kind == "congestion"] == []


def test_a_port_row_is_suspect_when_it_shows_trouble_by_itself() -> None:
    """``port_suspect`` (worked out once per row as it enters the window) is what the port rule starts from: a state
    other than ACTIVE or a non-zero error / link-down count; a low rate is judged against the cluster's at the pass."""
    from dashboard.diagnosis.detectors.window import port_suspect

    assert [port_suspect(s, None) for s in ("ACTIVE", "4: ACTIVE", "Active", None, "")] == [0.0] * 5
    assert [port_suspect(s, None) for s in ("DOWN", "1: DOWN", "INIT", "Polling")] == [1.0] * 4
    assert port_suspect("ACTIVE", {"symbol_error": 0, "port_xmit_data": 10**9, "port_xmit_wait": 5}) == 0.0
    for counter in ("symbol_error", "link_downed", "port_rcv_errors", "port_xmit_discards"):
        assert port_suspect("ACTIVE", {counter: 2}) == 1.0, counter


@pytest.mark.parametrize(("port", "title"), [
    ({"state": "DOWN"}, "flapping"),
    ({"counters": {"symbol_error": 7}}, "link errors"),
    ({"rate_gbps": 100.0}, "runs at 100 of 400 Gb/s"),
])
def test_a_sick_port_is_named_on_its_node_and_no_other(port: dict[str, Any], title: str) -> None:
    buf = WindowBuffer(interconnect="ib")
    for sec in range(10):
        ts = T0 + sec
        for host in NODES:
            sample = {"ts": ts, "device": "mlx5_0", "port": 1, "state": "ACTIVE", "rate_gbps": 400.0,
                      "link_layer": "InfiniBand", "interval_s": 1.0, "counters": dict(BACKGROUND)}
            if host == "node-c" and sec % 2:  # every other sample: a flap, errors, or a slow link
                sample = {**sample, **port, "counters": {**BACKGROUND, **port.get("counters", {})}}
            buf.add({"host": host, "sent_at": ts, "ports": [sample]})
    found = [d for d in run_all(buf.window(T0 + 9), Thresholds()) if d.kind == "slow_link"]
    assert [(d.subject, title in d.title) for d in found] == [("node-c", True)], [d.title for d in found]
