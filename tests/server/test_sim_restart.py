"""`clusterdx demo` started a second time on the same data directory: its simulator numbers its batches from 0
again, which the server already holds with other content (409 seq_reused). Like the agent, it jumps past the reused
stretch and sends again, so the second run's samples are stored (they were all refused, and the cluster went
silent on its own dashboard)."""

from __future__ import annotations

import time
from typing import Any

from collectors.sim.model import SimCluster
from collectors.sim.scenario import parse
from collectors.sim.sender import RENUMBER_SKIP, Sender
from tests.server import framed
from tests.server.conftest import AsgiServer, World


def _run(server: AsgiServer, token: str, start: float, ticks: int) -> list[str]:
    sim = SimCluster(parse({"cluster": {"nodes": 2, "gpus_per_node": 2, "seed": 5}}), start_ts=start)
    sender = Sender(server.url, token, threads=2)
    try:
        return [o for t in range(ticks) for o in sender.send_and_wait(sim.tick(start + t + 1))]
    finally:
        sender.close()


def test_a_simulator_started_again_renumbers_and_is_stored(asgi_server: AsgiServer, world: World) -> None:
    from dashboard.storage import frames
    from dashboard.telemetry.models import AgentBatch

    t0 = time.time() - 60
    assert _run(asgi_server, world.token, t0, 3) == ["accepted"] * 6
    # The second run: the same agents and seqs 0..2, other samples (20 s later).
    assert _run(asgi_server, world.token, t0 + 20, 3) == ["accepted"] * 6
    seqs: Any = sorted(AgentBatch.objects.filter(cluster=world.cluster).values_list("agent_id", "seq"))
    per_agent = {a: [s for b, s in seqs if b == a] for a, _ in seqs}
    assert all(s == [0, 1, 2, RENUMBER_SKIP, RENUMBER_SKIP + 1, RENUMBER_SKIP + 2] for s in per_agent.values()), seqs
    stamps = sorted({round(ts - t0) for ts in framed.stored(frames.GPUS, cluster=world.cluster)["ts"]})
    assert stamps == [1, 2, 3, 21, 22, 23], stamps
