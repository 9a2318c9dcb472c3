"""The counting and bucketing that stand in for sorts in the detectors give what the sorts gave."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dashboard.diagnosis.detectors.base import SortedColumns, nanmedian
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


@given(hnp.arrays(float, hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=12), elements=_CELLS),
       st.sampled_from([25, 75, 10, 100 * (1 - 0.9), 50, 0, 100, 33.3]))
def test_percentile_down_the_sorted_columns_is_numpys(x: np.ndarray, p: float) -> None:
    """From the one sort: numpy's linear interpolation (from below under half way, from above past it), the last
    value past the end, NaN for an all-NaN column, to the bit; and its median beside it."""
    cols = SortedColumns(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        want = np.nanpercentile(x, p, axis=0) if x.shape[0] else np.full(x.shape[1], np.nan)
        want_median = np.nanmedian(x, axis=0) if x.shape[0] else np.full(x.shape[1], np.nan)
    assert np.array_equal(cols.percentile(p), want, equal_nan=True)
    assert np.array_equal(cols.median(), want_median, equal_nan=True)


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


def test_run_grids_built_once_per_window_are_the_grids_built_for_each_caller() -> None:
    """run_steps keeps each run's grid layout and field matrices in the window for the next detector: what each caller
    gets equals a grid scattered afresh, repeated (rank, step) rows included (a run restarted from a checkpoint), and
    a caller writing into its matrices changes nobody else's."""
    from types import SimpleNamespace

    from dashboard.diagnosis.detectors.steps import _dense, run_steps

    def fresh(t: dict[str, np.ndarray], run: int, cols: tuple[str, ...], last: int) -> Any:
        rows = np.nonzero(t["run"] == run)[0]
        if not len(rows):
            return None
        keep = rows[t["step"][rows] > np.nanmax(t["step"][rows]) - last - 1]
        (ranks, r_at), (steps, s_at) = _dense(t["rank"][keep]), _dense(t["step"][keep])
        m = {}
        for c in ("step_time_s", "ts", *cols):
            m[c] = np.full((len(ranks), len(steps)), np.nan)
            m[c][r_at, s_at] = t[c][keep]
        full = np.sum(~np.isnan(m["step_time_s"]), axis=0) >= max(1, 0.5 * len(ranks))
        return (ranks, steps[full], {c: v[:, full] for c, v in m.items()}) if full.any() else None

    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(0, 300))
        t = {"run": rng.integers(0, 2, n).astype(float), "rank": rng.integers(0, 20, n).astype(float),
             "step": rng.integers(0, 30, n).astype(float), "ts": rng.random(n), "x": rng.random(n),
             "step_time_s": np.where(rng.random(n) < 0.2, np.nan, rng.random(n))}
        w = SimpleNamespace(steps=t, grids={}, runs=["a", "b"])
        for run, cols, last in [(0, ("x",), 5), (1, (), 8), (0, ("x",), 5), (0, (), 8), (1, ("x",), 8)]:
            want, got = fresh(t, run, cols, last), run_steps(w, run, cols, last)  # type: ignore[arg-type]
            assert (want is None) == (got is None)
            if got is None:
                continue
            assert np.array_equal(got.ranks, want[0]) and np.array_equal(got.steps, want[1])
            assert got.m.keys() == want[2].keys()
            for c, mat in want[2].items():
                assert np.array_equal(got.m[c], mat, equal_nan=True)
            got.m["step_time_s"][:] = -1.0  # the next caller's grid is not this one


_PROBE = st.tuples(st.sampled_from([-1.0, 0.0, 1.0, 2.0, 3.0, float("nan")]),  # sender
                   st.sampled_from([-1.0, 0.0, 1.0, 2.0, 3.0, float("nan")]),  # peer
                   st.sampled_from([0.0, 1.0, 1.5, 2.0, 3.0, 4.0]),  # ts: ties common
                   st.sampled_from([0.0, 1.0, 5.0, float("nan")]),  # sent
                   st.sampled_from([0.0, 1.0, 2.0, 5.0, float("nan")]))  # lost


@given(st.lists(_PROBE, max_size=40), st.dictionaries(st.integers(0, 3), st.sampled_from([-1.0, 0.5, 1.0, 2.0, 9.0]),
                                                      max_size=4))
def test_unreachable_of_every_silent_node_at_once_is_each_nodes(probes: list[tuple[float, ...]],
                                                               heard: dict[int, float]) -> None:
    """nodes_down asks about every node silent past its limit in one sort (unreachable_all): the same (lost, sent,
    peers, rounds) as the definition node by node (test_node_cutoff.unreachable_one), with ties in time, unknown
    peers and senders, NaN counts."""
    from dashboard.diagnosis.detectors.base import Thresholds
    from dashboard.diagnosis.detectors.network import unreachable_all
    from dashboard.diagnosis.detectors.window import GPU_NUM, GPU_OBJ, PROBE_NUM, STEP_NUM, Table, Window
    from tests.diagnosis.test_node_cutoff import unreachable_one

    rows = [(*p, 0.1, float("nan")) for p in probes]
    w = Window(now=10.0, nodes=["a", "b", "c", "d"], steps=Table.from_rows(STEP_NUM, (), []),
               gpus=Table.from_rows(GPU_NUM, GPU_OBJ, []), ports=Table.from_rows(("node", "ts"), (), []),
               probes=Table.from_rows(PROBE_NUM, (), rows), events=[], hosts={}, runs=[], last_heard={})
    t = Thresholds()
    assert unreachable_all(w, heard, t) == {i: unreachable_one(w, i, h, t) for i, h in heard.items()}
