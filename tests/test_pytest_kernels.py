"""harness/pytest_kernels.py: a run starts compiling numba's kernels into an empty cache without a
test asking for them, for every element width, and leaves nothing running when it ends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.pytest_kernels import WARM_UP
from harness.reaper import alive

REPO = Path(__file__).resolve().parent.parent

INNER_TEST = """
import os, time
from pathlib import Path
from harness import pytest_kernels

def test_the_cache_fills_by_itself():
    Path(os.environ["WARMERS_FILE"]).write_text(" ".join(str(p.pid) for p in pytest_kernels._warmers))
    cache = Path(os.environ["NUMBA_CACHE_DIR"])
    deadline = time.monotonic() + 1200  # a cold compile on a machine the suite shares
    while not list(cache.rglob("*.nbi")):
        assert time.monotonic() < deadline, "nothing was compiled"
        time.sleep(0.5)
"""


def test_the_warm_up_covers_every_element_width():
    widths = sorted(torch.empty(0, dtype=getattr(torch, name)).element_size() for names in WARM_UP for name in names)
    assert widths == [1, 2, 4, 8]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_run_compiles_into_an_empty_cache_by_itself_and_leaves_nothing_running(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER_TEST)
    warmers = tmp_path / "warmers"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "harness.pytest_reaper",
         "-p", "harness.pytest_kernels", "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        cwd=REPO, capture_output=True, text=True, timeout=1500,
        env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PYTHONPATH": str(REPO),
             "WARMERS_FILE": str(warmers)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    pids = [int(pid) for pid in warmers.read_text().split()]
    assert len(pids) == len(WARM_UP)
    assert not [pid for pid in pids if alive(pid)], "a warm-up process outlived its run"
