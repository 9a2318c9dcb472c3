"""Hostile and unlucky batches (issue 12, items 1, 4 and 5): every one is answered with a documented 4xx that
names the problem and changes nothing, never a 5xx an agent would retry forever.

Runs on SQLite and, with DATABASE_URL set, on PostgreSQL: the two refuse different things (SQLite a lone surrogate,
PostgreSQL an integer beyond its column), and the wire format must stop both before the database sees them."""

from __future__ import annotations

import json
import time
import typing
from typing import Any

import pytest
from django.db import models

from clusterdx import wire
from dashboard.ingest.errors import ERRORS
from dashboard.storage import frames as fr
from dashboard.telemetry import models as m
from tests.server import framed
from tests.server.conftest import World, make_batch, post
from tests.server.test_ingest import assert_refused, counts

pytestmark = pytest.mark.django_db

# -- integers: every bound the wire declares fits the column the writer puts it in ----------------------------------

# The largest value each integer column type holds (on every backend Django supports).
COLUMN_MAX: dict[type[models.Field], int] = {
    models.SmallIntegerField: 2**15 - 1, models.PositiveSmallIntegerField: 2**15 - 1,
    models.IntegerField: 2**31 - 1, models.PositiveIntegerField: 2**31 - 1,
    models.BigIntegerField: 2**63 - 1, models.PositiveBigIntegerField: 2**63 - 1,
}
# wire record -> {wire field: (model, column)}: same-named columns of the record's table, and the inventory columns.
# GPU samples, steps and probes are frames (dashboard.storage.frames): their numbers travel in a float64 matrix, and
# only the columns a frame derives from them are integer columns (a step frame's step range).
TABLES = {wire.HostSample: m.HostSample, wire.PortSample: m.PortSample, wire.Event: m.Event}
ELSEWHERE: dict[type[wire.Record], dict[str, tuple[type[models.Model], str]]] = {
    wire.GpuSample: {"index": (m.Gpu, "index")},
    wire.Step: {"step": (m.StepFrame, "step_hi")},
    wire.RunMeta: {"rank": (m.Rank, "rank"), "local_rank": (m.Rank, "local_rank"), "gpu_index": (m.Rank, "gpu_index"),
                   "world_size": (m.Run, "world_size")},
    wire.Batch: {"seq": (m.AgentBatch, "seq")},
}


