"""End to end: the agent process posting to the real Django ingest (pytest-django's live_server)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from agent_support import start_agent, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

SCENARIO = "gpus 8\n0 3 ecc_sbe_volatile 10 20\n0.3 2 xid 79\n0 7 error nvmlDeviceGetPcieReplayCounter 3\n"


@pytest.fixture(autouse=True)
def _fresh_ingest_caches() -> Iterator[None]:
    from dashboard.ingest.writer import clear_caches

    clear_caches()
    yield
    clear_caches()


@pytest.mark.parametrize("version", [1, 2])
def test_the_agent_feeds_the_real_ingest(live_server: Any, standin: Path, tmp_path: Path, version: int) -> None:
    """Either wire version (2: the GPU samples as a block, clusterdx.blocks) stores the same things."""
    from dashboard.storage import frames as fr
    from dashboard.telemetry import tokens
    from dashboard.telemetry.models import AgentBatch, Cluster, Event
    from tests.server import framed

    cluster = Cluster.objects.create(name="e2e")
    _, token = tokens.create_token(cluster, "agents")
    agent = start_agent(tmp_path, live_server.url, lib_dir=standin, scenario=SCENARIO, interval=0.2, token=token,
                        toml=f"wire_version = {version}")
    try:
        wait_for(lambda: AgentBatch.objects.filter(cluster=cluster).count() >= 4
                 and Event.objects.filter(cluster=cluster, kind="xid").exists(), what="batches and the Xid stored")
    finally:
        agent.stop()
    seqs = list(AgentBatch.objects.filter(cluster=cluster, agent_id="test-node").order_by("seq")
                .values_list("seq", flat=True))
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    xid = Event.objects.get(cluster=cluster, kind="xid")
    assert (xid.code, xid.gpu_index, xid.severity) == (79, 2, "critical")
    gpus = framed.stored(fr.GPUS, cluster=cluster)

    def latest(index: int) -> int:
        """The position of GPU ``index``'s newest sample."""
        mine = np.flatnonzero(gpus["index"] == index)
        return int(mine[np.argmax(gpus["ts"][mine])])

    seven = latest(7)
    assert np.isnan(gpus["pcie_replay_total"][seven])
    assert gpus.objs["unavailable"][seven]["pcie_replay_total"] == "not supported"
    assert gpus["ecc_sbe_volatile"][latest(3)] > 10
    assert "token refused" not in agent.log() and "rejected" not in agent.log()
    assert "sent as wire version 1" not in agent.log()


def test_an_agent_on_version_2_falls_back_when_its_server_predates_it(live_server: Any, standin: Path,
                                                                       tmp_path: Path, monkeypatch: Any) -> None:
    """A server of an earlier release parses with version 1's parser alone (what it ran): it refuses the first
    version 2 post with 400, and the agent rewrites its spool as version 1 and goes on, losing nothing."""
    from clusterdx import wire
    from dashboard.ingest import blocks
    from dashboard.storage import frames as fr
    from dashboard.telemetry import tokens
    from dashboard.telemetry.models import AgentBatch, Cluster
    from tests.server import framed

    monkeypatch.setattr(blocks, "parse", lambda body: wire.parse_batch(body, keep_records=True))
    cluster = Cluster.objects.create(name="e2e-old")
    _, token = tokens.create_token(cluster, "agents")
    agent = start_agent(tmp_path, live_server.url, lib_dir=standin, scenario=SCENARIO, interval=0.2, token=token,
                        toml="wire_version = 2")
    try:
        wait_for(lambda: AgentBatch.objects.filter(cluster=cluster).count() >= 4, what="batches stored")
    finally:
        agent.stop()
    seqs = list(AgentBatch.objects.filter(cluster=cluster).order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs  # no gap: the refused batch was resent
    gpus = framed.stored(fr.GPUS, cluster=cluster)
    assert sorted(set(gpus["index"].astype(int).tolist())) == list(range(8)) and len(gpus) % 8 == 0
    rewritten = re.search(r"predates wire version 2 .*: (\d+) spooled batch\(es\) rewritten", agent.log())
    assert rewritten and int(rewritten.group(1)) >= 1, agent.log()
    assert "dropped, not retried" not in agent.log()
