"""The counting and bucketing that stand in for sorts in the detectors give what the sorts gave."""

from __future__ import annotations

import numpy as np
import pytest

from dashboard.diagnosis.detectors.paths import _by_group
from dashboard.diagnosis.detectors.steps import _dense


@pytest.mark.parametrize("values", [
    [], [3.0], [5.0, 2.0, 5.0, 9.0], [1.5, 1.0], [float("nan"), 1.0], [0.0, 1e12], [-3.0, -1.0, -3.0],
    list(np.random.default_rng(1).integers(0, 100, 1000).astype(float)),
])
def test_dense_is_unique_with_inverse(values: list[float]) -> None:
    v = np.array(values, dtype=float)
    want, want_at = np.unique(v, return_inverse=True)
    got, got_at = _dense(v)
    assert np.array_equal(got, want, equal_nan=True) and got.dtype == want.dtype
    assert np.array_equal(got_at.ravel(), want_at.ravel())


def test_pairs_by_group_are_the_per_group_comparisons() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        n_pairs, n = int(rng.integers(0, 60)), int(rng.integers(1, 7))
        ga, gb = rng.integers(-1, n, n_pairs), rng.integers(-1, n, n_pairs)
        cross, inside = _by_group(ga, gb, n)
        assert len(cross) == len(inside) == n
        for i in range(n):
            assert np.array_equal(cross[i], np.nonzero((ga == i) ^ (gb == i))[0])
            assert np.array_equal(inside[i], np.nonzero((ga == i) & (gb == i))[0])
