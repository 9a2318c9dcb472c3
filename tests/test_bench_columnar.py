"""benchmarks/columnar.py stays runnable and its columnar store gives back exactly the numbers sent. Its decode and
checks are the server's own (dashboard.ingest.blocks), which tests/test_blocks.py holds to version 1's meaning."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_columnar_store_reads_back_the_numbers_sent() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "columnar.py"), "--nodes", "4", "--fill", "2", "--seconds", "2",
         "--group", "3"],
        capture_output=True, text=True, timeout=300, check=True).stdout
    assert re.search(r"today: +\d+ us of CPU per node-second", out), out
    got = re.search(r"columnar: +\d+ us of CPU per node-second \(([\d.]+) of today's\); the same values read back: (\w+)",
                    out)
    assert got and got.group(2) == "True", out
