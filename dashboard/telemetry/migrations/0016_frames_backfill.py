# The GPU samples, steps and probes stored as rows before frames existed, stored again as frames (0015), so a server
# upgraded in place keeps its history on the pages that read frames. Node by node (a step frame: run by run), in time
# order, a bounded number of rows per read; progress is printed, since at 2,048 nodes a 6 h hot window is hundreds of
# millions of rows. The rows stay where they are.

import sys
import time
from datetime import UTC, datetime
from typing import Any

from django.db import migrations

CHUNK = 50_000


def _epoch(connection: Any, col: str) -> str:
    """PostgreSQL's exact epoch; SQLite's column as stored (its julianday() is off by microseconds): :func:`_seconds`
    converts it."""
    return f"EXTRACT(EPOCH FROM {col})::float8" if connection.vendor == "postgresql" else col


def _seconds(value: Any) -> float:
    """A sample time as read: epoch seconds (PostgreSQL), or SQLite's text (or the datetime its converter made)."""
    if isinstance(value, float | int):
        return float(value)
    when = value if isinstance(value, datetime) else datetime.fromisoformat(value)
    return when.replace(tzinfo=UTC).timestamp()


def _text(connection: Any, col: str) -> str:
    return f"({col})::text" if connection.vendor == "postgresql" else col


def _json(v: Any) -> Any:
    import json

    return json.loads(v) if isinstance(v, str) else v


class _Say:
    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.done, self.last = what, total, 0, 0.0

    def add(self, n: int) -> None:
        self.done += n
        if time.monotonic() - self.last > 5 or self.done == self.total:
            self.last = time.monotonic()
            sys.stdout.write(f"\n    framing {self.what}: {self.done:,} of {self.total:,} rows")
            sys.stdout.flush()


def _chunks(cursor: Any, select: str, table: str) -> Any:
    """The rows of ``SELECT {select} FROM table`` (whose first column is ``id``), CHUNK at a time in id order: the
    primary key pages through any table, and the frames of a chunk are built from the rows it holds."""
    after = -1
    while True:
        cursor.execute(f"SELECT {select} FROM {table} WHERE id > %s ORDER BY id LIMIT {CHUNK}", [after])
        rows = cursor.fetchall()
        if not rows:
            return
        yield rows
        after = rows[-1][0]


def _insert(cursor: Any, connection: Any, table: str, cols: list[str], rows: list[list[Any]]) -> None:
    if not rows:
        return
    q = connection.ops.quote_name
    adapt = connection.ops.adapt_datetimefield_value
    out = [[adapt(v) if isinstance(v, datetime) else v for v in row] for row in rows]
    cursor.executemany(f"INSERT INTO {q(table)} ({', '.join(q(c) for c in cols)}) "
                       f"VALUES ({', '.join(['%s'] * len(cols))})", out)


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def backfill(apps: Any, schema_editor: Any) -> None:
    import numpy as np

    from dashboard.storage import frames as fr

    conn = schema_editor.connection
    q = conn.ops.quote_name
    with conn.cursor() as cur:
        # GPU samples and probes: by node, in time order; a frame per node, 10 s window and read chunk.
        for kind, table, nums, objs, target, extra in (
            (fr.GPUS, "telemetry_gpusample", ["gpu_index" if c == "index" else c for c in fr.GPUS.numbers],
             list(fr.GPUS.objects), "telemetry_gpuframe", []),
            (fr.PROBES, "telemetry_probe", list(fr.PROBES.numbers), ["peer"], "telemetry_probeframe", ["peers"]),
        ):
            cur.execute(f"SELECT count(*) FROM {q(table)}")
            total = cur.fetchone()[0]
            if not total:
                continue
            say = _Say(kind.name, total)
            sel = [_epoch(conn, "ts") if c == "ts" else _number(conn, c) for c in nums]
            select = (f"id, node_id, cluster_id, {', '.join(sel)}, "
                      f"{', '.join(_text(conn, c) if c != 'peer' else c for c in objs)}")
            for chunk in _chunks(cur, select, q(table)):
                out: list[list[Any]] = []
                by_node: dict[tuple[int, int], list[tuple[Any, ...]]] = {}
                for row in chunk:
                    by_node.setdefault((row[1], row[2]), []).append(row)
                for (node_id, cluster_id), rows in by_node.items():
                    at = 3 + nums.index("ts")
                    mat = np.array([(*r[3:at], _seconds(r[at]), *r[at + 1:3 + len(nums)]) for r in rows],
                                   dtype=np.float64).reshape(len(rows), len(nums))
                    columns = {f: [(_json(r[3 + len(nums) + j]) if f != "peer" else r[3 + len(nums) + j])
                                   for r in rows] for j, f in enumerate(objs)}
                    for b in fr.build(kind, mat, fr.objects(kind, columns)):
                        out.append([cluster_id, node_id, _dt(b.ts), b.n, kind.layout, b.data,
                                    *([b.peers] if extra else [])])
                _insert(cur, conn, target, ["cluster_id", "node_id", "ts", "n", "layout", "data", *extra], out)
                say.add(len(chunk))
        # Steps: by run, in step order; frames split by rank group, step bucket and 10 s window as ingest does.
        cur.execute(f"SELECT count(*) FROM {q('telemetry_stepsample')}")
        total = cur.fetchone()[0]
        if total:
            say = _Say("steps", total)
            nums = list(fr.STEPS.numbers)
            sel = [_epoch(conn, "ts") if c == "ts" else c for c in nums]
            select = (f"id, run_id, cluster_id, node_id, {', '.join(sel)}, "
                      f"{', '.join(_text(conn, c) for c in fr.STEPS.objects)}")
            for chunk in _chunks(cur, select, q("telemetry_stepsample")):
                out = []
                groups: dict[tuple[int, int, Any], list[tuple[Any, ...]]] = {}
                for row in chunk:
                    groups.setdefault((row[1], row[2], row[3]), []).append(row)
                for (run_id, cluster_id, node_id), rows in groups.items():
                    at = 4 + nums.index("ts")
                    mat = np.array([(*r[4:at], _seconds(r[at]), *r[at + 1:4 + len(nums)]) for r in rows],
                                   dtype=np.float64).reshape(len(rows), len(nums))
                    columns = {f: [_json(r[4 + len(nums) + j]) for r in rows] for j, f in enumerate(fr.STEPS.objects)}
                    for b in fr.build(fr.STEPS, mat, fr.objects(fr.STEPS, columns), [run_id] * len(rows)):
                        out.append([cluster_id, b.run_id, node_id, _dt(b.ts), b.rank_group, b.step_lo, b.step_hi,
                                    b.n, fr.STEPS.layout, b.data])
                _insert(cur, conn, "telemetry_stepframe", ["cluster_id", "run_id", "node_id", "ts", "rank_group",
                                                           "step_lo", "step_hi", "n", "layout", "data"], out)
                say.add(len(chunk))


_BOOLS = {"retired_pages_pending", "remap_pending", "remap_failure"}


def _number(connection: Any, col: str) -> str:
    """A numeric column as a number: booleans as 0 / 1 (PostgreSQL's are not numbers, SQLite's converter would make
    them Python bools, which numpy takes as well, but ``+ 0`` skips the converter)."""
    if col in _BOOLS:
        return f"{col}::int" if connection.vendor == "postgresql" else f"({col} + 0)"
    return col


class Migration(migrations.Migration):

    dependencies = [
        ("telemetry", "0015_frames"),
        ("storage", "0003_partition_frames"),
    ]

    operations = [migrations.RunPython(backfill, migrations.RunPython.noop, elidable=True)]
