"""Straight to the real Django ingest (pytest-django's live server, a token made with the dashboard's own code):
what the hooks post is accepted and lands as steps, run metadata and events."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hooks_support import free_port

from trainer_hooks import Monitor


@pytest.mark.django_db(transaction=True)
def test_the_hooks_post_to_the_real_ingest_endpoint(live_server, hook_env):
    from dashboard.storage import frames as fr
    from dashboard.telemetry import tokens
    from dashboard.telemetry.models import Cluster, Event, Rank, Run
    from tests.server import framed

    _, token = tokens.create_token(Cluster.objects.create(name="hooks-cluster"), "hooks")
    hook_env.setenv("CLUSTERDX_SERVER", live_server.url)
    hook_env.setenv("CLUSTERDX_TOKEN", token)
    hook_env.setenv("MASTER_ADDR", "127.0.0.1")
    hook_env.setenv("MASTER_PORT", str(free_port()))
    mon = Monitor(run="live-run", transport="server", interval=0.05, parallel={"tp": 1}, layout={"grad_accum": 2})
    dist.init_process_group("gloo", rank=0, world_size=1)  # one rank: a real process group, a real collective
    try:
        for i in mon.loader(range(5)):
            with mon.step(tokens=2048, samples=4):
                dist.all_reduce(torch.ones(4))
                mon.log(loss=1.0 / (i + 1))
    finally:
        dist.destroy_process_group()
    mon.checkpoint_saved(path="/ckpt/4")
    mon.close(timeout=10)

    assert mon.stats()["dropped"] == {} and mon.stats()["sent"]["batches"] >= 1
    run = Run.objects.get(name="live-run")
    steps = framed.stored(fr.STEPS, run=run)
    order = np.argsort(steps["step"], kind="stable")
    assert [(int(steps["step"][i]), steps["tokens"][i], steps["samples"][i]) for i in order] == \
        [(i, 2048, 4) for i in range(5)]
    assert steps.objs["metrics"][order[1]] == {"loss": 0.5} and not np.isnan(steps["data_wait_s"][order[0]])
    assert run.world_size == 1
    # The collective by process group, stored as sent (a step's groups), and the layout in the rank's metadata.
    (world,) = steps.objs["groups"][order[1]]
    assert (world["role"], world["name"], world["calls"], world["bytes"], world["ops"]) == (
        "world", "default_pg", 1, 16, {"all_reduce": 1})
    assert world["exposed_s"] is not None and not np.isnan(steps["comm_s"][order[1]])
    assert Rank.objects.get(run=run, rank=0).meta["layout"]["grad_accum"] == 2
    assert Event.objects.filter(kind="checkpoint").count() == 1
