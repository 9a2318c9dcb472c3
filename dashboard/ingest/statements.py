"""How many rows each multi-row INSERT carries on SQLite: a pure function, shared by the group writer and
``benchmarks/sqlite_convoy.py`` so the benchmark measures the writer's own layout.

Python's sqlite3 releases the GIL around every ``sqlite3_step``, i.e. once per statement, and taking it back while
the event loop is busy decoding posts can cost up to the switch interval (5 ms). So the fewer statements a group's
rows take, the less the writer waits. Whole statements of ``per`` rows, then the rest split by the binary digits of
its size (a rest of 56 is 32 + 16 + 8): at most log2(per) statements more, where the rest row by row cost up to
``per - 1`` (``python benchmarks/sqlite_convoy.py --commit 1592``), and only log2(per) + 1 distinct statement texts per
table, so each stays in sqlite3's cache of prepared statements.
"""

from __future__ import annotations


def statement_sizes(rows: int, per: int) -> list[int]:
    """The rows of each statement for ``rows`` rows at most ``per`` a statement, largest first; they sum to ``rows``."""
    if per < 1:
        raise ValueError("per must be at least 1")
    sizes = [per] * (rows // per)
    rest = rows % per
    bit = 1 << max(rest.bit_length() - 1, 0)
    while rest:
        if rest & bit:
            sizes.append(bit)
            rest -= bit
        bit >>= 1
    return sizes
