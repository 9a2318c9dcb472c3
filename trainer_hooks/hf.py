"""Hugging Face adapter: a ``TrainerCallback`` that drives a :class:`~trainer_hooks.Monitor`
(``pip install transformers``).

    trainer = Trainer(..., callbacks=[HFCallback(run="my-run")])

One step is one optimizer step (all its gradient-accumulation micro-batches). The Trainer fetches a step's batches
just before ``on_step_begin``, so the time since the previous ``on_step_end`` is the data wait. Loss and grad norm
come from the Trainer's logs (every ``logging_steps``); tokens from ``num_input_tokens_seen`` when the Trainer
counts them (``include_num_input_tokens_seen``).

Under DDP (accelerate wraps the model in ``DistributedDataParallel``) the callback times the gradient all-reduces with
the Monitor's comm hook, registered on the Trainer's wrapped model when training begins: DDP's reducer issues them
from C++, where the process-group timing cannot see them wait. A comm hook already there (yours, or accelerate's
``DistributedDataParallelKwargs(comm_hook=...)``) is left alone: DDP takes only one.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as exc:
    raise ImportError("trainer_hooks.HFCallback needs transformers: pip install transformers") from exc

from trainer_hooks import layout
from trainer_hooks.monitor import Monitor

_LOGGED = ("loss", "grad_norm", "learning_rate")
log = logging.getLogger("trainer_hooks")


class HFCallback(TrainerCallback):
    def __init__(self, monitor: Monitor | None = None, **monitor_kwargs: Any) -> None:
        self.monitor = monitor or Monitor(**monitor_kwargs)
        self._tokens_seen = 0
        self._hooked: weakref.WeakSet[Any] = weakref.WeakSet()  # DDP models that carry our hook: one per model

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.monitor.set_identity(args.process_index, args.world_size, args.local_process_index)
        self.monitor.set_dtype("bf16" if args.bf16 else "fp16" if args.fp16 else None)
        self.monitor.watch(model)
        self.monitor.watch_loader(kwargs.get("train_dataloader"))
        self.monitor.set_layout(**layout.from_hf(args))
        self._time_ddp(_wrapped_model(model))
        self.monitor.timer.step = state.global_step
        self._tokens_seen = state.num_input_tokens_seen or 0
        self.monitor.timer.fetch_begin()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.monitor.timer.fetch_end()
        samples = args.per_device_train_batch_size * args.gradient_accumulation_steps
        self.monitor.begin_step(step=state.global_step, samples=samples)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        seen = state.num_input_tokens_seen or 0
        tokens, self._tokens_seen = seen - self._tokens_seen, seen
        self.monitor.end_step(tokens=tokens if tokens > 0 else None)
        self.monitor.timer.fetch_begin()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        values = {k: logs[k] for k in _LOGGED if logs and isinstance(logs.get(k), int | float)}
        if values:
            self.monitor.log(**values)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.monitor.checkpoint_saved(state.global_step, path=f"{args.output_dir}/checkpoint-{state.global_step}")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.monitor.flush()

    def _time_ddp(self, wrapped: Any) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(wrapped, DistributedDataParallel) or wrapped in self._hooked:
            return
        self._hooked.add(wrapped)  # checked once per model, so the warning below is not repeated every train()
        existing = wrapped._get_ddp_logging_data().get("comm_hook") or (wrapped._comm_hooks and "a Python hook")
        if existing:
            log.warning("trainer_hooks: the DDP model already has a comm hook (%s), kept: DDP takes only one, so the "
                        "callback's hook does not time the gradient all-reduces", existing)
            return
        try:
            self.monitor.ddp_comm_hook(wrapped)
        except RuntimeError as exc:  # DDP refused it (a hook set where the checks above cannot see): training goes on
            log.warning("trainer_hooks: could not register the timing comm hook on the DDP model: %s", exc)


def _wrapped_model(model: Any) -> Any:
    """The Trainer's ``model_wrapped`` (DDP, FSDP, DeepSpeed engine) for ``model``, or None.

    Callbacks are handed the unwrapped model only, and no reference to the Trainer; ``on_train_begin`` is called from
    inside ``Trainer.train``, after accelerate wrapped the model, so the Trainer is found on the call stack."""
    from transformers import Trainer

    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer) and (model is None or owner.model is model):
                return getattr(owner, "model_wrapped", None)
            frame = frame.f_back
    finally:
        del frame  # a frame held in a local keeps every frame above it alive
    return None
