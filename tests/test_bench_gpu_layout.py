"""benchmarks/gpu_layout.py stays runnable and its packed layouts give back exactly the values today's rows hold
(the benchmark compares what each layout reads back; a lossy packing would print False)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_packed_gpu_layouts_read_back_the_values_the_rows_hold() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_layout.py"), "--nodes", "6", "--fill", "3", "--seconds", "2",
         "--commit", "4", "--delta", "2"],
        capture_output=True, text=True, timeout=300, check=True).stdout
    rows = re.findall(r"(\d+) GPU samples", out)
    assert rows == ["96", "96", "96"], out  # 6 nodes x 8 GPUs x the 2 s read back, by each of the three layouts
    ratios = re.findall(r"/ today: write ([\d.]+), read ([\d.]+), size ([\d.]+); the same values read back: (\w+)", out)
    assert len(ratios) == 2 and all(same == "True" for *_, same in ratios), out
