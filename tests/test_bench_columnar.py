"""benchmarks/columnar.py stays runnable, its columnar store gives back exactly the numbers sent, and its group-wide
check refuses what the wire refuses (a check that passed everything would make the columnar path look cheaper)."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_columnar", ROOT / "benchmarks" / "columnar.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # msgspec resolves the module's annotations through it
    spec.loader.exec_module(mod)
    return mod


def test_the_group_check_refuses_what_the_wire_refuses() -> None:
    b = _bench()
    names = [c.name for c in b.COLS["gpus"]]
    row = np.array([[math.nan if c.nullable else max(c.lo, 0.0) for c in b.COLS["gpus"]]])
    assert b.check("gpus", row.copy())
    for name, value in (("util_gpu_pct", 100.5), ("temp_c", -1e300), ("ts", math.nan), ("ecc_dbe_volatile", 1.5),
                        ("remap_pending", 2.0), ("ts", 2e11), ("index", 1024.0)):
        bad = row.copy()
        bad[0, names.index(name)] = value
        assert not b.check("gpus", bad), (name, value)
    steps = [c.name for c in b.COLS["steps"]]
    ok = np.array([[math.nan if c.nullable else max(c.lo, 0.0) for c in b.COLS["steps"]]] * 3)
    assert b.check("steps", ok)
    ok[1, steps.index("rank")] = 1_000_001
    assert not b.check("steps", ok), "one bad row of a group's block fails the check"


def test_the_columnar_store_reads_back_the_numbers_sent() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "columnar.py"), "--nodes", "4", "--fill", "2", "--seconds", "2",
         "--group", "3"],
        capture_output=True, text=True, timeout=300, check=True).stdout
    assert re.search(r"today: +\d+ us of CPU per node-second", out), out
    got = re.search(r"columnar: +\d+ us of CPU per node-second \(([\d.]+) of today's\); the same values read back: (\w+)",
                    out)
    assert got and got.group(2) == "True", out
