"""dashboard.storage.gpu_samples: the one module the pages, the evidence and "why was step N slow" read GPU samples
through. Its answers against a direct computation over the samples seeded (as frames, as ingest stores them; both
databases: the suite runs this file on SQLite and on PostgreSQL). tests/server/test_sample_readers.py keeps it the one
module."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from dashboard.storage import gpu_samples
from dashboard.storage.models import RollupState
from dashboard.storage.rollup import roll_up
from dashboard.telemetry.models import GpuFrame, Node
from dashboard.web.series import TimeRange
from tests.server import framed
from tests.server.conftest import World

T0 = 1_700_000_040.0  # a whole minute


def _seeded() -> list[dict[str, Any]]:
    """Two GPUs, 300 s at 1 Hz. The clock's max alternates between two values, so a bucket's mean of per-sample
    ratios differs from the ratio of its means; one sample a minute reports a max of 0 (no ratio for it). GPU 1
    throttles for sw_power_cap in seconds 100-159 and for hw_slowdown in 130-189 (a reason whose name is part of
    another's must not light it up). An ECC counter and a flag, to be read back as an int and a bool."""
    return [{"ts": T0 + s, "index": g, "util_gpu_pct": float((s + g) % 100), "sm_clock_mhz": 900.0 + s,
             "sm_clock_max_mhz": 0.0 if s % 60 == 7 else (1800.0 if s % 2 else 2000.0), "temp_c": 60.0 + g,
             "ecc_sbe_aggregate": s // 60, "retired_pages_pending": s % 2 == 1,
             "throttle_reasons": [r for r, on in (("sw_power_cap", g == 1 and 100 <= s < 160),
                                                  ("hw_slowdown", g == 1 and 130 <= s < 190)) if on]}
            for s in range(300) for g in range(2)]


@pytest.fixture
def rows(world: World) -> Node:
    """The samples of :func:`_seeded`, posted every 2 s (a frame per post and 10 s window)."""
    node = Node.objects.create(cluster=world.cluster, hostname="node-g")
    samples = _seeded()
    for i in range(0, len(samples), 4):
        framed.gpus(world.cluster, node, samples[i:i + 4])
    return node


def _expect(gpu: int, width: int, value: Any) -> dict[float, list[float]]:
    """Bucket start -> the values ``value(sample)`` of the GPU's seeded samples in it, by direct computation."""
    out: dict[float, list[float]] = {}
    for r in _seeded():
        v = value(r)
        if r["index"] == gpu and v is not None:
            out.setdefault(math.floor(r["ts"] / width) * width, []).append(v)
    return out


@pytest.mark.django_db
def test_buckets_are_each_gpus_min_mean_max(rows: Node) -> None:
    tr = TimeRange(T0, T0 + 299, points=5)  # 60 s buckets
    got = gpu_samples.buckets(rows.id, tr, ["util_gpu_pct"])
    assert set(got) == {"0", "1"}
    for g in (0, 1):
        want = _expect(g, 60, lambda r: r["util_gpu_pct"])
        s = got[str(g)]
        assert s["t"] == sorted(want)
        assert s["util_gpu_pct"]["min"] == [min(want[t]) for t in s["t"]]
        assert s["util_gpu_pct"]["max"] == [max(want[t]) for t in s["t"]]
        assert s["util_gpu_pct"]["mean"] == pytest.approx([sum(want[t]) / len(want[t]) for t in s["t"]])
    one = gpu_samples.buckets(rows.id, tr, ["util_gpu_pct"], gpu=1, keep={"util_gpu_pct": ("max",)})
    assert set(one) == {"1"} and set(one["1"]["util_gpu_pct"]) == {"max"}


@pytest.mark.django_db
def test_the_ratio_from_raw_samples_is_each_samples_averaged(rows: Node) -> None:
    tr = TimeRange(T0, T0 + 299, points=5)
    got = gpu_samples.ratio_buckets(rows.id, 0, tr, "sm_clock_mhz", "sm_clock_max_mhz", ["temp_c"])
    assert got is not None
    want = _expect(0, 60, lambda r: r["sm_clock_mhz"] / r["sm_clock_max_mhz"] if r["sm_clock_max_mhz"] else None)
    assert got["ratio"]["mean"] == pytest.approx([sum(want[t]) / len(want[t]) for t in got["t"]])
    means = _expect(0, 60, lambda r: r["sm_clock_mhz"])
    maxes = _expect(0, 60, lambda r: r["sm_clock_max_mhz"])
    of_means = [(sum(means[t]) / len(means[t])) / (sum(maxes[t]) / len(maxes[t])) for t in got["t"]]
    assert all(abs(a - b) > 1e-3 for a, b in zip(got["ratio"]["mean"], of_means, strict=True)), \
        "the fixture must tell the two ratios apart"
    assert got["temp_c"]["max"] == [60.0] * len(got["t"])
    assert gpu_samples.ratio_buckets(rows.id, 5, tr, "sm_clock_mhz", "sm_clock_max_mhz", []) is None


@pytest.mark.django_db
def test_the_ratio_from_the_rollups_is_the_ratio_of_their_means(world: World) -> None:
    node = Node.objects.create(cluster=world.cluster, hostname="node-r")
    base = math.floor((time.time() - 3 * 3600) / 60) * 60
    framed.gpus(world.cluster, node, [{"ts": base + s, "index": 0, "sm_clock_mhz": 1000.0 + s,
                                       "sm_clock_max_mhz": 2000.0} for s in range(120)])
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
    newest = gpu_samples.latest(rows.id, [0, 1, 7], ["util_gpu_pct", "temp_c", "ecc_sbe_aggregate",
                                                     "retired_pages_pending", "power_w", "throttle_reasons"])
    assert set(newest) == {0, 1}, "a GPU that never sent a sample is absent"
    assert newest[1] == {"ts": T0 + 299, "util_gpu_pct": float(300 % 100), "temp_c": 61.0, "ecc_sbe_aggregate": 4,
                         "retired_pages_pending": True, "power_w": None, "throttle_reasons": []}
    assert type(newest[1]["ecc_sbe_aggregate"]) is int and type(newest[1]["retired_pages_pending"]) is bool

    assert gpu_samples.heard(rows.id, 0, T0 + 10, T0 + 20) == [T0 + s for s in range(10, 21)]
    assert gpu_samples.heard(rows.id, 0, T0, T0 + 299, limit=3) == [T0, T0 + 1, T0 + 2]

    other = Node.objects.create(cluster=world.other_cluster, hostname="node-g")  # the same name, another cluster
    framed.gpus(world.other_cluster, other, [{"ts": T0 + 5, "index": 0, "temp_c": 99.0}])
    got = sorted(gpu_samples.around(world.cluster.id, {"node-g"}, T0 + 4, T0 + 5, ("temp_c",)))
    assert got == [("node-g", 0, 60.0), ("node-g", 0, 60.0), ("node-g", 1, 61.0), ("node-g", 1, 61.0)]
    assert all(type(g) is int for _, g, _ in got)
    got = sorted(gpu_samples.around(world.cluster.id, {"node-g", "node-h"}, T0 + 100, T0 + 100,
                                    ("ecc_sbe_aggregate", "retired_pages_pending", "power_w", "throttle_reasons")))
    assert got == [("node-g", 0, 1, False, None, []), ("node-g", 1, 1, False, None, ["sw_power_cap"])]
    assert list(gpu_samples.around(world.cluster.id, {"node-h"}, T0, T0 + 299, ("temp_c",))) == []

    assert gpu_samples.any_heard(world.cluster.id)
    GpuFrame.objects.filter(cluster=world.cluster).delete()
    assert not gpu_samples.any_heard(world.cluster.id) and gpu_samples.any_heard(world.other_cluster.id)


@pytest.mark.django_db
def test_latest_is_the_newest_sample_wherever_its_frame_lies(world: World) -> None:
    """A frame's ``ts`` is its oldest sample's: the newest sample can be in a frame older than another frame of the
    same window. Equal times: the sample written last. A GPU silent for hours is still found."""
    node = Node.objects.create(cluster=world.cluster, hostname="node-l")
    framed.gpus(world.cluster, node, [{"ts": T0 - 7200.0, "index": 2, "temp_c": 30.0}])  # two hours before
    framed.gpus(world.cluster, node, [{"ts": T0 + 1, "index": 0, "temp_c": 1.0}, {"ts": T0 + 9, "index": 0, "temp_c": 9.0}])
    framed.gpus(world.cluster, node, [{"ts": T0 + 5, "index": 0, "temp_c": 5.0}, {"ts": T0 + 5, "index": 1, "temp_c": 2.0}])
    framed.gpus(world.cluster, node, [{"ts": T0 + 5, "index": 1, "temp_c": 3.0}, {"ts": T0 + 5, "index": 1, "temp_c": 4.0}])
    got = gpu_samples.latest(node.id, [0, 1, 2, 3], ["temp_c"])
    assert got == {0: {"ts": T0 + 9, "temp_c": 9.0}, 1: {"ts": T0 + 5, "temp_c": 4.0},
                   2: {"ts": T0 - 7200.0, "temp_c": 30.0}}
    assert gpu_samples.latest(node.id, [], ["temp_c"]) == {}
    assert gpu_samples.heard(node.id, 0, T0, T0 + 60) == [T0 + 1, T0 + 5, T0 + 9]


@pytest.mark.django_db
def test_a_sample_without_a_reasons_list_is_in_no_band(world: World) -> None:
    node = Node.objects.create(cluster=world.cluster, hostname="node-n")
    framed.gpus(world.cluster, node, [{"ts": T0 + s, "index": g, "throttle_reasons": ["hw_slowdown"] if g else None}
                                      for s in range(20) for g in range(2)])
    names, got = gpu_samples.flag_buckets(node.id, TimeRange(T0, T0 + 19, points=2))
    assert names == ["hw_slowdown"] and set(got) == {"1"}
    assert got["1"] == {"t": [T0, T0 + 10], "hw_slowdown": [1.0, 1.0]}
