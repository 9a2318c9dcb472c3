"""The rows of each multi-row INSERT on SQLite (dashboard.ingest.statements): all rows, few statements, few texts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dashboard.ingest.statements import statement_sizes


def test_whole_statements_then_the_rest_by_its_binary_digits() -> None:
    assert statement_sizes(184, 64) == [64, 64, 32, 16, 8]
    assert statement_sizes(128, 64) == [64, 64]
    assert statement_sizes(63, 64) == [32, 16, 8, 4, 2, 1]
    assert statement_sizes(0, 64) == []
    assert statement_sizes(5, 1) == [1] * 5
    # A per-statement bound that is no power of two: the rest still splits into powers of two below it.
    assert statement_sizes(1000, 468) == [468, 468, 64]


@given(rows=st.integers(0, 100_000), per=st.integers(1, 1024))
def test_every_row_in_few_statements_of_few_sizes(rows: int, per: int) -> None:
    sizes = statement_sizes(rows, per)
    assert sum(sizes) == rows
    assert all(0 < s <= per for s in sizes)
    assert sizes == sorted(sizes, reverse=True)
    rest = rows % per
    # Row by row the rest took `rest` statements; here one per set bit of it.
    assert len(sizes) == rows // per + bin(rest).count("1")
    # The distinct texts a table needs over any number of groups: `per` and the powers of two below it.
    assert set(sizes) <= {per} | {1 << b for b in range(per.bit_length())}


def test_refuses_a_bound_below_one() -> None:
    with pytest.raises(ValueError):
        statement_sizes(3, 0)
