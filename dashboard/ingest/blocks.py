"""The server's half of wire version 2 (:mod:`clusterdx.blocks`): a post's blocks decoded into float64 matrices and
checked against the wire's declarations, a whole group of posts' matrices at once.

The numeric checks are a handful of numpy comparisons over a matrix, whatever its number of rows: in range, whole
where the wire says an integer, 0 or 1 where it says a bool, NaN (null) only where the wire allows None; an infinite
value is out of every range. The other fields (strings, literals, lists and mappings, a few per record) go through
the wire's own compiled check of that field, once per distinct value: a step block's 8 ranks name one run.
:func:`records` gives back version 1's records (the dicts ``wire.validate`` returns), for the writer until it stores
blocks as they came (docs/scaling.md, the columnar plan) and for the tests that hold the two versions to one meaning.

Every refusal is a :class:`~clusterdx.wire.WireError` whose path names the block and, for a value, its row and field
(``gpus[3].util_gpu_pct``), worded as version 1 words it.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import math
import re
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
import pybase64

from clusterdx import wire, wire_compiled
from clusterdx.blocks import BLOCK_WIRE_VERSION, BLOCKED, LAYOUTS, Column, Layout
from clusterdx.blocks import records as _records


@dataclass(slots=True)
class Block:
    """One post's block of one kind: ``mat`` has a row per record and a column per numeric field in the layout's
    order (a column the post left out is NaN); ``cols`` has every other field's values, a list of ``n`` each.
    ``checked``: whether its numbers were checked yet (the fast path leaves that to the group writer,
    :func:`check_posts`, which checks a whole group's blocks at once)."""

    kind: str
    mat: np.ndarray
    cols: dict[str, list[Any]]
    checked: bool = True
    # the numeric columns values() was asked for, each made once per block; and which columns hold a null
    _py: dict[str, list[Any]] = field(default_factory=dict, compare=False, repr=False)
    _nulls: list[bool] | None = field(default=None, compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.mat)

    def column(self, name: str) -> np.ndarray:
        """A numeric field's column (NaN where null)."""
        return self.mat[:, _BOUNDS[self.kind].index[name]]

    def values(self, name: str) -> list[Any]:
        """A field's values as version 1's records hold them: None for null, whole numbers as ints, flags as bools.
        The list is the block's own (shared by every reader of the block): read it, never change it."""
        got = self._py.get(name)
        if got is not None:
            return got
        at = _BOUNDS[self.kind].index.get(name)
        if at is None:
            return self.cols[name]
        got = self._py[name] = self._python(at)
        return got

    def _python(self, at: int) -> list[Any]:
        # Only the columns asked for, each when first asked: the live publisher and the writer read 5 to 8 of a
        # block's columns (6 of a GPU block's 34), and making the whole matrix Python values cost 3.5x as much a
        # post. Which columns hold a null is one call for the whole matrix; a column without one (most) is then
        # one or two numpy calls. Whole numbers go through int64 (the wire bounds them inside it), flags through bool.
        if self._nulls is None:
            self._nulls = np.isnan(self.mat).any(axis=0).tolist()
        col, kind = self.mat[:, at], _BOUNDS[self.kind].types[at]
        null = np.isnan(col) if self._nulls[at] else None
        if kind == "float":
            out = col.tolist()
        elif kind == "int":
            out = (col if null is None else np.where(null, 0.0, col)).astype(np.int64).tolist()
        else:
            out = (col != 0).tolist()
        if null is not None:
            for i in np.flatnonzero(null).tolist():
                out[i] = None
        return out


def rows_of(records: list[Any] | Block, fields: wire.Fields) -> Iterable[Any]:
    """``fields`` of each record of a batch's list, as ``map(fields.of(records), records)`` reads them (a tuple per
    record, the bare value for one field), whether the list is version 1's records (dicts or kept structs) or a
    version 2 :class:`Block`, whose rows are never made records."""
    if type(records) is not Block:
        return map(fields.of(records), records)
    columns = [records.values(f) for f in fields.names]
    return columns[0] if len(columns) == 1 else zip(*columns, strict=True)


@dataclass(frozen=True, slots=True)
class _Bounds:
    lo: np.ndarray
    hi: np.ndarray
    whole: np.ndarray
    nullable: np.ndarray
    index: dict[str, int]
    whole_at: np.ndarray  # the columns of ``whole``, by number
    types: tuple[str, ...]  # each column's type: "float", "int" or "bool"


_BOUNDS = {kind: _Bounds(np.array([c.lo for c in lay.numbers]), np.array([c.hi for c in lay.numbers]),
                         np.array([c.type != "float" for c in lay.numbers]),
                         np.array([c.nullable for c in lay.numbers]), {c.name: i for i, c in enumerate(lay.numbers)},
                         np.array([i for i, c in enumerate(lay.numbers) if c.type != "float"], dtype=np.intp),
                         tuple(c.type for c in lay.numbers))
           for kind, lay in LAYOUTS.items()}
# Each non-numeric field's own check, as version 1's reference path compiles it (None passes where the field is
# optional), and as msgspec types of a whole column (wire_compiled, the same declarations): the fast path, which
# is never looser; what it refuses goes to the reference check, which decides and words the error.
_OTHER_CHECKS = {kind: {f: wire._compile(wire._fields(lay.record)[f][0]) for f in lay.others}
                 for kind, lay in LAYOUTS.items()}
_OTHER_TYPES = {kind: {f: list[wire_compiled._type(wire._fields(lay.record)[f][0])] for f in lay.others}  # type: ignore[misc]
                for kind, lay in LAYOUTS.items()}
_KEYS = {"n", "num_cols", "num", "cols"}


def _num_cols(kind: str, raw: Any, path: str) -> list[int]:
    """Where each of the post's matrix columns goes in the layout's."""
    if type(raw) is not list or any(type(c) is not str for c in raw):
        raise wire.WireError(path, "expected a list of column names")
    lay, idx = LAYOUTS[kind], _BOUNDS[kind].index
    out = []
    for i, name in enumerate(raw):
        if name not in idx:
            raise wire.WireError(f"{path}[{i}]", f"unknown column (a {lay.record.__name__} has no numeric field {name[:64]!r})")
        out.append(idx[name])
    if len(set(out)) != len(out):
        raise wire.WireError(path, "a column is named twice")
    missing = [c.name for c in lay.numbers if c.required and idx[c.name] not in out]
    if missing:
        raise wire.WireError(path, f"missing required column {missing[0]!r}")
    return out


def decode_block(kind: str, raw: Any, path: str | None = None, fast: bool = False) -> Block:
    """Check one block's shape (not yet its numbers: :func:`check`) and decode it. ``raw`` is the JSON value;
    ``fast``: whether its strings may be judged by the compiled checks (not where the post has a NUL escape)."""
    path = kind if path is None else path
    lay = LAYOUTS[kind]
    if type(raw) is not dict:
        raise wire.WireError(path, "expected a block: an object with n, num_cols, num and cols")
    unknown = raw.keys() - _KEYS
    if unknown:
        raise wire.WireError(f"{path}.{sorted(unknown)[0][:64]}", "unknown field (a block has n, num_cols, num and cols)")
    for key in ("n", "num_cols", "num"):
        if key not in raw:
            raise wire.WireError(f"{path}.{key}", "missing required field")
    n = raw["n"]
    if type(n) is not int or not 0 <= n <= lay.max_rows:
        raise wire.WireError(f"{path}.n", f"must be a whole number from 0 to {lay.max_rows}, got {wire._describe(n)}")
    where = _num_cols(kind, raw["num_cols"], f"{path}.num_cols")
    if type(raw["num"]) is not str:
        raise wire.WireError(f"{path}.num", f"expected base64 text, got {wire._describe(raw['num'])}")
    want = 8 * n * len(where)
    # 4 base64 characters per 3 bytes: a longer text cannot be the matrix, and is not decoded to find out.
    if len(raw["num"]) > 4 * math.ceil(want / 3):
        raise wire.WireError(f"{path}.num", f"longer than {n} rows x {len(where)} columns of float64")
    try:
        data = base64.b64decode(raw["num"], validate=True)
    except (binascii.Error, ValueError):
        raise wire.WireError(f"{path}.num", "not base64") from None
    if len(data) != want:
        raise wire.WireError(f"{path}.num", f"holds {len(data)} bytes; {n} rows x {len(where)} columns x 8 are {want}")
    got = np.frombuffer(data, dtype="<f8").reshape(n, len(where))
    if len(where) == len(lay.numbers) and where == list(range(len(where))):
        mat = got.astype(np.float64, copy=False)
    else:
        mat = np.full((n, len(lay.numbers)), np.nan)
        mat[:, where] = got
    return Block(kind, mat, _cols(kind, lay, raw.get("cols", {}), n, f"{path}.cols", fast))


def _cols(kind: str, lay: Layout, raw: Any, n: int, path: str, fast: bool) -> dict[str, list[Any]]:
    if type(raw) is not dict:
        raise wire.WireError(path, f"expected an object, got {wire._describe(raw)}")
    checks = _OTHER_CHECKS[kind]
    unknown = raw.keys() - checks.keys()
    if unknown:
        name = sorted(unknown)[0][:64]
        raise wire.WireError(f"{path}.{name}", f"unknown field (a {lay.record.__name__} has no such field)")
    out: dict[str, list[Any]] = {}
    for f in lay.others:
        if f not in raw:
            if f in lay.required_others and n:
                raise wire.WireError(f"{path}.{f}", "missing required field")
            out[f] = [lay.defaults.get(f)] * n
            continue
        values = raw[f]
        if type(values) is not list or len(values) != n:
            raise wire.WireError(f"{path}.{f}", f"expected a list of {n} values, got {wire._describe(values)}")
        if fast:
            try:
                out[f] = msgspec.to_builtins(msgspec.convert(values, _OTHER_TYPES[kind][f]))
                continue
            except msgspec.ValidationError:
                pass
        # The check's own result (a nested record comes back with its defaults filled in, as version 1 gives it),
        # worked out once per distinct string.
        check, seen, kept = checks[f], {}, []
        for i, v in enumerate(values):
            if v is None and f in lay.required_others:
                raise wire.WireError(f"{path}.{f}[{i}]", "missing required field")
            if isinstance(v, str):
                if v not in seen:
                    seen[v] = check(v, f"{path}.{f}[{i}]")
                kept.append(seen[v])
            else:
                kept.append(check(v, f"{path}.{f}[{i}]"))
        out[f] = kept
    return out


def _why(col: Column, v: float) -> str:
    """Version 1's words for a refused value."""
    if math.isnan(v):
        return "missing required field" if col.required else "must not be null"
    if not math.isfinite(v):
        return "must be a finite number"
    if col.type == "bool" and v not in (0.0, 1.0):
        return f"expected true or false, got {v!r}"
    if col.type == "int" and not v.is_integer():
        return f"expected an integer, got {v!r}"
    if v < col.lo:
        return f"must be >= {wire._bound(col.lo)}, got {v!r}"
    return f"must be <= {wire._bound(col.hi)}, got {v!r}"


def first_bad(kind: str, mat: np.ndarray) -> tuple[int, int, str] | None:
    """The first (row, column, reason) of ``mat`` (any number of posts' rows of ``kind``) that the wire refuses.
    The usual answer, none, in a few whole-matrix operations (a comparison with NaN is false, quietly: no errstate)."""
    b = _BOUNDS[kind]
    whole = mat[:, b.whole_at]
    ok = ((mat >= b.lo) & (mat <= b.hi)) | (mat != mat) & b.nullable
    if ok.all() and (np.floor(whole) == whole)[~np.isnan(whole)].all():
        return None
    return _first_bad(kind, mat)


def _first_bad(kind: str, mat: np.ndarray) -> tuple[int, int, str] | None:
    b = _BOUNDS[kind]
    null = np.isnan(mat)
    with np.errstate(invalid="ignore"):
        ok = (mat >= b.lo) & (mat <= b.hi) & (~b.whole | (np.floor(mat) == mat))
    ok |= null & b.nullable
    if ok.all():
        return None
    row, col = (int(x) for x in np.argwhere(~ok)[0])
    c = LAYOUTS[kind].numbers[col]
    return row, col, _why(c, float(mat[row, col]))


def check(blocks: list[Block]) -> None:
    """Check the numbers of ``blocks`` (any kinds, any posts), each kind's as one matrix; raises the first refusal's
    :class:`~clusterdx.wire.WireError`, its path naming the row within its own block."""
    by_kind: dict[str, list[Block]] = {}
    for blk in blocks:
        by_kind.setdefault(blk.kind, []).append(blk)
    for kind, group in by_kind.items():
        mats = [b.mat for b in group]
        bad = first_bad(kind, mats[0] if len(mats) == 1 else np.concatenate(mats))
        if bad is None:
            continue
        row, col, why = bad
        for b in group:  # which block the row is in
            if row < len(b.mat):
                raise wire.WireError(f"{kind}[{row}].{LAYOUTS[kind].numbers[col].name}", why)
            row -= len(b.mat)


def check_posts(batches: list[dict[str, Any]]) -> list[wire.WireError | None]:
    """The numbers of every block the fast path left unchecked in ``batches``, a whole group's of a kind as one
    matrix (at a post's eight rows numpy's cost is per call, not per value: a check per post was most of parsing
    one); the refusal of each batch, or None. Blocks found good are marked checked."""
    out: list[wire.WireError | None] = [None] * len(batches)
    by_kind: dict[str, list[tuple[int, Block]]] = {}
    for i, batch in enumerate(batches):
        for kind in BLOCKED:
            blk = batch.get(kind)
            if type(blk) is Block and not blk.checked:
                by_kind.setdefault(kind, []).append((i, blk))
    for kind, group in by_kind.items():
        mats = [b.mat for _, b in group]
        if first_bad(kind, mats[0] if len(mats) == 1 else np.concatenate(mats)) is not None:
            for i, blk in group:  # which posts: each alone, worded as the reference path words it
                try:
                    check([blk])
                except wire.WireError as exc:
                    out[i] = out[i] or exc
        for _, blk in group:
            blk.checked = True
    return out


def records(block: Block) -> list[dict[str, Any]]:
    """The block's records as version 1's dicts (fields in declaration order, None where null)."""
    return _records(block.kind, block.mat.tolist(), block.cols)


# Where a producer writes the version first (the agent does), one look at the body's start tells a version 2 post.
_V2_START = re.compile(rb'\s*\{\s*"v"\s*:\s*2\s*[,}]')
SPOKEN = f"this server speaks {wire.WIRE_VERSION} and {BLOCK_WIRE_VERSION}"


def parse(body: bytes) -> dict[str, Any]:
    """Decode and check a post of either version: what ``wire.parse_batch(body, keep_records=True)`` gives for
    version 1, and for version 2 the same batch with its GPU samples, steps, probes and rank beats as checked
    :class:`Block` objects (a Block is sized like the records it carries; :func:`records` gives them). Raises
    :class:`~clusterdx.wire.MalformedJson` or :class:`~clusterdx.wire.WireError` as version 1 does."""
    if _V2_START.match(body, 0, 64):
        return _parse_v2_fast(body) or parse_v2(body)
    try:
        return wire.parse_batch(body, keep_records=True)
    except wire.WireError as exc:
        if exc.path != "v":
            raise
    return parse_v2(body)  # "v" not first, or a version this server does not speak: version 2's words for it


_GENERIC = msgspec.json.Decoder()
_ENVELOPE = wire_compiled.struct(wire.Batch)


def _load(body: bytes) -> tuple[Any, bool]:
    """The post's JSON value, and whether the compiled checks may judge it: msgspec read it, and it has no NUL
    escape (the one refusal msgspec has no constraint for). What msgspec cannot read, ``json.loads`` may (a lone
    surrogate escape): then the reference checks word what is wrong with it."""
    if b"\\u0000" not in body:
        try:
            return _GENERIC.decode(body), True
        except (msgspec.DecodeError, RecursionError):
            pass
    try:
        return json.loads(body), False
    except (ValueError, RecursionError) as exc:  # not JSON, bad UTF-8, or an integer of too many digits
        raise wire.MalformedJson(str(exc)) from None


def parse_v2(body: bytes) -> dict[str, Any]:
    """A version 2 post by the reference checks: its envelope through version 1's own checks (everything but the
    blocks is version 1's), its blocks decoded and their numbers checked at once. What it refuses, it words; what it
    accepts, :func:`_parse_v2_fast` must give alike (tests/test_blocks.py)."""
    payload, fast = _load(body)
    if type(payload) is not dict:
        raise wire.WireError("", f"expected an object, got {wire._describe(payload)}")
    if payload.get("v") != BLOCK_WIRE_VERSION:
        raise wire.WireError("v", f"unsupported wire version {payload.get('v')!r}; {SPOKEN}")
    raw = {kind: payload.pop(kind) for kind in BLOCKED if kind in payload}
    payload["v"] = wire.WIRE_VERSION
    batch = None
    if fast:
        with contextlib.suppress(msgspec.ValidationError):
            batch = msgspec.to_builtins(msgspec.convert(payload, _ENVELOPE))
    if batch is None:
        try:
            batch = wire.validate_batch(payload)
        except RecursionError:
            raise wire.WireError("", "nesting too deep") from None
    decoded = [decode_block(kind, value, fast=fast) for kind, value in raw.items()]
    check(decoded)
    for kind in BLOCKED:
        batch[kind] = Block(kind, np.empty((0, len(LAYOUTS[kind].numbers))), {f: [] for f in LAYOUTS[kind].others})
    for blk in decoded:
        batch[blk.kind] = blk
    batch["v"] = BLOCK_WIRE_VERSION
    return batch


# -- the fast path: the whole post decoded and type-checked by msgspec in one call --------------------------------------


def _cols_struct(kind: str) -> type[msgspec.Struct]:
    """A block's ``cols``: each other field a list of its wire type (None when the post leaves the field out), but
    a patterned string's pattern, which :func:`_fast_block` checks once per distinct value (:data:`_PATTERNS`)."""
    lay = LAYOUTS[kind]
    fields = [(f, list[wire_compiled._type(tp, patterns=f not in _PATTERNS[kind])] | None, None)  # type: ignore[misc]
              for f, tp in ((f, wire._fields(lay.record)[f][0]) for f in lay.others)]
    return msgspec.defstruct(f"{lay.record.__name__}Cols", fields, kw_only=True, forbid_unknown_fields=True, gc=False)


# Per kind, its columns of patterned strings (a step's or beat's run, a probe's peer) and their patterns. A post's
# column repeats a few values (one run, a node's peers): msgspec ran the pattern for each row, a third of the
# decoding of a post; here each distinct value is checked once, and a value that passed is remembered.
_PATTERNS = {kind: {f: p for f in lay.others if (p := wire_compiled.pattern(wire._fields(lay.record)[f][0]))}
             for kind, lay in LAYOUTS.items()}
_PASSED: dict[re.Pattern[str], set[str]] = {}
PASSED_MAX = 8192  # values remembered per pattern (hostile posts may send any number of valid ones)


def _matches(pattern: re.Pattern[str], values: list[Any]) -> bool:
    """Whether every string of ``values`` matches ``pattern`` (None passes: the column's type said where it may be)."""
    passed = _PASSED.setdefault(pattern, set())
    for v in set(values).difference(passed):
        if v is not None:
            if not pattern.search(v):
                return False
            if len(passed) < PASSED_MAX:
                passed.add(v)
    return True


def _block_struct(kind: str) -> type[msgspec.Struct]:
    lay = LAYOUTS[kind]
    n = Annotated[int, msgspec.Meta(ge=0, le=lay.max_rows)]
    cols = _cols_struct(kind)
    return msgspec.defstruct(f"{lay.record.__name__}BlockV2", [("n", n), ("num_cols", list[str]), ("num", str),
                                                               ("cols", cols, msgspec.field(default_factory=cols))],
                             kw_only=True, forbid_unknown_fields=True, gc=False)


def _batch_struct() -> type[msgspec.Struct]:
    """Version 1's envelope (its compiled record types) with the blocked kinds as blocks; an absent block is None."""
    fields: list[Any] = [("v", Literal[2])]
    for name, (tp, default) in wire._fields(wire.Batch).items():
        if name == "v":
            continue
        if name in BLOCKED:
            fields.append((name, _block_struct(name), None))
        elif default is wire._MISSING:
            fields.append((name, wire_compiled._type(tp)))
        else:
            fields.append((name, wire_compiled._type(tp), default))
    return msgspec.defstruct("BatchV2Fast", fields, kw_only=True, forbid_unknown_fields=True, gc=False)


_FAST = msgspec.json.Decoder(_batch_struct())
_ENVELOPE_FIELDS = tuple(f for f in wire._fields(wire.Batch) if f not in BLOCKED and f != "v")
# Per kind, the other fields whose values are records (a step's groups): made plain dicts, as version 1 gives them.
def _holds_record(tp: Any) -> bool:
    tp, _ = wire._split_annotated(tp)
    if isinstance(tp, type) and issubclass(tp, wire.Record):
        return True
    return any(_holds_record(a) for a in typing.get_args(tp))


_NESTED = {kind: {f for f in lay.others if _holds_record(wire._fields(lay.record)[f][0])}
           for kind, lay in LAYOUTS.items()}
_WHERE: dict[tuple[str, tuple[str, ...]], list[int] | None] = {}  # (kind, num_cols) -> _num_cols' answer


def _where(kind: str, names: list[str]) -> list[int] | None:
    """Where each of the post's matrix columns goes (None: refused, the reference path words why). Agents of one
    release send the same few column lists: each is worked out once."""
    key = (kind, tuple(names))
    if key not in _WHERE:
        try:
            got: list[int] | None = _num_cols(kind, names, kind)
        except wire.WireError:
            got = None
        if len(_WHERE) < 1024:  # bounded: hostile posts may send any lists
            _WHERE[key] = got
        return got
    return _WHERE[key]


def _fast_block(kind: str, raw: Any) -> Block | None:
    lay, n = LAYOUTS[kind], raw.n
    where = _where(kind, raw.num_cols)
    if where is None or len(raw.num) > 4 * math.ceil(8 * n * len(where) / 3):
        return None
    try:
        # pybase64 (SIMD): 1 µs for a post's GPU matrix where binascii took 30. Never looser than binascii's strict
        # mode (a padding form that only binascii takes goes to the reference path, which decides).
        data = pybase64.b64decode(raw.num, validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(data) != 8 * n * len(where):
        return None
    got = np.frombuffer(data, dtype="<f8").reshape(n, len(where))
    if len(where) == len(lay.numbers) and where == _IDENTITY[kind]:
        mat = got
    else:
        mat = np.full((n, len(lay.numbers)), np.nan)
        mat[:, where] = got
    cols: dict[str, list[Any]] = {}
    for f in lay.others:
        values = getattr(raw.cols, f)
        if values is None:
            if f in lay.required_others and n:
                return None
            values = [lay.defaults.get(f)] * n
        elif len(values) != n:
            return None
        elif f in _NESTED[kind]:
            values = msgspec.to_builtins(values)
        elif f in _PATTERNS[kind] and not _matches(_PATTERNS[kind][f], values):
            return None
        cols[f] = values
    return Block(kind, mat, cols, checked=False)  # its numbers: the group writer's (check_posts)


_IDENTITY = {kind: list(range(len(lay.numbers))) for kind, lay in LAYOUTS.items()}


def _parse_v2_fast(body: bytes) -> dict[str, Any] | None:
    """A version 2 post decoded and type-checked in one msgspec call (the envelope's records, the blocks' shapes
    and every string and JSON value by the wire's compiled types); None for anything it would refuse or cannot judge
    (a NUL escape): the reference path (:func:`parse_v2`) then decides and words it. Its blocks' numbers are left to
    :func:`check_posts`, which the writer runs over its whole group before it stores anything: together never looser
    than the reference path (tests/test_blocks.py)."""
    # A body without a backslash has no escapes at all (memchr: a few µs for a post, the 6-byte search ~14).
    if b"\\" in body and b"\\u0000" in body:
        return None
    try:
        value = _FAST.decode(body)
    except (msgspec.MsgspecError, RecursionError):
        return None
    batch: dict[str, Any] = msgspec.to_builtins({f: getattr(value, f) for f in _ENVELOPE_FIELDS})
    for kind in BLOCKED:
        raw = getattr(value, kind)
        if raw is None:
            batch[kind] = Block(kind, np.empty((0, len(LAYOUTS[kind].numbers))), {f: [] for f in LAYOUTS[kind].others})
            continue
        blk = _fast_block(kind, raw)
        if blk is None:
            return None
        batch[kind] = blk
    batch["v"] = BLOCK_WIRE_VERSION
    return batch
