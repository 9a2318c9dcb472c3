"""The ingest door: the round trip into the database, and every bad input answered with a documented 4xx that
changes nothing."""

from __future__ import annotations

import gzip
import json
from typing import Any

import pytest

from dashboard.storage import frames as fr
from dashboard.telemetry import models as m
from dashboard.telemetry import tokens
from tests.server import framed
from tests.server.conftest import World, make_batch, post

pytestmark = pytest.mark.django_db


def counts() -> dict[str, int]:
    return {model.__name__: model.objects.count() for model in
            (m.AgentBatch, m.GpuFrame, m.StepFrame, m.Event, m.Node, m.Run, m.HostSample, m.PortSample, m.ProbeFrame)}


def assert_refused(response: Any, status: int, code: str, before: dict[str, int], detail: str = "") -> None:
    assert response.status_code == status, response.content
    body = response.json()
    assert body["error"] == code
    assert detail in body["detail"]
    assert counts() == before, "a refused batch must change nothing"


def test_it_stores_a_batch_and_its_inventory(client: Any, world: World) -> None:
    batch = make_batch(seq=0, events=[{"ts": 1.7e9, "kind": "xid", "severity": "critical", "code": 79,
                                       "gpu_index": 1, "message": "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."}])
    r = post(client, batch, world.token)
    assert r.status_code == 200, r.content
    assert r.json() == {"status": "accepted", "seq": 0, "records": 5, "send_interval_s": 1.0}
    node = m.Node.objects.get(cluster=world.cluster, hostname="node-000")
    gpus = framed.stored(fr.GPUS, node=node)
    assert sorted(zip(gpus["index"].tolist(), gpus["util_gpu_pct"].tolist(), strict=True)) == [(0, 50.0), (1, 51.0)]
    assert m.Gpu.objects.filter(node=node).count() == 2
    run = m.Run.objects.get(cluster=world.cluster, name="run-1")
    assert run.last_step == 1
    assert framed.count(fr.STEPS, run=run) == 2
    assert m.Event.objects.get().code == 79


def test_it_accepts_gzip_bodies(client: Any, world: World) -> None:
    r = post(client, make_batch(seq=3), world.token, gz=True)
    assert r.status_code == 200 and r.json()["status"] == "accepted"
    assert framed.count(fr.GPUS) == 2


def test_it_answers_a_repeated_sequence_number_as_duplicate_and_stores_once(client: Any, world: World) -> None:
    batch = make_batch(seq=7)
    assert post(client, batch, world.token).json()["status"] == "accepted"
    before = counts()
    r = post(client, batch, world.token)  # the same content (a retry); other content is a 409: test_ingest_hostile
    assert r.status_code == 200 and r.json()["status"] == "duplicate"
    assert counts() == before
    # The same seq from another agent is a different batch.
    assert post(client, make_batch(seq=7, host="node-001"), world.token).json()["status"] == "accepted"


def test_it_refuses_malformed_json(client: Any, world: World) -> None:
    before = counts()
    assert_refused(post(client, b'{"v": 1, "agent_id": ', world.token), 400, "malformed_json", before)
    assert_refused(post(client, b"\xff\xfe\x00garbage", world.token), 400, "malformed_json", before)


@pytest.mark.parametrize(
    ("mutate", "detail"),
    [
        (lambda b: b["gpus"][1].update(power_w="hot"), "gpus[1].power_w: expected a number"),
        (lambda b: b.update(seq=-1), "seq: must be >= 0"),
        (lambda b: b.update(seq=True), "seq: expected an integer"),
        (lambda b: b.pop("agent_id"), "agent_id: missing required field"),
        (lambda b: b["steps"][0].pop("rank"), "steps[0].rank: missing required field"),
        (lambda b: b.update(v=3), "unsupported wire version 3; this server speaks 1 and 2"),
        (lambda b: b.update(v=2), "gpus: expected a block"),  # version 2 carries its GPU samples as a block
        (lambda b: b.update(gpus={"0": {}}), "gpus: expected a list"),
        (lambda b: b["gpus"][0].update(util_gpu_pct=float("nan")), "finite"),
        (lambda b: b["gpus"][0].update(util_gpu_pct=140.0), "util_gpu_pct: must be <= 100"),
        (lambda b: b.update(host="node-1; rm -rf /"), "host: the string"),
        (lambda b: b.update(host="<script>alert(1)</script>"), "does not match"),
        (lambda b: b.update(colour="blue"), "colour: unknown field"),
        (lambda b: b["steps"][0].update(run="x" * 500), "steps[0].run: too long"),
        (lambda b: b.update(events=[{"ts": 1.0, "kind": "xid", "message": "a\x00b"}]), "NUL"),
    ],
)
def test_it_refuses_batches_that_do_not_match_the_wire_format(client: Any, world: World, mutate: Any, detail: str) -> None:
    batch = make_batch()
    mutate(batch)
    before = counts()
    body = json.dumps(batch, allow_nan=True).encode()
    assert_refused(post(client, body, world.token), 400, "invalid_batch", before, detail)


def test_it_refuses_a_batch_that_is_not_an_object(client: Any, world: World) -> None:
    before = counts()
    assert_refused(post(client, [1, 2, 3], world.token), 400, "invalid_batch", before, "expected an object")
    assert_refused(post(client, b"[" * 100_000 + b"]" * 100_000, world.token), 400, "malformed_json", before)


