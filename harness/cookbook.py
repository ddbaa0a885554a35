"""cookbook: runs an unmodified tinker-cookbook recipe against a training server, offline, and
writes the SFT data its arithmetic RL environment expects.

A recipe runs as `python -m tinker_cookbook.recipes...` in a subprocess (its own event loop,
logging and argument parsing, as a user runs it), with `HF_HUB_OFFLINE=1` and the server's URL and
API key; `run_recipe` checks it finished and returns its metrics.jsonl. The recipes' arguments and
why they are what they are live in the tests that call this.

Not here: the server (training_server.py), the model directories (tiny_model.py).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from harness.training_server import API_KEY


def run_recipe(module: str, args: list[str], log_path: Path, server, *, timeout_s: float = 800.0) -> list[dict]:
    """Runs recipe `module` with `args` against `server` (a TrainingServer), logging to `log_path`;
    asserts it ran to "Training completed successfully" and returns its metrics, one dict a step."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TINKER_API_KEY": API_KEY,
        "TINKER_TELEMETRY": "0",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        module,
        *args,
        f"base_url={server.url}",
        f"log_path={log_path}",
        "behavior_if_log_dir_exists=delete",
    ]
    proc = subprocess.run(
        cmd, env=env, cwd=log_path.parent, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Training completed successfully" in proc.stdout + proc.stderr
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def write_arithmetic_conversations(path: Path, *, count: int, seed: int) -> Path:
    """SFT data in the arithmetic environment's own format (tinker_cookbook.recipes.math_rl.
    arithmetic_env): its few-shot exchange, then "What is x + y?" answered with the bare sum,
    x and y drawn from the environment's range 0..100."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            x, y = rng.randint(0, 100), rng.randint(0, 100)
            messages = [
                {"role": "user", "content": "What is 4 + 5?"},
                {"role": "assistant", "content": "9"},
                {"role": "user", "content": f"What is {x} + {y}?"},
                {"role": "assistant", "content": str(x + y)},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path
