"""The wire format's declarations compiled into msgspec types: JSON decoding and validation in one pass, in C.

Generated from the same records as :func:`clusterdx.wire.validate_batch` and :func:`clusterdx.wire.json_schema` (one
source of truth): each ``Record`` becomes a ``msgspec.Struct`` and each ``Range``, ``Len`` and ``Pattern`` a
``msgspec.Meta`` constraint. The server needs msgspec; agents and training hooks import :mod:`clusterdx.wire` without
it, which imports this module only when :func:`clusterdx.wire.parse_batch` is first called.

This is the fast path for the batches producers really send. It is *stricter* than the reference validator, never
looser: whatever it refuses, or a case it leaves alone (a ``\\u0000`` escape, ``3.0`` for an integer, ``NaN``), goes
to the reference path (``json.loads`` + :func:`clusterdx.wire.validate_batch`), which decides and words the error.
So every answer, accepted dict or error, is the reference path's; tests/test_wire_compiled.py checks both agree.
"""

from __future__ import annotations

import math
import re
import sys
import typing
from functools import cache
from typing import Annotated, Any, Literal

import msgspec

from clusterdx import wire

# JSON has no word for infinity; ``1e999`` is "Number out of range" to msgspec already. The bound says "finite" the way
# the reference path does, so that no float reaches a record without it.
_FINITE = {"ge": -sys.float_info.max, "le": sys.float_info.max}


def _meta(meta: list[Any], kind: type, patterns: bool = True) -> msgspec.Meta | None:
    """The msgspec constraint for a wire type's ``Range``, ``Len`` and ``Pattern`` markers (``kind`` is its base);
    without its ``Pattern`` unless ``patterns``."""
    out: dict[str, Any] = dict(_FINITE) if kind is float else {}
    for m in meta:
        if isinstance(m, wire.Range):
            if kind is int:  # exact for integers, whatever the bound's own type (1e11 or 10**11)
                out.update({k: f(v) for k, f, v in (("ge", math.ceil, m.ge), ("le", math.floor, m.le)) if v is not None})
            else:
                out.update({k: v for k, v in (("ge", m.ge), ("le", m.le)) if v is not None})
        elif isinstance(m, wire.Len):
            out["max_length"] = m.max
            if m.min:
                out["min_length"] = m.min
        elif isinstance(m, wire.Pattern) and patterns:
            out["pattern"] = _anchored(m.regex)
    if kind is int and ("ge" not in out or "le" not in out):
        # json.loads refuses integers over sys.get_int_max_str_digits() digits and msgspec does not: every integer the
        # wire carries is bounded (a database column holds it), which also keeps the two parsers' answers the same.
        raise TypeError("a wire integer must declare Range(ge=..., le=...)")
    return msgspec.Meta(**out) if out else None


def _constrained(tp: Any, constraint: msgspec.Meta | None) -> Any:
    return tp if constraint is None else Annotated[tp, constraint]


def _type(tp: Any, patterns: bool = True) -> Any:
    """The msgspec annotation for one wire annotation; with ``patterns`` False, a string's ``Pattern`` is left for
    the caller to check (see :func:`pattern`), at this level only: a record inside keeps all of its own."""
    tp, meta = wire._split_annotated(tp)
    origin = typing.get_origin(tp)
    if tp in (str, int, float, bool):
        return _constrained(tp, _meta(meta, tp, patterns))
    if origin not in (list, dict) and any(isinstance(m, (wire.Range, wire.Len, wire.Pattern)) for m in meta):
        raise TypeError(f"constraints on {tp!r} are not supported (put them inside the union)")
    if origin is Literal:
        return tp
    if origin is list:
        (item,) = typing.get_args(tp)
        return _constrained(list[_type(item, patterns)], _meta(meta, list))
    if origin is dict:
        # The key type is the wire's, whatever the declaration says: the reference validator checks keys alike.
        return _constrained(dict[_type(wire.DictKey), _type(typing.get_args(tp)[1])], _meta(meta, dict))
    if isinstance(tp, type) and issubclass(tp, wire.Record):
        return struct(tp)
    args = typing.get_args(tp)
    if len(args) == 2 and type(None) in args:  # T | None
        (inner,) = [a for a in args if a is not type(None)]
        return _type(inner, patterns) | None
    raise TypeError(f"unsupported wire type {tp!r}")


def pattern(tp: Any) -> re.Pattern[str] | None:
    """The ``Pattern`` of a string type (or of its ``| None``), compiled as msgspec searches it; None for other types.
    Where a column of a post repeats one value (a run's name in each of its steps, a peer in each probe round) the
    caller checks each distinct value once, not each row: msgspec runs the regular expression for every string."""
    tp, meta = wire._split_annotated(tp)
    args = typing.get_args(tp)
    if len(args) == 2 and type(None) in args and not meta:
        (tp,) = [a for a in args if a is not type(None)]
        tp, meta = wire._split_annotated(tp)
    pat = next((m for m in meta if isinstance(m, wire.Pattern)), None)
    return re.compile(_anchored(pat.regex)) if tp is str and pat is not None else None


def _anchored(regex: str) -> str:
    # msgspec searches; the reference validator fullmatches ("$" would also match before a final newline).
    return rf"\A(?:{regex})\Z"


class Struct(msgspec.Struct):
    """The base of the compiled records: a record the server keeps as decoded (:func:`decode`'s ``keep``) is still
    read by key, ``record["ts"]`` and ``record.get("ts")``, as a dict would be; its hot readers take attributes."""

    def __getitem__(self, name: str) -> Any:
        try:
            return getattr(self, name)
        except AttributeError:
            raise KeyError(name) from None

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name, default)


@cache
def struct(cls: type[wire.Record]) -> type[Struct]:
    """The ``msgspec.Struct`` for a wire record: its fields in declaration order, unknown fields refused."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for name, (tp, default) in wire._fields(cls).items():
        if default is wire._MISSING:
            fields.append((name, _type(tp)))
        else:  # msgspec copies an empty list default per instance, as the reference validator does
            fields.append((name, _type(tp), default))
    # gc=False: a decoded batch is a tree (no cycles); the records kept as structs are never in a cycle either.
    return msgspec.defstruct(cls.__name__, fields, bases=(Struct,), kw_only=True, forbid_unknown_fields=True,
                             gc=False, module=__name__)


@cache
def decoder(cls: type[wire.Record]) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(struct(cls))


def decode(cls: type[wire.Record], body: bytes, keep: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """The record ``cls`` in ``body`` as plain dicts with defaults filled in, exactly as ``json.loads`` then
    :func:`clusterdx.wire.validate` would return it; None when this path cannot say (the reference path decides).

    The lists of records named in ``keep`` stay the decoded :class:`Struct` records: converting a node-second's
    eight GPU samples (35 fields each) into dicts, and freeing them again once stored, was about a tenth of the
    embedded server's GIL-holding time at 2,048 nodes, for dicts that its writer and live publisher only read."""
    if b"\\" in body and b"\\u0000" in body:
        # A NUL escape is the one refusal msgspec has no constraint for (the reference path names the field). Raw NUL
        # bytes are not JSON to either parser. (A body without a backslash has no escape: memchr finds that in a
        # fraction of the 6-byte search's time.)
        return None
    try:
        value = decoder(cls).decode(body)
    except (msgspec.MsgspecError, RecursionError):
        return None
    kept = {name: getattr(value, name) for name in keep}
    for name in keep:
        setattr(value, name, [])
    out: dict[str, Any] = msgspec.to_builtins(value)
    out.update(kept)
    return out
