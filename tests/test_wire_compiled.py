"""``wire.parse_batch`` (msgspec types generated from the wire declarations) against the reference path it replaces on
the server, ``wire.validate_batch(json.loads(body))``: for every body, the same batch (types, key order, ``-0.0``
and all) or the same error, word for word; and the compiled path itself takes every valid batch (so the equality
is not won by handing everything to the reference path).

Batches are generated from the declarations (``wire._fields``), valid ones and then mutated at one or two places with
values derived from the field's own bounds (the bound, one past it, its integral float, a string of its maximum
length in characters that UTF-16 counts twice, a pattern match with a trailing newline), JSON tokens Python accepts
and msgspec does not (``NaN``, ``1e999``, 400-digit integers), duplicate keys, and whole-body damage."""

from __future__ import annotations

import json
import math
import re
import typing
from functools import cache
from typing import Any, Literal

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clusterdx import wire, wire_compiled


class Raw(str):
    """A JSON token written as it is (``NaN``, ``1e999``): json.dumps would write a string."""


class Again(str):
    """A key written a second time in the same object: equal to nothing but itself, so a dict holds both."""

    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other


def dumps(value: Any, ascii_only: bool) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k), ensure_ascii=ascii_only)}: {dumps(v, ascii_only)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(dumps(v, ascii_only) for v in value) + "]"
    return json.dumps(value, ensure_ascii=ascii_only, allow_nan=True)


def reference(body: bytes) -> tuple[str, str]:
    """What the ingest view answered before parse_batch: ("ok", the batch as JSON) or (error kind, message)."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:
        return "malformed", str(exc)
    try:
        return "ok", json.dumps(wire.validate_batch(payload))
    except wire.WireError as exc:
        return "invalid", str(exc)


def compiled(body: bytes) -> tuple[str, str]:
    try:
        return "ok", json.dumps(wire.parse_batch(body))  # json.dumps tells 1 from 1.0 and True, and -0.0 from 0.0
    except wire.MalformedJson as exc:
        return "malformed", str(exc)
    except wire.WireError as exc:
        return "invalid", str(exc)


def assert_same(body: bytes) -> tuple[str, str]:
    expected = reference(body)
    assert compiled(body) == expected, body[:2000]
    fast = wire_compiled.decode(wire.Batch, body)
    if fast is not None:  # the compiled path is never looser than the reference, and gives the same batch
        assert expected == ("ok", json.dumps(fast)), body[:2000]
    kept = wire_compiled.decode(wire.Batch, body, wire.KEPT_RECORDS)
    if kept is not None:  # the records ingest keeps as the decoder's hold the same values
        assert all(isinstance(r, wire_compiled.Struct) for k in wire.KEPT_RECORDS for r in kept[k]), body[:2000]
        assert expected == ("ok", json.dumps(msgspec.to_builtins(kept))), body[:2000]
    return expected


# -- valid values, from the declarations ----------------------------------------------------------------------------
TEXT = st.characters(exclude_categories=("Cs",), exclude_characters="\x00")
WIDE = ["a", "é", "\U0001f600", "\x7f", "\u2028"]  # one character each; the emoji is two UTF-16 units, four bytes


fields = cache(wire._fields)  # get_type_hints evaluates every annotation again on each call


def _parts(tp: Any) -> tuple[Any, dict[type, Any]]:
    tp, meta = wire._split_annotated(tp)
    return tp, {type(m): m for m in meta}


@cache
def valid(tp: Any) -> st.SearchStrategy[Any]:
    tp, meta = _parts(tp)
    rng, ln, pat = meta.get(wire.Range), meta.get(wire.Len), meta.get(wire.Pattern)
    lo, hi = (rng.ge, rng.le) if rng else (None, None)
    if tp is int:
        return st.integers(math.ceil(lo), math.floor(hi))
    if tp is float:
        ints = st.integers(-(2**1000) if lo is None else math.ceil(lo), 2**1000 if hi is None else math.floor(hi))
        return st.one_of(st.floats(lo, hi, allow_nan=False, allow_infinity=False), ints)
    if tp is bool:
        return st.booleans()
    if tp is str:
        top = ln.max if ln else 64
        least = ln.min if ln else 0
        if pat:
            full = st.from_regex(pat.regex, fullmatch=True).filter(lambda s: least <= len(s) <= top)
            return st.one_of(full, st.just("a" * top))
        return st.one_of(st.text(TEXT, min_size=least, max_size=min(top, 8)), st.sampled_from(WIDE).map(lambda c: c * top))
    origin = typing.get_origin(tp)
    if origin is Literal:
        return st.sampled_from(typing.get_args(tp))
    if origin is list:
        return st.lists(valid(typing.get_args(tp)[0]), max_size=min(ln.max if ln else 2, 2))
    if origin is dict:
        return st.dictionaries(valid(wire.DictKey), valid(typing.get_args(tp)[1]), max_size=min(ln.max if ln else 3, 3))
    if isinstance(tp, type) and issubclass(tp, wire.Record):
        return record(tp)
    (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
    return st.one_of(st.none(), valid(inner))


@cache
def record(cls: type[wire.Record]) -> st.SearchStrategy[dict[str, Any]]:
    declared = fields(cls)
    required = {n: valid(tp) for n, (tp, d) in declared.items() if d is wire._MISSING}
    optional = {n: valid(tp) for n, (tp, d) in declared.items() if d is not wire._MISSING}
    return st.fixed_dictionaries(required, optional=optional)


# -- one field broken, with values its declaration makes interesting -------------------------------------------------
def tricky(tp: Any) -> list[Any]:
    """Values at, just past and just beside the bounds of ``tp``, and of the wrong kind."""
    tp, meta = _parts(tp)
    args = typing.get_args(tp)
    if type(None) in args and len(args) == 2:
        tp, meta = _parts(next(a for a in args if a is not type(None)))
        args = typing.get_args(tp)  # a Literal's own values, not the union's (which are not JSON)
    rng, ln, pat = meta.get(wire.Range), meta.get(wire.Len), meta.get(wire.Pattern)
    out: list[Any] = [None, True, "1", [], {}, Raw("NaN"), Raw("-Infinity"), Raw("1e999"), Raw("1" * 400), Raw("-0.0")]
    if tp in (int, float) and rng:
        for b in (rng.ge, rng.le):
            if b is not None:
                out += [b, float(b), int(b) - 1, int(b) + 1, b + 0.5, math.nextafter(b, -math.inf),
                        math.nextafter(b, math.inf), Raw(f"{float(b):e}"), Raw(f"{int(b)}.0")]
        out += [2**63, 2**64, -(2**63) - 1, 10**40, 1e308, 5e-324, Raw("-0"), Raw("1E2"), Raw("1e-400"), Raw("9" * 4400)]
    if tp is str:
        top, least = (ln.max, ln.min) if ln else (64, 0)
        out += [c * n for c in ("a", "\U0001f600", "é") for n in (top, top + 1, max(least - 1, 0))]
        out += ["a\x00", "\ud800", "\udc00\ud800", "\ud83d\ude00", "a\n", 5, 1.5]
        if pat:
            out += ["a" * top + "\n", "\na", "-a", "a b", "_a", ".a"]
    if typing.get_origin(tp) is Literal:
        out += [*args, *(f"{a}x" for a in args if isinstance(a, str)), 1.0, 2, "1"]
    if typing.get_origin(tp) in (list, dict) and ln and ln.max <= 64:
        item = {"ts": 1.0} if typing.get_origin(tp) is list else 1
        out += [[item] * (ln.max + 1), {f"k{i}": 1 for i in range(ln.max + 1)}]
    if typing.get_origin(tp) is dict:
        out += [{"": 1}, {"k" * 128: 1}, {"k" * 129: 1}, {"\x00": 1}, {"\ud800": 1}, {"k": "x"}, {"k": None}]
    return out


def slots(value: Any, tp: Any) -> list[tuple[Any, Any, Any]]:
    """(container, key or index, declared type) of every value in ``value`` (declared as ``tp``), depth first."""
    tp, _ = _parts(tp)
    args = typing.get_args(tp)
    if type(None) in args and len(args) == 2:
        tp, _ = _parts(next(a for a in args if a is not type(None)))
    out: list[tuple[Any, Any, Any]] = []
    if isinstance(tp, type) and issubclass(tp, wire.Record) and isinstance(value, dict):
        for name, (ftp, _) in fields(tp).items():
            out.append((value, name, ftp))
            if name in value:
                out += slots(value[name], ftp)
    elif typing.get_origin(tp) is list and isinstance(value, list):
        for i, v in enumerate(value):
            out += [(value, i, typing.get_args(tp)[0]), *slots(v, typing.get_args(tp)[0])]
    elif typing.get_origin(tp) is dict and isinstance(value, dict):
        for k, v in value.items():
            out += [(value, k, typing.get_args(tp)[1]), *slots(v, typing.get_args(tp)[1])]
    return out


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    batch = draw(record(wire.Batch))
    for _ in range(draw(st.integers(1, 2))):
        container, key, tp = draw(st.sampled_from(slots(batch, wire.Batch)))
        how = draw(st.sampled_from(["set"] * 6 + ["delete", "unknown", "dup-first", "dup-last"]))
        if how == "set" or isinstance(container, list):
            container[key] = draw(st.sampled_from(tricky(tp)))
        elif how == "delete":
            container.pop(key, None)
        elif how == "unknown":
            container[key + "_x"] = 1
        elif key in container:  # a repeated key: json.loads and msgspec both keep the last
            items = list(container.items())
            container.clear()
            if how == "dup-last":
                container.update(items)
            container[Again(key)] = draw(st.sampled_from(tricky(tp)))
            container.update(items if how == "dup-first" else {})
    body = dumps(batch, draw(st.booleans())).encode("utf-8", "surrogatepass")
    damage = draw(st.sampled_from(["none"] * 8 + ["bom", "utf-16", "truncate", "trailing", "spaces", "nest"]))
    if damage == "bom":
        body = b"\xef\xbb\xbf" + body
    elif damage == "utf-16":
        body = body.decode("utf-8", "surrogatepass").encode("utf-16", "surrogatepass")
    elif damage == "truncate":
        body = body[: draw(st.integers(0, len(body) - 1))]
    elif damage == "trailing":
        body += draw(st.sampled_from([b" \n\t\r", b" x", b"{}", b"\x00", b"\x0c"]))
    elif damage == "spaces":
        body = re.sub(rb'", ', b'",\n\t ', body)
    elif damage == "nest":
        body = body.replace(b'"gpus": [', b'"gpus": [' + b"[" * 3000, 1)
    return body


FAST = settings(max_examples=100, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


@FAST
@given(record(wire.Batch), st.booleans())
def test_every_valid_batch_takes_the_compiled_path_and_comes_out_the_same(batch: dict[str, Any], ascii_only: bool) -> None:
    body = dumps(batch, ascii_only).encode()
    assert wire_compiled.decode(wire.Batch, body) is not None, body[:2000]
    assert assert_same(body)[0] == "ok"


@settings(FAST, max_examples=250)
@given(mutated())
def test_a_broken_batch_gets_the_same_answer_word_for_word(body: bytes) -> None:
    assert_same(body)


@pytest.mark.parametrize("body", [
    b'{"v": 1, "agent_id": "a", "seq": 3.0, "host": "h", "sent_at": 1}',  # an integral float is an integer
    b'{"v": 1.0, "agent_id": "a", "seq": 3, "host": "h", "sent_at": 1}',
    b'{"v": 1, "agent_id": "a", "seq": "x", "seq": 3, "host": "h", "sent_at": 1}',
    b'{"v": 1, "agent_id": "a", "seq": 3, "host": "h", "sent_at": 1, "sent_at": -1}',
    b'{"v": 1, "agent_id": "a", "seq": 3, "host": "h", "sent_at": ' + b"1" * 400 + b"}",  # was an OverflowError (500)
    b'{"v": 1, "agent_id": "a", "seq": 3, "host": "h", "sent_at": NaN}',
    b'{"v": 1, "agent_id": "a", "seq": 3, "host": "h\\n", "sent_at": 1}',
    b'{"v": 1, "agent_id": "a", "seq": 3, "host": "h", "sent_at": 1, "dropped": {"\\u0000": 1}}',
    b'{"v": 1, "agent_id": "a", "seq": 3, "host": "h", "sent_at": 1, "dropped": {"a": 1, "a": -1}}',
    b'{"v": 2, "agent_id": "a", "seq": 3, "host": "h", "sent_at": 1}',
    b'{"v": 1, "agent_id": "a", "seq": 3, "host": "h", "sent_at": 1, "gpus": [' + b"[" * 100_000 + b"]",
    b"[" * 100_000 + b"]" * 100_000, b"", b"null", b"[1, 2]", b"\xff\xfe\x00garbage",
])
def test_the_cases_where_the_two_parsers_differ_get_the_reference_answer(body: bytes) -> None:
    assert_same(body)


def test_the_old_overflow_is_a_wire_error_naming_the_field() -> None:
    body = b'{"v": 1, "agent_id": "a", "seq": 3, "host": "h", "sent_at": ' + b"1" * 400 + b"}"
    with pytest.raises(wire.WireError, match=r"^sent_at: must be a finite number$"):
        wire.parse_batch(body)


def test_an_unbounded_integer_cannot_be_declared() -> None:
    class Loose(wire.Record):
        n: int

    with pytest.raises(TypeError, match="Range"):
        wire_compiled.struct(Loose)


def wide_batch() -> dict[str, Any]:
    return {"v": 1, "agent_id": "a", "seq": 3, "host": "h", "sent_at": 1.7e9, "gpus": [
        {"ts": 1.7e9, "index": i, "uuid": f"GPU-{i}", "util_gpu_pct": 50.5, "mem_used_bytes": 2**40 + i, "temp_c": None,
         "throttle_reasons": ["sw_power_cap"] if i else [], "ecc_dbe_volatile": 0, "remap_pending": False,
         "unavailable": {"nvlink": "not supported"}} for i in range(3)],
        "steps": [{"run": "r", "rank": i, "step": 7, "ts": 1.7e9, "step_time_s": 1.5, "phases": {"fwd": 0.5},
                   "groups": [{"role": "tp", "name": "tp", "group_rank": i, "group_size": 2, "calls": 4,
                               "inflight_s": 0.25}]} for i in range(2)],
        "probes": [{"ts": 1.7e9, "peer": "g", "sent": 10, "lost": 0, "rtt_ms": 0.05}]}


def test_a_kept_record_reads_like_the_dict_it_replaces() -> None:
    body = json.dumps(wide_batch()).encode()
    as_dicts, as_records = wire.parse_batch(body), wire.parse_batch(body, keep_records=True)
    for key in wire.KEPT_RECORDS:
        assert as_records[key] and all(type(d) is dict for d in as_dicts[key])
        for d, r in zip(as_dicts[key], as_records[key], strict=True):
            assert isinstance(r, wire_compiled.Struct)
            assert msgspec.to_builtins({k: r[k] for k in d}) == msgspec.to_builtins({k: r.get(k) for k in d}) == d
            assert set(r.__struct_fields__) == set(d) and wire.Fields("ts", "ts").of([r])(r) == (d["ts"], d["ts"])
            assert r.get("no_such_field") is None and r.get("no_such_field", 7) == 7
            with pytest.raises(KeyError):
                r["no_such_field"]
    assert as_records["steps"][0]["groups"][0]["name"] == "tp"  # a record inside a kept one is read alike
    rest = set(as_dicts) - set(wire.KEPT_RECORDS)
    assert {k: as_records[k] for k in rest} == {k: as_dicts[k] for k in rest}


def test_the_reference_path_answers_dicts_even_when_records_are_asked_for() -> None:
    batch = wide_batch()
    batch["gpus"][0]["index"] = Raw("3.0")  # an integral float: the compiled path leaves it to the reference path
    body = dumps(batch, ascii_only=True).encode()
    assert wire_compiled.decode(wire.Batch, body, wire.KEPT_RECORDS) is None
    got = wire.parse_batch(body, keep_records=True)
    assert all(type(r) is dict for k in wire.KEPT_RECORDS for r in got[k])
    assert got["gpus"][0]["index"] == 3 and type(got["gpus"][0]["index"]) is int
