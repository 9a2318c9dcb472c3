"""The layout read off real objects (no processes), and the arithmetic that turns a step's collectives into
GroupTiming records: what in flight, exposed and arrival mean, pinned on hand-made marks."""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from trainer_hooks import layout
from trainer_hooks.collectives import Call, GroupInfo, summarize
from trainer_hooks.timing import CpuClock


def test_activation_checkpointing_is_seen_on_wrapped_modules():
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    assert layout.from_model(plain) == {}
    wrapped = torch.nn.Sequential(checkpoint_wrapper(torch.nn.Linear(4, 4)), torch.nn.ReLU())
    assert layout.from_model(wrapped) == {"activation_checkpointing": True}


def test_deepspeed_config_capture():
    # DeepSpeed itself is not run here: 0.19.8 installs (pure Python), but a 2-rank ZeRO-2 job on its CPU
    # accelerator (DS_ACCELERATOR=cpu, gloo) did not get through 3 steps of a 2-layer model in 120 s on this
    # machine. Its collectives are torch.distributed calls, timed like FSDP's; what the hooks read from DeepSpeed
    # itself is its config dict (engine.config, accelerate's deepspeed_plugin.deepspeed_config).
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "none"}},
              "activation_checkpointing": {"partition_activations": True}}
    assert layout.from_deepspeed_config(config) == {
        "strategy": "deepspeed", "zero_stage": 3, "offload": True, "grad_accum": 8, "micro_batch": 4,
        "activation_checkpointing": True}
    auto = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}
    assert layout.from_deepspeed_config(auto) == {"strategy": "deepspeed", "zero_stage": 2, "offload": False}


def call(info: GroupInfo, start: float, end: float | None, waits: list[tuple[float, float]], op: str = "all_reduce",
         nbytes: int = 100) -> Call:
    c = Call(info, op, nbytes, start, None)
    c.end, c.waits = end, waits
    return c


def test_groups_in_flight_exposed_and_arrival():
    tp = GroupInfo("tp", "tp", 1, 2, 0)
    dp = GroupInfo("dp", "dp", 0, 2, 1)
    calls = [
        # TP: two overlapping collectives in flight 0.1-0.4 and 0.3-0.5; the thread waited 0.35-0.5.
        call(tp, 0.1, 0.4, []), call(tp, 0.3, 0.5, [(0.35, 0.5)]),
        # DP: one collective nobody in Python waited for (DDP's reducer): in flight 0.6-0.9, exposure unknown.
        call(dp, 0.6, 0.9, [], nbytes=50),
    ]
    # One more TP wait-less collective would make TP's exposure unknown too; here only the first has none.
    groups, comm, arrive = summarize(calls, CpuClock.seconds, 0.0, 1.0, 0.02, [])
    by_role = {g["role"]: g for g in groups}
    t, d = by_role["tp"], by_role["dp"]
    assert (t["calls"], t["bytes"], t["ops"], t["index"], t["group_rank"]) == (2, 200, {"all_reduce": 2}, 0, 1)
    assert abs(t["inflight_s"] - 0.4) < 1e-9  # the union 0.1-0.5, not 0.3 + 0.2
    assert t["exposed_s"] is None  # its first collective was never waited for in Python
    assert abs(t["arrive_s"] - 0.12) < 1e-9  # the lead (data wait) before the body, plus the first issue
    assert d["exposed_s"] is None and abs(d["inflight_s"] - 0.3) < 1e-9
    # comm_s: the waits seen (0.35-0.5) and the unseen collectives' whole flight (0.1-0.4, 0.6-0.9): 0.1-0.5 + 0.3.
    assert abs(comm - 0.7) < 1e-9 and abs(arrive - 0.12) < 1e-9


def test_exposed_is_the_waits_when_every_collective_was_waited_for():
    pp = GroupInfo("pp", "pp", 0, 2, None)
    calls = [call(pp, 0.1, 0.3, [(0.25, 0.3)], op="send"), call(pp, 0.2, 0.6, [(0.4, 0.6)], op="recv")]
    groups, comm, arrive = summarize(calls, CpuClock.seconds, 0.0, 1.0, 0.0, [(0.8, 0.9)])
    (g,) = groups
    assert g["ops"] == {"send": 1, "recv": 1} and abs(g["inflight_s"] - 0.5) < 1e-9
    assert abs(g["exposed_s"] - 0.25) < 1e-9  # 0.25-0.3 and 0.4-0.6: overlapped compute is not exposed
    assert abs(comm - 0.35) < 1e-9  # plus the span timed by hand (mon.comm()) 0.8-0.9
    assert abs(arrive - 0.1) < 1e-9
