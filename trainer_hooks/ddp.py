"""Communication time under DDP: a communication hook that times each gradient bucket's all-reduce.

The hook wraps another hook (torch's ``allreduce_hook`` unless told otherwise) and only adds a clock mark before
it and one when its future completes, so the gradients are exactly what the wrapped hook produces. torch documents
``allreduce_hook`` as equivalent to DDP without a hook; ``tests/hooks`` checks that bitwise.

On CUDA the end mark is an event recorded in the future's callback, which torch runs on a stream that waits for the
collective: the event completes when the all-reduce did, with no host synchronisation. On gloo the callback runs
when the collective finished, on gloo's thread.
"""

from __future__ import annotations

from typing import Any

from trainer_hooks.timing import StepTimer


class TimedHookState:
    """What DDP hands back to :func:`timed_hook` for every bucket."""

    __slots__ = ("hook", "state", "timer")

    def __init__(self, timer: StepTimer, hook: Any, state: Any) -> None:
        self.timer, self.hook, self.state = timer, hook, state


# Deliberately not annotated: DDP inspects a hook's annotations and accepts only the real classes.
def timed_hook(state, bucket):
    timer = state.timer
    if not timer.in_step:  # outside a measured step (validation, a warm-up): pass through untimed
        return state.hook(state.state, bucket)
    token = timer.comm_begin()
    future = state.hook(state.state, bucket)

    def finished(fut):
        timer.comm_end(token)
        return fut.value()

    return future.then(finished)


def register_comm_hook(ddp_model: Any, timer: StepTimer, hook: Any = None, state: Any = None) -> None:
    """Registers :func:`timed_hook` on ``ddp_model`` (a ``DistributedDataParallel``), wrapping ``hook``."""
    if hook is None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        hook = allreduce_hook
    ddp_model.register_comm_hook(TimedHookState(timer, hook, state), timed_hook)
