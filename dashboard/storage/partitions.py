"""PostgreSQL: the big time-series tables are partitioned by day (declarative RANGE partitioning on ``ts``).

Retention then drops whole day partitions (no DELETE, no vacuum debt, no bloat), and a time-range query touches only
the days it names. Every table has a default partition, so an insert never fails for want of a partition (a clock far
off, a day the maintenance task did not run); rows that land there are moved out when their day's partition is made.

Partitions are named ``<table>_pYYYYMMDD`` (UTC days) and ``<table>_default``. The primary key is (id, ts): PostgreSQL
wants the partition key in every unique index. Django keeps reading and writing through the parent table by ``id``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import UTC, date, datetime, timedelta
from typing import Any

DAY = timedelta(days=1)
NAME = re.compile(r"_p(\d{8})$")
# Each partition's storage parameters, by table. A frame's ``data`` is LZ4 already (dashboard.storage.frames), yet a
# row past ~2 KB (a 4 s post's step frame: 1.6 KB of data on average, 2.2 KB at most) set off PostgreSQL's TOAST:
# pglz tried to compress the LZ4 and gave up, then the value went out of line, a row and an index entry in the TOAST
# table on every insert and a second lookup on every read. Up to 8,160 bytes (a page's worth) a frame stays in its
# row as written: the 39,424 step frames of a 60 s run at 2,048 nodes copied in 0.40 s instead of 1.00 s and read
# back in 0.05 s of the database's time instead of 0.13 s (docs/scaling.md), in 74 MB instead of 24 + 55.
STORAGE = {table: "toast_tuple_target = 8160"
           for table in ("telemetry_gpuframe", "telemetry_stepframe", "telemetry_probeframe")}


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _bound(day: date) -> str:
    """A UTC midnight as a literal (DDL takes no parameters; it is built from a date, never from input)."""
    return datetime(day.year, day.month, day.day, tzinfo=UTC).isoformat()


def _with(table: str) -> str:
    return f" WITH ({STORAGE[table]})" if table in STORAGE else ""


def set_storage(cursor: Any, table: str) -> list[str]:
    """Give the table's partitions that exist (the default one included) its ``STORAGE`` parameters; the rows they
    hold stay as stored, the next ones are stored so. Returns the partitions changed."""
    if table not in STORAGE:
        return []
    names = [*partitions(cursor, table).values(), table + "_default"]  # partition_table always makes the default
    for name in names:
        cursor.execute(f"ALTER TABLE {_q(name)} SET ({STORAGE[table]})")
    return names


def partition_name(table: str, day: date) -> str:
    return f"{table}_p{day:%Y%m%d}"


def is_partitioned(cursor: Any, table: str) -> bool:
    cursor.execute("SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)", [table])
    row = cursor.fetchone()
    return row is not None and row[0] == "p"


def partition_table(cursor: Any, table: str, ahead_days: int = 2) -> None:
    """Turn a plain Django table into a partitioned one with the same columns, indexes, foreign keys and rows.

    The table is rebuilt (rename, create, copy, drop): PostgreSQL cannot partition a table in place. Index and foreign
    key definitions are read from the catalog before and replayed after, so their names stay Django's."""
    if is_partitioned(cursor, table):
        return
    # Unique constraints first (their ts-including key is the rollups' upsert target), then foreign keys.
    cursor.execute("SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
                   "WHERE conrelid = to_regclass(%s) AND contype IN ('u', 'f') ORDER BY contype DESC", [table])
    fks = cursor.fetchall()
    cursor.execute("SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema() AND tablename = %s "
                   "AND indexname <> %s", [table, f"{table}_pkey"])
    indexes = [d for name, d in cursor.fetchall() if name not in {c for c, _ in fks}]
    flat, seq = f"{table}__flat", f"{table}_pid_seq"
    cursor.execute(f"ALTER TABLE {_q(table)} RENAME TO {_q(flat)}")
    # LIKE without INCLUDING IDENTITY: before PostgreSQL 17 a partitioned table cannot have an identity column, so
    # ids come from a plain sequence (owned by the column, so pg_get_serial_sequence and Django's resets find it).
    cursor.execute(f"CREATE TABLE {_q(table)} (LIKE {_q(flat)} INCLUDING DEFAULTS) PARTITION BY RANGE (ts)")
    cursor.execute(f"CREATE SEQUENCE {_q(seq)} OWNED BY {_q(table)}.id")
    cursor.execute(f"ALTER TABLE {_q(table)} ALTER COLUMN id SET DEFAULT nextval('{seq}')")
    cursor.execute(f"CREATE TABLE {_q(table + '_default')} PARTITION OF {_q(table)} DEFAULT{_with(table)}")
    cursor.execute(f"SELECT min(ts), max(ts), max(id) FROM {_q(flat)}")
    lo, hi, top = cursor.fetchone()
    today = datetime.now(UTC).date()
    first = min(lo.astimezone(UTC).date(), today) if lo else today
    last = max(hi.astimezone(UTC).date(), today) if hi else today
    ensure_partitions(cursor, table, (first + DAY * i for i in range((last - first).days + 1 + ahead_days)))
    cursor.execute(f"INSERT INTO {_q(table)} SELECT * FROM {_q(flat)}")
    if top is not None:
        cursor.execute("SELECT setval(%s, %s)", [seq, top])
    cursor.execute(f"DROP TABLE {_q(flat)}")
    cursor.execute(f"ALTER TABLE {_q(table)} ADD CONSTRAINT {_q(table + '_pkey')} PRIMARY KEY (id, ts)")
    for sql in indexes:
        cursor.execute(sql)
    for name, definition in fks:
        cursor.execute(f"ALTER TABLE {_q(table)} ADD CONSTRAINT {_q(name)} {definition}")


