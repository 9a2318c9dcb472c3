"""A gloo rank whose worker thread still holds a Python callback when the main thread is done: the callback's
closure keeps an object whose release waits 1 s with the GIL free, as a descheduled gloo thread would.

    python late_release_worker.py finalize|exit
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.gloo_exit import exit_without_finalizing


class ReleasedLate:
    def __del__(self) -> None:
        time.sleep(1.0)  # long past the main thread's exit, even on loaded cores


def hook(state, bucket):  # not annotated: DDP accepts only its own classes in a hook's annotations
    held = ReleasedLate()

    def done(fut):
        _ = held  # kept by the closure: released with the callback, on gloo's thread
        return fut.value()

    return allreduce_hook(state, bucket).then(done)


def main() -> None:
    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(8, 1))
    model.register_comm_hook(None, hook)
    model(torch.randn(4, 8)).sum().backward()
    dist.destroy_process_group()
    print("trained", flush=True)
    if sys.argv[1] == "exit":
        exit_without_finalizing()


if __name__ == "__main__":
    main()
