"""How much the training hooks add to a step, against a bare loop and against Lightning's ThroughputMonitor.

    .venv/bin/python benchmarks/hooks.py [--steps 20000] [--rounds 5] [--work-us 50] [--collectives 3000] [--json]

1. Plain loop. The same loop bare, with the two lines (``mon.loader`` + ``mon.step``), and fully dressed
   (plus two phases and ``mon.log(loss=...)``), in interleaved rounds so drift hits all three alike. A step is
   ``--work-us`` of busy Python work. Per-step times come from consecutive clock reads; the overhead is the
   difference of the p50, p99, mean and mean99 (the mean of the fastest 99%) against the bare loop. The Monitor
   ships for real: over UDP to a socket that stands in for the agent, so the background thread's JSON encoding
   competes for the GIL as it would.
2. Inside a real ``lightning.Trainer`` run on the CPU, ThroughputMonitor and our LightningCallback side by side in
   the same run: each is wrapped by a probe that times every hook call it gets (less the probe's own cost,
   measured on an empty callback), summed per training step.

3. Collectives, per path (a one-rank gloo group in this process, so the numbers are the hooks' own cost, not a
   network's): a synchronous ``dist.all_reduce`` (DDP's Python hook, hand-written calls), an async one and its
   ``wait`` (FSDP, pipelining's P2P take the same wrapper), FSDP's ``all_gather_single`` + ``reduce_scatter_single``
   pair, and the functional all-reduce + ``wait_tensor`` DTensor issues; each untraced (tracer uninstalled),
   installed but outside a step (the wrapper's pass-through), and timed inside a step. Then the shipping thread's
   cost of turning one step's calls into ``groups`` (``as_record``), per step and per collective.

On CUDA ThroughputMonitor also calls ``torch.cuda.synchronize()`` every step; the hooks never do. This CPU
benchmark cannot show that difference, only the Python cost.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer_hooks import Monitor

ns = time.perf_counter_ns


def busy(us: float) -> Callable[[], None]:
    """A step's worth of Python work that neither sleeps nor releases the GIL."""
    ns_budget = int(us * 1000)

    def work() -> None:
        end = ns() + ns_budget
        while ns() < end:
            pass

    return work


def bare_loop(steps: int, work: Callable[[], None]) -> list[int]:
    stamps = [0] * steps
    for i in range(steps):
        work()
        stamps[i] = ns()
    return stamps


def monitor_loop(mon: Monitor, steps: int, work: Callable[[], None], full: bool) -> list[int]:
    stamps = [0] * steps
    for i in mon.loader(range(steps)):
        with mon.step(tokens=4096, samples=8):
            if full:
                with mon.phase("forward"):
                    work()
                with mon.phase("backward"):
                    pass
                mon.log(loss=1.25)
            else:
                work()
        stamps[i] = ns()
    return stamps


