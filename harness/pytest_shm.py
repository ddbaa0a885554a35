"""pytest_shm: the test run leaves nothing in /dev/shm.

Shared memory outlives the processes that made it: a vLLM server stopped by signal left its
message queues (psm_*, ~400 MiB a server) and CPU tensor-parallel buffers behind, and an engine
left its LoRA adapter directory; each run of the suite took more of the machine's memory until
a reboot. At the end of the run (the controller, under xdist), every /dev/shm entry of the kinds
this stack makes (SHM_PREFIXES) that appeared during the run and that no live process still holds
is removed so that the next run starts clean, and named; each fails the run but Python's
semaphores (SEMAPHORE_PREFIX), which are only named.

tests/conftest.py registers it beside the reaper.

Not here: releasing a stopped server's shared memory (weightsync.app.demo.processes), stopping
processes (`reaper.py`).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from weightsync.app.demo.processes import release_shared_memory

SHM = Path("/dev/shm")
SHM_PREFIXES = ("psm_", "sem.mp-", "vllm", "weightsync-", "torch_")
"""What vLLM, Python's multiprocessing, torch and weightsync name their /dev/shm entries."""

SEMAPHORE_PREFIX = "sem.mp-"
"""Python's multiprocessing semaphores (a few bytes each): removed and named, but they do not fail
the run. One is left when a process tree is killed with its resource tracker, which the reaper and
the servers' stops do on purpose; the heavy kinds (vLLM's queues, LoRA directories) fail it."""

TRACKER_GRACE_S = 15.0
"""How long the check waits for exiting processes' resource trackers to clean up first."""

_started = time.time()


def _trackers_running() -> bool:
    """Whether a Python resource tracker other than this process's own is still running."""
    from multiprocessing import resource_tracker

    own = getattr(resource_tracker._resource_tracker, "_pid", None)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == own:
            continue
        try:
            if b"multiprocessing.resource_tracker" in (entry / "cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


def _ours_since(started: float) -> set[Path]:
    if not SHM.is_dir():
        return set()
    found = set()
    for entry in SHM.iterdir():
        try:
            if entry.name.startswith(SHM_PREFIXES) and entry.lstat().st_ctime >= started:
                found.add(entry)
        except OSError:  # gone meanwhile
            continue
    return found


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller checks once for all
        return
    left = _ours_since(_started)
    deadline = time.monotonic() + TRACKER_GRACE_S
    while left and _trackers_running() and time.monotonic() < deadline:
        time.sleep(0.1)  # the workers' resource trackers unlink what their tests leaked as they exit
        left = _ours_since(_started)
    removed = release_shared_memory(left)
    semaphores = [entry for entry in removed if entry.name.startswith(SEMAPHORE_PREFIX)]
    failing = [entry for entry in removed if entry not in semaphores]
    writer = session.config.get_terminal_writer()
    if semaphores:
        names = "\n".join(f"  {entry}" for entry in semaphores)
        writer.line(
            f"removed {len(semaphores)} semaphores of killed process trees from /dev/shm:\n{names}", yellow=True
        )
    if not failing:
        return
    names = "\n".join(f"  {entry}" for entry in failing)
    writer.line(
        f"the tests left {len(failing)} entries in /dev/shm (removed now; fix the test that made them):\n{names}",
        red=True,
    )
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
