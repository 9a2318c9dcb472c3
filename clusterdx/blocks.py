"""Wire version 2: a post's GPU samples, steps, probes and rank beats as column blocks, not records.

A node-second in version 1 is ~35 JSON records, and the server makes a Python object of every value in them: the
floor that every per-record cut kept finding (docs/scaling.md, "A columnar node-second"). In version 2 the numbers
of each of those four kinds travel as one base64 float64 matrix per post (a row per record, a column per numeric
field, little-endian, null as NaN) and their few other values (strings, literals, lists, mappings) as one list per
field; the server checks a whole group of posts' matrices at once against the same declarations
(:mod:`clusterdx.wire`), so the schema stays the one source of truth. Host and port samples, events, runs and the
topology stay records.

A block::

    {"n": 8, "num_cols": ["ts", "index", ...], "num": "<base64 of n x len(num_cols) float64>",
     "cols": {"uuid": [...8 values], "name": [...], ...}}

``num_cols`` names the matrix's columns, so an agent and a server of different releases agree on what each column
is: a column the server does not know is refused, one the agent left out is null (if the wire allows that). A field
of ``cols`` that is absent takes its declared default in every row.

What float64 cannot carry exactly: whole numbers beyond 2**53 (:data:`EXACT_INT`; the wire's counters and byte
counts allow up to 2**63 - 1, far past what a GPU or a step reports), non-finite floats (the wire refuses those
anyway), and a value of the wrong type. :func:`encode_block` raises :class:`Unblockable` for such a record and the
agent sends that post as version 1, whose checks word the error: nothing is lost or silently rounded.

This module is the agent's half and needs only the standard library (the agent does not install numpy); the
server's decode and checks are :mod:`dashboard.ingest.blocks`.
"""

from __future__ import annotations

import array
import base64
import math
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from clusterdx import wire

BLOCK_WIRE_VERSION = 2
# The record lists a version 2 post carries as blocks, and the wire record of each.
BLOCKED: dict[str, type[wire.Record]] = {
    "gpus": wire.GpuSample, "steps": wire.Step, "probes": wire.Probe, "beats": wire.RankBeat}
EXACT_INT = 2**53  # every whole number of magnitude up to this is a float64; past it they round


class Unblockable(ValueError):
    """A record whose values a block cannot carry exactly: its post goes as version 1."""


@dataclass(frozen=True, slots=True)
class Column:
    """A numeric field of a blocked record, with the wire's checks of it as numbers a matrix column is compared with."""

    name: str
    type: Literal["float", "int", "bool"]
    lo: float
    hi: float
    nullable: bool  # None allowed (NaN in the matrix)
    required: bool  # no default: a version 1 record must name it


@dataclass(frozen=True, slots=True)
class Layout:
    record: type[wire.Record]
    numbers: tuple[Column, ...]
    others: tuple[str, ...]  # the fields carried as lists (strings, literals, lists, mappings), in declaration order
    required_others: frozenset[str]
    defaults: dict[str, Any]  # of the optional fields among ``others``
    max_rows: int  # as many records as version 1's batch allows of the kind


_NUMERIC = {float: "float", int: "int", bool: "bool"}


def _layout(kind: str, cls: type[wire.Record]) -> Layout:
    numbers: list[Column] = []
    others: list[str] = []
    required: set[str] = set()
    defaults: dict[str, Any] = {}
    for name, (tp, default) in wire._fields(cls).items():
        base, meta = wire._split_annotated(tp)
        args = typing.get_args(base)
        nullable = typing.get_origin(base) in (typing.Union, types.UnionType) and type(None) in args
        if nullable:
            (base,) = [a for a in args if a is not type(None)]
            base, inner = wire._split_annotated(base)
            meta = meta + inner
        typ = _NUMERIC.get(base)
        if typ is None:
            others.append(name)
            if default is wire._MISSING:
                required.add(name)
            else:
                defaults[name] = default
            continue
        ranges = [m for m in meta if isinstance(m, wire.Range)]
        lo = max([r.ge for r in ranges if r.ge is not None], default=-sys.float_info.max)
        hi = min([r.le for r in ranges if r.le is not None], default=sys.float_info.max)
        if typ == "bool":
            lo, hi = 0.0, 1.0
        if typ == "int":  # beyond it a float64 is not the number the agent had: refused, never rounded
            lo, hi = max(lo, -EXACT_INT), min(hi, EXACT_INT)
        numbers.append(Column(name, typ, float(lo), float(hi), nullable, default is wire._MISSING))  # type: ignore[arg-type]
    _, batch_meta = wire._split_annotated(wire._fields(wire.Batch)[kind][0])
    rows = next(m.max for m in batch_meta if isinstance(m, wire.Len))
    return Layout(cls, tuple(numbers), tuple(others), frozenset(required), defaults, rows)


LAYOUTS: dict[str, Layout] = {kind: _layout(kind, cls) for kind, cls in BLOCKED.items()}


def _number(col: Column, value: Any) -> float:
    """``value`` as the matrix carries it, or :class:`Unblockable` where that would not be exactly it."""
    if value is None:
        return math.nan  # a required or non-nullable one is refused by the server's check, as version 1 refuses it
    t = type(value)
    if col.type == "bool":
        if t is bool:
            return 1.0 if value else 0.0
    # Not a bool for a number: version 1 refuses those.
    elif (t is int or (t is float and math.isfinite(value))) and (col.type == "float" or abs(value) <= EXACT_INT):
        try:
            return float(value)
        except OverflowError:  # an integer of 309 digits or more
            pass
    raise Unblockable(f"{col.name}: {value!r} cannot travel as a float64")