def per_step_us(stamps: list[int]) -> list[float]:
    return [(b - a) / 1000 for a, b in itertools.pairwise(stamps)]


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    # The trimmed mean leaves out the slowest 1%: on a shared machine those are other people's processes.
    return {"p50": ordered[len(ordered) // 2], "p99": ordered[int(len(ordered) * 0.99)],
            "mean": statistics.fmean(ordered), "mean99": statistics.fmean(ordered[: int(len(ordered) * 0.99)])}


def plain(steps: int, rounds: int, work_us: float) -> dict[str, Any]:
    mon = Monitor(run="bench", queue_size=100_000)
    work = busy(work_us)
    times: dict[str, list[float]] = {"bare": [], "two lines": [], "full": []}
    monitor_loop(mon, 2000, work, full=True)  # warm-up: first-step metadata, thread start
    for _ in range(rounds):
        times["bare"] += per_step_us(bare_loop(steps, work))
        times["two lines"] += per_step_us(monitor_loop(mon, steps, work, full=False))
        times["full"] += per_step_us(monitor_loop(mon, steps, work, full=True))
    mon.close()
    stats = {name: summary(values) for name, values in times.items()}
    base = stats["bare"]
    overhead = {name: {k: s[k] - base[k] for k in s} for name, s in stats.items() if name != "bare"}
    return {"per_step_us": stats, "overhead_us": overhead, "dropped": mon.stats()["dropped"],
            "steps": steps * rounds, "work_us": work_us}


def lightning_side_by_side(steps: int) -> dict[str, Any]:
    import lightning
    import torch
    from lightning.pytorch.callbacks import Callback, ThroughputMonitor

    from trainer_hooks import LightningCallback

    class Probe(Callback):
        """Forwards every hook to ``inner`` and sums the time the inner callback takes per training step."""

        def __init__(self, inner: Callback) -> None:
            self.inner, self.per_step, self._acc = inner, [], 0
            for name in ("setup", "on_train_start", "on_train_epoch_start", "on_train_batch_start",
                         "on_train_batch_end", "on_save_checkpoint", "teardown"):
                setattr(self, name, self._timed(getattr(inner, name), name == "on_train_batch_end"))

        def _timed(self, hook: Callable[..., Any], closes_step: bool) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                start = ns()
                result = hook(*args, **kwargs)
                self._acc += ns() - start
                if closes_step:
                    self.per_step.append(self._acc / 1000)
                    self._acc = 0
                return result

            return call

    class Tiny(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    probes = {"empty callback (probe cost)": Probe(Callback()),
              "ThroughputMonitor": Probe(ThroughputMonitor(batch_size_fn=lambda b: b[0].shape[0])),
              "trainer_hooks.LightningCallback": Probe(LightningCallback(run="bench-pl", queue_size=100_000))}
    data = torch.utils.data.TensorDataset(torch.randn(steps * 2, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    trainer = lightning.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                log_every_n_steps=50, callbacks=list(probes.values()))
    started = time.perf_counter()
    trainer.fit(Tiny(), loader)
    wall = time.perf_counter() - started
    probes["trainer_hooks.LightningCallback"].inner.monitor.close()
    probe_cost = summary(probes["empty callback (probe cost)"].per_step[100:])
    out = {name: {k: v - probe_cost[k] for k, v in summary(p.per_step[100:]).items()}
           for name, p in probes.items() if not name.startswith("empty")}
    return {"per_step_us": out, "probe_cost_us": probe_cost, "steps": steps, "trainer_step_us": wall / steps * 1e6}


def collectives(calls: int, rounds: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from trainer_hooks.collectives import TRACER
    from trainer_hooks.timing import StepTimer

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    sock.close()
    dist.init_process_group("gloo", rank=0, world_size=1)
    world = dist.group.WORLD
    t, big, out = torch.ones(256), torch.ones(1024), torch.empty(1024)

    def sync() -> None:
        dist.all_reduce(t)

    def async_wait() -> None:
        dist.all_reduce(t, async_op=True).wait()

    def fsdp_pair() -> None:
        dist.all_gather_single(out, big, async_op=True).wait()
        dist.reduce_scatter_single(big, out, async_op=True).wait()

    def functional() -> None:
        funcol.all_reduce(t, "sum", world).wait()

    paths = {"sync all_reduce": (sync, 1), "async all_reduce + wait": (async_wait, 1),
             "FSDP all_gather + reduce_scatter": (fsdp_pair, 2), "functional all_reduce (DTensor)": (functional, 1)}
    kept: list[Any] = []
    timer = StepTimer("bench", 0, kept.append)
    per_call: dict[str, dict[str, list[float]]] = {n: {"untraced": [], "installed": [], "timed": []} for n in paths}
    for _ in range(rounds):
        for name, (fn, n) in paths.items():
            for mode in ("untraced", "installed", "timed"):
                if mode == "untraced":
                    TRACER.uninstall()
                else:
                    TRACER.install()
                    TRACER.timer = timer
                if mode == "timed":
                    timer.begin()
                start = ns()
                for _ in range(calls):
                    fn()
                per_call[name][mode].append((ns() - start) / 1000 / calls / n)
                if mode == "timed":
                    timer.end()
                    timer.poll()
    # The shipping thread's work for a step with 64 timed collectives in two groups.
    timer.begin()
    for _ in range(32):
        async_wait()
        functional()
    timer.end()
    timer.poll()
    step = kept.pop()
    record_us = []
    for _ in range(200):
        start = ns()
        timer._timings(step, {})
        record_us.append((ns() - start) / 1000)
    TRACER.uninstall()
    dist.destroy_process_group()
    med = {name: {mode: statistics.median(v) for mode, v in modes.items()} for name, modes in per_call.items()}
    return {"per_call_us": med, "record_us_per_step": statistics.median(record_us), "record_calls": 64,
            "calls": calls, "rounds": rounds}


def print_report(result: dict[str, Any]) -> None:
    p = result["plain"]
    print(f"Plain loop: {p['steps']} steps of {p['work_us']:g} µs busy work, interleaved rounds")
    print(f"  {'':12} {'p50 µs':>10} {'p99 µs':>10} {'mean µs':>10} {'mean99 µs':>10}")
    for name, s in p["per_step_us"].items():
        print(f"  {name:12} {s['p50']:10.2f} {s['p99']:10.2f} {s['mean']:10.2f} {s['mean99']:10.2f}")
    for name, s in p["overhead_us"].items():
        ratio = p["per_step_us"][name]["mean99"] / p["per_step_us"]["bare"]["mean99"]
        print(f"  overhead, {name:10}: p50 {s['p50']:+.2f} µs  p99 {s['p99']:+.2f} µs  mean {s['mean']:+.2f} µs"
              f"  mean99 {s['mean99']:+.2f} µs  (mean99 ratio to bare {ratio:.3f})")
    print(f"  records dropped: {p['dropped'] or 'none'}")
    lt = result.get("lightning")
    if lt:
        print(f"Lightning Trainer, {lt['steps']} steps side by side (a Trainer step here: "
              f"{lt['trainer_step_us']:.0f} µs; probe cost {lt['probe_cost_us']['p50']:.2f} µs subtracted)")
        for name, s in lt["per_step_us"].items():
            print(f"  {name:32} p50 {s['p50']:6.2f} µs  p99 {s['p99']:7.2f} µs  mean {s['mean']:6.2f} µs"
                  f"  mean99 {s['mean99']:6.2f} µs per step")
        ours, theirs = (lt["per_step_us"][k] for k in ("trainer_hooks.LightningCallback", "ThroughputMonitor"))
        print(f"  ours / ThroughputMonitor: p50 {ours['p50'] / theirs['p50']:.2f}, "
              f"mean {ours['mean'] / theirs['mean']:.2f}, mean99 {ours['mean99'] / theirs['mean99']:.2f}")
    co = result.get("collectives")
    if co:
        print(f"Collectives on a one-rank gloo group, median of {co['rounds']} rounds of {co['calls']} (µs per collective)")
        print(f"  {'':34} {'untraced':>9} {'installed':>10} {'timed':>9} {'added':>8} {'ratio':>6}")
        for name, m in co["per_call_us"].items():
            print(f"  {name:34} {m['untraced']:9.2f} {m['installed']:10.2f} {m['timed']:9.2f}"
                  f" {m['timed'] - m['untraced']:+8.2f} {m['timed'] / m['untraced']:6.2f}")
        per = co["record_us_per_step"]
        print(f"  groups of a step with {co['record_calls']} collectives, built on the shipping thread: {per:.0f} µs"
              f" per step, {per / co['record_calls']:.2f} µs per collective")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000, help="steps per variant and round (plain loop)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work-us", type=float, default=50.0, help="busy work per step, µs")
    parser.add_argument("--lightning-steps", type=int, default=3000, help="0 skips the Lightning comparison")
    parser.add_argument("--collectives", type=int, default=3000, help="calls per path and round; 0 skips them")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = parser.parse_args()
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # the agent's stand-in: bound, never read
    sink.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    sink.bind(("127.0.0.1", 0))
    os.environ["CLUSTERDX_AGENT_ADDR"] = f"127.0.0.1:{sink.getsockname()[1]}"
    result: dict[str, Any] = {"plain": plain(args.steps, args.rounds, args.work_us)}
    if args.lightning_steps:
        result["lightning"] = lightning_side_by_side(args.lightning_steps)
    if args.collectives:
        result["collectives"] = collectives(args.collectives, 5)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_report(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