def test_it_refuses_missing_unknown_and_revoked_tokens(client: Any, world: World) -> None:
    before = counts()
    assert_refused(post(client, make_batch(), None), 401, "missing_token", before)
    assert_refused(post(client, make_batch(), "cdx_0000_nope"), 401, "unknown_token", before)
    assert_refused(post(client, make_batch(), world.token + "x"), 401, "unknown_token", before)
    prefix = world.token.split("_")[1]
    assert tokens.revoke(prefix)
    assert_refused(post(client, make_batch(), world.token), 401, "unknown_token", before, "revoked")


def test_it_refuses_a_token_of_another_cluster(client: Any, world: World) -> None:
    before = counts()
    batch = make_batch(cluster="prod-a")
    assert_refused(post(client, batch, world.other_token), 403, "wrong_cluster", before, "prod-b")
    assert post(client, batch, world.token).status_code == 200


def test_it_refuses_oversized_bodies_and_gzip_bombs(client: Any, world: World, settings: Any) -> None:
    settings.CLUSTERDX = {**settings.CLUSTERDX, "INGEST_MAX_BODY_BYTES": 64 * 1024}
    before = counts()
    big = make_batch(events=[{"ts": 1.0, "kind": "nccl", "message": "x" * 8000} for _ in range(20)])
    assert_refused(post(client, big, world.token), 413, "too_large", before)
    bomb = gzip.compress(b'{"v": 1, "pad": "' + b"0" * 10_000_000 + b'"}')
    assert len(bomb) < 64 * 1024
    assert_refused(post(client, bomb, world.token, HTTP_CONTENT_ENCODING="gzip"), 413, "too_large", before,
                   "decompressed")


def test_it_refuses_bad_gzip(client: Any, world: World) -> None:
    before = counts()
    r = post(client, b"not gzip at all", world.token, HTTP_CONTENT_ENCODING="gzip")
    assert_refused(r, 400, "bad_encoding", before)
    truncated = gzip.compress(json.dumps(make_batch()).encode())[:-12]
    assert_refused(post(client, truncated, world.token, HTTP_CONTENT_ENCODING="gzip"), 400, "bad_encoding", before)


def test_it_refuses_wrong_content_types_and_encodings(client: Any, world: World) -> None:
    before = counts()
    body = json.dumps(make_batch()).encode()
    assert_refused(post(client, body, world.token, content_type="text/plain"), 415, "unsupported_media_type", before)
    assert_refused(post(client, body, world.token, content_type="application/x-www-form-urlencoded"), 415,
                   "unsupported_media_type", before)
    assert_refused(post(client, body, world.token, HTTP_CONTENT_ENCODING="br"), 415, "unsupported_media_type", before)


def test_it_answers_other_methods_with_405(client: Any, world: World) -> None:
    r = client.get("/api/v1/ingest")
    assert r.status_code == 405 and r.json()["error"] == "method_not_allowed" and r["Allow"] == "POST"


def test_a_refused_batch_does_not_disturb_what_was_accepted(client: Any, world: World) -> None:
    assert post(client, make_batch(seq=0), world.token).status_code == 200
    stored = counts()
    bad = make_batch(seq=1)
    bad["steps"][1]["step_time_s"] = -5
    assert post(client, bad, world.token).status_code == 400
    assert counts() == stored
    # The agent fixes the producer and sends seq 1 again: it is not a duplicate of the refused one.
    assert post(client, make_batch(seq=1), world.token).json()["status"] == "accepted"


def test_it_records_run_metadata_per_rank(client: Any, world: World) -> None:
    meta = {"run": "run-1", "rank": 3, "world_size": 16, "ts": 1.7e9, "host": "node-002", "local_rank": 3,
            "gpu_index": 3, "env": {"NCCL_IB_TIMEOUT": "22"}, "dataloader": {"num_workers": 2, "pin_memory": False},
            "flops_per_token": 7.8e9, "peak_flops": 989e12, "versions": {"nccl": "2.27.3"}}
    assert post(client, make_batch(runs=[meta]), world.token).status_code == 200
    rank = m.Rank.objects.get(run__name="run-1", rank=3)
    assert rank.node is not None and rank.node.hostname == "node-002"
    assert rank.meta["dataloader"]["num_workers"] == 2
    run = rank.run
    assert run.world_size == 16 and run.meta["peak_flops"] == 989e12 and run.meta["versions"] == {"nccl": "2.27.3"}


@pytest.mark.django_db(transaction=True)
def test_a_live_layer_that_is_down_never_fails_a_stored_batch(client: Any, world: World, monkeypatch: Any) -> None:
    """Redis restarting: the batch is committed before the live update runs, so the agent gets its 200 (a 500 made it
    retry into a "duplicate" while the live view never saw the batch)."""
    from dashboard.live import publish
    from dashboard.live.state import RedisState

    dead = RedisState("redis://127.0.0.1:1/0", "cdx-dead")  # a real client; nothing listens on port 1
    monkeypatch.setattr(publish, "get_state", lambda: dead)
    r = post(client, make_batch(seq=0), world.token)
    assert (r.status_code, r.json()["status"]) == (200, "accepted")
    assert m.AgentBatch.objects.filter(cluster=world.cluster, seq=0).count() == 1