def encode_block(kind: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """One kind's records (version 1 dicts) as a block. A record's unknown field raises :class:`Unblockable` too:
    version 1 names it in its error."""
    lay = LAYOUTS[kind]
    known = {c.name for c in lay.numbers} | set(lay.others)
    nums = array.array("d")
    for r in records:
        extra = r.keys() - known
        if extra:
            raise Unblockable(f"unknown field {sorted(extra)[0]!r}")
        nums.extend(_number(c, r.get(c.name)) for c in lay.numbers)
    if sys.byteorder == "big":
        nums.byteswap()
    cols = {f: [r.get(f, lay.defaults.get(f)) for r in records] for f in lay.others
            if f in lay.required_others or any(f in r for r in records)}
    return {"n": len(records), "num_cols": [c.name for c in lay.numbers], "num": base64.b64encode(nums).decode(),
            "cols": cols}


def encode_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """A version 1 batch (a dict) as version 2: its four record lists as blocks, everything else as it was. Raises
    :class:`Unblockable` where a block cannot carry a record exactly."""
    # The version first: the server tells a version 2 post by its first bytes.
    out = {"v": BLOCK_WIRE_VERSION, **{k: v for k, v in batch.items() if k not in BLOCKED and k != "v"}}
    for kind in BLOCKED:
        out[kind] = encode_block(kind, list(batch.get(kind) or ()))
    return out


_AS = {"float": float, "int": int, "bool": bool}
# Per kind, each field in declaration order (as version 1's dicts have them): its matrix column and the conversion
# back from a float, or (None, None) for a field of ``cols``.
_ORDER = {kind: [(f, *next(((i, _AS[c.type]) for i, c in enumerate(lay.numbers) if c.name == f), (None, None)))
                 for f in wire._fields(lay.record)] for kind, lay in LAYOUTS.items()}


def records(kind: str, rows: list[list[float]], cols: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Version 1's records of a block: ``rows`` in the layout's column order (NaN for null), ``cols`` each other
    field's values (a field absent from it is None). Fields in declaration order, as ``wire.validate`` gives them."""
    order = _ORDER[kind]
    return [{f: (cols[f][i] if f in cols else None) if at is None else None if row[at] != row[at] else as_(row[at])
             for f, at, as_ in order} for i, row in enumerate(rows)]


def decode_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """A version 2 batch this encoder wrote, back as version 1 (records as dicts): what an agent resends when the
    server it reaches predates version 2. Not a check: the server's half (:mod:`dashboard.ingest.blocks`) is."""
    out = {k: v for k, v in batch.items() if k not in BLOCKED}
    out["v"] = wire.WIRE_VERSION
    for kind, lay in LAYOUTS.items():
        block = batch.get(kind)
        if not block:
            continue
        nums = array.array("d", base64.b64decode(block["num"]))
        if sys.byteorder == "big":
            nums.byteswap()
        # Into the layout's column order (this encoder writes it so; a column left out is null).
        at = {name: j for j, name in enumerate(block["num_cols"])}
        width, where = len(at), [at.get(c.name) for c in lay.numbers]
        rows = [[math.nan if j is None else nums[i * width + j] for j in where] for i in range(block["n"])]
        out[kind] = records(kind, rows, block.get("cols", {}))
    return out


def json_schema() -> dict[str, dict[str, Any]]:
    """JSON Schema of a version 2 batch and of each kind's block (OpenAPI ``components.schemas``), from the same
    layouts the encoder and the server's checks use. The numbers inside ``num`` are base64, beyond JSON Schema's
    reach: the server checks them against the record's own schema (the column's ``minimum`` / ``maximum``)."""
    wires = wire.json_schema()
    out: dict[str, dict[str, Any]] = {}
    for kind, lay in LAYOUTS.items():
        name = lay.record.__name__
        props = wires[name]["properties"]
        out[f"{name}Block"] = {
            "type": "object",
            "description": f"{kind} as wire version 2 carries them: the numeric fields of {name} as one little-endian "
                           "float64 matrix (a row per record, NaN for null), the others as one list per field",
            "properties": {
                "n": {"type": "integer", "minimum": 0, "maximum": lay.max_rows},
                "num_cols": {"type": "array", "items": {"enum": [c.name for c in lay.numbers]}, "uniqueItems": True},
                "num": {"type": "string", "contentEncoding": "base64",
                        "description": "n x len(num_cols) float64, row-major"},
                "cols": {"type": "object", "additionalProperties": False,
                         "properties": {f: {"type": "array", "items": props[f]} for f in lay.others}},
            },
            "required": ["n", "num_cols", "num"],
            "additionalProperties": False,
        }
    batch = wires["Batch"]
    out["BatchV2"] = {
        **batch,
        "description": "A batch in wire version 2: version 1's Batch, its GPU samples, steps, probes and rank beats "
                       "as blocks",
        "properties": {**batch["properties"], "v": {"enum": [BLOCK_WIRE_VERSION]},
                       **{kind: {"$ref": f"#/components/schemas/{lay.record.__name__}Block"}
                          for kind, lay in LAYOUTS.items()}},
    }
    return out
