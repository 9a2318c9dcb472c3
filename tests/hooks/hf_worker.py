"""One rank of the HF Trainer + DDP test, started the way torchrun starts it (RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    python hf_worker.py <result.json> <steps>

Trains a tiny model twice from the same seed, without and with the HFCallback (accelerate wraps it in DDP over gloo),
and writes to <result.json>.<rank> whether the parameters came out bitwise equal, and whether a comm hook already on
a DDP model is left in place. The monitored run's records go to CLUSTERDX_AGENT_ADDR like a real run's.
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch
import transformers
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from trainer_hooks import HFCallback, Monitor


class TinyConfig(transformers.PretrainedConfig):
    model_type = "clusterdx-tiny-ddp"

    def __init__(self, width: int = 8, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.width = width


class TinyModel(transformers.PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.layer = torch.nn.Linear(config.width, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.layer(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def train(steps: int, callbacks: list) -> tuple[TinyModel, transformers.Trainer]:
    torch.manual_seed(0)
    model = TinyModel(TinyConfig())
    gen = torch.Generator().manual_seed(1)  # the same data on every rank: the sampler gives each rank its shard
    data = [{"x": torch.randn(8, generator=gen), "labels": torch.randn(1, generator=gen)} for _ in range(steps * 8)]
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), max_steps=steps, per_device_train_batch_size=4, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train()
    return model, trainer


def main() -> None:
    result_path, steps = sys.argv[1], int(sys.argv[2])
    plain, _ = train(steps, [])
    callback = HFCallback(monitor=Monitor(interval=0.05))
    monitored, trainer = train(steps, [callback])
    callback.monitor.close()
    wrapped = trainer.model_wrapped
    # A DDP model whose owner registered a hook of their own: the callback must keep theirs (DDP takes only one).
    theirs = DistributedDataParallel(TinyModel(TinyConfig()))
    theirs.register_comm_hook(None, allreduce_hook)
    callback._time_ddp(theirs)
    torch.manual_seed(0)
    initial = TinyModel(TinyConfig()).layer.weight
    verdict = {
        "ddp": isinstance(wrapped, DistributedDataParallel),
        "hooked": [h.__name__ for h, _ in getattr(wrapped, "_comm_hooks", [])],
        "theirs_kept": [h.__name__ for h, _ in theirs._comm_hooks],
        "bitwise": all(torch.equal(a, b) for a, b in zip(plain.parameters(), monitored.parameters(), strict=True)),
        "trained": not torch.equal(monitored.layer.weight, initial),
    }
    with open(f"{result_path}.{trainer.args.process_index}", "w") as fh:
        json.dump(verdict, fh)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
