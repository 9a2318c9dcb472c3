"""Hugging Face adapter: a ``TrainerCallback`` that drives a :class:`~trainer_hooks.Monitor`
(``pip install transformers``).

    trainer = Trainer(..., callbacks=[HFCallback(run="my-run")])

One step is one optimizer step (all its gradient-accumulation micro-batches). The Trainer fetches a step's batches
just before ``on_step_begin``, so the time since the previous ``on_step_end`` is the data wait. Loss and grad norm
come from the Trainer's logs (every ``logging_steps``); tokens from ``num_input_tokens_seen`` when the Trainer
counts them (``include_num_input_tokens_seen``).
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as exc:
    raise ImportError("trainer_hooks.HFCallback needs transformers: pip install transformers") from exc

from trainer_hooks import layout
from trainer_hooks.monitor import Monitor

_LOGGED = ("loss", "grad_norm", "learning_rate")


class HFCallback(TrainerCallback):
    def __init__(self, monitor: Monitor | None = None, **monitor_kwargs: Any) -> None:
        self.monitor = monitor or Monitor(**monitor_kwargs)
        self._tokens_seen = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.monitor.set_identity(args.process_index, args.world_size, args.local_process_index)
        self.monitor.set_dtype("bf16" if args.bf16 else "fp16" if args.fp16 else None)
        self.monitor.watch(model)
        self.monitor.watch_loader(kwargs.get("train_dataloader"))
        self.monitor.set_layout(**layout.from_hf(args))
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
