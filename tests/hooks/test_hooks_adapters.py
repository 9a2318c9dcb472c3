"""The Lightning and HF Trainer adapters on tiny CPU models built here (nothing downloaded): records arrive at the
agent's socket with sensible values. Each loader is slowed a little so data wait has something to show."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch
from hooks_support import free_port, gloo_env, run_ranks, wait_for

from trainer_hooks import Monitor

FETCH_DELAY = 0.03
STEPS = 6


def slow_collate(items: list) -> object:
    time.sleep(FETCH_DELAY)
    return torch.utils.data.default_collate(items)


def check_steps(steps: list[dict], first_step: int = 0) -> None:
    assert [s["step"] for s in steps] == list(range(first_step, first_step + STEPS))
    later = steps[1:]  # the first fetch also starts the iterator
    assert statistics.median(s["data_wait_s"] for s in later) > 0.8 * FETCH_DELAY
    assert all(s["step_time_s"] >= s["data_wait_s"] + s["compute_s"] - 1e-6 for s in steps)
    assert all(0 < s["compute_s"] < 1.0 for s in steps)


def tiny_lightning_module(lightning: object) -> object:
    class Tiny(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Tiny()


def test_the_lightning_callback_reports_steps_loss_and_the_checkpoint(udp_agent, hook_env, tmp_path):
    lightning = pytest.importorskip("lightning")
    from trainer_hooks import LightningCallback

    hook_env.setenv("CLUSTERDX_AGENT_ADDR", udp_agent.addr)
    data = torch.utils.data.TensorDataset(torch.randn(STEPS * 4, 8), torch.randn(STEPS * 4, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4, collate_fn=slow_collate)
    callback = LightningCallback(run="lightning", interval=0.05)
    trainer = lightning.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, precision="bf16-mixed",
                                enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                                callbacks=[callback])
    trainer.fit(tiny_lightning_module(lightning), loader)
    callback.monitor.close()

    assert wait_for(lambda: len(udp_agent.records("steps")) == STEPS and udp_agent.records("events"))
    steps = udp_agent.records("steps")
    check_steps(steps)
    assert all(s["samples"] == 4 and s["metrics"]["loss"] > 0 for s in steps)
    (run,) = udp_agent.records("runs")[:1]
    assert run["params"] == 9 and run["world_size"] == 1 and run["dtype"] == "bf16"
    assert run["dataloader"]["batch_size"] == 4
    assert {k: v for k, v in run["layout"].items() if v is not None} == {
        "strategy": "single", "grad_accum": 1, "micro_batch": 4}
    checkpoint = [e for e in udp_agent.records("events") if e["kind"] == "checkpoint"]
    assert [e["step"] for e in checkpoint] == [STEPS]
    assert udp_agent.records("runs")[-1]["last_checkpoint_step"] == STEPS


def test_the_lightning_callback_times_ddp_all_reduces(udp_agent, hook_env, tmp_path):
    lightning = pytest.importorskip("lightning")
    from trainer_hooks import LightningCallback

    hook_env.setenv("CLUSTERDX_AGENT_ADDR", udp_agent.addr)
    data = torch.utils.data.TensorDataset(torch.randn(STEPS * 4, 8), torch.randn(STEPS * 4, 1))
    callback = LightningCallback(run="lightning-ddp", interval=0.05)
    # One gloo rank in this process: Lightning's real DDPStrategy path, without launching processes.
    trainer = lightning.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, strategy="ddp", logger=False,
                                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                                default_root_dir=tmp_path, callbacks=[callback])
    try:
        trainer.fit(tiny_lightning_module(lightning), torch.utils.data.DataLoader(data, batch_size=4))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    callback.monitor.close()
    assert wait_for(lambda: len(udp_agent.records("steps")) == STEPS)
    steps = udp_agent.records("steps")
    assert all(0 < s["comm_s"] < s["step_time_s"] and s["comm_arrive_s"] is not None for s in steps)
    assert udp_agent.records("runs")[0]["parallel"] == {"dp": 1}
    # The gradient all-reduces, seen at the process group: DDP's group is the data-parallel one. DDP's reducer waits
    # for them in C++, out of the hooks' sight: no exposure is claimed, their time in flight counts as comm_s.
    for s in steps:
        (dp,) = s["groups"]
        assert (dp["role"], dp["group_size"], dp["exposed_s"]) == ("dp", 1, None)
        assert dp["ops"] == {"all_reduce": dp["calls"]} and dp["inflight_s"] > 0
    assert udp_agent.records("runs")[-1]["layout"]["strategy"] == "ddp"


def test_the_hf_callback_reports_steps_loss_grad_norm_and_checkpoints(udp_agent, hook_env, tmp_path):
    transformers = pytest.importorskip("transformers")
    from hf_worker import TinyConfig, TinyModel  # the DDP worker's model: one tiny linear layer

    from trainer_hooks import HFCallback

    class SlowTrainer(transformers.Trainer):
        def get_train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(self.train_dataset, batch_size=4, collate_fn=slow_collate)

    hook_env.setenv("CLUSTERDX_AGENT_ADDR", udp_agent.addr)
    hook_env.setenv("WANDB_DISABLED", "true")
    data = [{"x": torch.randn(8), "labels": torch.randn(1)} for _ in range(STEPS * 4)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, logging_steps=1, save_steps=3,
        report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, save_only_model=True,
    )
    callback = HFCallback(monitor=Monitor(run="hf", interval=0.05))
    trainer = SlowTrainer(model=TinyModel(TinyConfig()), args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    callback.monitor.close()

    assert wait_for(lambda: len(udp_agent.records("steps")) == STEPS and len(udp_agent.records("events")) == 3)
    steps = udp_agent.records("steps")
    check_steps(steps)
    assert all(s["samples"] == 4 for s in steps)
    assert all(s["metrics"]["loss"] > 0 and s["metrics"]["grad_norm"] >= 0 for s in steps)
    run = udp_agent.records("runs")[0]
    assert run["params"] == 9 and run["flops_per_token"] == 54.0 and run["world_size"] == 1
    assert {k: v for k, v in run["layout"].items() if v is not None} == {
        "strategy": "single", "grad_accum": 1, "micro_batch": 4}
    *checkpoints, finished = udp_agent.records("events")
    assert [(e["kind"], e["step"]) for e in checkpoints] == [("checkpoint", 3), ("checkpoint", 6)]
    assert finished["kind"] == "hook" and finished["data"] == {"state": "finished"} and finished["step"] == STEPS - 1
    assert checkpoints[0]["data"]["path"].endswith("checkpoint-3")


def test_the_hf_callback_times_ddp_all_reduces_without_changing_the_parameters(udp_agent, tmp_path):
    pytest.importorskip("transformers")
    world, steps = 2, 4
    result, port = tmp_path / "result.json", free_port()
    # Two real gloo ranks as torchrun starts them: accelerate wraps the model in DistributedDataParallel.
    args = [sys.executable, str(Path(__file__).with_name("hf_worker.py")), str(result), str(steps)]
    run_ranks([(args, gloo_env(rank, world, port, CLUSTERDX_AGENT_ADDR=udp_agent.addr, CLUSTERDX_RUN="hf-ddp",
                               CLUSTERDX_HOOK_BEAT_S="0", WANDB_DISABLED="true")) for rank in range(world)], timeout=120)
    for rank in range(world):
        verdict = json.loads(Path(f"{result}.{rank}").read_text())
        assert verdict == {"ddp": True, "hooked": ["timed_hook"], "theirs_kept": ["allreduce_hook"], "bitwise": True,
                           "trained": True}, (rank, verdict)
    assert wait_for(lambda: len(udp_agent.records("steps")) == world * steps)
    for s in udp_agent.records("steps"):
        assert 0 < s["comm_s"] < s["step_time_s"], s
        (dp,) = s["groups"]
        assert (dp["role"], dp["group_size"]) == ("dp", world) and dp["ops"] == {"all_reduce": dp["calls"]}
    assert {r["layout"]["strategy"] for r in udp_agent.records("runs")} == {"ddp"}
