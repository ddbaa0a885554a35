"""The benchmarks' checks of their own pure helpers (bench/selftest.py), run through its command line:
tests never import bench/ (tests/test_layers.py), and a helper a benchmark's results depend on
still gets checked in CI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_bench_selftest_passes():
    done = subprocess.run(
        [sys.executable, "-m", "bench.selftest"], cwd=REPO, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    assert "ok   check_plan_runs_shared_cells_once_largest_size_first" in done.stdout, "the checks did not run"
