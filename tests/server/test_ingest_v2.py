"""Wire version 2 (clusterdx.blocks) through the real ingest: a post of blocks stores exactly what the same batch as
version 1 stores, is idempotent the same way, and a malformed or hostile one is a 400 that names the value and
changes nothing (both databases: the suite runs this file on SQLite and on PostgreSQL)."""

from __future__ import annotations

import base64
import gzip
import json
import struct
import time
from typing import Any

import httpx
import pytest

from clusterdx import blocks
from dashboard.storage import frames as fr
from dashboard.telemetry import models as m
from tests.server import framed
from tests.server.conftest import AsgiServer, World, make_batch, post
from tests.server.test_ingest import assert_refused, counts

pytestmark = pytest.mark.django_db

SERIES = (m.HostSample, m.PortSample)


def _sim_batches(nodes: int = 2, seconds: int = 3) -> list[dict[str, Any]]:
    from collectors.sim.model import SimCluster
    from collectors.sim.scenario import parse

    start = time.time() - seconds - 5
    sim = SimCluster(parse({"cluster": {"nodes": nodes, "gpus_per_node": 8, "seed": 11}}), start)
    out, seq = [], 0
    for t in range(seconds):
        for b in sim.tick(start + t):
            seq += 1
            out.append({**b, "seq": seq})
    return out


def _rows(cluster: Any) -> dict[str, list[tuple[Any, ...]]]:
    """Every series row of the cluster, with its node by name and without ids: what two clusters fed the same batches
    must hold alike."""
    out = {}
    for model in SERIES:
        names = [f.attname for f in model._meta.concrete_fields
                 if f.attname not in ("id", "cluster_id", "node_id", "run_id", "peer_node_id")]
        rows = model.objects.filter(cluster=cluster).values_list("node__hostname", *names)
        out[model.__name__] = sorted(rows, key=repr)
    hosts = dict(m.Node.objects.filter(cluster=cluster).values_list("id", "hostname"))
    runs = dict(m.Run.objects.filter(cluster=cluster).values_list("id", "name"))
    for kind in fr.KINDS.values():  # the samples of the frames, each with its node and run by name
        got = fr.read(kind, cluster_id=cluster.id, cols=("node_id", "run_id") if kind is fr.STEPS else ("node_id",),
                      objects=kind.objects)
        out[f"{kind.name} frames"] = sorted(
            ((hosts[int(got["node_id"][i])], runs[int(got["run_id"][i])] if kind is fr.STEPS else None,
              *[None if v != v else v for v in got.mat[i].tolist()], *(json.dumps(got.objs[f][i]) for f in kind.objects))
             for i in range(len(got))), key=repr)
    out["runs"] = sorted(m.Run.objects.filter(cluster=cluster).values_list("name", "last_step", "world_size"))
    out["gpus"] = sorted(m.Gpu.objects.filter(node__cluster=cluster).values_list("node__hostname", "index", "uuid"))
    return out


def test_a_version_2_post_stores_what_version_1_stores(client: Any, world: World) -> None:
    batches = _sim_batches()
    for b in batches:
        r1 = post(client, b, world.token, gz=True)
        r2 = post(client, blocks.encode_batch(b), world.other_token, gz=True)
        assert r1.status_code == r2.status_code == 200, (r1.content, r2.content)
        assert r1.json() == r2.json()  # the same seq, records counted alike
    one, two = _rows(world.cluster), _rows(world.other_cluster)
    kept = ("gpus frames", "steps frames", "probes frames", "runs", "gpus", "HostSample")
    assert all(one[k] for k in kept), {k: len(v) for k, v in one.items()}
    assert one == two


def test_a_version_2_post_resent_is_a_duplicate_and_a_reused_seq_is_refused(client: Any, world: World) -> None:
    body = json.dumps(blocks.encode_batch(make_batch(seq=3))).encode()
    assert post(client, body, world.token).json()["status"] == "accepted"
    before = counts()
    again = post(client, body, world.token)
    assert again.status_code == 200 and again.json()["status"] == "duplicate" and counts() == before
    other = json.dumps(blocks.encode_batch(make_batch(seq=3, host="node-000")) | {"sent_at": time.time() + 1}).encode()
    assert post(client, other, world.token).status_code == 409
    assert counts() == before


def _with_value(batch: dict[str, Any], kind: str, row: int, name: str, value: float) -> dict[str, Any]:
    """The batch as version 2, one number of its matrix replaced (what no honest encoder sends)."""
    body = blocks.encode_batch(batch)
    lay = blocks.LAYOUTS[kind]
    width = len(lay.numbers)
    nums = list(struct.unpack(f"<{body[kind]['n'] * width}d", base64.b64decode(body[kind]["num"])))
    nums[row * width + [c.name for c in lay.numbers].index(name)] = value
    body[kind]["num"] = base64.b64encode(struct.pack(f"<{len(nums)}d", *nums)).decode()
    return body


