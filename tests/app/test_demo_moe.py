"""`weightsync demo --moe`: the flag swaps the demo's dense Qwen3 for a tiny Qwen3-MoE of the same
active size, in the trainer's and every agent's config. The run itself (minutes) is the demo's own
proof: docs/benchmarks.md cites one."""

from __future__ import annotations

import argparse

from weightsync.app.cli import jobs
from weightsync.app.demo.run import _ARCH, MOE_ARCHITECTURE, _agent_toml, _trainer_toml
from weightsync.models import ModelConfig, num_parameters


def test_the_moe_architecture_has_the_dense_demo_models_active_size():
    moe, dense = ModelConfig(**MOE_ARCHITECTURE), ModelConfig(**_ARCH)
    assert moe.is_moe and moe.model_type == "qwen3_moe" and moe.num_experts == 8
    assert moe.num_experts_per_tok * moe.moe_intermediate_size == dense.intermediate_size
    assert num_parameters(moe) > 2 * num_parameters(dense)


def test_the_moe_flag_reaches_the_trainer_and_the_agents(tmp_path):
    parser = argparse.ArgumentParser()
    jobs.add_parsers(parser.add_subparsers())
    config = jobs.demo_config(parser.parse_args(["demo", "--moe", "--quick", "--out-dir", str(tmp_path / "demo")]))
    assert config.architecture == MOE_ARCHITECTURE and config.rl_steps == 2
    assert jobs.demo_config(parser.parse_args(["demo"])).architecture == _ARCH
    trainer = _trainer_toml(config, tmp_path, leaders=["127.0.0.1:1"]).read_text()
    agent = _agent_toml(config, tmp_path, "region-a-1", "region-a", peers=[]).read_text()
    for text in (trainer, agent):
        assert 'model_type = "qwen3_moe"' in text and "num_experts = 8" in text