def _int_range(tp: Any) -> tuple[float, float] | None:
    """(ge, le) of an integer wire field (``Annotated[int, Range]`` or ``... | None``), None for other types."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) is typing.Union else [tp]
    inner = args[0]
    if typing.get_origin(inner) is not typing.Annotated or inner.__origin__ is not int:
        return None
    rng = next(x for x in inner.__metadata__ if isinstance(x, wire.Range))
    return rng.ge, rng.le


def _integer_columns() -> list[tuple[str, float, float, type[models.Field]]]:
    out = []
    for record in {*TABLES, *ELSEWHERE}:
        targets = dict(ELSEWHERE.get(record, {}))
        if record in TABLES:
            names = {f.name for f in TABLES[record]._meta.get_fields()}
            targets.update({n: (TABLES[record], n) for n in wire.field_names(record) if n in names and n not in targets})
        for name, (tp, _) in wire._fields(record).items():
            bounds = _int_range(tp)
            if bounds is not None and name in targets:
                model, column = targets[name]
                out.append((f"{record.__name__}.{name}", *bounds, type(model._meta.get_field(column))))
    return sorted(out, key=lambda row: row[0])


def test_it_bounds_every_integer_field_within_its_column() -> None:
    rows = _integer_columns()
    assert len(rows) >= 14  # the mapping above really finds the columns (the frames took the sample tables' 20)
    too_wide = [(name, le, kind.__name__) for name, ge, le, kind in rows if le > COLUMN_MAX[kind] or ge < 0]
    assert not too_wide, f"wire bounds wider than their columns: {too_wide}"


def test_the_published_schema_carries_the_same_bounds() -> None:
    schemas = wire.json_schema()
    code = schemas["Event"]["properties"]["code"]["anyOf"][0]
    assert code["maximum"] == 2**31 - 1
    assert schemas["Probe"]["properties"]["sent"]["maximum"] == 2**31 - 1


def _at_bound(extreme: int) -> dict[str, Any]:
    """A batch with each integer of an event and a probe at ``extreme`` (the top of its wire range, or one past)."""
    now = time.time()
    event = {"ts": now, "kind": "xid", "code": 2**31 - 1 + extreme, "gpu_index": 1023, "rank": 1_000_000,
             "step": 2**63 - 1}
    probe = {"ts": now, "peer": "node-001", "sent": 2**31 - 1 + extreme, "lost": 2**31 - 1}
    return make_batch(events=[event], probes=[probe])


def test_it_stores_every_integer_at_the_top_of_its_range(client: Any, world: World) -> None:
    r = post(client, _at_bound(0), world.token)
    assert r.status_code == 200, r.content
    assert m.Event.objects.get().code == 2**31 - 1 and framed.stored(fr.PROBES)["sent"].tolist() == [2**31 - 1]


@pytest.mark.parametrize(("mutate", "detail"), [
    (lambda b: b["events"][0].update(code=2**31), "events[0].code: must be <= 2147483647"),
    (lambda b: b["probes"][0].update(sent=2**31), "probes[0].sent: must be <= 2147483647"),
    (lambda b: b["probes"][0].update(lost=2**40), "probes[0].lost: must be <= 2147483647"),
])
def test_it_refuses_an_integer_beyond_its_column_naming_it(client: Any, world: World, mutate: Any, detail: str) -> None:
    batch = _at_bound(0)
    mutate(batch)
    assert_refused(post(client, batch, world.token), 400, "invalid_batch", counts(), detail)


# -- strings: lone surrogates and NUL characters, wherever a string goes ------------------------------------------

@pytest.mark.parametrize(("mutate", "detail"), [
    (lambda b: b.update(events=[{"ts": time.time(), "kind": "nccl", "message": "bad \ud800 byte"}]),
     "events[0].message: lone surrogate"),
    (lambda b: b["gpus"][0].update(name="H100 \udfff"), "gpus[0].name: lone surrogate"),
    (lambda b: b.update(events=[{"ts": time.time(), "kind": "nccl", "data": {"k": "\ud83d"}}]),
     "events[0].data.k: lone surrogate"),
    (lambda b: b.update(events=[{"ts": time.time(), "kind": "nccl", "data": {"\udc80": "v"}}]),
     "events[0].data: lone surrogate"),
    (lambda b: b["gpus"][0].update(unavailable={"x\x00": "y"}), "gpus[0].unavailable: NUL"),
    (lambda b: b["gpus"][0].update(throttle_reasons=["ok", "a\x00"]), "gpus[0].throttle_reasons[1]: NUL"),
])
def test_it_refuses_strings_no_database_can_store(client: Any, world: World, mutate: Any, detail: str) -> None:
    batch = make_batch()
    mutate(batch)
    body = json.dumps(batch).encode()  # ensure_ascii: the surrogate travels as the JSON escape "\ud800"
    assert_refused(post(client, body, world.token), 400, "invalid_batch", counts(), detail)


def test_a_surrogate_pair_is_a_character_and_is_stored(client: Any, world: World) -> None:
    batch = make_batch(events=[{"ts": time.time(), "kind": "nccl", "message": "ok \U0001f600 é"}])
    assert post(client, json.dumps(batch).encode(), world.token).status_code == 200
    assert m.Event.objects.get().message == "ok \U0001f600 é"


# -- timestamps: the server's clock bounds what a node may claim ---------------------------------------------------

DAY = 86_400.0


@pytest.mark.parametrize(("mutate", "detail"), [
    (lambda b: b.update(sent_at=b["sent_at"] + DAY), "sent_at: 86400 s ahead of the server's clock"),
    (lambda b: b["steps"][1].update(ts=b["steps"][1]["ts"] + 3600), "steps[1].ts: 3600 s ahead"),
    (lambda b: b["gpus"][0].update(ts=1e11), "gpus[0].ts:"),
    (lambda b: b.update(beats=[{"run": "r", "rank": 0, "ts": time.time() + 600, "state": "step", "state_s": 1.0}]),
     "beats[0].ts: 600 s ahead"),
    (lambda b: b.update(sent_at=b["sent_at"] - 4 * DAY), "sent_at: sent 96 h ago, beyond the retention of 72 h"),
])
def test_it_refuses_a_clock_that_is_far_off(client: Any, world: World, mutate: Any, detail: str) -> None:
    batch = make_batch()
    mutate(batch)
    assert_refused(post(client, batch, world.token), 400, "clock_skew", counts(), detail)


def test_a_small_skew_and_an_old_record_in_a_fresh_batch_are_accepted(client: Any, world: World) -> None:
    # A log source replayed from its start carries old times; those rows are simply purged by the next retention.
    batch = make_batch(sent_at=time.time() + 60, events=[{"ts": 1.7e9, "kind": "kmsg", "message": "old line"}])
    assert post(client, batch, world.token).status_code == 200


def test_the_future_bound_is_a_setting(client: Any, world: World, settings: Any) -> None:
    settings.CLUSTERDX = {**settings.CLUSTERDX, "INGEST_MAX_FUTURE_S": 30.0}
    batch = make_batch(sent_at=time.time() + 60)
    assert_refused(post(client, batch, world.token), 400, "clock_skew", counts(), "(limit 30 s")


# -- sequence numbers: a reused seq with other content is a conflict, never a duplicate ----------------------------

def test_a_reused_seq_with_other_content_is_refused_and_a_true_repeat_is_a_duplicate(client: Any, world: World) -> None:
    first = make_batch(seq=7)
    body = json.dumps(first).encode()
    assert post(client, body, world.token).json()["status"] == "accepted"
    before = counts()
    # A retry resends the same bytes (the agent its spooled body), gzipped or not.
    for again in (post(client, body, world.token), post(client, body, world.token, gz=True)):
        assert again.status_code == 200 and again.json()["status"] == "duplicate"
    other = make_batch(seq=7)
    other["gpus"][0]["util_gpu_pct"] = 99.0  # a rolled-back counter numbered a new batch with an old seq
    r = post(client, other, world.token)
    assert_refused(r, 409, "seq_reused", before, "seq 7 of agent-node-000 was already stored with other content")
    assert m.AgentBatch.objects.get().digest


def test_a_batch_stored_before_digests_existed_is_still_a_duplicate(client: Any, world: World) -> None:
    assert post(client, make_batch(seq=3), world.token).status_code == 200
    m.AgentBatch.objects.update(digest="")  # a row from before migration 0004
    other = make_batch(seq=3)
    other["gpus"][0]["util_gpu_pct"] = 99.0
    assert post(client, other, world.token).json()["status"] == "duplicate"


def test_every_new_refusal_is_documented(client: Any) -> None:
    assert ERRORS["clock_skew"][0] == 400 and ERRORS["seq_reused"][0] == 409
    doc = client.get("/api/openapi.json").json()
    responses = doc["paths"]["/api/v1/ingest"]["post"]["responses"]
    assert "`seq_reused`" in responses["409"]["description"] and "`clock_skew`" in responses["400"]["description"]
    assert {"clock_skew", "seq_reused"} <= set(doc["components"]["schemas"]["Error"]["properties"]["error"]["enum"])
