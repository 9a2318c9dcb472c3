"""Hostile lines cost linear time: no regex in a parser that reads untrusted log text backtracks quadratically.

Python's ``re`` has no step counter, so each shape is timed at 16 KB and 64 KB (CPU time, best of several runs):
linear code takes ~4x as long for 4x the input, a quadratic regex ~16x. A 4 KB probe first fails fast (instead of
running for minutes) when a shape is catastrophically slow. The I/O layers also cut lines to ``MAX_LINE`` before
any matching, which is checked directly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from clusterdx.cli import main
from collectors.doctor import _unwrap, detect_kind, diagnose
from collectors.doctor import nccl as nccl_mod
from collectors.doctor.ib import IbFacts
from collectors.doctor.kmsg import XidFacts
from collectors.doctor.nccl import NcclFacts, NcclStreamParser
from collectors.doctor.smi import SmiFacts
from collectors.doctor.text import MAX_LINE, clean_line, iter_source_lines
from collectors.doctor.torchdist import TorchFacts
from collectors.xid import parse_kmsg_line

LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "logs"
SP = " "


def _ib(line: str) -> None:
    f = IbFacts()
    f.feed("CA 'mlx5_0'")
    f.feed("Port 1:")
    f.feed(line)
    f.findings()


def _nccl(line: str) -> None:
    f = NcclFacts()
    f.feed(line)
    f.findings()


def _stream(line: str) -> None:
    NcclStreamParser().feed(line)


def _torch(line: str) -> None:
    f = TorchFacts()
    f.feed(line)
    f.findings(8)


def _smi(line: str) -> None:
    f = SmiFacts()
    f.feed("GPU 00000000:01:00.0")
    f.feed(line)
    f.findings()


# (parser, the worst shape found for one of its regexes, as a function of the line length)
SHAPES: dict[str, tuple[Callable[[str], object], Callable[[int], str]]] = {
    "ib key with spaces": (_ib, lambda n: "a" + SP * n + "x"),
    "ib value with spaces": (_ib, lambda n: "Rate: a" + SP * n + "x"),
    "ib state with spaces": (_ib, lambda n: "State: a" + SP * n + "x"),
    "ib phys state with spaces": (_ib, lambda n: "Physical state: a" + SP * n + "(1"),
    "ib perfquery dots": (_ib, lambda n: "SymbolErrorCounter:" + "." * n + " x"),
    "ib speed digits": (_ib, lambda n: "active_speed: " + "1" * n),
    "ib width digits": (_ib, lambda n: "active_width: " + "1" * n),
    "ib sysfs value spaces": (_ib, lambda n: "mlx5_0/ports/1/counters/symbol_error: a" + SP * n + "x"),
    "ib sysfs state spaces": (_ib, lambda n: "mlx5_0/ports/1/state: a" + SP * n + "x"),
    "ib sysfs device run": (_ib, lambda n: "a" * n + "/ports/1/state: 4: ACTIVE"),
    "ib ibqueryerrors": (_ib, lambda n: "GUID 0x1 port 1:" + "[a == 1" * (n // 7)),
    "nccl network spaces": (_nccl, lambda n: "h:1:2 [0] NCCL INFO Using network a" + SP * n + "x"),
    "nccl completion repeated": (_nccl, lambda n: "h:1:2 [0] NCCL WARN " + "Got completion with error 1 " * (n // 28)),
    "nccl head spaces": (_nccl, lambda n: "h:1:2 [0]" + SP * n + " NCCL INFO x"),
    "nccl head digits": (_nccl, lambda n: "x:" + "1" * n + " NCCL INFO x"),
    "nccl version repeated": (_nccl, lambda n: "NCCL version 1." * (n // 15)),
    "stream network spaces": (_stream, lambda n: "h:1:2 [0] NCCL INFO Using network a" + SP * n + "x"),
    "stream via spaces": (_stream, lambda n: "h:1:2 [0] NCCL INFO Channel 00 via a" + SP * n + "x"),
    "stream via repeated": (_stream, lambda n: "h:1:2 [0] NCCL INFO Channel 00" + " via" * (n // 4) + " x"),
    "stream completion repeated": (_stream, lambda n: "h:1:2 [0] NCCL WARN " + "Got completion with error 1 "
                                   * (n // 28)),
    "stream nranks repeated": (_stream, lambda n: "h:1:2 [0] NCCL INFO " + "rank 1 " * (n // 7) + "nranks 2"),
    "torch WorkNCCL repeated": (_torch, lambda n: "Watchdog " + "WorkNCCL(OpType=A " * (n // 18)),
    "torch NCCL error in": (_torch, lambda n: "NCCL error in: " + "a," * (n // 2)),
    "torch store timeout": (_torch, lambda n: "DistStoreError timed out " + "timeout after 1 " * (n // 16)),
    "torch ranks": (_torch, lambda n: "NCCL error " + "Rank 1 " * (n // 7)),
    "torch table": (_torch, lambda n: "rank" + SP * n + ":"),
    "xid off the bus": (XidFacts().feed, lambda n: "NVRM: GPU at PCI:0000:01:00: " + "a" * n),
    "xid name": (parse_kmsg_line, lambda n: "NVRM: Xid (PCI:0000:01:00): 79, pid=1, name=" + "a" * n),
    "smi key with spaces": (_smi, lambda n: "    Product Name" + SP * n + "x"),
    "ansi escapes": (clean_line, lambda n: "\x1b]" * (n // 2) + "\x1b[" + "0" * (n // 2)),
    "detection": (detect_kind, lambda n: "GPU 0000:01:00.0" + SP * n + "x a:1:1 [1] " * (n // 11)),
}


def _cpu(fn: Callable[[str], object], line: str, runs: int = 5) -> float:
    best = float("inf")
    for _ in range(runs):
        t0 = time.process_time()
        fn(line)
        best = min(best, time.process_time() - t0)
    return best


@pytest.mark.parametrize("name", list(SHAPES))
def test_a_hostile_line_costs_linear_time(name):
    fn, make = SHAPES[name]
    probe = _cpu(fn, make(4096), runs=1)
    assert probe < 0.05, f"{name}: one 4 KB line took {probe:.3f} s of CPU"
    t16, t64 = _cpu(fn, make(16384)), _cpu(fn, make(65536))
    # 4x the input: ~4x the time when linear, ~16x when quadratic; 1 ms of slack for timer noise on tiny times.
    assert t64 < 8 * t16 + 0.001, f"{name}: 16 KB {t16 * 1e3:.2f} ms, 64 KB {t64 * 1e3:.2f} ms"


def test_lines_are_cut_before_any_parser_sees_them():
    text = "a" * 200_000 + "\n" + "b" * 5000 + "\n" + "c" * 10
    assert [len(line) for line in iter_source_lines(text)] == [MAX_LINE, MAX_LINE, 10]
    assert MAX_LINE <= 4096


def test_unwrapping_a_terminal_wrap_never_builds_an_unbounded_line():
    lines = ["w" * 100] * 5000  # all exactly the wrap width, none starting a record: one "record" in theory
    joined = list(_unwrap(lines, 100))
    assert max(map(len, joined)) <= MAX_LINE
    assert len(joined) == 1  # the continuations are still swallowed, not counted as lines of their own


def test_the_head_cache_stays_small():
    nccl_mod._head_cache.clear()
    f = NcclFacts()
    for i in range(3000):  # long, distinct prefixes before the level marker
        f.feed(f"{i:06d}" + "p" * 1000 + f" h{i}:1:2 [0] NCCL INFO x")
    for i in range(6000):  # many short distinct prefixes
        f.feed(f"[{i}] h:1:2 [0] NCCL INFO x")
    assert sum(map(len, nccl_mod._head_cache)) < 1_000_000
    assert len(nccl_mod._head_cache) <= 4096


def test_a_long_digit_run_is_not_fatal():
    # int() refuses more than 4300 digits; a line is cut to MAX_LINE first, so no parser ever sees that many.
    digits = "9" * 10_000
    text = "\n".join([f"h:1:2 [0] NCCL INFO a.cc:1 -> {digits}", f"h:1:2 [{digits}] NCCL INFO x",
                      f"NVRM: Xid (PCI:0000:01:00): 79, pid={digits}, name=x, y",
                      f"[E ProcessGroupNCCL.cpp:1] [Rank {digits}] Watchdog caught collective operation timeout"])
    report = diagnose(text)
    assert report.lines == 4


def _hostile_lines(width: int) -> list[str]:
    """One line of each job-log shape (NCCL, torch, Xid) at ``width`` characters; no fact a fixture lacks."""
    n = width - 60
    return [
        "kp-ddp-worker-0:3468:3905 [4] NCCL INFO Using network a" + SP * n + "x",
        "kp-ddp-worker-0:3468:3905 [4] NCCL WARN " + "Got completion with error 1 " * (n // 28),
        "kp-ddp-worker-0:3468:3905 [4] NCCL INFO Channel 00 via a" + SP * n + "x",
        "kp-ddp-worker-0:3468:3905 [4] NCCL INFO Channel 00" + " via" * (n // 4) + " x",
        "kp-ddp-worker-0:3468:3905 [4]" + SP * n + " NCCL INFO x",
        "NCCL version 1." * (n // 15),
        "Watchdog " + "WorkNCCL(OpType=A " * (n // 18),
        "NVRM: GPU at PCI:0000:01:00: " + "a" * n,
        "\x1b]" * (n // 2),
    ]


@pytest.mark.timeout(120)
def test_a_20_mb_hostile_upload_keeps_the_verdict(tmp_path, capsys):
    fixture = (LOGS / "nccl_ib_status12_plugin.log").read_text()
    block = "\n".join(_hostile_lines(4000) + _hostile_lines(65536)) + "\n"
    path = tmp_path / "hostile.log"
    with path.open("w") as fh:
        for _ in range(20_000_000 // len(block)):
            fh.write(block)
        fh.write(fixture)
    assert main(["doctor", "--json", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    clean = diagnose(fixture).to_dict()
    assert (out["kind"], out["verdict"]) == (clean["kind"], clean["verdict"])


@pytest.mark.timeout(60)
def test_a_hostile_ib_dump_keeps_the_verdict():
    fixture = (LOGS / "ib_ibstat_polling.log").read_text()
    shapes = [make(4000) for name, (fn, make) in SHAPES.items() if fn is _ib and "sysfs" not in name]
    text = ("\n".join(shapes) + "\n") * 100 + fixture
    clean = diagnose(fixture, kind="ib")
    hostile = diagnose(text, kind="ib")
    assert (hostile.kind, hostile.verdict) == (clean.kind, clean.verdict)


@pytest.mark.timeout(20)
def test_a_forged_world_size_does_not_build_a_range_of_it():
    text = ("h:1:2 [0] NCCL INFO comm 0x1 rank 0 nranks 99999999999\n[E ProcessGroupNCCL.cpp:1] [Rank 0] Watchdog "
            "caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, Timeout(ms)=1)\n")
    assert diagnose(text).facts["error_class"] == "timeout"


@pytest.mark.parametrize("text", [
    "<?xml version='1.0'?>\n<nvidia_smi_log>\n<gpu id='00000000:01:00.0'>\n" + "<a>\n" * 3000 + "</a>\n" * 3000
    + "</gpu>\n</nvidia_smi_log>\n",
    "<?xml version='1.0'?>\n<nvidia_smi_log>\n<gpu id='00000000:01:00.0'>\n" + "<a>" * 1300 + "\n",
    "GPU 00000000:01:00.0\n" + "".join(" " * (i + 1) + "Retired Pages\n" for i in range(3000)),
    "GPU 00000000:01:00.0\n    Clocks Throttle Reasons\n" + "".join(" " * (i + 5) + "x\n" for i in range(3000)),
    "GPU 00000000:01:00.0\n    Product Name : \u00b2\n",
], ids=["deep-xml", "deep-open-xml", "deep-text", "deep-reasons", "superscript-digit"])
def test_nvidia_smi_nesting_and_odd_digits_are_not_fatal(text):
    assert diagnose(text, kind="nvidia-smi").kind == "nvidia-smi"
