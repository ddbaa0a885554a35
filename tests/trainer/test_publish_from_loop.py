"""What the training loop publishes, as a new user met it: the step's metrics line said
`publish/version` of the version before (the last one committed, a step behind the weights just
published), and no version carried a config.json, so nothing pulled from the store loaded in an
engine. Now `publish/version` is the step's own version and every version names the model's
files (config.json of the architecture trained, with the dtype published).
"""

from __future__ import annotations

import json
import socket

import pytest
import torch
import torch.distributed as dist

from weightsync.model_files import get_model_files
from weightsync.models import ModelConfig, build_model
from weightsync.publisher import PublisherConfig
from weightsync.stores import LocalStore
from weightsync.trainer.config import ModelSpec, PublishConfig
from weightsync.trainer.publish import WeightPublisher, model_files_of
from weightsync.versions import read_manifest

ARCH = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1)


@pytest.fixture
def world_of_one():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_each_steps_line_names_its_own_version_and_every_version_carries_config_json(tmp_path, world_of_one):
    config = PublishConfig(store=str(tmp_path / "store"), model="loop", probe_prompts=0)
    files = model_files_of(ModelSpec(architecture=ARCH), ARCH, config)
    publisher = WeightPublisher(config, rank=0, world_size=1, model_files=files)
    model = build_model(ARCH, seed=0)
    lines = []
    try:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.lm_head.weight.add_(0.01)
            metrics = publisher.publish(model.state_dict(), step)  # what Trainer.publish does each step
            metrics.update(publisher.collect())
            lines.append(metrics)
    finally:
        publisher.close()
    assert [m["publish/version"] for m in lines] == [1, 2, 3]
    assert all(m.get("publish/committed_version", 0) <= m["publish/version"] for m in lines)
    store = LocalStore(tmp_path / "store")
    for version in (1, 2, 3):
        config_json = json.loads(get_model_files(store, "loop", read_manifest(store, "loop", version))["config.json"])
        assert ModelConfig.from_hf(config_json) == ARCH
        assert config_json["torch_dtype"] == "bfloat16" and config_json["architectures"] == ["Qwen3ForCausalLM"]


def test_a_run_from_an_init_directory_publishes_that_directorys_files(tmp_path):
    from harness.tiny_model import write_tiny_model

    init = write_tiny_model(tmp_path / "init")
    files = model_files_of(ModelSpec(init_dir=str(init)), ARCH, PublishConfig(store="unused"))
    assert files["config.json"] == (init / "config.json").read_bytes()
    assert "tokenizer.json" in files
    fp32 = PublishConfig(store="unused", publisher=PublisherConfig(cast_floats_to=None))
    kept = model_files_of(ModelSpec(architecture=ARCH), ARCH, fp32)
    assert json.loads(kept["config.json"])["torch_dtype"] == "float32"
