"""The reaper (harness/reaper.py) stops what a test leaves running, on every exit path: an orphan
whose parent is gone (found by the mark it inherited), and the processes of a test that a pytest
timeout ends. What a wider scope started is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from harness.reaper import Reaper, alive, descendants

REPO = Path(__file__).resolve().parents[1]
# A parent that starts a sleeper in a session of its own, prints its PID and exits at once: the
# sleeper is an orphan, as the agents of a run whose driver was killed are.
ORPHAN = (
    "import subprocess, sys; "
    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True, "
    "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
    "print(p.pid, flush=True)"
)


def wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_an_orphan_is_found_by_its_mark_and_stopped_with_its_scope():
    """A sleeper whose parent exited (re-parented to init, no longer our descendant) is still
    stopped when the scope that started it closes; a process started before the scope is not."""
    outside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with Reaper().scope() as left:
            orphan = int(subprocess.run([sys.executable, "-c", ORPHAN], capture_output=True, text=True,
                                        check=True, timeout=120).stdout)  # fmt: skip
            assert orphan not in descendants(), "the orphan should have been re-parented away from us"
        assert orphan in left and "time.sleep(600)" in left[orphan]
        wait_for(lambda: not alive(orphan), f"pid {orphan} outlived its scope")
        assert alive(outside.pid), "a process started before the scope must be left to its owner"
    finally:
        outside.kill()
        outside.wait(timeout=60)


def test_a_test_ended_by_a_pytest_timeout_leaves_no_process_behind(tmp_path):
    pid_file = tmp_path / "pid"
    (tmp_path / "test_inner.py").write_text(
        textwrap.dedent(f"""
        import subprocess, sys, time
        import pytest

        @pytest.mark.timeout(5)
        def test_hangs():
            orphan = subprocess.run([sys.executable, "-c", {ORPHAN!r}], capture_output=True, text=True).stdout
            open({str(pid_file)!r}, "w").write(orphan)
            time.sleep(600)
    """)
    )
    inner = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "harness.pytest_reaper",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_inner.py"),
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert inner.returncode == 1 and "Timeout" in inner.stdout, inner.stdout[-3000:]
    assert "left 1 process(es) running; stopped" in inner.stdout, inner.stdout[-3000:]
    orphan = int(pid_file.read_text())
    wait_for(lambda: not alive(orphan), f"pid {orphan} outlived the timed-out test")
