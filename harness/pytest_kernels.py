"""pytest_kernels: numba's kernels are compiled once at the start of a run, not in every process
of its first tests.

A fresh clone has an empty numba cache (the kernels' `__pycache__`). The tests that start first
run publisher and agent processes side by side, and each compiled the same kernels (~13-25 s of
one CPU per element width on an idle machine); the crash test's children were killed before they
could write the cache, so each restart compiled them again. When the session starts (the
controller, under xdist), two processes compile the codecs' kernels and the position digest's
for every element width into the cache while the workers start and collect (two, not one per
width: each process pays ~10 s to set numba up before its first kernel). Nothing waits for them: a
test that needs a kernel not yet cached compiles it as before. Once cached, each process only
loads them (~1 s). They run under the session's reaper mark, so one still running when the run
ends is stopped with the session's other processes.

Tests that need an empty cache name their own `NUMBA_CACHE_DIR`.

tests/conftest.py registers it beside the reaper.

Not here: what each codec compiles (`weightsync.format.codecs.warmup`), the position digest's
kernel (`weightsync.agents.engines.position_digest`).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

WARM_UP = (("bfloat16", "uint8"), ("float32", "float64"))
"""One dtype per element width (the kernels are compiled per width, not per dtype), in two
processes; bf16, what most tests publish, first."""

_warmers: list[subprocess.Popen] = []  # held, not waited for: the reaper stops any still running

_WARM = """
import sys, torch
from weightsync.agents.engines.position_digest import weights_sum
from weightsync.format.codecs import warm_up
for name in sys.argv[1:]:
    warm_up([name])
    weights_sum({"w": torch.zeros(8, dtype=getattr(torch, name))})
"""


@pytest.hookimpl(trylast=True)  # after the reaper's: the processes carry the session's mark
def pytest_sessionstart(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller started them
        return
    for names in WARM_UP:
        _warmers.append(
            subprocess.Popen(
                [sys.executable, "-c", _WARM, *names],
                cwd=session.config.rootpath,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
