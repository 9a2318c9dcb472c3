"""One rank of the parallelism tests (4 gloo ranks, started like torchrun): three short trainings in one process.

    python parallel_worker.py <result.json> <slow_rank> <delay_s> <steps>
    python parallel_worker.py diagnose <delay_s> <steps> <parallelism>:<rank>:<data|compute> ...

1. FSDP2: ``fully_shard`` over a 1-D "dp" mesh of the 4 ranks;
2. tensor parallel over a 2-D mesh dp=2 x tp=2 (ColwiseParallel -> RowwiseParallel), the gradients all-reduced over
   "dp" by a hand-written ``dist.all_reduce``; ``slow_rank`` sleeps ``delay_s`` before its forward;
3. a two-stage pipeline (``torch.distributed.pipelining``, GPipe, 2 micro-batches) over a 2-D mesh dp=2 x pp=2.

Each is run twice from the same initial weights and data: without the collective tracer (uninstalled) and with a
Monitor timing every collective; the parameters after both must be bitwise equal. Records go to
CLUSTERDX_AGENT_ADDR (runs par-fsdp2, par-tp, par-pp); verdicts to <result.json>.<rank>.

``diagnose`` runs each scenario once, with the Monitor only, under the run name ``dx-<parallelism>-<rank>-<kind>``:
that rank's loader (``data``) or its compute sleeps ``delay_s`` every step; records go wherever the CLUSTERDX_*
environment sends them (the diagnosis end-to-end test: the real ingest endpoint).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.gloo_exit import exit_without_finalizing
from trainer_hooks import Monitor
from trainer_hooks.collectives import TRACER

Train = Callable[[Monitor | None], list[torch.Tensor]]
Slow = tuple[int, str, float] | None  # (rank, "data" | "compute", seconds), applied only to a timed (Monitor) run


def mlp(width: int = 16) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width * 2), torch.nn.ReLU(), torch.nn.Linear(width * 2, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, width))


def batches(seed: int, steps: int, n: int = 8, width: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, width, generator=gen), torch.randn(n, width, generator=gen)) for _ in range(steps)]


def feed(mon: Monitor | None, items: list[tuple[torch.Tensor, torch.Tensor]], rank: int, slow: Slow) -> Iterable[Any]:
    """The batches through the Monitor's loader (so every rank reports its data wait); the slow rank's loader sleeps."""
    if mon is None:
        return items

    def load() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for item in items:
            if slow is not None and slow[1] == "data" and rank == slow[0]:
                time.sleep(slow[2])  # a slow filesystem behind this rank's loader
            yield item

    return mon.loader(load())


def work(mon: Monitor | None, rank: int, slow: Slow) -> None:
    if mon is not None and slow is not None and slow[1] == "compute" and rank == slow[0]:
        time.sleep(slow[2])  # a slow GPU, or a rank with more work


def local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.to_local().detach().clone() if hasattr(t, "to_local") else t.detach().clone() for t in tensors]


def fsdp2(rank: int, steps: int, slow: Slow = None) -> Train:
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))

    def train(mon: Monitor | None) -> list[torch.Tensor]:
        model = mlp()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        if mon is not None:
            mon.watch(model)
        for x, y in feed(mon, batches(10 + rank, steps), rank, slow):
            with mon.step(samples=len(x)) if mon else _null():
                work(mon, rank, slow)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
        return local(list(model.parameters()))

    return train


def tensor_parallel(rank: int, steps: int, slow: Slow = None) -> Train:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_group("dp")
    replica = mesh.get_coordinate()[0]

    def train(mon: Monitor | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        if mon is not None:
            mon.watch(model)
        # One batch per DP replica, the same on both of its TP ranks.
        for x, y in feed(mon, batches(20 + replica, steps), rank, slow):
            with mon.step(samples=len(x)) if mon else _null():
                work(mon, rank, slow)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                for p in model.parameters():  # data parallel by hand: a collective no wrapper issued
                    dist.all_reduce(p.grad.to_local(), group=dp)
                opt.step()
                opt.zero_grad()
        return local(list(model.parameters()))

    return train


def pipeline(rank: int, steps: int, slow: Slow = None) -> Train:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica, stage_index = mesh.get_coordinate()
    dp = mesh.get_group("dp")

    def train(mon: Monitor | None) -> list[torch.Tensor]:
        full = mlp()
        part = full[:2] if stage_index == 0 else full[2:]
        stage = PipelineStage(part, stage_index, 2, torch.device("cpu"), group=mesh.get_group("pp"))
        schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=torch.nn.functional.mse_loss)
        opt = torch.optim.SGD(part.parameters(), lr=0.05)
        if mon is not None:
            mon.watch(part)
            mon.watch_mesh(mesh)
            mon.watch_pipeline(schedule)
        for x, y in feed(mon, batches(30 + replica, steps), rank, slow):
            with mon.step(samples=len(x)) if mon else _null():
                work(mon, rank, slow)
                if stage_index == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=y)
                for p in part.parameters():
                    dist.all_reduce(p.grad, group=dp)
                opt.step()
                opt.zero_grad()
        return local(list(part.parameters()))

    return train


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def compare(name: str, train: Train, rank: int) -> dict[str, object]:
    TRACER.uninstall()
    plain = train(None)
    mon = Monitor(run=f"par-{name}", interval=0.05)
    timed = train(mon)
    mon.close()
    return {"bitwise": len(plain) == len(timed) and all(torch.equal(a, b) for a, b in zip(plain, timed, strict=True)),
            "installed": bool(TRACER._saved), "params": len(plain)}


def diagnose(delay: float, steps: int, scenarios: list[str]) -> None:
    rank = dist.get_rank()
    builds = {"fsdp2": fsdp2, "tp": tensor_parallel, "pp": pipeline}
    for scenario in scenarios:
        name, slow_rank, kind = scenario.split(":")
        train = builds[name](rank, steps, (int(slow_rank), kind, delay))
        mon = Monitor(run=f"dx-{name}-{slow_rank}-{kind}", interval=0.05)
        train(mon)
        mon.close(timeout=10)


def main() -> None:
    if sys.argv[1] == "diagnose":
        dist.init_process_group("gloo")
        diagnose(float(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
        dist.destroy_process_group()
        return
    result_path, slow_rank, delay, steps = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    verdicts = {
        "fsdp2": compare("fsdp2", fsdp2(rank, steps), rank),
        "tp": compare("tp", tensor_parallel(rank, steps, (slow_rank, "compute", delay)), rank),
        "pp": compare("pp", pipeline(rank, steps), rank),
    }
    with open(f"{result_path}.{rank}", "w") as fh:
        json.dump(verdicts, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalizing()
