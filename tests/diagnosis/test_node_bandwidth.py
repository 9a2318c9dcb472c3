"""A node is named for narrow bulk transfers only when they are narrow for what its link moved: agents probe in step,
so two transfers often arrive at one node together and each measures half of its link.

Eight nodes ping each other every second. Each round two nodes send into n08 at once, n08 and n07 send into one
node at once, and four other nodes send one transfer each (the cluster's yardstick). Before transfers were credited
with their share, n08, whose every transfer was a shared one, was named slow on a healthy cluster (the testbed saw
"node-h: bulk bandwidth 0.64 Gb/s vs 1.07").
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dashboard.diagnosis.detectors import Thresholds, run_all
from dashboard.diagnosis.detectors.buffer import WindowBuffer
from dashboard.diagnosis.detectors.network import sharing

T0 = 1_760_000_000.0
HOSTS = [f"n{i:02d}" for i in range(1, 9)]
LINK_GBPS = 1.0


def _round(s: int) -> list[tuple[int, int]]:
    """(sender, receiver) index pairs of round ``s``."""
    a, b, y = s % 3, 3 + s % 3, (s + 1) % 6
    pairs = [(a, 7), (b, 7), (7, y), (6, y)]
    used = {7, y}
    for src in (i for i in range(6) if i not in (a, b)):
        dst = next(r for r in ((src + 1 + s + k) % 7 for k in range(7)) if r != src and r not in used)
        used.add(dst)
        pairs.append((src, dst))
    return pairs


def _window(node_gbps: Callable[[int], float], seconds: int = 10):
    buf = WindowBuffer()
    for s in range(seconds):
        ts = T0 + s
        into: dict[int, int] = {}
        for _, dst in _round(s):
            into[dst] = into.get(dst, 0) + 1
        bulk = {}
        for src, dst in _round(s):
            # Transfers into one node split its link; a transfer is as fast as the narrower end allows.
            bulk[(src, dst)] = min(node_gbps(dst) / into[dst], node_gbps(src))
        for i, host in enumerate(HOSTS):
            probes = [{"ts": ts, "peer": HOSTS[j], "sent": 4, "lost": 0, "rtt_ms": 0.05,
                       **({"bw_gbps": bulk[(i, j)]} if (i, j) in bulk else {})} for j in range(8) if j != i]
            buf.add({"host": host, "sent_at": ts, "probes": probes, "hosts": [{"ts": ts, "cpu_pct": 30.0}]})
    return buf.window(T0 + seconds - 1)


def test_transfers_that_shared_their_receiver_do_not_name_a_healthy_node() -> None:
    w = _window(lambda i: LINK_GBPS)
    into_n08 = (w.probes["peer"] == w.node_index()["n08"]) & ~np.isnan(w.probes["bw_gbps"])
    assert set(sharing(w)[into_n08]) == {2.0}  # the schedule does what the docstring says
    assert {d.key for d in run_all(w, Thresholds())} == set()


def test_a_rate_limited_node_is_named_though_its_transfers_shared_its_link() -> None:
    found = run_all(_window(lambda i: 0.08 if i == 7 else LINK_GBPS), Thresholds())
    assert {d.key for d in found} == {("slow_link", "n08")}
    metrics = found[0].evidence["metrics"]
    assert metrics["bw_gbps"] < 0.1 < metrics["baseline_bw_gbps"] / 5, metrics
