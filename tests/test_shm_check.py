"""harness/pytest_shm: a run that leaves a /dev/shm entry of ours behind fails, names it and
removes it; a Python semaphore left by a killed process tree is removed and named only."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this system")]


def _run_leaking(tmp_path: Path, name: str) -> subprocess.CompletedProcess:
    test = tmp_path / "test_leak.py"
    test.write_text(f"def test_leaks():\n    open('/dev/shm/{name}', 'wb').write(b'x')\n")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "harness.pytest_shm", "-p", "no:cacheprovider", str(test)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_run_that_leaves_shared_memory_behind_fails_naming_it_and_it_is_removed(tmp_path):
    name = f"weightsync-leak-{uuid.uuid4().hex[:8]}"
    run = _run_leaking(tmp_path, name)
    assert run.returncode == 1, run.stdout
    assert "the tests left 1 entries in /dev/shm" in run.stdout and f"/dev/shm/{name}" in run.stdout
    assert not (SHM / name).exists()


def test_a_left_semaphore_is_removed_and_named_without_failing_the_run(tmp_path):
    name = f"sem.mp-{uuid.uuid4().hex[:8]}"
    run = _run_leaking(tmp_path, name)
    assert run.returncode == 0, run.stdout
    assert "removed 1 semaphores of killed process trees" in run.stdout and name in run.stdout
    assert not (SHM / name).exists()
