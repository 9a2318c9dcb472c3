"""Wire version 2's blocks (clusterdx.blocks, the agent's half; dashboard.ingest.blocks, the server's): a block
carries exactly version 1's records, and its checks refuse exactly what version 1 refuses. A check that passed
everything would make the columnar path look cheaper than it is, and a block that rounded a counter would be a
silent change of the data."""

from __future__ import annotations

import base64
import json
import math
import struct
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clusterdx import blocks, wire
from dashboard.ingest import blocks as server

GPU = {"ts": 1_700_000_000.5, "index": 3, "uuid": "GPU-1", "name": "H100", "util_gpu_pct": 97.0,
       "mem_used_bytes": 70 * 2**30, "ecc_dbe_volatile": 0, "remap_pending": False, "throttle_reasons": ["hw_slowdown"],
       "unavailable": {"nvlink": "not supported"}}
STEP = {"run": "llama-8b", "rank": 5, "step": 1200, "ts": 1_700_000_001.0, "step_time_s": 1.25, "tokens": 2**20,
        "phases": {"forward": 0.4},
        "groups": [{"role": "dp", "name": "dp", "group_rank": 5, "group_size": 8, "calls": 12, "inflight_s": 0.1}]}
PROBE = {"ts": 1_700_000_000.0, "peer": "node-007", "sent": 10, "lost": 1, "rtt_ms": 0.21}
BEAT = {"run": "llama-8b", "rank": 5, "ts": 1_700_000_000.0, "state": "data", "state_s": 3.5, "pid": 4242}
ONE = {"gpus": GPU, "steps": STEP, "probes": PROBE, "beats": BEAT}


def _wire(obj: Any) -> Any:
    """Through JSON and back, as the post travels."""
    return json.loads(json.dumps(obj))


