"""The vllm engine's adapter-only checks and handoff (agents/engines/vllm_lora.py), without a vLLM server:
what is refused before a server is touched, the PEFT directory vLLM reads, and the digest of an
adapter as vLLM holds it. The real server: tests/agents/engines/test_vllm_lora.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from weightsync.agents.engines import vllm_lora
from weightsync.errors import IntegrityError, LayoutError
from weightsync.format.hashing import xxh3_hex

INFO = {"enabled": True, "max_rank": 8, "modules": ["down_proj", "k_proj", "lm_head", "q_proj", "v_proj"], "ids": []}


def adapter(rank=4, modules=("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj")):
    g = torch.Generator().manual_seed(0)
    out = {}
    for module in modules:
        out[f"{module}.lora_A.weight"] = torch.randn(rank, 16, generator=g)
        out[f"{module}.lora_B.weight"] = torch.randn(24, rank, generator=g)
    return out


def write(path, tensors):
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path))
    return {n: xxh3_hex(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())) for n, t in tensors.items()}


def test_the_rank_of_a_servable_adapter():
    assert vllm_lora.adapter_rank(1, adapter(rank=4), INFO) == 4


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({}, "holds no tensors"),
        ({**adapter(), "model.norm.weight": torch.ones(16)}, "not a LoRA adapter matrix"),
        ({"m.q_proj.lora_A.weight": torch.ones(4, 16)}, "needs both lora_A and lora_B"),
        ({"m.q_proj.lora_A.weight": torch.ones(4, 16), "m.q_proj.lora_B.weight": torch.ones(24, 2)}, "A must be"),
        ({**adapter(rank=4), **adapter(rank=2, modules=("m.k_proj",))}, "mixes adapter ranks"),
        (adapter(rank=16), "--max-lora-rank 16"),
        (adapter(modules=("model.layers.0.mlp.gate_proj",)), "adapts \\['gate_proj'\\]"),
    ],
)
def test_adapters_vllm_cannot_serve_are_refused_with_the_reason(weights, message):
    with pytest.raises(LayoutError, match=message):
        vllm_lora.adapter_rank(3, weights, INFO)


def test_the_peft_directory_holds_the_tensors_under_peft_names_and_the_config(tmp_path):
    weights = adapter()
    hashes = vllm_lora.write_peft_dir(tmp_path / "peft", weights, 4, 32.0, write)
    stored = load_file(str(tmp_path / "peft" / vllm_lora.WEIGHTS_FILE))
    assert sorted(stored) == sorted(hashes) == sorted("base_model.model." + n for n in weights)
    assert all(torch.equal(stored["base_model.model." + n], t) for n, t in weights.items())
    config = json.loads((tmp_path / "peft" / vllm_lora.CONFIG_FILE).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 32.0 and config["target_modules"] == ["down_proj", "q_proj"]
    assert config["peft_type"] == "LORA" and config["bias"] == "none"


def test_the_held_digest_is_of_lora_b_times_alpha_over_rank_in_the_served_dtype():
    weights = adapter()
    scale = 32.0 / 4
    dtypes = {"bfloat16": torch.bfloat16}
    reports = [{"tensors": {}}]
    for name, t in weights.items():
        held = t.to(torch.bfloat16) * scale if name.endswith("lora_B.weight") else t.to(torch.bfloat16)
        reports[0]["tensors"][name] = ["bfloat16", xxh3_hex(memoryview(held.view(-1).view(torch.uint8).numpy()))]
    vllm_lora.verify(5, weights, reports, scale, {}, dtypes)  # passes: what vLLM holds
    a_name = "model.layers.0.self_attn.q_proj.lora_A.weight"
    assert all(torch.equal(t, adapter()[n]) for n, t in weights.items()), "hashing left the agent's tensors alone"
    bad = json.loads(json.dumps(reports))
    bad[0]["tensors"][a_name][1] = "0" * 32
    with pytest.raises(IntegrityError, match=f"holds adapter tensor {a_name}"):
        vllm_lora.verify(5, weights, bad, scale, {}, dtypes)
    missing = json.loads(json.dumps(reports))
    del missing[0]["tensors"][a_name]
    with pytest.raises(LayoutError, match="1 tensors missing"):
        vllm_lora.verify(5, weights, missing, scale, {}, dtypes)
    unscaled = json.loads(json.dumps(reports))  # an engine that ignored the scale would not pass
    b_name = "model.layers.0.self_attn.q_proj.lora_B.weight"
    b = weights[b_name].to(torch.bfloat16)
    unscaled[0]["tensors"][b_name][1] = xxh3_hex(memoryview(b.view(-1).view(torch.uint8).numpy()))
    with pytest.raises(IntegrityError):
        vllm_lora.verify(5, weights, unscaled, scale, {}, dtypes)
