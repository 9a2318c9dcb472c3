"""One rank of the testbed's training job: gloo DDP on a small model, with ``trainer_hooks.Monitor`` and the timed
comm hook, started inside a node's namespace the way torchrun starts it (RANK, WORLD_SIZE, MASTER_ADDR/PORT, and
CLUSTERDX_AGENT_ADDR / CLUSTERDX_RUN pointing at the node's agent).

    python netns_rank.py --compute-s 0.05 --slow-file DIR/slow-data.rank{rank} [--max-steps N]

A sleep stands in for the GPU's compute (it costs no CPU: the machine has two cores for four ranks and four
agents). While the file ``--slow-file`` names (with this rank filled in) exists, this rank's loader sleeps the
number of seconds it holds before each batch, like a loader behind a slow filesystem: the test slows one rank's
data in the middle of a healthy run. The job runs until the test stops it; ``--max-steps`` only bounds a test
that forgets to.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.gloo_exit import exit_without_finalizing
from trainer_hooks import Monitor


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--compute-s", type=float, default=0.05)
    p.add_argument("--slow-file", default="")
    p.add_argument("--max-steps", type=int, default=5000)
    p.add_argument("--collective-timeout-s", type=float, default=120.0)
    return p.parse_args()


class Batches(torch.utils.data.IterableDataset):
    """Endless random batches of 8, each costing the delay ``slow_file`` holds while it exists."""

    def __init__(self, rank: int, slow_file: str) -> None:
        self.rank, self.slow_file = rank, slow_file

    def __iter__(self):  # type: ignore[no-untyped-def]
        gen = torch.Generator().manual_seed(self.rank)
        while True:
            time.sleep(self._delay())
            yield torch.randn(8, 32, generator=gen), torch.randn(8, 1, generator=gen)

    def _delay(self) -> float:
        if not self.slow_file:
            return 0.0
        try:
            with open(self.slow_file) as fh:
                return float(fh.read() or 0)
        except (OSError, ValueError):
            return 0.0


def realtime(on: bool) -> None:
    """The training loop's thread (this one: the scheduler's pid 0 is the calling thread) at a real-time priority, or
    back to the normal one. The sleep stands in for a GPU's compute, which no host process delays; but on CI's loaded
    cores the rank woke late (a 50 ms step took up to 198 ms beside three busy loops and a browser test; 53 ms under
    SCHED_RR), and a rank was named a straggler in a rate-limit scenario. Only the loop: four ranks importing torch
    at that priority left the server under test beside them no core for 3 s, and a dying rank's teardown would
    hold its agent back. nice -10 where real-time is not allowed (not root)."""
    try:
        if on:
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
        else:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (PermissionError, AttributeError):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, -10 if on else 0)


def main() -> None:
    args = parse()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout_s))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    slow_file = args.slow_file.format(rank=rank)
    loader = torch.utils.data.DataLoader(Batches(rank, slow_file), batch_size=None, num_workers=0)
    mon = Monitor(model=ddp, interval=0.05)
    mon.ddp_comm_hook(ddp)
    realtime(True)
    try:
        for step, (x, y) in enumerate(mon.loader(loader)):
            if step >= args.max_steps:
                break
            with mon.step(samples=len(x)):
                with mon.phase("forward"):
                    time.sleep(args.compute_s)  # the GPU's share of the step
                    loss = torch.nn.functional.mse_loss(ddp(x), y)
                with mon.phase("backward"):
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                mon.log(loss=loss)
            if step == 0:
                print("stepping", flush=True)
    finally:
        realtime(False)  # an error's traceback and the exit at the normal priority
    mon.close()
    dist.barrier()  # gloo can abort at exit when a peer is already gone
    dist.destroy_process_group()
    exit_without_finalizing()


if __name__ == "__main__":
    main()