def _roundtrip(kind: str, recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    blk = server.decode_block(kind, _wire(blocks.encode_block(kind, recs)))
    server.check([blk])
    return server.records(blk)


def _v1(kind: str, rec: dict[str, Any]) -> dict[str, Any]:
    return wire.validate(blocks.BLOCKED[kind], rec)


@pytest.mark.parametrize("kind", sorted(ONE))
def test_a_block_carries_version_1s_records_exactly(kind: str) -> None:
    assert _v1(kind, ONE[kind])  # the sample is a valid record
    assert _roundtrip(kind, [ONE[kind]] * 3) == [_v1(kind, ONE[kind])] * 3
    assert _roundtrip(kind, []) == []


def test_a_simulated_clusters_posts_survive_the_trip() -> None:
    from collectors.sim.model import SimCluster
    from collectors.sim.scenario import parse

    start = time.time() - 120
    sim = SimCluster(parse({"cluster": {"nodes": 3, "gpus_per_node": 8, "seed": 5}}), start)
    seen = dict.fromkeys(blocks.BLOCKED, 0)
    for t in range(6):
        for batch in sim.tick(start + t):
            body = _wire(blocks.encode_batch({**batch, "seq": t + 1}))
            assert body["v"] == blocks.BLOCK_WIRE_VERSION
            assert {k: v for k, v in body.items() if k not in blocks.BLOCKED and k != "v"} == \
                   {k: v for k, v in _wire(batch).items() if k not in blocks.BLOCKED and k not in ("v", "seq")} | \
                   {"seq": t + 1}
            for kind in blocks.BLOCKED:
                blk = server.decode_block(kind, body[kind])
                server.check([blk])
                assert server.records(blk) == [_v1(kind, r) for r in _wire(batch.get(kind, []))]
                seen[kind] += len(blk.mat)
    assert all(seen.values()), seen  # every kind was exercised


def test_the_agent_can_turn_its_blocks_back_into_version_1() -> None:
    """What an agent resends when its server predates version 2 (collectors.agent.spool.Spool.downgrade)."""
    from collectors.sim.model import SimCluster
    from collectors.sim.scenario import parse

    start = time.time() - 60
    sim = SimCluster(parse({"cluster": {"nodes": 2, "gpus_per_node": 8, "seed": 2}}), start)
    for t in range(3):
        for batch in sim.tick(start + t):
            batch = _wire({**batch, "seq": t})
            back = blocks.decode_batch(_wire(blocks.encode_batch(batch)))
            assert back["v"] == wire.WIRE_VERSION
            assert wire.validate_batch(back) == wire.validate_batch(batch)


def _refused_by_v1(kind: str, rec: dict[str, Any]) -> bool:
    try:
        _v1(kind, _wire(rec))
    except wire.WireError:
        return True
    return False


def _refused_by_block(kind: str, name: str, value: float) -> bool:
    """The post's row with ``value`` put straight into the matrix, as a hostile or buggy sender could."""
    lay = blocks.LAYOUTS[kind]
    enc = blocks.encode_block(kind, [ONE[kind]])
    at = [c.name for c in lay.numbers].index(name)
    row = list(struct.unpack(f"<{len(lay.numbers)}d", base64.b64decode(enc["num"])))
    row[at] = value
    enc["num"] = base64.b64encode(struct.pack(f"<{len(row)}d", *row)).decode()
    blk = server.decode_block(kind, _wire(enc))
    try:
        server.check([blk])
    except wire.WireError as exc:
        assert exc.path == f"{kind}[0].{name}", exc.path
        return True
    return False


def _as_v1(col: blocks.Column, v: float) -> tuple[bool, Any]:
    """(whether version 1 JSON can say ``v`` for this field at all, the value it would say)."""
    if math.isnan(v):
        return True, None
    if not math.isfinite(v):
        return False, None
    if col.type == "bool":
        return v in (0.0, 1.0), v == 1.0
    if col.type == "int" and v.is_integer():
        return True, int(v)
    return True, v


COLUMNS = [(kind, c) for kind, lay in sorted(blocks.LAYOUTS.items()) for c in lay.numbers]
EDGES = st.sampled_from([0.0, -0.0, -1.0, 0.5, 1.0, 2.0, 100.0, 100.5, 1023.0, 1024.0, 1e7, 1e7 + 1, 1e11, 2e11,
                         2.0**31 - 1, 2.0**31, 2.0**53, 2.0**53 + 2, 2.0**63, -2.0**53, math.nan, math.inf,
                         -math.inf, 1e308, -1e308])
VALUES = st.one_of(EDGES, st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**64, 2**64).map(float))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(COLUMNS), VALUES)
def test_the_block_checks_refuse_what_version_1_refuses(column: tuple[str, blocks.Column], v: float) -> None:
    kind, col = column
    sayable, as_v1 = _as_v1(col, v)
    refused = _refused_by_block(kind, col.name, v)
    if not sayable:  # infinity, or a bool that is not 0 or 1: no version 1 post says it, and no block may
        assert refused, (kind, col.name, v)
        return
    v1_refused = _refused_by_v1(kind, {**ONE[kind], col.name: as_v1})
    if col.type == "int" and not v1_refused and abs(v) > blocks.EXACT_INT:
        # The one difference, by design: a counter past 2**53 is not carried (it would be rounded); the agent's
        # encoder sends such a post as version 1 (next test), so no value version 1 takes is lost.
        assert refused
        return
    assert refused == v1_refused, (kind, col.name, v, as_v1)


def test_what_a_block_cannot_carry_goes_as_version_1() -> None:
    for kind, field, value in (("steps", "tokens", 2**60), ("gpus", "util_gpu_pct", math.inf),
                               ("gpus", "util_gpu_pct", "97"), ("gpus", "remap_pending", 1),
                               ("probes", "sent", True), ("beats", "pid", 2.0**60), ("steps", "rank", 10**400)):
        with pytest.raises(blocks.Unblockable):
            blocks.encode_block(kind, [{**ONE[kind], field: value}])
    assert not _refused_by_v1("steps", {**STEP, "tokens": 2**60})  # version 1 takes it: nothing is lost
    with pytest.raises(blocks.Unblockable, match="unknown field"):
        blocks.encode_block("probes", [{**PROBE, "jitter_ms": 1.0}])
    # A whole number as a float is what version 1 takes for an integer too.
    assert _roundtrip("probes", [{**PROBE, "sent": 10.0}])[0]["sent"] == 10


def _bad(kind: str, change: Any) -> wire.WireError:
    enc = _wire(blocks.encode_block(kind, [ONE[kind], ONE[kind]]))
    change(enc)
    with pytest.raises(wire.WireError) as got:
        server.check([server.decode_block(kind, enc)])
    return got.value


