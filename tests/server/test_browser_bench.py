"""benchmarks/browser.py, small: 16 nodes for a few seconds, every page measured with finite numbers.

Not a timing assertion (the suite's machine is whatever it is): the harness must start its server, feed it, find
the run, sign in, wait on each page's chart and come back with numbers, then stop by itself."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import network_lock
from tests.conftest import service_missing
from tests.server.browser import CHROMIUM

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.browser


def test_the_browser_benchmark_measures_every_page(tmp_path: Path) -> None:
    if not Path(CHROMIUM).exists():
        service_missing(f"no chromium at {CHROMIUM} (apt-get install chromium)")
    out = tmp_path / "bench.json"
    # The harness starts its own embedded server (fresh data dir): nothing of the suite's database is touched.
    env_free = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    with network_lock.browsing():  # its Chromium, like the suite's, runs while no testbed changes the host's network
        proc = subprocess.run(
            [sys.executable, "benchmarks/browser.py", "--nodes", "16", "--ranks", "64", "--seconds", "4", "--loads",
             "1", "--window", "2", "--paint-timeout", "60", "--json", str(out)],
            cwd=ROOT, env=env_free, capture_output=True, text=True, timeout=280)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["page"] for r in rows] == ["overview", "node", "run"], proc.stdout[-3000:]
    for r in rows:
        assert r["marker"], f"{r['page']}: no chart element to wait on"
        assert r["paint_p50_ms"] is not None and math.isfinite(r["paint_p50_ms"]) and r["paint_p50_ms"] > 0, r
        assert r["snapshot_bytes"] and r["snapshot_bytes"] > 0, r
        assert r["busy"] is not None and 0 <= r["busy"] <= 1.05, r  # CDP's clocks may round a little over 1
        assert r["api_bytes"] >= 0
    assert "Browser benchmark" in proc.stdout and "goals at 2,048 nodes" in proc.stdout
