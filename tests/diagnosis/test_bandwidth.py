"""Bulk-bandwidth slow links: a transfer only ever comes out slower than its link (contention with another probe, a
busy CPU), so a node is narrow only when every one of its recent transfers is, against several peers. The testbed
found healthy nodes named on 80% slow transfers."""

from __future__ import annotations

from collections.abc import Callable

from dashboard.diagnosis.detectors import Thresholds
from dashboard.diagnosis.detectors.buffer import WindowBuffer
from dashboard.diagnosis.detectors.network import slow_links

T0 = 1_760_000_000.0
NODES = ("node-a", "node-b", "node-c", "node-d")


def window(bw: Callable[[str, str, int], float], seconds: int = 10) -> WindowBuffer:
    """Every node sends a bulk transfer to every peer each second, at ``bw(src, dst, second)`` Gb/s."""
    buf = WindowBuffer()
    for sec in range(seconds):
        ts = T0 + sec
        for src in NODES:
            probes = [{"ts": ts, "peer": dst, "sent": 4, "lost": 0, "rtt_ms": 0.05, "bw_gbps": bw(src, dst, sec)}
                      for dst in NODES if dst != src]
            buf.add({"host": src, "sent_at": ts, "probes": probes})
    return buf


def named(buf: WindowBuffer, seconds: int = 10) -> list[tuple[str, str]]:
    return [d.key for d in slow_links(buf.window(T0 + seconds - 1), Thresholds(), set())]


def test_it_names_a_node_whose_every_recent_transfer_is_narrow() -> None:
    buf = window(lambda a, b, s: 0.1 if "node-b" in (a, b) else 1.0)
    assert named(buf) == [("slow_link", "node-b")]
    d = slow_links(buf.window(T0 + 9), Thresholds(), set())[0]
    assert d.evidence["metrics"]["bw_gbps"] == 0.1 and d.evidence["metrics"]["baseline_bw_gbps"] == 1.0


def test_one_transfer_at_link_speed_clears_a_node_that_was_merely_contended() -> None:
    # 17 of node-b's 18 transfers in its last three rounds are slow (94%, over the old 75% bar), but one ran at
    # the link's speed: the link is fine, the others met contention.
    best = ("node-b", "node-a", 9)
    buf = window(lambda a, b, s: 1.0 if (a, b, s) == best else 0.5 if "node-b" in (a, b) else 1.0)
    assert named(buf) == []


def test_a_healthy_cluster_with_noisy_transfers_is_quiet() -> None:
    buf = window(lambda a, b, s: 1.0 - 0.1 * ((NODES.index(a) * 3 + NODES.index(b) + s) % 5))
    assert named(buf) == []