def partitions(cursor: Any, table: str) -> dict[date, str]:
    """The table's day partitions, by day (the default partition is not listed)."""
    cursor.execute("SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                   "WHERE i.inhparent = to_regclass(%s)", [table])
    out: dict[date, str] = {}
    for (name,) in cursor.fetchall():
        match = NAME.search(name)
        if match and name == partition_name(table, datetime.strptime(match.group(1), "%Y%m%d").date()):
            out[datetime.strptime(match.group(1), "%Y%m%d").date()] = name
    return out


def ensure_partitions(cursor: Any, table: str, days: Iterable[date]) -> list[str]:
    """Create the partitions of ``days`` that do not exist yet; returns the names created.

    When the default partition already holds rows of such a day, they are moved into the new partition in the same
    transaction (PostgreSQL refuses to create a partition whose rows sit in the default one)."""
    have = partitions(cursor, table)
    made = []
    for day in sorted(set(days) - set(have)):
        name, lo, hi = partition_name(table, day), _bound(day), _bound(day + DAY)
        default = _q(table + "_default")
        cursor.execute(f"SELECT EXISTS (SELECT 1 FROM {default} WHERE ts >= %s AND ts < %s)", [lo, hi])
        if not cursor.fetchone()[0]:
            cursor.execute(f"CREATE TABLE {_q(name)} PARTITION OF {_q(table)} FOR VALUES FROM ('{lo}') TO ('{hi}')"
                           f"{_with(table)}")
        else:
            cursor.execute(f"CREATE TABLE {_q(name)} (LIKE {_q(table)} INCLUDING DEFAULTS){_with(table)}")
            cursor.execute(f"WITH moved AS (DELETE FROM {default} WHERE ts >= %s AND ts < %s RETURNING *) "
                           f"INSERT INTO {_q(name)} SELECT * FROM moved", [lo, hi])
            cursor.execute(f"ALTER TABLE {_q(table)} ATTACH PARTITION {_q(name)} FOR VALUES FROM ('{lo}') TO ('{hi}')")
        made.append(name)
    return made


def drop_before(cursor: Any, table: str, cut: date, chunk: int = 50_000) -> tuple[list[str], int]:
    """Drop the day partitions that end at or before ``cut`` (a UTC midnight), and delete, in chunks, the default
    partition's rows before it. Returns the partitions dropped and the rows deleted from the default partition."""
    dropped = []
    for day, name in sorted(partitions(cursor, table).items()):
        if day + DAY <= cut:
            cursor.execute(f"DROP TABLE {_q(name)}")
            dropped.append(name)
    default, deleted = _q(table + "_default"), 0
    while True:
        cursor.execute(f"DELETE FROM {default} WHERE id IN (SELECT id FROM {default} WHERE ts < %s LIMIT %s)",
                       [_bound(cut), chunk])
        deleted += cursor.rowcount
        if cursor.rowcount < chunk:
            return dropped, deleted
