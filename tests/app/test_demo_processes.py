"""Stopping a process group (`weightsync.app.demo.processes`): nothing of the group is left
running, and what it mapped in /dev/shm is released even when the process that mapped it is not
the direct child (vLLM's engine core and workers are the server's children)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from weightsync.app.demo.processes import group_processes, kill_process_group, stop_process_group

MAPPER = """
import mmap, sys, time
f = open(sys.argv[1], "w+b")
f.truncate(1 << 24)
held = mmap.mmap(f.fileno(), 1 << 24)
print("ready", flush=True)
time.sleep(600)
"""


def _group_mapping_shared_memory():
    """A shell (the direct child, in a group of its own) whose child maps a /dev/shm file."""
    path = Path("/dev/shm") / f"weightsync-test-{uuid.uuid4().hex}"
    proc = subprocess.Popen(
        ["bash", "-c", f'"{sys.executable}" -c "$0" "$1" & wait', MAPPER, str(path)],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout.readline() == b"ready\n"
    return proc, path


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
@pytest.mark.parametrize("end", [kill_process_group, stop_process_group])
def test_the_whole_group_is_gone_and_its_shared_memory_released(end):
    proc, path = _group_mapping_shared_memory()
    try:
        assert path.exists()
        end(proc, timeout_s=60)
        assert proc.returncode is not None
        assert group_processes(proc.pid) == []
        assert not path.exists()
    finally:
        proc.stdout.close()
        path.unlink(missing_ok=True)
