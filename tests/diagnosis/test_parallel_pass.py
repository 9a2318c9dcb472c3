"""The parallel-layout findings through the real pass: ingest (the API) → the loader (group timings, layout, loss) →
the detectors → Finding rows, and the efficiency the pass stores (MFU per step, goodput per run), read back by the
run page's API; then the run page in a browser (its MFU chart, goodput headline, marked loss spike and layout)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from dashboard.diagnosis import efficiency
from dashboard.diagnosis.models import Finding, RunEfficiency, StepEfficiency
from dashboard.telemetry.models import Run
from tests.server import conftest as server
from tests.server.conftest import World, make_batch, post

world = server.world
_fresh_caches = server._fresh_caches  # autouse: the ingest writer's id caches outlive the rolled-back database
asgi_server = server.asgi_server
page = server.page

STEPS = 60
STEP_S = 0.3
SPIKE = 57
LAYOUT = {"strategy": "fsdp2", "mesh": {"dp": 4}, "zero_stage": 3, "offload": False,
          "activation_checkpointing": False, "grad_accum": 1, "micro_batch": 8}


def _feed(client: Any, w: World, now: float) -> None:
    """Four ranks on node-0..3 (GPU 0 each), FSDP over one dp group; ranks 1 and 3 wait 80 ms for data each step
    and arrive late at the all-gather. Rank 0's loss spikes at step 57 while node-1's GPU logs 31 corrected ECC
    errors."""
    t0 = now - 1.0 - STEP_S * STEPS
    for r in range(4):
        host, slow = f"node-{r}", r in (1, 3)
        steps = []
        for s in range(STEPS):
            dw = 0.08 if slow else 0.002
            g = {"role": "dp", "name": "dp", "group_rank": r, "group_size": 4, "index": 0, "calls": 3,
                 "bytes": 1 << 24, "inflight_s": 0.1, "exposed_s": 0.0 if slow else 0.08,
                 "arrive_s": 0.1 + dw}
            row = {"run": "fsdp", "rank": r, "step": s, "ts": t0 + STEP_S * (s + 1), "step_time_s": STEP_S,
                   "data_wait_s": dw, "compute_s": 0.2, "comm_s": 0.1 - dw if not slow else 0.0,
                   "comm_arrive_s": 0.1 + dw, "tokens": 8192, "groups": [g]}
            if r == 0:
                row["metrics"] = {"loss": 6.0 if s == SPIKE else 2.5 - 0.001 * s + 0.01 * ((s * 7) % 5)}
            steps.append(row)
        meta = {"run": "fsdp", "rank": r, "world_size": 4, "ts": t0, "host": host, "gpu_index": 0,
                "flops_per_token": 6e9, "peak_flops": 1e15, "layout": {**LAYOUT, "coords": {"dp": r}},
                "env": {"NCCL_DEBUG": "WARN"}}
        gpus = [{"ts": now - 8 + k, "index": 0, "uuid": f"GPU-{host}-0", "util_gpu_pct": 97.0,
                 "sm_clock_mhz": 1980.0, "sm_clock_max_mhz": 1980.0, "ecc_dbe_volatile": 0,
                 "ecc_sbe_volatile": 40 + (31 if r == 1 and k >= 6 else 0)} for k in range(8)]
        resp = post(client, make_batch(0, host, sent_at=now, steps=steps, runs=[meta], gpus=gpus), w.token)
        assert resp.status_code == 200, resp.content


@pytest.mark.django_db
def test_the_pass_names_each_starving_rank_the_spike_and_stores_efficiency(world: World, client: Any) -> None:
    from dashboard.diagnosis.tasks import run_pass

    now = time.time()
    _feed(client, world, now)
    res = run_pass(world.cluster, now)
    assert efficiency.record(world.cluster.id, now) >= STEPS - 8  # the newest settle first
    open_ = dict(Finding.objects.filter(cluster=world.cluster, state="open").values_list("subject", "kind"))
    assert {s: k for s, k in open_.items() if k in ("data_starvation", "straggler")} == {
        "fsdp/rank1": "data_starvation", "fsdp/rank3": "data_starvation"}
    starve = Finding.objects.get(subject="fsdp/rank1")
    assert starve.evidence["metrics"]["role"] == "dp" and starve.node.hostname == "node-1"
    spike = Finding.objects.get(kind="loss_spike")
    assert spike.subject == f"fsdp/step{SPIKE}" and spike.severity == "warning"
    assert spike.title == f"Loss spike at step {SPIKE} coincides with 31 corrected ECC errors on node-1/gpu0"
    assert res.changes is not None
    from dashboard.web.evidence import chart

    panel = chart(spike)["panels"][0]
    assert panel["markers"][0]["x"] == SPIKE and panel["series"][0]["x"][-1] == SPIKE

    run = Run.objects.get(name="fsdp")
    eff = RunEfficiency.objects.get(run=run)
    mfu = StepEfficiency.objects.filter(run=run).first().mfu
    assert mfu == pytest.approx(4 * 8192 * 6e9 / (1e15 * 4 * STEP_S), rel=1e-3)
    assert eff.goodput == pytest.approx(1.0, abs=0.02)  # back to back, no gap: all of it productive
    assert efficiency.record(world.cluster.id, now + 5) > 0  # the next one folds the rest, never twice
    assert efficiency.record(world.cluster.id, now + 6) == 0
    assert StepEfficiency.objects.filter(run=run).count() == STEPS

    client.force_login(world.owner)
    body = client.get(f"/api/v1/runs/{run.id}/steps", {"points": 60}).json()
    assert body["run_efficiency"]["goodput"] == pytest.approx(1.0, abs=0.02)
    assert body["mfu_step"][-1] == pytest.approx(mfu, rel=1e-3)
    assert [(s["step"], s["severity"]) for s in body["loss_spikes"]] == [(SPIKE, "warning")]
    settings = client.get(f"/api/v1/runs/{run.id}/settings").json()
    assert settings["layout"]["values"]["mesh"]["value"] == "dp=4"
    assert "coords" not in settings["layout"]["values"] and settings["layout"]["deviating"] == 0


@pytest.mark.browser
def test_the_run_page_shows_mfu_goodput_the_spike_and_the_layout(world: World, asgi_server: Any, page: Any,
                                                                client: Any, tmp_path: Any) -> None:
    from dashboard.diagnosis.tasks import run_pass
    from tests.server.browser import keep_screenshot, sign_in, wait_live

    now = time.time()
    _feed(client, world, now)
    run_pass(world.cluster, now)
    efficiency.record(world.cluster.id, now + 5)
    run = Run.objects.get(name="fsdp")
    sign_in(page, asgi_server.url, "alice", World.password, f"/runs/{run.id}/")
    wait_live(page)
    page.wait_for_function("document.body.dataset.lossSpikes === '1'")
    page.wait_for_function("document.getElementById('kpi-goodput').textContent.endsWith('%')")
    assert page.text_content("#kpi-goodput") in ("100.0%", "99.9%", "99.8%")
    assert "productive of" in page.text_content("#goodput-detail")
    page.wait_for_selector("#layout table.layout")
    layout = page.text_content("#layout")
    assert "fsdp2" in layout and "dp=4" in layout and "ZeRO stage" in layout
    # The charts are drawn once plotly has run, which on loaded cores may come after the page's data is in.
    page.wait_for_selector("#efficiency .scatterlayer .trace", state="attached")
    page.wait_for_selector("#loss .scatterlayer .point", state="attached")
    assert page.locator("#loss .scatterlayer .point").count() == 1  # the spike's marker
    keep_screenshot(page, "run-parallel", tmp_path)
