"""One rank of the DDP tests, started the way torchrun starts it (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the env).

    python ddp_worker.py <result.json> <slow_data_rank> <slow_compute_rank> <delay_s> <steps>

First checks that gradients with the timing comm hook are bitwise those of plain DDP, then trains with the
Monitor; the records go to CLUSTERDX_AGENT_ADDR like a real run's. The verdict of the gradient check is written
to <result.json>.<rank>.
"""

from __future__ import annotations

import copy
import json
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.gloo_exit import exit_without_finalizing
from trainer_hooks import Monitor, StepTimer
from trainer_hooks.ddp import register_comm_hook


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 1))


def gradients_match(rank: int) -> dict[str, object]:
    base = model()
    plain = DDP(copy.deepcopy(base))
    # A tiny bucket cap gives several buckets, hence several timed all-reduces per step.
    hooked = DDP(copy.deepcopy(base), bucket_cap_mb=0.01)
    records: list[dict[str, object]] = []
    timer = StepTimer("grad-check", rank, lambda step: records.append(step.as_record()))
    register_comm_hook(hooked, timer)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data, so the all-reduce matters
    x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 1, generator=gen)
    torch.nn.functional.mse_loss(plain(x), y).backward()
    timer.begin()
    torch.nn.functional.mse_loss(hooked(x), y).backward()
    timer.end()
    timer.poll()
    pairs = list(zip(plain.parameters(), hooked.parameters(), strict=True))
    return {
        "bitwise": all(torch.equal(a.grad, b.grad) for a, b in pairs),
        "averaged": not torch.equal(pairs[0][0].grad, _local_grad(base, x, y)),
        "comm_s": records[0].get("comm_s"),
    }


def _local_grad(base: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    local = copy.deepcopy(base)
    torch.nn.functional.mse_loss(local(x), y).backward()
    return next(local.parameters()).grad


def main() -> None:
    result_path, slow_data, slow_compute, delay, steps = sys.argv[1:6]
    slow_data, slow_compute, delay, steps = int(slow_data), int(slow_compute), float(delay), int(steps)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with open(f"{result_path}.{rank}", "w") as fh:
        json.dump(gradients_match(rank), fh)

    def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        if rank == slow_data:
            time.sleep(delay)  # a slow filesystem behind this rank's loader
        return torch.stack([i[0] for i in items]), torch.stack([i[1] for i in items])

    data = torch.utils.data.TensorDataset(torch.randn(steps * 8, 32), torch.randn(steps * 8, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8, collate_fn=collate)
    ddp = DDP(model(), bucket_cap_mb=0.01)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    mon = Monitor(model=ddp, parallel={"tp": 1}, interval=0.05)
    mon.ddp_comm_hook(ddp)
    for x, y in mon.loader(loader):
        with mon.step(samples=len(x)):
            with mon.phase("forward"):
                if rank == slow_compute:
                    time.sleep(delay)  # a slow GPU, or a rank with more work
                loss = torch.nn.functional.mse_loss(ddp(x), y)
            with mon.phase("backward"):
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            mon.log(loss=loss)
        if mon.timer.step == 5 and rank == 0:
            mon.checkpoint_saved()
    mon.close()
    dist.destroy_process_group()
    exit_without_finalizing()


if __name__ == "__main__":
    main()
