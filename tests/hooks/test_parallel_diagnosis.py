"""End to end under every parallelism: four real gloo ranks (parallel_worker.py ``diagnose``, one launch for the
module) train FSDP2, tensor parallel over a 2-D DeviceMesh and a two-stage pipeline, one rank's loader or compute
slowed per run; the real hooks post to the real ingest endpoint (pytest-django's live server), the real diagnosis
pass reads what was stored, and the finding names that rank, within its group, and no other rank."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from hooks_support import free_port, gloo_env, run_ranks

WORLD, DELAY, STEPS = 4, 0.5, 7  # the lag floor is 2% of the step: 10 ms here, over a loaded machine's jitter
WORKER = Path(__file__).with_name("parallel_worker.py")
ROOT = Path(__file__).resolve().parents[2]
# (parallelism, slow rank, what is slow) -> (finding kind, the group role it is named in, group index, rank in it).
# Meshes (see parallel_worker.py): FSDP2 dp=4; TP [[0, 1], [2, 3]] as dp x tp; PP [[0, 1], [2, 3]] as dp x pp.
SCENARIOS = {
    ("fsdp2", 2, "data"): ("data_starvation", "dp", 0, 2),
    ("fsdp2", 1, "compute"): ("straggler", "dp", 0, 1),
    ("tp", 3, "data"): ("data_starvation", "tp", 1, 1),
    ("tp", 0, "compute"): ("straggler", "tp", 0, 0),
    ("pp", 1, "data"): ("data_starvation", "pp", 0, 1),
    ("pp", 2, "compute"): ("straggler", "pp", 1, 0),
}
LATE = ("data_starvation", "straggler")


@pytest.mark.django_db(transaction=True)
def test_each_slow_rank_is_named_in_its_group_and_no_other(live_server):
    pytest.importorskip("torch.distributed.pipelining")
    from dashboard.diagnosis.models import Finding
    from dashboard.diagnosis.tasks import run_pass
    from dashboard.storage import frames as fr
    from dashboard.telemetry import tokens
    from dashboard.telemetry.models import Cluster, Run
    from tests.server import framed

    cluster = Cluster.objects.create(name="parallel-dx")
    _, token = tokens.create_token(cluster, "hooks")
    port = free_port()
    specs = [f"{name}:{rank}:{kind}" for name, rank, kind in SCENARIOS]
    jobs = []
    for rank in range(WORLD):
        env = gloo_env(rank, WORLD, port, CLUSTERDX_SERVER=live_server.url, CLUSTERDX_TOKEN=token,
                       CLUSTERDX_HOOK_TRANSPORT="server", CLUSTERDX_HOOK_BEAT_S="0")
        for name in ("CLUSTERDX_AGENT_ADDR", "CLUSTERDX_RUN", "CLUSTERDX_TOKEN_FILE"):
            env.pop(name, None)
        jobs.append(([sys.executable, str(WORKER), "diagnose", str(DELAY), str(STEPS), *specs], env))
    run_ranks(jobs, timeout=150, tail=3000)
    runs = {f"dx-{name}-{rank}-{kind}": (name, rank, kind) for name, rank, kind in SCENARIOS}
    stored = {r.name: framed.count(fr.STEPS, run=r) for r in Run.objects.filter(cluster=cluster)}
    assert stored == dict.fromkeys(runs, WORLD * STEPS)  # every step of every rank went through the real ingest

    run_pass(cluster, time.time())
    found: dict[tuple[str, int, str], list[tuple]] = {key: [] for key in SCENARIOS}
    late = Finding.objects.filter(cluster=cluster, state="open", kind__in=LATE)
    for f in late:
        metrics = f.evidence["metrics"]
        found[runs[f.subject.split("/")[0]]].append(
            (f.subject.split("/")[1], f.kind, metrics.get("role"), metrics.get("group_index"), metrics.get("group_rank")))
    expected = {key: [(f"rank{key[1]}", *want)] for key, want in SCENARIOS.items()}
    assert found == expected, {f.subject: (f.title, f.evidence["metrics"].get("lag_s")) for f in late}
    # Named within its group: the title says which group, and the evidence carries the group's own arrivals.
    f = Finding.objects.get(cluster=cluster, subject="dx-tp-3-data/rank3")
    assert "tp rank 1 of tp group 1" in f.title and f.evidence["metrics"]["group_ranks"] == [2, 3]
    assert sorted(f.evidence["series"]["group_arrivals"]["arrive_s"]) == ["2", "3"]
    stage = Finding.objects.get(cluster=cluster, subject="dx-pp-2-compute/rank2")
    assert stage.title.startswith("Pipeline stage 0 (rank 2") and set(stage.evidence["metrics"]["bubble_by_stage"]) == {
        "0", "1"}
