"""processes: stopping what the demo (and the test harness) starts, and nothing of anyone else's.

A child runs in a process group of its own (torchrun's ranks, vLLM's engine core and workers
share their parent's), so it is stopped as a group: SIGTERM, a grace period, SIGKILL to what is
left, by process group id, never by name. What the group held in /dev/shm is read before the stop
and released after: a vLLM server stopped by signal leaves its message queues (psm_*), CPU
tensor-parallel buffers and semaphores behind, because the resource tracker that would unlink
them dies with the group. Only entries no live process holds are removed.

Not here: starting them (`run.py`, `vllm.py`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path


def stop_process_group(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """Stops `proc` and every process of its group (see the module docstring)."""
    held = group_shared_memory(proc.pid)
    deadline = time.monotonic() + timeout_s
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    # The rest of the group gets the grace period to exit on its own: a resource tracker ignores
    # SIGTERM and unlinks what its processes leaked once the last of them is gone.
    _wait_group_gone(proc.pid, deadline)
    _kill_group_and_release(proc, held, timeout_s)  # what is left of the group (engine core, workers, ranks)


def kill_process_group(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """SIGKILL to `proc` and every process of its group at once (a crash, no grace); what the group
    held in /dev/shm is released once its processes are gone."""
    _kill_group_and_release(proc, group_shared_memory(proc.pid), timeout_s)


def _kill_group_and_release(proc: subprocess.Popen, held: set[Path], timeout_s: float) -> None:
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()
    # Killed, not yet gone: `proc`'s children (vLLM's engine core and workers) are not ours to
    # reap, and until they have exited they still map what they held, which is then not released.
    _wait_group_gone(proc.pid, time.monotonic() + timeout_s)
    release_shared_memory(held)


def _wait_group_gone(pgid: int, deadline: float) -> None:
    while group_processes(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def group_shared_memory(pgid: int) -> set[Path]:
    """The /dev/shm entries that the live processes of process group `pgid` map or hold open:
    vLLM's message queues (psm_*), its CPU tensor-parallel buffers (vllm_*cpushm*) and semaphores.
    A server stopped by signal leaves them behind when its resource tracker dies with it; read
    them before the stop, release them after (`release_shared_memory`)."""
    return shared_memory_of(group_processes(pgid))


def release_shared_memory(paths: Iterable[Path]) -> list[Path]:
    """Removes each of `paths` that still exists and that no live process maps or holds open (a
    directory: nothing inside it; one still in use is never touched); the ones it removed."""
    left = {p for p in paths if p.exists()}
    if not left:
        return []
    in_use = shared_memory_of(_pids())
    removed = []
    for path in sorted(left - in_use):
        try:
            if path.is_dir() and not path.is_symlink():
                if any(path in held.parents for held in in_use):
                    continue
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
        except OSError:  # gone meanwhile, or not ours
            continue
    return removed


def group_processes(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    return [pid for pid in _pids() if _pgid(pid) == pgid]


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def shared_memory_of(pids: Iterable[int]) -> set[Path]:
    """The /dev/shm entries the live processes `pids` map or hold open."""
    found: set[Path] = set()
    for pid in pids:
        proc = Path("/proc") / str(pid)
        try:
            for line in (proc / "maps").read_text().splitlines():
                where = line.find("/dev/shm/")
                if where >= 0:
                    found.add(Path(line[where:].removesuffix(" (deleted)")))
            fds = list((proc / "fd").iterdir())
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:  # closed meanwhile: the others are still read
                continue
            if target.startswith("/dev/shm/"):
                found.add(Path(target.removesuffix(" (deleted)")))
    return found
