"""tinker-cookbook 0.5.8 recipes, unmodified, against the training server (no network): the
chat SFT recipe (its loss falls) and the math RL recipe on the arithmetic environment (it runs
its steps, sampling through the agent-synced sampler, whose log-probs agree with the trainer's).

The model is the tiny random one from harness/tiny_model.py with its generated tokenizer;
`renderer_name=role_colon` and `HF_HUB_OFFLINE=1` keep the cookbook offline. The commands are
the ones docs/training-api.md gives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker_cookbook")

from harness.tiny_model import write_tiny_model
from harness.training_server import API_KEY, TrainingServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with TrainingServer(tmp_path_factory.mktemp("server") / "state") as srv:
        yield srv


def run_recipe(module: str, args: list[str], log_path: Path, server) -> list[dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TINKER_API_KEY": API_KEY, "TINKER_TELEMETRY": "0",
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", module, *args, f"base_url={server.url}", f"log_path={log_path}",
           "behavior_if_log_dir_exists=delete"]
    proc = subprocess.run(cmd, env=env, cwd=log_path.parent, capture_output=True, text=True, timeout=800, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Training completed successfully" in proc.stdout + proc.stderr
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_chat_sft_recipe_runs_unmodified_and_its_loss_falls(tmp_path, server, model_dir):
    import tinker_cookbook

    dataset = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    metrics = run_recipe("tinker_cookbook.recipes.chat_sl.train", [
        f"model_name={model_dir}", f"dataset={dataset}", "renderer_name=role_colon", "batch_size=8",
        "max_steps=6", "save_every=0", "eval_every=0", "learning_rate=0.01", "lora_rank=0"], tmp_path / "sft", server)
    nll = [m["train_mean_nll"] for m in metrics if "train_mean_nll" in m]
    assert len(nll) == 6
    assert nll[-1] < nll[0] - 0.5, nll


def test_math_rl_recipe_runs_unmodified_through_the_synced_sampler(tmp_path, server, model_dir):
    metrics = run_recipe("tinker_cookbook.recipes.math_rl.train", [
        "env=arithmetic", f"model_name={model_dir}", "renderer_name=role_colon", "groups_per_batch=4",
        "group_size=4", "max_tokens=5", "max_steps=3", "eval_every=0", "save_every=0", "lora_rank=0"],
        tmp_path / "rl", server)
    steps = [m for m in metrics if "env/all/reward/total" in m]
    assert [m["step"] for m in steps] == [0, 1, 2]
    # The sampler's log-probs of its own tokens are the trainer's (bf16 vs fp32 weights): the
    # weights the agent serves are the ones the trainer published.
    assert all(abs(m["optim/kl_sample_train_v1"]) < 1e-3 for m in steps)
    assert all(m["env/all/total_episodes"] == 16 for m in steps)
