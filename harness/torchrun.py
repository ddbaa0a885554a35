"""torchrun: a script run on N gloo ranks under `torch.distributed.run`, for the distributed tests.

One launch costs seconds (and more on a loaded machine), so each distributed test module runs one
suite of jobs per launch and reads what it left in an output folder. The environment is the
test's, without torchrun's own variables (a launch inside a launch would join the wrong group)
and with one OpenMP thread per rank (N ranks share the machine's cores).

Not here: what the ranks run (the scenario scripts beside the tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_")


def run_under_torchrun(
    script: Path, *args: str, nproc: int, timeout_s: float, cwd: Path
) -> subprocess.CompletedProcess:
    """`script args...` on `nproc` ranks (standalone rendezvous); its output captured."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_TORCHRUN_VARIABLES)}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