def test_a_malformed_block_is_refused_with_its_path() -> None:
    cases = [
        ("gpus", lambda b: b.update(num=b["num"][:-4]), "gpus.num", "bytes"),
        ("gpus", lambda b: b.update(num="!!!!" + b["num"][4:]), "gpus.num", "not base64"),
        ("gpus", lambda b: b.update(num=b["num"] * 1000), "gpus.num", "longer than"),
        ("gpus", lambda b: b.update(n=3), "gpus.num", "bytes"),
        ("gpus", lambda b: b.update(n=-1), "gpus.n", "whole number"),
        ("gpus", lambda b: b.update(n=4097), "gpus.n", "whole number"),
        ("gpus", lambda b: b.update(n=True), "gpus.n", "whole number"),
        ("gpus", lambda b: b["num_cols"].__setitem__(1, "evil\u0000col"), "gpus.num_cols[1]", "unknown column"),
        ("gpus", lambda b: b["num_cols"].__setitem__(1, "ts"), "gpus.num_cols", "twice"),
        ("gpus", lambda b: b.update(extra=1), "gpus.extra", "unknown field"),
        ("gpus", lambda b: b["cols"].update(nope=[1, 2]), "gpus.cols.nope", "unknown field"),
        ("gpus", lambda b: b["cols"].update(uuid=["a"]), "gpus.cols.uuid", "list of 2"),
        ("gpus", lambda b: b["cols"].update(uuid=["a", 7]), "gpus.cols.uuid[1]", "expected a string"),
        ("steps", lambda b: b["cols"].update(run=["ok", "bad run!"]), "steps.cols.run[1]", "does not match"),
        ("steps", lambda b: b["cols"].update(run=["ok", None]), "steps.cols.run[1]", "missing required"),
        ("steps", lambda b: b["cols"].pop("run"), "steps.cols.run", "missing required"),
        ("steps", lambda b: b["cols"].update(phases=[{}, {"x": -1}]), "steps.cols.phases[1].x", ">= 0"),
        ("probes", lambda b: b["cols"].update(peer=["ok", "\ud800"]), "probes.cols.peer[1]", "surrogate"),
        ("beats", lambda b: b["cols"].update(state=["data", "dancing"]), "beats.cols.state[1]", "must be one of"),
        ("probes", lambda b: b.update(num_cols=["ts", "sent"]), "probes.num_cols", "missing required column 'lost'"),
        ("probes", lambda b: b.update(num_cols="ts"), "probes.num_cols", "list of column names"),
    ]
    for kind, change, path, words in cases:
        err = _bad(kind, change)
        assert err.path == path and words in err.message, (path, err.path, err.message)


def test_a_column_an_older_agent_left_out_is_null() -> None:
    enc = blocks.encode_block("probes", [PROBE])
    lay = blocks.LAYOUTS["probes"]
    keep = [c.name for c in lay.numbers if c.name != "bw_gbps"]
    row = struct.unpack(f"<{len(lay.numbers)}d", base64.b64decode(enc["num"]))
    enc.update(num_cols=keep, num=base64.b64encode(struct.pack(
        f"<{len(keep)}d", *[v for c, v in zip(lay.numbers, row, strict=True) if c.name != "bw_gbps"])).decode())
    blk = server.decode_block("probes", _wire(enc))
    server.check([blk])
    assert server.records(blk) == [_v1("probes", PROBE)]


def test_a_groups_check_names_the_row_in_its_own_block() -> None:
    good = server.decode_block("steps", _wire(blocks.encode_block("steps", [STEP] * 4)))
    bad = server.decode_block("steps", _wire(blocks.encode_block("steps", [STEP, {**STEP, "rank": 1_000_001}])))
    server.check([good, good])
    with pytest.raises(wire.WireError) as got:
        server.check([good, good, bad])
    assert got.value.path == "steps[1].rank" and "<= 1000000" in got.value.message


def test_the_agents_half_needs_no_numpy() -> None:
    code = "import sys, clusterdx.blocks; assert 'numpy' not in sys.modules and 'msgspec' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- the fast path (one msgspec decode of the whole post) against the reference path ------------------------------------


