"""``series.downsample_rows`` (samples in memory, the frames' rows) answers what ``series.downsample`` (SQL over row
tables) answers for the same samples: the same buckets, statistics, nulls and keys, so a page cannot tell them apart.

Held against the SQL grouping itself on host samples (a row table), on both databases, for random samples: whole and
fractional times, nulls, several nodes, ranges that cut buckets, ``keep``."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dashboard.telemetry.models import HostSample, Node
from dashboard.web.series import TimeRange, downsample, downsample_rows

pytestmark = pytest.mark.django_db

T0 = 1_790_000_000.0
samples = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3000), st.sampled_from([0.0, 0.25, 0.5, 0.999]),
                             st.one_of(st.none(), st.floats(0, 100, allow_nan=False)),
                             st.one_of(st.none(), st.integers(0, 10**12))), min_size=1, max_size=120)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=samples, span=st.integers(30, 3000), points=st.integers(10, 200), keep_max=st.booleans())
def test_it_buckets_as_the_sql_grouping_does(world: Any, rows: list[tuple[int, int, float, float | None, int | None]],
                                             span: int, points: int, keep_max: bool) -> None:
    HostSample.objects.all().delete()
    nodes = [Node.objects.get_or_create(cluster=world.cluster, hostname=f"ds-{i}")[0] for i in range(3)]
    HostSample.objects.bulk_create([HostSample(cluster=world.cluster, node=nodes[n], ts=datetime.fromtimestamp(T0 + s + f, UTC),
                                               cpu_pct=cpu, mem_used_bytes=mem) for n, s, f, cpu, mem in rows])
    tr = TimeRange(T0 + 17, T0 + 17 + span, points=points)
    keep = {"mem_used_bytes": ("max",)} if keep_max else None
    fields = ["cpu_pct", "mem_used_bytes"]
    want = downsample(HostSample.objects.filter(cluster=world.cluster), tr, fields, by=["node_id"], keep=keep)
    ts = np.array([T0 + s + f for _, s, f, _, _ in rows])
    values = {"cpu_pct": np.array([math.nan if c is None else c for _, _, _, c, _ in rows]),
              "mem_used_bytes": np.array([math.nan if m is None else m for *_, m in rows])}
    ids = np.array([float(nodes[n].id) for n, *_ in rows])
    got = downsample_rows(ts, values, tr, fields, groups=[ids], keep=keep)
    _same(got, want, fields)
    # And all nodes as one series (no groups).
    _same(downsample_rows(ts, values, tr, fields, keep=keep),
          downsample(HostSample.objects.filter(cluster=world.cluster), tr, fields, keep=keep), fields)


def _same(got: dict[str, Any], want: dict[str, Any], fields: list[str]) -> None:
    assert got.keys() == want.keys()
    for key, series in want.items():
        assert got[key]["t"] == series["t"]
        for f in fields:
            assert got[key][f].keys() == series[f].keys()
            for stat, vals in series[f].items():
                mine = got[key][f][stat]
                assert [v is None for v in mine] == [v is None for v in vals], (key, f, stat)
                assert [v for v in mine if v is not None] == pytest.approx([v for v in vals if v is not None],
                                                                          rel=1e-9, abs=1e-9), (key, f, stat)
