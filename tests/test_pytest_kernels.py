"""harness/pytest_kernels.py: a run compiles numba's kernels for every element width into an
empty cache at its start, without a test asking for them (in a pytest run of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parent.parent

INNER_TEST = """
import os, time
from pathlib import Path

def kernels():
    cache = Path(os.environ["NUMBA_CACHE_DIR"])
    return sorted(p.name.split("-")[0] for p in cache.rglob("*.nbc"))

def test_the_cache_fills_by_itself():
    deadline = time.monotonic() + 1200  # two cold compiles on a machine the suite shares
    while time.monotonic() < deadline:
        got = kernels()
        if got.count("changes._scan_kernel") >= 4 and got.count("position_digest._numba_kernel.locals._sum") >= 4:
            return
        time.sleep(1.0)
    raise AssertionError(got)
"""


def test_a_run_compiles_every_width_of_the_kernels_into_an_empty_cache(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER_TEST)
    cache = tmp_path / "numba"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "harness.pytest_reaper",
         "-p", "harness.pytest_kernels", "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        cwd=REPO, env={**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    names = {p.name.split("-")[0] for p in cache.rglob("*.nbc")}
    # every kernel of both codecs with kernels (ctx, rans), their shared scan, and the digest
    assert {"changes._scan_kernel", "ctx._emit_kernel", "ctx._decode_kernel", "rans._emit_kernel",
            "rans._decode_kernel", "position_digest._numba_kernel.locals._sum"} <= names, sorted(names)  # fmt: skip
