"""Straight to the real Django ingest (pytest-django's live server, a token made with the dashboard's own code):
what the hooks post is accepted and lands as steps, run metadata and events."""

from __future__ import annotations

import pytest

from trainer_hooks import Monitor


@pytest.mark.django_db(transaction=True)
def test_the_hooks_post_to_the_real_ingest_endpoint(live_server, hook_env):
    from dashboard.telemetry import tokens
    from dashboard.telemetry.models import Cluster, Event, Run, StepSample

    _, token = tokens.create_token(Cluster.objects.create(name="hooks-cluster"), "hooks")
    hook_env.setenv("CLUSTERDX_SERVER", live_server.url)
    hook_env.setenv("CLUSTERDX_TOKEN", token)
    mon = Monitor(run="live-run", transport="server", interval=0.05, parallel={"tp": 1})
    for i in mon.loader(range(5)):
        with mon.step(tokens=2048, samples=4):
            mon.log(loss=1.0 / (i + 1))
    mon.checkpoint_saved(path="/ckpt/4")
    mon.close(timeout=10)

    assert mon.stats()["dropped"] == {} and mon.stats()["sent"]["batches"] >= 1
    run = Run.objects.get(name="live-run")
    rows = StepSample.objects.filter(run=run).order_by("step")
    assert [(r.step, r.tokens, r.samples) for r in rows] == [(i, 2048, 4) for i in range(5)]
    assert rows[1].metrics == {"loss": 0.5} and rows[0].data_wait_s is not None
    assert run.world_size == 1
    assert Event.objects.filter(kind="checkpoint").count() == 1
