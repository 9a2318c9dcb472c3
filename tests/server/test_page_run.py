"""The run and rank pages' API: the whole run downsampled by step, rank x step heatmaps, settings with drift, the
explain link, access rules, and a live snapshot whose size does not grow with the ranks."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Any

import jsonschema
import numpy as np
import pytest

from dashboard.live.consumers import _snapshot
from dashboard.live.events import FRAME_SCHEMA, STEP_AGG_ROW
from dashboard.storage import frames as fr
from dashboard.telemetry.models import Node, Rank, Run
from tests.server import framed
from tests.server.conftest import World
from tests.server.test_diagnosis_pass import Feed

pytestmark = pytest.mark.django_db

FAULTS = [{"kind": "straggler", "at_s": 4, "rank": 6, "magnitude": 0.6},
          {"kind": "nccl_env_drift", "at_s": 0, "rank": 13}]


@pytest.fixture
def run(world: World) -> Run:
    """A simulated 8-node x 4-GPU run of ~17 steps with a straggler (rank 6) and NCCL drift (rank 13)."""
    Feed(world, FAULTS).run(20, passes=False)
    return Run.objects.get(name="llm")


def _stored(run: Run) -> fr.Rows:
    """Every step sample stored for ``run``, read straight from its frames (not through the pages' reader)."""
    return fr.read(fr.STEPS, run_id=run.id)


def _get(client: Any, user: Any, url: str, **params: Any) -> Any:
    client.force_login(user)
    return client.get(url, params)


def test_it_downsamples_the_whole_run_into_buckets_of_steps(client: Any, world: World, run: Run) -> None:
    stored = _stored(run)
    steps = sorted({int(s) for s in stored["step"]})
    assert len(steps) > 12, "the run must be longer than the points asked for"
    body = _get(client, world.owner, f"/api/v1/runs/{run.id}/steps", points=10).json()
    width = math.ceil((steps[-1] - steps[0] + 1) / 10)
    assert width > 1 and body["bucket_steps"] == width and len(body["step"]) <= 10
    assert (body["first_step"], body["last_step"]) == (steps[0], steps[-1])
    assert body["step"][0] == steps[0] and body["step_end"][-1] == steps[-1]
    # the second bucket's numbers are exactly what its rank-step rows say
    lo, hi = body["step"][1], body["step_end"][1]
    rows = stored.where((stored["step"] >= lo) & (stored["step"] <= hi))
    st, cp = rows["step_time_s"], rows["compute_s"]
    assert len(st) and not np.isnan(st).any() and not np.isnan(cp).any()
    assert body["step_time_s"]["mean"][1] == pytest.approx(st.mean(), rel=1e-4)
    assert body["compute_s"]["max"][1] == pytest.approx(cp.max(), rel=1e-4)
    assert body["compute_s"]["min"][1] == pytest.approx(cp.min(), rel=1e-4)
    assert lo <= body["slowest_step"][1] <= hi
    assert all(v is not None and 0 < v <= 1 for v in body["mfu"]), "the sim reports FLOPs per token and peak FLOPS"
    assert body["loss"][0] > body["loss"][-1], "the simulated loss falls"
    assert body["efficiency"]["mfu"] == pytest.approx(body["mfu"][-1], rel=0.2)
    # a zoomed window comes back finer: one step per point
    zoomed = _get(client, world.owner, f"/api/v1/runs/{run.id}/steps", from_step=lo, to_step=hi, points=10).json()
    assert zoomed["bucket_steps"] == 1 and zoomed["step"] == list(range(lo, hi + 1))
    one = _get(client, world.owner, f"/api/v1/runs/{run.id}/steps", rank=6, from_step=lo, to_step=lo).json()
    (six,) = stored.where((stored["rank"] == 6) & (stored["step"] == lo))["compute_s"]
    assert one["compute_s"]["mean"][0] == pytest.approx(six, rel=1e-4)
    assert _get(client, world.owner, f"/api/v1/runs/{run.id}/steps", points=1).status_code == 400


@pytest.mark.parametrize("max_rows", [2048, 16])  # 16: the 32 ranks become one row per node (its slowest rank)
def test_each_heatmap_cell_is_its_ranks_mean_over_the_bucket(world: World, run: Run, max_rows: int,
                                                              monkeypatch: Any) -> None:
    from dashboard.web.pages import run_series

    monkeypatch.setattr(run_series, "MAX_HEATMAP_ROWS", max_rows)
    lo, hi = 2, int(run.last_step)
    hosts = {r.rank: r.node.hostname for r in Rank.objects.filter(run=run).select_related("node")}
    for metric in run_series.HEATMAP_METRICS:
        for cols in (1, 4, 600):
            body = run_series.heatmap(run, metric, lo, hi, cols)
            width = body["bucket_steps"]
            want: dict[tuple[str, int], list[float]] = {}
            stored = _stored(run)
            for rank, step, value in zip(stored["rank"].astype(int).tolist(), stored["step"].astype(int).tolist(),
                                         stored[metric].tolist(), strict=True):
                if not lo <= step <= hi:
                    continue
                label = f"rank {rank}" if body["row_kind"] == "rank" else hosts[rank]
                per = want.setdefault((label, rank, (step - lo) // width), [])  # type: ignore[arg-type]
                if not math.isnan(value):
                    per.append(value)
            cells: dict[tuple[str, int], float] = {}
            for (label, _, b), vals in want.items():
                if vals:
                    cells[(label, b)] = max(cells.get((label, b), -math.inf), float(np.mean(vals)))
            got = {(row["label"], b): v for row, zs in zip(body["rows"], body["z"], strict=True)
                   for b, v in enumerate(zs) if v is not None}
            assert got.keys() == cells.keys(), (metric, cols)
            assert all(abs(got[k] - cells[k]) <= 5e-5 for k in got), (metric, cols)


def test_the_heatmap_orders_ranks_by_node_and_shows_the_straggler_as_a_stripe(client: Any, world: World,
                                                                                run: Run) -> None:
    # move ranks 0-3 to the last node: rows follow the nodes, not the rank numbers
    last = Node.objects.get(cluster=world.cluster, hostname="node-007")
    Rank.objects.filter(run=run, rank__lt=4).update(node=last)
    body = _get(client, world.owner, f"/api/v1/runs/{run.id}/heatmap", metric="compute_s", points=10).json()
    assert body["row_kind"] == "rank" and len(body["rows"]) == 32
    assert len(body["steps"]) <= 10 and all(len(row) == len(body["steps"]) for row in body["z"])
    order = [r["rank"] for r in body["rows"]]
    assert order[:4] == [4, 5, 6, 7] and order[-8:] == [0, 28, 1, 29, 2, 30, 3, 31]  # node, then local rank
    assert [n["host"] for n in body["nodes"]] == [f"node-{i:03d}" for i in range(1, 8)]
    assert body["nodes"][-1] == {**body["nodes"][-1], "first_row": 24, "rows": 8}
    assert body["rows"][0]["url"] == f"/runs/{run.id}/ranks/4/"
    z = np.array([[np.nan if v is None else v for v in row] for row in body["z"]])
    mean = np.nanmean(z[:, -2:], axis=1)
    assert order[int(np.argmax(mean))] == 6, "the straggler's row is the slowest"
    assert _get(client, world.owner, f"/api/v1/runs/{run.id}/heatmap", metric="nope").status_code == 400


def test_settings_highlight_the_nccl_drift_and_odd_dataloaders(client: Any, world: World, run: Run) -> None:
    s = _get(client, world.owner, f"/api/v1/runs/{run.id}/settings").json()
    assert s["world_size"] == 32 and s["run_wide"]["dtype"] == "bf16" and s["parallel"] == {"dp": 32}
    drift = {(d["rank"], d["key"]): d for d in s["env"]["drift"]}
    assert set(drift) == {(13, "NCCL_IB_TIMEOUT"), (13, "NCCL_ALGO")}
    d = drift[(13, "NCCL_IB_TIMEOUT")]
    assert (d["value"], d["url"], d["host"], d["node_url"]) == ("14", f"/runs/{run.id}/ranks/13/", "node-003",
                                                                 "/clusters/prod-a/nodes/node-003/")
    assert d["gpu_url"] == "/clusters/prod-a/nodes/node-003/gpus/1/"
    assert s["env"]["values"]["NCCL_IB_TIMEOUT"]["drift"] is True
    assert s["env"]["values"]["NCCL_IB_TIMEOUT"]["ranks"] == 31
    odd = {dv["rank"] for dv in s["dataloader"]["deviations"] if dv["key"] == "num_workers"}
    assert odd == {r for r in range(32) if r % 7 == 5}
    assert s["versions"]["deviations"] == []
    nccl = _get(client, world.owner, f"/api/v1/runs/{run.id}/nccl").json()
    assert len(nccl["nodes"]) == 8 and all(n["url"].startswith("/clusters/prod-a/nodes/") for n in nccl["nodes"])


def test_the_page_links_the_explain_api_with_every_layer(client: Any, world: World, run: Run) -> None:
    page = _get(client, world.owner, f"/runs/{run.id}/")
    assert page.status_code == 200
    html = page.content.decode()
    data = json.loads(html.split('<script id="page-data" type="application/json">')[1].split("</script>")[0])
    assert data["n_ranks"] == 32 and data["ranks"]["6"]["url"] == f"/runs/{run.id}/ranks/6/"
    assert data["hosts"]["node-001"] == "/clusters/prod-a/nodes/node-001/"
    step = run.last_step - 2
    body = client.get(f"{data['api']['explain_prefix']}{step}/explain").json()
    assert set(body["layers"]) >= {"gpus", "nccl", "xid", "ib", "probes", "other_events"}
    assert body["layers"]["gpus"]["throttled"], "the straggler's GPU is throttled in the window"
    assert len(body["ranks"]) == 32 and body["cause"]["summary"]
    six = next(r for r in body["ranks"] if r["rank"] == 6)
    assert (six["url"], six["gpu_url"]) == (f"/runs/{run.id}/ranks/6/", "/clusters/prod-a/nodes/node-001/gpus/2/")
    rank = _get(client, world.owner, f"/runs/{run.id}/ranks/6/")
    assert rank.status_code == 200 and "/clusters/prod-a/nodes/node-001/gpus/2/" in rank.content.decode()
    r = client.get(f"/api/v1/runs/{run.id}/ranks/6").json()
    assert (r["host"], r["gpu"], r["meta"]["dataloader"]["num_workers"]) == ("node-001", 2, 8)
    assert r["bounds"][1] == run.last_step
    assert client.get(f"/runs/{run.id}/ranks/999/").status_code == 404


def test_outsiders_get_404_and_the_logged_out_401(client: Any, world: World, run: Run) -> None:
    apis = [f"/api/v1/runs/{run.id}/steps", f"/api/v1/runs/{run.id}/heatmap", f"/api/v1/runs/{run.id}/settings",
            f"/api/v1/runs/{run.id}/nccl", f"/api/v1/runs/{run.id}/ranks/3"]
    for url in apis:
        assert client.get(url).status_code == 401, url
    assert client.get(f"/runs/{run.id}/").status_code == 302  # to the login page
    client.force_login(world.outsider)
    for url in [*apis, f"/runs/{run.id}/", f"/runs/{run.id}/ranks/3/"]:
        assert client.get(url).status_code == 404, url
    client.force_login(world.teammate)
    assert all(client.get(url).status_code == 200 for url in apis)


def _bulk_run(world: World, name: str, ranks: int, steps: int) -> Run:
    run = Run.objects.create(cluster=world.cluster, name=name, world_size=ranks, last_step=steps - 1)
    now = datetime.now(UTC)
    framed.steps(world.cluster, None, run,
                 [{"rank": r, "step": s, "ts": now, "step_time_s": 1.0 + r * 1e-6, "data_wait_s": 0.1, "compute_s": 0.7,
                   "comm_s": 0.2, "comm_arrive_s": 0.8, "tokens": 4096}
                  for s in range(steps) for r in range(ranks)])
    return run


def _snapshot_bytes(world: World, run: Run) -> tuple[int, dict[str, Any]]:
    frame = _snapshot.func(world.cluster, run, None, None)  # the consumer's own snapshot, called in this thread
    jsonschema.validate(frame, FRAME_SCHEMA)
    return len(json.dumps(frame)), frame


def test_the_snapshot_does_not_grow_with_the_ranks(world: World) -> None:
    small, big = _bulk_run(world, "small", 8, 30), _bulk_run(world, "big", 512, 30)
    small_bytes, small_frame = _snapshot_bytes(world, small)
    big_bytes, big_frame = _snapshot_bytes(world, big)
    assert len(small_frame["steps"]) == 20 * 8, "a small run keeps per-rank rows for its per-rank bars"
    assert big_frame["steps"] == [], "no ranks x steps rows for a big run"
    rows = big_frame["run"]["recent"]["rows"]
    assert len(rows) == 30 and big_frame["run"]["recent"]["columns"] == STEP_AGG_ROW
    last = dict(zip(STEP_AGG_ROW, rows[-1], strict=True))
    assert last["ranks"] == 512 and last["tokens"] == 512 * 4096 and last["compute_s"] == pytest.approx(0.7)
    assert last["step_time_max_s"] == pytest.approx(1.0 + 511e-6)
    # per step the aggregate costs the same at 512 ranks as at 8: at 2,048 nodes x 8 ranks (and 300 steps)
    # the snapshot's step part stays far under the 2 MB goal
    per_step = (big_bytes - len(json.dumps({**big_frame, "run": {**big_frame["run"], "recent": None}}))) / 30
    assert per_step < 200, per_step
    assert per_step * 300 < 100_000
    assert big_bytes < small_bytes, (big_bytes, small_bytes)
