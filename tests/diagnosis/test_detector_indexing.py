"""The counting and bucketing that stand in for sorts in the detectors give what the sorts gave."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dashboard.diagnosis.detectors.base import nanmedian
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


# Values drawn from a few, so that ties and equal middles are common; NaN where a rank's row has not arrived.
_CELLS = st.sampled_from([float("nan"), 0.0, 0.25, 1.0, 1.5, 3.0, -2.0, 1e-9, 7e6])


@given(hnp.arrays(float, hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=12), elements=_CELLS),
       st.booleans())
def test_nanmedian_down_the_columns_is_numpys(x: np.ndarray, keepdims: bool) -> None:
    """The sort that reads each column's middle at its own count gives numpy's values to the bit: even and odd
    counts, ties, all-NaN columns (NaN), empty matrices."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy warns of an all-NaN column
        want = np.nanmedian(x, axis=0, keepdims=keepdims)
        got = nanmedian(x, axis=0, keepdims=keepdims)
    assert np.shape(got) == np.shape(want)
    assert np.array_equal(got, want, equal_nan=True)


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


def test_ranks_sharing_one_environment_dict_drift_as_ranks_with_equal_copies() -> None:
    """share_env makes equal environments one dict; the NCCL drift check takes a shared one by identity, and must
    count and compare exactly as it does for equal copies (a drifting rank among 40, an unhashable value)."""
    from dashboard.diagnosis.detectors.nccl import _drift, _Envs, share_env
    from dashboard.diagnosis.detectors.window import RankInfo, RunInfo

    def env(r: int) -> dict[str, object]:
        e: dict[str, object] = {"NCCL_IB_HCA": "mlx5", "NCCL_SOCKET_IFNAME": "eth0" if r != 7 else "ib0"}
        if r == 9:
            e["NCCL_DEBUG_SUBSYS"] = ["INIT"]  # unhashable: stands alone
        return e

    def run(shared: bool) -> RunInfo:
        pool: dict[object, object] = {}
        ranks = {}
        for r in range(40):
            meta = {"rank": r, "env": env(r)}
            ranks[r] = RankInfo(f"node-{r // 8}", r % 8, share_env(meta, pool) if shared else meta)
        return RunInfo("llm", 40, {}, ranks)

    copies, one = run(False), run(True)
    assert len({id(i.meta["env"]) for i in one.ranks.values()}) == 3  # the common one, rank 7's, rank 9's
    a, b = _Envs(copies), _Envs(one)
    assert (a.count, a.nccl, [(r, i) for r, _, i in a.ranks]) == (b.count, b.nccl, [(r, i) for r, _, i in b.ranks])
    assert _drift(copies) == _drift(one) and 7 in _drift(one)