def _post(**blocks_: Any) -> dict[str, Any]:
    body = {"v": 2, "agent_id": "agent-1", "seq": 4, "host": "node-001", "sent_at": 1_700_000_002.0,
            "hosts": [{"ts": 1_700_000_000.0, "cpu_pct": 12.5}]}
    for kind, rec in ONE.items():
        body[kind] = blocks.encode_block(kind, [rec, rec])
    body.update(blocks_)
    return body


def _same_batch(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], server.Block):
            assert a[k].kind == b[k].kind and a[k].cols == b[k].cols, k
            assert np.array_equal(a[k].mat, b[k].mat, equal_nan=True), k
        else:
            assert a[k] == b[k], k


def _outcome(fn: Any, body: bytes) -> Any:
    try:
        return fn(body)
    except (wire.WireError, wire.MalformedJson) as exc:
        return exc


def test_the_fast_path_reads_a_simulated_clusters_posts_as_the_reference_path_does() -> None:
    from collectors.sim.model import SimCluster
    from collectors.sim.scenario import parse

    start = time.time() - 120
    sim = SimCluster(parse({"cluster": {"nodes": 3, "gpus_per_node": 8, "run": "llm", "seed": 9}}), start)
    for t in range(4):
        for batch in sim.tick(start + t):
            body = json.dumps(blocks.encode_batch({**batch, "seq": t + 1})).encode()
            fast = server._parse_v2_fast(body)
            assert fast is not None, "a simulated post is taken by the fast path"
            _same_batch(fast, server.parse_v2(body))
            for kind in blocks.BLOCKED:  # and each block still carries exactly version 1's records
                assert server.records(fast[kind]) == [_v1(kind, r) for r in _wire(batch.get(kind, []))]


def test_the_fast_path_never_takes_what_the_reference_path_refuses() -> None:
    """Every malformed block of test_a_malformed_block_is_refused_with_its_path, in a whole post: the fast path
    leaves it to the reference path (None), which refuses it with its words."""
    changes = [
        ("gpus", lambda b: b.update(num=b["num"][:-4])), ("gpus", lambda b: b.update(n=3)),
        ("gpus", lambda b: b["num_cols"].__setitem__(1, "ts")), ("gpus", lambda b: b.update(extra=1)),
        ("gpus", lambda b: b["cols"].update(uuid=["a"])), ("gpus", lambda b: b["cols"].update(uuid=["a", 7])),
        ("steps", lambda b: b["cols"].update(run=["ok", "bad run!"])), ("steps", lambda b: b["cols"].pop("run")),
        ("steps", lambda b: b["cols"].update(run=["ok", None])),
        ("steps", lambda b: b["cols"].update(phases=[{}, {"x": -1}])),
        ("beats", lambda b: b["cols"].update(state=["data", "dancing"])),
        ("probes", lambda b: b.update(num_cols=["ts", "sent"])), ("gpus", lambda b: b.update(n=-1)),
        ("probes", lambda b: b.update(num="!!!!" + b["num"][4:])),
    ]
    for kind, change in changes:
        post = _post()
        change(post[kind])
        body = json.dumps(post).encode()
        assert server._parse_v2_fast(body) is None, kind
        assert isinstance(_outcome(server.parse_v2, body), wire.WireError), kind