def test_a_bad_version_2_post_is_a_400_naming_the_value(client: Any, world: World) -> None:
    assert post(client, make_batch(seq=1), world.token).status_code == 200  # accepted before: must stay
    before = counts()
    b = make_batch(seq=2)
    v2 = blocks.encode_batch(b)
    cases: list[tuple[Any, str]] = [
        (_with_value(b, "gpus", 1, "util_gpu_pct", 250.0), "gpus[1].util_gpu_pct: must be <= 100"),
        (_with_value(b, "steps", 0, "ts", float("nan")), "steps[0].ts: missing required field"),
        (_with_value(b, "steps", 1, "tokens", 0.5), "steps[1].tokens: expected an integer"),
        (_with_value(b, "gpus", 0, "ts", float("inf")), "gpus[0].ts: must be a finite number"),
        ({**v2, "gpus": {**v2["gpus"], "num": v2["gpus"]["num"][:-8]}}, "gpus.num: holds"),
        ({**v2, "gpus": {**v2["gpus"], "num": "@@@@"}}, "gpus.num"),
        ({**v2, "steps": {**v2["steps"], "cols": {"run": ["run-1", "<script>alert(1)</script>"]}}},
         "steps.cols.run[1]"),
        ({**v2, "gpus": b["gpus"]}, "gpus: expected a block"),
        ({**v2, "host": "bad host\u0000"}, "host"),
        # A NUL escape and a lone surrogate: msgspec's compiled checks leave both to the reference ones.
        ({**v2, "gpus": {**v2["gpus"], "cols": {"uuid": ["GPU-0", "GPU-\u0000"]}}}, "gpus.cols.uuid[1]: NUL"),
        ({**v2, "gpus": {**v2["gpus"], "cols": {"uuid": ["GPU-\ud800", "GPU-1"]}}}, "gpus.cols.uuid[0]: lone surrogate"),
        ({**v2, "v": 3}, "unsupported wire version 3; this server speaks 1 and 2"),
        ({"gpus": v2["gpus"], **{k: v for k, v in v2.items() if k != "gpus"}, "v": 2}, ""),  # "v" not first: fine
    ]
    for body, words in cases[:-1]:
        r = post(client, body, world.token)
        assert_refused(r, 400, "invalid_batch", before, words)
    last = post(client, cases[-1][0], world.token)
    assert last.status_code == 200, last.content
    malformed = post(client, b'{"v": 2, "gpus": {"n": 1,', world.token)
    assert_refused(malformed, 400, "malformed_json", counts())


def test_a_group_stores_its_good_posts_and_refuses_the_one_with_a_bad_number(world: World) -> None:
    """The fast path leaves a version 2 post's numbers to the group writer, which checks a whole group's blocks at
    once: a bad number is that post's 400 (worded as the reference path words it), the group's others are stored."""
    from clusterdx import wire
    from dashboard.ingest import blocks as server_blocks
    from dashboard.ingest.writer import Stored, store_group

    good = [make_batch(seq=s, host="node-000") for s in (1, 2)]
    bad = _with_value(make_batch(seq=1, host="node-001"), "gpus", 1, "util_gpu_pct", 250.0)
    posts = [blocks.encode_batch(good[0]), bad, good[1]]
    jobs = [(world.cluster, server_blocks.parse(json.dumps(p).encode()), "") for p in posts]
    assert not any(b.checked for b in (jobs[1][1]["gpus"], jobs[0][1]["steps"]))  # left to the writer
    out = store_group(jobs)
    assert out[0] == out[2] == Stored("accepted", 4)
    assert isinstance(out[1], wire.WireError) and str(out[1]) == "gpus[1].util_gpu_pct: must be <= 100, got 250.0"
    assert framed.count(fr.GPUS, cluster=world.cluster) == 4  # two posts of two GPUs: nothing of the bad one
    assert not m.Node.objects.filter(cluster=world.cluster, hostname="node-001").exists()


def test_the_real_server_takes_version_2(asgi_server: AsgiServer, world: World) -> None:
    """Through uvicorn and the ASGI fast path, gzip as the agent sends it."""
    batches = _sim_batches(nodes=1, seconds=2)
    with httpx.Client(base_url=asgi_server.url, timeout=30) as http:
        for b in batches:
            r = http.post("/api/v1/ingest", content=gzip.compress(json.dumps(blocks.encode_batch(b)).encode()),
                          headers={"Authorization": f"Bearer {world.token}", "Content-Type": "application/json",
                                   "Content-Encoding": "gzip"})
            assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
    want = sum(len(b["gpus"]) for b in batches)
    assert framed.count(fr.GPUS, cluster=world.cluster) == want
