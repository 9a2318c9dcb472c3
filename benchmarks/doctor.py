"""Log doctor throughput: MB/s of ``diagnose`` on a large multi-rank NCCL log (goal: >= 50 MB/s on one core).

The log is synthesised the way a 16-node x 8-GPU job with NCCL_DEBUG=INFO writes it: every rank's init, ring and
tree channels over P2P and IB, interleaved, with application lines and a few WARNs mixed in.

``--hostile job|ib`` measures a hostile upload instead: lines shaped to make a backtracking regex rescan them
(runs of spaces, dots, digits, repeated "Got completion" / "WorkNCCL(" / " via "), 4 KB and 64 KB long, followed by
a real log. ``--tree DIR`` imports the doctor from another checkout, e.g. the code before a change::

    mkdir /tmp/old && git archive HEAD collectors | tar -x -C /tmp/old
    python benchmarks/doctor.py --hostile job --mb 20 --tree /tmp/old --budget-s 60

A run that exceeds ``--budget-s`` stops and reports the rate over what it had read (an upper bound).

    python benchmarks/doctor.py [--mb 200] [--file existing.log] [--hostile job|ib] [--tree DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if "--tree" in sys.argv:  # before the import below: the doctor is then the other checkout's
    REPO = Path(sys.argv[sys.argv.index("--tree") + 1]).resolve()
sys.path.insert(0, str(REPO))

from collectors.doctor import diagnose  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "logs"


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


def _hostile_lines(kind: str, width: int) -> list[str]:
    n = width - 60
    sp = " " * n
    if kind == "ib":
        return ["a" + sp + "x", "Rate: a" + sp + "x", "State: a" + sp + "x", "SymbolErrorCounter:" + "." * n + " x",
                "active_speed: " + "1" * n, "active_width: " + "1" * n,
                "zz9/ports/1/counters/symbol_error: a" + sp + "x"]
    head = "kp-ddp-worker-0:3468:3905 [4] NCCL "
    return [head + "INFO Using network a" + sp + "x", head + "WARN " + "Got completion with error 1 " * (n // 28),
            head + "INFO Channel 00" + " via" * (n // 4) + " x", head + "INFO Channel 00 via a" + sp + "x",
            "Watchdog " + "WorkNCCL(OpType=A " * (n // 18), "NCCL version 1." * (n // 15), "\x1b]" * (n // 2)]


def write_hostile(path: Path, kind: str, megabytes: int) -> int:
    # Half the bytes in 4 KB lines (the longest a parser sees after the cut: the most regex work per byte).
    block = "\n".join(_hostile_lines(kind, 4000) * 16 + _hostile_lines(kind, 65536)) + "\n"
    fixture = (FIXTURES / ("ib_ibstat_polling.log" if kind == "ib" else "nccl_ib_status12_plugin.log")).read_text()
    with path.open("w") as fh:
        for _ in range(max(1, megabytes * 1_000_000 // len(block))):
            fh.write(block)
        fh.write(fixture)
    return path.stat().st_size


class _OverBudget(Exception):
    pass


class _Budgeted:
    """A file read in 64 KB pieces that stops the run once ``budget_s`` has passed (checked between pieces)."""

    def __init__(self, path: Path, budget_s: float) -> None:
        self.fh = path.open("rb")
        self.deadline = time.perf_counter() + budget_s
        self.read_bytes = 0

    def read(self, n: int = -1) -> bytes:
        if time.perf_counter() > self.deadline:
            raise _OverBudget
        data = self.fh.read(min(n if n > 0 else 1 << 16, 1 << 16))
        self.read_bytes += len(data)
        return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200, help="size of the synthetic log")
    ap.add_argument("--file", type=Path, help="measure this log instead of a synthetic one")
    ap.add_argument("--hostile", choices=("job", "ib"), help="a hostile upload instead of a real-looking log")
    ap.add_argument("--tree", type=Path, help="import the doctor from this checkout (the code before a change)")
    ap.add_argument("--budget-s", type=float, default=600.0, help="stop a run that takes longer than this")
    args = ap.parse_args()
    tmp = None
    if args.file:
        path = args.file
    else:
        fd, name = tempfile.mkstemp(prefix="doctor-bench-", suffix=".log")
        os.close(fd)
        tmp = path = Path(name)
        if args.hostile:
            write_hostile(path, args.hostile, args.mb)
        else:
            write_log(path, args.mb)
    size = path.stat().st_size
    source = _Budgeted(path, args.budget_s)
    report = None
    try:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        try:
            report = diagnose([source], kind="ib" if args.hostile == "ib" else None)  # type: ignore[list-item]
        except _OverBudget:
            size = source.read_bytes
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        source.fh.close()
        if tmp is not None:
            os.unlink(path)
    mb = size / 1e6
    print(f"code: {REPO}")
    if report is None:
        print(f"stopped after {args.budget_s:g} s with {mb:.2f} MB read: at most {mb / wall:.3f} MB/s wall, "
              f"{mb / cpu:.3f} MB/s per core")
        return 0
    print(f"log: {mb:.1f} MB, {report.lines} lines, kind={report.kind}, unparsed={report.unparsed_lines}")
    print(f"wall {wall:.2f} s, cpu {cpu:.2f} s -> {mb / wall:.1f} MB/s wall, {mb / cpu:.1f} MB/s per core (goal 50)")
    print(f"verdict: {report.verdict[:160]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
