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

import pytest

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


# How tests/conftest.py loads the reaper (as a plugin of the whole run), and how it used to (its
# hooks imported into the conftest, where they see only the nodes under tests/).
AS_PLUGIN = "def pytest_configure(config):\n    config.pluginmanager.import_plugin('harness.pytest_reaper')\n"
AS_CONFTEST_HOOKS = (
    "from harness.pytest_reaper import pytest_fixture_setup, pytest_runtest_call, pytest_sessionstart, "
    "pytest_unconfigure  # noqa: F401\n"
)


@pytest.mark.parametrize("conftest", [AS_PLUGIN, AS_CONFTEST_HOOKS], ids=["as-plugin", "as-conftest-hooks"])
def test_a_session_fixture_a_test_body_requests_lazily_outlives_that_test(tmp_path, conftest):
    """CI once lost its moto server half-way: the first test to need it requested it inside its
    body, the server took that test's mark, and every later S3 test could not connect. Loaded as a
    plugin, the reaper sees the fixture's setup (on the session node) and leaves its server alone."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text(conftest)
    (tmp_path / "tests" / "test_inner.py").write_text(
        textwrap.dedent("""
        import subprocess, sys
        import pytest

        @pytest.fixture(scope="session")
        def server():
            proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            yield proc
            proc.kill()
            proc.wait()

        def test_first_needs_it_in_its_body(request):
            assert request.getfixturevalue("server").poll() is None

        def test_later_finds_it_running(server):
            assert server.poll() is None, "the session's server was stopped with the first test"
    """)
    )
    inner = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "tests"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if conftest == AS_PLUGIN:
        assert inner.returncode == 0 and "2 passed" in inner.stdout, inner.stdout[-3000:]
        assert "process(es) running; stopped" not in inner.stdout, inner.stdout[-3000:]
    else:  # the way that lost CI its moto server
        assert "1 failed, 1 passed" in inner.stdout, inner.stdout[-3000:]
        assert "test_first_needs_it_in_its_body left 1 process(es) running; stopped" in inner.stdout