def test_a_patterned_column_is_checked_once_per_value_and_never_less(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's name or a peer is checked once per distinct value of a post and remembered once it passed: a value
    seen before never lets a new one through, and what is remembered is bounded."""
    def fast(kind: str, field: str, values: list[Any]) -> Any:
        post = _post()
        post[kind]["cols"][field] = values
        return server._parse_v2_fast(json.dumps(post).encode())

    assert fast("steps", "run", ["llama-8b", "llama-8b"]) is not None
    assert "llama-8b" in server._PASSED[server._PATTERNS["steps"]["run"]]
    for kind, field, bad in [("steps", "run", "bad run!"), ("beats", "run", "-starts-with-a-dash"),
                             ("probes", "peer", "node-007\n"), ("probes", "peer", "")]:
        assert fast(kind, field, [ONE[kind][field], bad]) is None, (kind, bad)  # the reference path words it
        assert isinstance(_outcome(server.parse_v2, json.dumps({**_post(), kind: {
            **_post()[kind], "cols": {**_post()[kind]["cols"], field: [ONE[kind][field], bad]}}}).encode()),
            wire.WireError)
        assert bad not in server._PASSED[server._PATTERNS[kind][field]]
    monkeypatch.setattr(server, "PASSED_MAX", 4)
    monkeypatch.setattr(server, "_PASSED", {})
    for i in range(0, 10, 2):
        assert fast("probes", "peer", [f"node-{i}", f"node-{i + 1}"]) is not None
    assert len(server._PASSED[server._PATTERNS["probes"]["peer"]]) == 4
    assert fast("probes", "peer", ["node-0", "node 0"]) is None  # still checked once the memo is full


NUMBERS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                    st.text(max_size=4), st.lists(st.integers(0, 3), max_size=2))


def _set_number(block: dict[str, Any], row: int, col: int, value: float) -> None:
    nums = list(struct.unpack(f"<{block['n'] * len(block['num_cols'])}d", base64.b64decode(block["num"])))
    nums[row * len(block["num_cols"]) + col % len(block["num_cols"])] = value
    block["num"] = base64.b64encode(struct.pack(f"<{len(nums)}d", *nums)).decode()


@settings(max_examples=400, deadline=None)
@given(kind=st.sampled_from(sorted(ONE)),
       where=st.sampled_from(["n", "cols", "num_cols", "block", "envelope", "number"]),
       field=st.sampled_from(["uuid", "run", "peer", "state", "throttle_reasons", "phases", "x", "ts", "host",
                              "seq", "sent_at"]), value=NUMBERS, col=st.integers(0, 40), number=VALUES)
def test_the_fast_path_agrees_with_the_reference_path_on_any_change(kind: str, where: str, field: str,
                                                                    value: Any, col: int, number: float) -> None:
    """One field or number of an otherwise valid post set to anything: the fast path, with the group writer's check
    of its numbers (check_posts), takes it as the reference path does, or leaves it to it (None); it never takes a
    post the reference path refuses."""
    post = _post()
    if where == "number":
        _set_number(post[kind], 1, col, number)
    elif where == "n":
        post[kind]["n"] = value
    elif where == "cols":
        post[kind]["cols"][field] = [value, value]
    elif where == "num_cols":
        post[kind]["num_cols"] = value
    elif where == "block":
        post[kind] = value
    else:
        post[field] = value
    body = json.dumps(post).encode()
    reference = _outcome(server.parse_v2, body)
    fast = server._parse_v2_fast(body)
    refused = None if fast is None else server.check_posts([fast])[0]
    if isinstance(reference, Exception):
        assert fast is None or refused is not None, (kind, where, field, value, number, reference)
        if refused is not None:  # worded as the reference path words it
            assert (refused.path, refused.message) == (reference.path, reference.message)
    elif fast is not None:
        assert refused is None, refused
        _same_batch(fast, reference)


def _types(rows: list[Any]) -> list[Any]:
    return [tuple(map(type, r)) if isinstance(r, tuple) else type(r) for r in rows]


def test_a_blocks_rows_read_as_its_records_hold_them_nulls_and_types_included() -> None:
    """rows_of over a version 2 block (every numeric column converted at once) gives each field exactly as version
    1's record holds it: ints as ints, flags as bools, None where null, whatever the order the fields are asked in."""
    from dashboard.ingest.blocks import rows_of

    for kind, rec in ONE.items():
        layout = blocks.LAYOUTS[kind]
        nullable = {c.name: None for c in layout.numbers if c.nullable}
        assert nullable, kind
        recs = [rec, {**rec, **nullable}, rec]
        blk = server.decode_block(kind, _wire(blocks.encode_block(kind, [_v1(kind, r) for r in recs])))
        server.check([blk])
        want = server.records(blk)
        assert any(v is None for r in want for v in r.values()), kind
        names = [c.name for c in layout.numbers][::-1] + list(layout.others)
        for fields in (names, names[:1], [names[-1], names[0]]):
            got = list(rows_of(blk, wire.Fields(*fields)))
            expect = [tuple(r[f] for f in fields) if len(fields) > 1 else r[fields[0]] for r in want]
            assert got == expect, (kind, fields)
            assert _types(got) == _types(expect), (kind, fields)
