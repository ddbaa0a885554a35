"""From trainer to server with no file written by hand (issue 42), for a dense model and a MoE whose
routed experts are frozen in int4: `weightsync train` -> `weightsync pull --out d` -> d loads in
transformers with the published weights bit for bit -> `weightsync agent --model-dir d`, and an
agent started from the store alone -> `weightsync status --verify` passes on both.

It failed at the pull: the trainer published no config.json, so the pulled directory loaded
nowhere, and an agent needed a --model-dir it could not get.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
CASES = {
    "dense": ("sft_tiny.toml", "sft-tiny", []),
    "moe-frozen-int4": ("sft_moe_tiny.toml", "sft-moe-tiny", ["parallel.frozen_experts=int4:32"]),
}
SYNC_DEADLINE_S = 300  # generous: two CPUs shared with other work


def _cli(*argv: str, cwd: Path, timeout_s: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    return subprocess.run(
        [sys.executable, "-m", "weightsync.app.cli", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _assert_transformers_holds(directory: Path) -> None:
    """d loads in transformers, every published tensor bit for bit (transformers 5 holds a MoE's
    experts fused: gate and up stacked in gate_up_proj, down in down_proj)."""
    transformers = pytest.importorskip("transformers")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.bfloat16, local_files_only=True
    ).state_dict()
    for name, tensor in load_file(directory / "model.safetensors").items():
        expert = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if expert is None:
            held = loaded[name]
        elif expert.group(3) == "down":
            held = loaded[f"{expert.group(1)}.down_proj"][int(expert.group(2))]
        else:
            fused = loaded[f"{expert.group(1)}.gate_up_proj"][int(expert.group(2))]
            half = fused.shape[0] // 2
            held = fused[:half] if expert.group(3) == "gate" else fused[half:]
        assert torch.equal(held, tensor), name


class _Agent:
    """`weightsync agent` as a child process, stopped by its PID."""

    def __init__(self, cwd: Path, *argv: str) -> None:
        # Its log to a file: a pipe nobody reads while the agent runs would stop it once full.
        self.log_path = cwd / f"agent-{len(list(cwd.glob('agent-*.log')))}.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "weightsync.app.cli", "agent", "--poll-interval-s", "0.5", *argv],
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        line = self.process.stdout.readline()
        if not line:
            raise AssertionError(f"the agent did not start: {self.log_path.read_text()[-4000:]}")
        self.address = json.loads(line)["address"]

    def wait_serving(self, version: int, cwd: Path) -> None:
        deadline = time.monotonic() + SYNC_DEADLINE_S
        while True:
            status = _cli("status", "--agent", self.address, "--json", cwd=cwd, timeout_s=60)
            if status.returncode == 0 and json.loads(status.stdout)["current_version"] == version:
                return
            assert time.monotonic() < deadline, f"not serving v{version} in time: {status.stdout} {status.stderr}"
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.mark.parametrize("case", sorted(CASES))
def test_train_pull_load_and_serve_with_no_file_written_by_hand(tmp_path, case):
    config, model, overrides = CASES[case]
    steps = ["train.steps=2", "train.schedule.warmup_steps=0", "train.checkpoint.dir=ckpt", "train.publish.store=store"]
    sets = [arg for override in [*steps, *overrides] for arg in ("--set", override)]
    trained = _cli("train", "--config", str(REPO / "trainer" / "configs" / config), "--nproc", "2", *sets, cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-4000:]

    pulled = _cli("pull", "--store", "store", "--model", model, "--out", "d", cwd=tmp_path)
    assert pulled.returncode == 0, pulled.stderr
    assert (tmp_path / "d" / "config.json").is_file() and "no config.json" not in pulled.stderr
    _assert_transformers_holds(tmp_path / "d")

    agents = []
    try:
        agents.append(_Agent(tmp_path, "--model", model, "--store", "store", "--model-dir", "d", "--cache-dir", "c1"))
        agents.append(_Agent(tmp_path, "--model", model, "--store", "store", "--cache-dir", "c2"))  # the store alone
        for agent in agents:
            agent.wait_serving(2, tmp_path)
            verified = _cli("status", "--agent", agent.address, "--verify", cwd=tmp_path, timeout_s=120)
            assert verified.returncode == 0, verified.stdout + verified.stderr
            assert "bit-exact" in verified.stdout
    finally:
        for agent in agents:
            agent.stop()
