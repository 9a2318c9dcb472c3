"""Many nodes' first batches at once, through a real server: each request is stored in a thread of its own, so
the inventory they share (nodes, runs, ranks) must never hand one request a row another has not committed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from dashboard.storage import frames as fr
from dashboard.telemetry import models as m
from tests.server import framed
from tests.server.conftest import AsgiServer, World, make_batch


def first_batch(node: int) -> dict[str, Any]:
    host = f"node-{node:03d}"
    meta = [{"run": "run-1", "rank": node * 2 + i, "world_size": 64, "ts": 1.7e9, "host": host, "local_rank": i,
             "env": {"NCCL_IB_TIMEOUT": "22"}} for i in range(2)]
    batch = make_batch(seq=0, host=host, runs=meta)
    for i, step in enumerate(batch["steps"]):
        step["rank"] = node * 2 + i
    return batch


def test_concurrent_first_batches_are_all_stored(asgi_server: AsgiServer, world: World) -> None:
    with httpx.Client(base_url=asgi_server.url, headers={"Authorization": f"Bearer {world.token}"}, timeout=30) as c:
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda n: c.post("/api/v1/ingest", json=first_batch(n)), range(32)))
        assert [r.status_code for r in answers] == [200] * 32, [r.text for r in answers if r.status_code != 200]
        # The second round uses the cached ids.
        with ThreadPoolExecutor(16) as pool:
            again = list(pool.map(lambda n: c.post("/api/v1/ingest", json={**first_batch(n), "seq": 1}), range(32)))
        assert {r.json()["status"] for r in again} == {"accepted"}
    assert m.Run.objects.filter(name="run-1").count() == 1
    assert m.Node.objects.count() == 32
    assert m.Rank.objects.count() == 64 and m.Run.objects.get().world_size == 64
    assert framed.count(fr.STEPS) == 128
