"""Several culprits at once, the late rank named within its process group, exposed communication, memory advice from
the layout and loss spikes with their hardware cause: pure detector tests over a :class:`WindowBuffer` (no database).

A run of four ranks, one per node (``node-0``..``node-3``, GPU 0 each), steps every 0.3 s for 20 steps; each case
changes one rank's (or a set's) numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from dashboard.diagnosis.detectors import Detection, run_all
from dashboard.diagnosis.detectors.buffer import WindowBuffer
from dashboard.diagnosis.detectors.steps import memory_advice

T0 = 1_760_000_000.0
STEP = 0.3
N_STEPS = 20
Groups = Callable[[int, int], list[dict[str, Any]] | None]


def _g(role: str, index: int, group_rank: int, size: int, arrive: float, exposed: float) -> dict[str, Any]:
    return {"role": role, "name": role, "group_rank": group_rank, "group_size": size, "index": index, "calls": 4,
            "bytes": 1 << 20, "inflight_s": exposed + 0.01, "exposed_s": exposed, "arrive_s": arrive}


def window(data: dict[int, float] | None = None, compute: dict[int, float] | None = None, groups: Groups | None = None,
           n: int = 4, meta: dict[str, Any] | None = None, extra: Callable[[int, int, dict[str, Any]], None] | None = None,
           seed: int = 0) -> WindowBuffer:
    rng = np.random.default_rng(seed)
    buf = WindowBuffer()
    for r in range(n):
        rmeta = {"run": "r", "rank": r, "world_size": n, "ts": T0, "host": f"node-{r}", "gpu_index": 0, **(meta or {})}
        steps = []
        for s in range(N_STEPS):
            dw = (data or {}).get(r, 0.002) + rng.uniform(0, 0.001)
            cp = (compute or {}).get(r, 0.2) * (1 + rng.normal(0, 0.003))
            row: dict[str, Any] = {"run": "r", "rank": r, "step": s, "ts": T0 + STEP * (s + 1), "step_time_s": STEP,
                                   "data_wait_s": dw, "compute_s": cp, "comm_s": max(0.0, STEP - dw - cp),
                                   "comm_arrive_s": dw + cp, "tokens": 4096,
                                   "groups": groups(s, r) if groups else None}
            if extra:
                extra(s, r, row)
            steps.append(row)
        buf.add({"host": f"node-{r}", "sent_at": T0 + STEP * N_STEPS, "runs": [rmeta], "steps": steps,
                 "hosts": [{"ts": T0 + STEP * N_STEPS, "cpu_pct": 20.0}]})
    return buf


def diagnose(buf: WindowBuffer) -> list[Detection]:
    return run_all(buf.window(T0 + STEP * N_STEPS + 0.2))


def keys(found: list[Detection], *kinds: str) -> list[tuple[str, str]]:
    return sorted(d.key for d in found if not kinds or d.kind in kinds)


# -- several culprits ---------------------------------------------------------------------------------------------

def test_it_names_exactly_the_two_of_four_ranks_that_starve() -> None:
    found = diagnose(window(data={1: 0.08, 3: 0.08}, compute={1: 0.2, 3: 0.2}))
    assert keys(found) == [("data_starvation", "r/rank1"), ("data_starvation", "r/rank3")]
    d = next(d for d in found if d.rank == 1)
    m = d.evidence["metrics"]
    assert d.subject_type == "rank" and d.node == "node-1"
    assert 0.08 <= m["data_wait_s"] <= 0.082 and m["median_data_wait_s"] < 0.004  # its own wait, not the mean
    assert m["culprits"] == "2/4" and m["co_culprits"] == [{"rank": 3, "node": "node-3"}]
    # The title rounds the median of its recent flagged steps: 80 or 81 ms (the steps wait 80-82 ms).
    assert "27%" in d.title and f"{m['data_wait_s'] * 1e3:.0f} ms" in d.title and m["data_wait_s"] * 1e3 < 82


def test_it_names_two_of_four_stragglers_from_their_own_compute() -> None:
    found = diagnose(window(compute={0: 0.26, 2: 0.26}))
    assert keys(found) == [("straggler", "r/rank0"), ("straggler", "r/rank2")]


def test_it_reports_the_run_only_when_nearly_every_rank_starves() -> None:
    found = diagnose(window(data={r: 0.08 for r in range(8)}, n=8))
    assert keys(found) == [("data_starvation", "r")]


def test_it_stays_quiet_on_a_healthy_run() -> None:
    for seed in range(3):
        assert diagnose(window(n=8, seed=seed)) == []


# -- within their group -------------------------------------------------------------------------------------------

def tp_dp(slow: int, lag: float) -> Groups:
    """Ranks {0,1} and {2,3} are TP groups 0 and 1 (the two DP replicas); {0,2} and {1,3} are DP groups 0 and 1.
    ``slow`` computes ``lag`` longer: its TP peer waits for it, and its whole replica arrives late at the DP
    all-reduce."""
    def groups(step: int, r: int) -> list[dict[str, Any]]:
        tp_idx, tp_rank, dp_idx, dp_rank = r // 2, r % 2, r % 2, r // 2
        peer_of_slow = r // 2 == slow // 2
        tp_arrive = 0.01 + (lag if r == slow else 0.0)
        tp_exposed = 0.002 + (lag if peer_of_slow and r != slow else 0.0)
        dp_arrive = 0.2 + (lag if peer_of_slow else 0.0)
        dp_exposed = 0.01 + (0.0 if peer_of_slow else lag)
        return [_g("tp", tp_idx, tp_rank, 2, tp_arrive, tp_exposed), _g("dp", dp_idx, dp_rank, 2, dp_arrive, dp_exposed)]
    return groups


def test_it_names_the_slow_tensor_parallel_rank_in_its_group_and_not_its_replica() -> None:
    found = diagnose(window(groups=tp_dp(slow=3, lag=0.03)))
    assert keys(found) == [("straggler", "r/rank3")]
    d = found[0]
    m = d.evidence["metrics"]
    assert (m["role"], m["group_index"], m["group_rank"], m["group_ranks"]) == ("tp", 1, 1, [2, 3])
    assert "tp rank 1 of tp group 1" in d.title and "30 ms late" in d.title
    assert m["replica"] == {"role": "tp", "index": 1, "ranks": [2, 3]}
    arrivals = d.evidence["series"]["group_arrivals"]
    assert set(arrivals["arrive_s"]) == {"2", "3"} and arrivals["arrive_s"]["3"][-1] > arrivals["arrive_s"]["2"][-1]


def test_it_names_the_slow_pipeline_stage_with_the_bubble_of_each_stage() -> None:
    def groups(step: int, r: int) -> list[dict[str, Any]]:
        stage, pipe = r % 2, r // 2  # pipelines {0,1} and {2,3}; rank 1 (stage 1 of pipeline 0) is slow
        exposed = 0.12 if r == 0 else 0.01 if r == 1 else 0.03
        return [_g("pp", pipe, stage, 2, 0.005, exposed)]
    found = diagnose(window(groups=groups, compute={1: 0.2}))
    assert keys(found) == [("straggler", "r/rank1")]
    m = found[0].evidence["metrics"]
    assert found[0].title.startswith("Pipeline stage 1 (rank 1 on node-1 GPU 0) is the slow stage")
    assert m["bubble_by_stage"] == {"0": 0.4, "1": 0.033}


def test_it_names_a_starving_rank_in_its_data_parallel_group_as_starvation() -> None:
    def groups(step: int, r: int) -> list[dict[str, Any]]:
        late = r == 2
        return [_g("dp", 0, r, 4, 0.25 if late else 0.2, 0.0 if late else 0.05)]
    found = diagnose(window(data={2: 0.05}, groups=groups))
    assert keys(found) == [("data_starvation", "r/rank2")]
    assert found[0].evidence["metrics"]["role"] == "dp"


def test_a_member_a_few_ms_late_beside_one_starved_for_half_a_second_is_not_named() -> None:
    """The group waits for its latest member: rank 1's 16 ms (a loaded host's scheduler) beside rank 2's 500 ms costs
    the group nothing; on its own, the same 16 ms in a 0.3 s step is named (the lag floor is 2 % of the step)."""
    def groups(lags: dict[int, float]) -> Groups:  # each member is blocked until the latest one arrives
        latest = max(lags.values())
        return lambda step, r: [_g("dp", 0, r, 4, 0.2 + lags.get(r, 0.0), 0.01 + latest - lags.get(r, 0.0))]
    found = diagnose(window(data={2: 0.5}, groups=groups({1: 0.016, 2: 0.5})))
    assert keys(found, "data_starvation", "straggler") == [("data_starvation", "r/rank2")]
    alone = diagnose(window(groups=groups({1: 0.016})))
    assert keys(alone, "data_starvation", "straggler") == [("straggler", "r/rank1")]


def test_a_rank_a_few_ms_late_in_another_group_beside_the_run_s_straggler_is_not_named() -> None:
    """The run waits for its latest rank: rank 0 computes 500 ms longer (its replica, ranks 0 and 1, is late at the
    DP all-reduce); in TP group 1, rank 3 trails rank 2 by 20 ms (a loaded host) — nothing while rank 0 holds the
    run back, and named once it does not (the same 20 ms is 5 % of the step, above the 2 % floor)."""
    def with_busy_rank_3(slow: Groups | None) -> Groups:
        def groups(step: int, r: int) -> list[dict[str, Any]]:
            out = slow(step, r) if slow is not None else [_g("tp", r // 2, r % 2, 2, 0.01, 0.002),
                                                         _g("dp", r % 2, r // 2, 2, 0.2, 0.01)]
            if r in (2, 3):  # rank 2 is blocked in TP group 1 for the 20 ms rank 3 arrives after it
                tp = out[0]
                out[0] = {**tp, "arrive_s": tp["arrive_s"] + (0.02 if r == 3 else 0.0),
                          "exposed_s": tp["exposed_s"] + (0.02 if r == 2 else 0.0)}
            return out
        return groups
    found = diagnose(window(compute={0: 0.5}, groups=with_busy_rank_3(tp_dp(slow=0, lag=0.5))))
    assert keys(found, "data_starvation", "straggler") == [("straggler", "r/rank0")]
    alone = diagnose(window(groups=with_busy_rank_3(None)))
    assert keys(alone, "data_starvation", "straggler") == [("straggler", "r/rank3")]


# -- exposed communication, memory ----------------------------------------------------------------------------------

def test_it_reports_exposed_communication_with_tp_across_nodes_and_a_forced_algorithm() -> None:
    def groups(step: int, r: int) -> list[dict[str, Any]]:
        return [_g("tp", r // 2, r % 2, 2, 0.01, 0.1), _g("dp", r % 2, r // 2, 2, 0.2, 0.03)]
    found = diagnose(window(groups=groups, meta={"env": {"NCCL_ALGO": "Tree"},
                                                 "layout": {"strategy": "fsdp2", "mesh": {"dp": 2, "tp": 2}}}))
    assert keys(found, "exposed_comm", "straggler", "data_starvation") == [("exposed_comm", "r")]
    d = next(d for d in found if d.kind == "exposed_comm")
    assert d.evidence["metrics"]["exposed_share"] == 0.433 and d.severity == "warning"
    assert d.evidence["metrics"]["tp_across_nodes"] == {"index": 0, "hosts": ["node-0", "node-1"]}
    assert "keep tensor parallelism within a node" in d.action and "unset NCCL_ALGO=Tree" in d.action


def test_memory_pressure_advises_what_the_layout_does_not_use_yet() -> None:
    def mem(step: int, r: int, row: dict[str, Any]) -> None:
        total = 80 * 2**30
        row |= {"mem_total_bytes": total, "mem_allocated_bytes": int(total * (0.93 if r == 1 else 0.6)),
                "mem_reserved_bytes": int(total * (0.96 if r == 1 else 0.7))}
    layout = {"zero_stage": 1, "activation_checkpointing": True, "micro_batch": 4, "grad_accum": 2, "offload": False}
    found = diagnose(window(extra=mem, meta={"layout": layout}))
    assert keys(found) == [("memory_pressure", "r/rank1")]
    action = found[0].action
    assert "halve the micro-batch (4→2) and double gradient accumulation (2→4)" in action
    assert "ZeRO-3 / FSDP FULL_SHARD (now stage 1)" in action and "offload optimizer state" in action
    assert "activation checkpointing" not in action
    assert "already uses" in memory_advice({"zero_stage": 3, "activation_checkpointing": True, "micro_batch": 1,
                                            "offload": True})


# -- loss spikes --------------------------------------------------------------------------------------------------

def _loss_run(spike_at: int | None, ecc: bool) -> WindowBuffer:
    buf = WindowBuffer()
    rng = np.random.default_rng(1)
    steps, last = [], T0 + STEP * 80
    for s in range(80):
        loss = 2.0 - 0.002 * s + rng.normal(0, 0.01)
        steps.append({"run": "r", "rank": 0, "step": s, "ts": T0 + STEP * (s + 1), "step_time_s": STEP,
                      "metrics": {"loss": 5.0 if s == spike_at else loss}})
    buf.add({"host": "node-0", "sent_at": last, "steps": steps,
             "runs": [{"run": "r", "rank": 0, "world_size": 1, "ts": T0, "host": "node-0", "gpu_index": 3}]})
    gpus = [{"index": 3, "ts": last - 10 + k, "util_gpu_pct": 95.0, "sm_clock_mhz": 1980.0, "sm_clock_max_mhz": 1980.0,
             "ecc_sbe_volatile": (100 + (31 if ecc and k >= 6 else 0)), "ecc_dbe_volatile": 0} for k in range(10)]
    buf.add({"host": "node-0", "sent_at": last, "gpus": gpus})
    return buf


def test_a_loss_spike_with_corrected_ecc_errors_names_both() -> None:
    found = run_all(_loss_run(77, ecc=True).window(T0 + STEP * 80 + 0.2))
    spike = [d for d in found if d.kind == "loss_spike"]
    assert [d.subject for d in spike] == ["r/step77"]
    d = spike[0]
    assert d.title == "Loss spike at step 77 coincides with 31 corrected ECC errors on node-0/gpu3"
    assert (d.severity, d.node, d.gpu_index, d.rank) == ("warning", "node-0", 3, 0)
    assert d.evidence["series"]["loss"]["spike_step"] == 77


def test_a_plain_loss_spike_is_info_and_a_smooth_loss_is_nothing() -> None:
    found = [d for d in run_all(_loss_run(77, ecc=False).window(T0 + STEP * 80 + 0.2)) if d.kind == "loss_spike"]
    assert [(d.subject, d.severity) for d in found] == [("r/step77", "info")]
    assert [d for d in run_all(_loss_run(None, ecc=True).window(T0 + STEP * 80 + 0.2)) if d.kind == "loss_spike"] == []


def test_two_of_four_late_in_one_data_parallel_group_are_both_named() -> None:
    def groups(step: int, r: int) -> list[dict[str, Any]]:
        late = r in (1, 3)
        return [_g("dp", 0, r, 4, 0.28 if late else 0.2, 0.0 if late else 0.08)]
    found = diagnose(window(data={1: 0.08, 3: 0.08}, groups=groups))
    assert keys(found) == [("data_starvation", "r/rank1"), ("data_starvation", "r/rank3")]
    assert {d.evidence["metrics"]["role"] for d in found} == {"dp"}


# -- goodput ------------------------------------------------------------------------------------------------------

def test_goodput_counts_stalls_checkpoints_restarts_and_replayed_steps() -> None:
    from dashboard.diagnosis.detectors.goodput import Goodput, fold

    g = Goodput()
    rows = [(s, 10.0 + s, 1.0) for s in range(10)]  # steps 0-9 back to back, 1 s each (ends 10..19)
    rows.append((10, 25.0, 1.0))  # a 5 s gap after step 9, which saved a checkpoint
    rows.append((11, 36.0, 1.0))  # a 10 s stall
    rows.append((12, 40.0, 4.0))  # a slow step: 1 s beyond 3x the median is stall
    rows += [(s, 60.0 + s - 9, 1.0) for s in (9, 10, 11, 12)]  # restart after 16 s, resuming at step 9
    assert fold(g, rows, checkpoint_steps={9}) == [*range(13), 9, 10, 11, 12]
    assert fold(g, [(12, 63.05, 1.0)], set()) == [], "a late rank's row of a folded step is not a replay"
    assert g.checkpoint_s == pytest.approx(5.0) and g.restart_s == pytest.approx(19.0)
    assert g.replayed_s == pytest.approx(1 + 1 + 1 + 3) and g.restarts == 1
    assert g.stall_s == pytest.approx(10.0 + 1.0)
    assert g.wall_s == pytest.approx(63.0 - 9.0)
    assert g.productive_s == pytest.approx(g.wall_s - g.stall_s - g.checkpoint_s - g.restart_s - g.replayed_s)
    assert g.goodput == pytest.approx(13.0 / 54.0)


# -- efficiency ---------------------------------------------------------------------------------------------------

# Four ranks of 4,096 tokens a 0.3 s step, 7.32e5 FLOPs a token on a 1 TFLOP/s GPU: 1.0 % MFU, under the 2 % floor.
LOW_MFU = {"flops_per_token": 732_000, "peak_flops": 1e12}


def test_a_run_under_the_mfu_floor_is_found_once_its_whole_world_reports() -> None:
    [d] = [d for d in diagnose(window(meta=LOW_MFU)) if d.kind == "efficiency"]
    assert d.evidence["metrics"]["mfu"] == pytest.approx(0.01, abs=1e-4) and d.evidence["metrics"]["ranks"] == 4


def test_an_efficiency_figure_over_part_of_the_world_is_no_finding() -> None:
    """Four of a 32-rank world reported (a starting run, or nodes that post every few seconds): their tokens over the
    whole world's peak read as 0.12 % MFU, which says nothing about the run."""
    assert not [d for d in diagnose(window(meta={**LOW_MFU, "world_size": 32})) if d.kind == "efficiency"]
