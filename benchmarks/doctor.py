"""Log doctor throughput: MB/s of ``diagnose`` on a large multi-rank NCCL log (goal: >= 50 MB/s on one core).

The log is synthesised the way a 16-node x 8-GPU job with NCCL_DEBUG=INFO writes it: every rank's init, ring and
tree channels over P2P and IB, interleaved, with application lines and a few WARNs mixed in.

    python benchmarks/doctor.py [--mb 200] [--file existing.log]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collectors.doctor import diagnose


def _rank_lines(node: int, gpu: int, rng: random.Random) -> list[str]:
    host, pid = f"gpu-node-{node:03d}", 40000 + node * 8 + gpu
    head = f"{host}:{pid}:{pid + 311} [{gpu}] NCCL INFO "
    rank = node * 8 + gpu
    lines = [
        f"{host}:{pid}:{pid} [{gpu}] NCCL INFO Bootstrap : Using eth0:10.1.{node}.{gpu}<0>",
        f"{host}:{pid}:{pid} [{gpu}] NCCL INFO NCCL_IB_HCA set by environment to mlx5_0,mlx5_1,mlx5_2,mlx5_3",
        f"{host}:{pid}:{pid} [{gpu}] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; "
        f"OOB eth0:10.1.{node}.1<0>",
        head + "Using network IB",
        head + f"comm 0x55d1c{rank:04x} rank {rank} nranks 128 cudaDev {gpu} nvmlDev {gpu} busId {gpu}b000 "
               "commId 0x9c4f3a1b2d - Init START",
    ]
    for ch in range(32):
        peer = (gpu + 1) % 8
        lines.append(head + f"Channel {ch:02d}/0 : {rank}[{gpu}] -> {node * 8 + peer}[{peer}] via P2P/IPC/read")
        if gpu == 7 or rng.random() < 0.2:
            nxt = ((node + 1) % 16) * 8
            lines.append(head + f"Channel {ch:02d}/0 : {rank}[{gpu}] -> {nxt}[0] [send] via NET/IB/{gpu % 4}/GDRDMA")
        lines.append(head + f"Trees [{ch}] {rank + 1}/-1/-1->{rank}->{max(rank - 1, 0)} "
                            f"[{ch + 1}] -1/-1/-1->{rank}->-1")
    lines.append(head + "Connected all rings")
    lines.append(head + f"comm 0x55d1c{rank:04x} rank {rank} nranks 128 cudaDev {gpu} busId {gpu}b000 - Init COMPLETE")
    return lines


def write_log(path: Path, megabytes: int, seed: int = 7) -> int:
    rng = random.Random(seed)
    target = megabytes * 1_000_000
    written = 0
    with path.open("w") as fh:
        while written < target:
            ranks = [_rank_lines(n, g, rng) for n in range(16) for g in range(8)]
            block: list[str] = []
            while any(ranks):  # interleave ranks the way a shared stdout does
                r = rng.randrange(len(ranks))
                if ranks[r]:
                    block.append(ranks[r].pop(0))
                if rng.random() < 0.01:
                    block.append(f"step {rng.randrange(10**6)} loss {rng.random():.4f} lr 3.0e-4 tokens/s 118342")
            if rng.random() < 0.3:
                block.append("gpu-node-003:40024:40335 [0] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion "
                             "from peer 10.1.4.1<40215> with error 12, opcode 0, len 0, vendor err 129 (Recv)")
            text = "\n".join(block) + "\n"
            fh.write(text)
            written += len(text.encode())
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200, help="size of the synthetic log")
    ap.add_argument("--file", type=Path, help="measure this log instead of a synthetic one")
    args = ap.parse_args()
    tmp = None
    if args.file:
        path = args.file
    else:
        fd, name = tempfile.mkstemp(prefix="doctor-bench-", suffix=".log")
        os.close(fd)
        tmp = path = Path(name)
        write_log(path, args.mb)
    size = path.stat().st_size
    try:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        report = diagnose([path])
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        if tmp is not None:
            os.unlink(path)
    mb = size / 1e6
    print(f"log: {mb:.1f} MB, {report.lines} lines, kind={report.kind}, unparsed={report.unparsed_lines}")
    print(f"wall {wall:.2f} s, cpu {cpu:.2f} s -> {mb / wall:.1f} MB/s wall, {mb / cpu:.1f} MB/s per core (goal 50)")
    print(f"verdict: {report.verdict[:160]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
