"""The trainer's LoRA adapters on a plain (unsharded) model: only the adapters train, the
adapted forward pass equals the merged weights' forward pass, and settings the model cannot take
are refused. The sharded path, end to end, is tests/app/training/test_training_lora.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from weightsync.errors import ConfigError
from weightsync.models import ModelConfig, build_model, token_logprobs
from weightsync.trainer import lora

CONFIG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def adapted_model(settings: lora.LoraSettings) -> tuple[torch.nn.Module, list[str]]:
    """A base model with adapters whose B is not zero (a trained state), as the engine builds them."""
    model = build_model(CONFIG, seed=1)
    base = model.state_dict()
    names = lora.attach(model, settings)
    adapters = lora.initial_adapters({k: tuple(v.shape) for k, v in base.items()}, names, settings)
    g = torch.Generator().manual_seed(2)
    adapters = {k: torch.randn(v.shape, generator=g) * 0.1 if ".lora_B." in k else v for k, v in adapters.items()}
    model.load_state_dict({**base, **adapters})
    return model, names


def test_only_the_adapters_train_and_merging_keeps_the_forward_pass():
    settings = lora.LoraSettings(rank=2, seed=7)
    model, names = adapted_model(settings)
    assert len(names) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and lm_head
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(name.endswith(lora.SUFFIXES) for name in trainable)
    assert set(lora.adapter_state_dict(model.state_dict())) == trainable

    merged = build_model(CONFIG, seed=0)
    merged.load_state_dict(lora.merged_state_dict(model.state_dict(), names, settings.scale))
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = token_logprobs(model(tokens[:, :-1]), tokens[:, 1:])
        got = token_logprobs(merged(tokens[:, :-1]), tokens[:, 1:])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_initial_adapters_start_from_the_base_model_and_follow_the_seed():
    settings = lora.LoraSettings(rank=3, train_attn=False, train_unembed=False, seed=5)
    shapes = {k: tuple(v.shape) for k, v in build_model(CONFIG).state_dict().items()}
    names = [n for n in (k[: -len(".weight")] for k in shapes) if n.rsplit(".", 1)[-1] in lora.MLP]
    first = lora.initial_adapters(shapes, names, settings)
    assert all(torch.equal(v, torch.zeros_like(v)) for k, v in first.items() if ".lora_B." in k)
    assert all(torch.equal(first[k], v) for k, v in lora.initial_adapters(shapes, names, settings).items())
    other = lora.initial_adapters(shapes, names, dataclasses.replace(settings, seed=6))
    assert not torch.equal(first[f"{names[0]}.lora_A.weight"], other[f"{names[0]}.lora_A.weight"])


def test_settings_the_model_cannot_take_are_refused():
    with pytest.raises(ConfigError, match="rank must be an integer >= 1"):
        lora.LoraSettings(rank=0)
    with pytest.raises(ConfigError, match="at least one of"):
        lora.LoraSettings(rank=1, train_attn=False, train_mlp=False, train_unembed=False)
    tied = dataclasses.replace(CONFIG, tie_word_embeddings=True)
    with pytest.raises(ConfigError, match="ties its embeddings"):
        lora.check_fits(tied, lora.LoraSettings(rank=1))
    lora.check_fits(tied, lora.LoraSettings(rank=1, train_unembed=False))
    with pytest.raises(ConfigError, match="ties its embeddings"):
        lora.attach(build_model(tied), lora.LoraSettings(rank=1))
