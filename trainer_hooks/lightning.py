"""Lightning adapter: a ``Callback`` that drives a :class:`~trainer_hooks.Monitor` (``pip install lightning``).

    trainer = Trainer(callbacks=[LightningCallback(run="my-run")])

The time between one batch's end and the next batch's start is the data wait (Lightning fetches the next batch
there). Under DDP the callback times the gradient all-reduces with the comm hook, unless the strategy already
registers a hook of its own (``DDPStrategy(ddp_comm_hook=...)``: DDP takes only one).
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name, still common
    try:
        from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef]
    except ImportError as exc:
        raise ImportError("trainer_hooks.LightningCallback needs Lightning: pip install lightning") from exc

from trainer_hooks import layout
from trainer_hooks.monitor import Monitor, batch_size


class LightningCallback(Callback):
    def __init__(self, monitor: Monitor | None = None, **monitor_kwargs: Any) -> None:
        self.monitor = monitor or Monitor(**monitor_kwargs)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.monitor.set_identity(trainer.global_rank, trainer.world_size, trainer.local_rank)
        self.monitor.set_dtype(trainer.precision)
        self.monitor.watch(pl_module)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.monitor.watch_loader(trainer.train_dataloader)
        self.monitor.timer.step = max(self.monitor.timer.step, trainer.global_step)
        if _is_ddp(trainer.strategy.model) and getattr(trainer.strategy, "_ddp_comm_hook", None) is None:
            self.monitor.ddp_comm_hook(trainer.strategy.model)
        mesh = layout.lightning_mesh(trainer)
        if mesh is not None:
            self.monitor.watch_mesh(mesh)
        self.monitor.watch(trainer.strategy.model or pl_module)  # the wrapped model: FSDP, DTensor parameters
        self.monitor.set_layout(**layout.from_lightning(trainer))
        batch = getattr(trainer.train_dataloader, "batch_size", None)
        if isinstance(batch, int) and batch >= 1:
            self.monitor.set_layout(micro_batch=batch)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.monitor.timer.fetch_begin()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.monitor.timer.fetch_end()
        self.monitor.begin_step(samples=batch_size(batch))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            self.monitor.log(loss=loss)
        self.monitor.end_step()
        self.monitor.timer.fetch_begin()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.monitor.checkpoint_saved(trainer.global_step)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.monitor.flush()


def _is_ddp(model: Any) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)
