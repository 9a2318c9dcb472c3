"""dashboard.storage.gpu_samples: the one module the pages, the evidence and "why was step N slow" read GPU samples
through. Its answers against a direct computation over the rows written (both databases: the suite runs this file on
SQLite and on PostgreSQL). tests/server/test_sample_readers.py keeps it the one module."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from dashboard.storage import gpu_samples
from dashboard.storage.models import RollupState
from dashboard.storage.rollup import roll_up
from dashboard.telemetry.models import GpuSample, Node
from dashboard.web.series import TimeRange
from tests.server.conftest import World

T0 = 1_700_000_040.0  # a whole minute


def _dt(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


@pytest.fixture
def rows(world: World) -> Node:
    """Two GPUs, 300 s at 1 Hz. The clock's max alternates between two values, so a bucket's mean of per-sample
    ratios differs from the ratio of its means; one sample a minute reports a max of 0 (no ratio for it). GPU 1
    throttles for sw_power_cap in seconds 100-159 and for hw_slowdown in 130-189 (a reason whose name is part of
    another's must not light it up: "power" is not searched, '"sw_power_cap"' is)."""
    node = Node.objects.create(cluster=world.cluster, hostname="node-g")
    GpuSample.objects.bulk_create([
        GpuSample(cluster=world.cluster, node=node, gpu_index=g, ts=_dt(T0 + s), util_gpu_pct=float((s + g) % 100),
                  sm_clock_mhz=900.0 + s, sm_clock_max_mhz=0.0 if s % 60 == 7 else (1800.0 if s % 2 else 2000.0),
                  temp_c=60.0 + g,
                  throttle_reasons=[r for r, on in (("sw_power_cap", g == 1 and 100 <= s < 160),
                                                    ("hw_slowdown", g == 1 and 130 <= s < 190)) if on])
        for s in range(300) for g in range(2)])
    return node


def _expect(node: Node, gpu: int, width: int, value: Any) -> dict[float, list[float]]:
    """Bucket start -> the values ``value(row)`` of the GPU's rows in it, by direct computation."""
    out: dict[float, list[float]] = {}
    for r in GpuSample.objects.filter(node=node, gpu_index=gpu):
        v = value(r)
        if v is not None:
            out.setdefault(math.floor(r.ts.timestamp() / width) * width, []).append(v)
    return out


@pytest.mark.django_db
def test_buckets_are_each_gpus_min_mean_max(rows: Node) -> None:
    tr = TimeRange(T0, T0 + 299, points=5)  # 60 s buckets
    got = gpu_samples.buckets(rows.id, tr, ["util_gpu_pct"])
    assert set(got) == {"0", "1"}
    for g in (0, 1):
        want = _expect(rows, g, 60, lambda r: r.util_gpu_pct)
        s = got[str(g)]
        assert s["t"] == sorted(want)
        assert s["util_gpu_pct"]["min"] == [min(want[t]) for t in s["t"]]
        assert s["util_gpu_pct"]["max"] == [max(want[t]) for t in s["t"]]
        assert s["util_gpu_pct"]["mean"] == pytest.approx([sum(want[t]) / len(want[t]) for t in s["t"]])
    one = gpu_samples.buckets(rows.id, tr, ["util_gpu_pct"], gpu=1, keep={"util_gpu_pct": ("max",)})
    assert set(one) == {"1"} and set(one["1"]["util_gpu_pct"]) == {"max"}


@pytest.mark.django_db
def test_the_ratio_from_raw_rows_is_each_samples_averaged(rows: Node) -> None:
    tr = TimeRange(T0, T0 + 299, points=5)
    got = gpu_samples.ratio_buckets(rows.id, 0, tr, "sm_clock_mhz", "sm_clock_max_mhz", ["temp_c"])
    assert got is not None
    want = _expect(rows, 0, 60, lambda r: r.sm_clock_mhz / r.sm_clock_max_mhz if r.sm_clock_max_mhz else None)
    assert got["ratio"]["mean"] == pytest.approx([sum(want[t]) / len(want[t]) for t in got["t"]])
    means = _expect(rows, 0, 60, lambda r: r.sm_clock_mhz)
    maxes = _expect(rows, 0, 60, lambda r: r.sm_clock_max_mhz)
    of_means = [(sum(means[t]) / len(means[t])) / (sum(maxes[t]) / len(maxes[t])) for t in got["t"]]
    assert all(abs(a - b) > 1e-3 for a, b in zip(got["ratio"]["mean"], of_means, strict=True)), \
        "the fixture must tell the two ratios apart"
    assert got["temp_c"]["max"] == [60.0] * len(got["t"])
    assert gpu_samples.ratio_buckets(rows.id, 5, tr, "sm_clock_mhz", "sm_clock_max_mhz", []) is None


@pytest.mark.django_db
def test_the_ratio_from_the_rollups_is_the_ratio_of_their_means(world: World) -> None:
    node = Node.objects.create(cluster=world.cluster, hostname="node-r")
    base = math.floor((time.time() - 3 * 3600) / 60) * 60
    GpuSample.objects.bulk_create([
        GpuSample(cluster=world.cluster, node=node, gpu_index=0, ts=_dt(base + s), sm_clock_mhz=1000.0 + s,
                  sm_clock_max_mhz=2000.0) for s in range(120)])
    roll_up()
    assert RollupState.objects.filter(rolled_through__isnull=False).exists()
    got = gpu_samples.ratio_buckets(node.id, 0, TimeRange(base, base + 119, 12, tier=10), "sm_clock_mhz",
                                    "sm_clock_max_mhz", [])
    assert got is not None and got["t"] == [base + 10 * i for i in range(12)]
    assert got["ratio"]["mean"] == pytest.approx([(1000.0 + 10 * i + 4.5) / 2000.0 for i in range(12)], rel=1e-4)


@pytest.mark.django_db
def test_flag_buckets_say_when_each_reason_was_set(rows: Node) -> None:
    tr = TimeRange(T0, T0 + 299, points=30)  # 10 s buckets
    names, got = gpu_samples.flag_buckets(rows.id, tr)
    assert names == ["hw_slowdown", "sw_power_cap"]
    assert set(got) == {"0", "1"}
    assert not any(any(got["0"][name]) for name in names), "GPU 0 reported an empty list every second"
    s = got["1"]
    on = {name: [t - T0 for t, v in zip(s["t"], s[name], strict=True) if v] for name in names}
    assert on["sw_power_cap"] == [100 + 10 * i for i in range(6)]
    assert on["hw_slowdown"] == [130 + 10 * i for i in range(6)]
    assert gpu_samples.flag_buckets(rows.id, tr, gpu=0) == ([], {})


@pytest.mark.django_db
def test_latest_heard_around_and_any(world: World, rows: Node) -> None:
    newest = gpu_samples.latest(rows.id, [0, 1, 7], ["util_gpu_pct", "temp_c"])
    assert set(newest) == {0, 1}, "a GPU that never sent a sample is absent"
    assert newest[1] == {"ts": T0 + 299, "util_gpu_pct": float(300 % 100), "temp_c": 61.0}

    assert gpu_samples.heard(rows.id, 0, T0 + 10, T0 + 20) == [T0 + s for s in range(10, 21)]
    assert gpu_samples.heard(rows.id, 0, T0, T0 + 299, limit=3) == [T0, T0 + 1, T0 + 2]

    other = Node.objects.create(cluster=world.other_cluster, hostname="node-g")  # the same name, another cluster
    GpuSample.objects.create(cluster=world.other_cluster, node=other, gpu_index=0, ts=_dt(T0 + 5), temp_c=99.0)
    got = sorted(gpu_samples.around(world.cluster.id, {"node-g"}, T0 + 4, T0 + 5, ("temp_c",)))
    assert got == [("node-g", 0, 60.0), ("node-g", 0, 60.0), ("node-g", 1, 61.0), ("node-g", 1, 61.0)]
    assert list(gpu_samples.around(world.cluster.id, {"node-h"}, T0, T0 + 299, ("temp_c",))) == []

    assert gpu_samples.any_heard(world.cluster.id)
    GpuSample.objects.filter(cluster=world.cluster).delete()
    assert not gpu_samples.any_heard(world.cluster.id) and gpu_samples.any_heard(world.other_cluster.id)
