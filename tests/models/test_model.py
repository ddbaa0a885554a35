"""The shared decoder (models/decoder.py): HF names per architecture, incremental decoding
equals full recomputation, weights handed in per call equal the module's own, and an HF-style
directory round-trips config and bf16 weights bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from weightsync.models import KVCache, ModelConfig, build_model, load_pretrained, save_pretrained, skeleton

SMALL = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
CASES = [("llama", False), ("qwen2", True), ("qwen3", False)]


@pytest.mark.parametrize("model_type,tied", CASES)
def test_names_follow_hugging_face(model_type, tied):
    names = set(build_model(ModelConfig(model_type=model_type, tie_word_embeddings=tied, **SMALL)).state_dict())
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names
    assert "model.layers.1.self_attn.o_proj.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names
    assert ("lm_head.weight" in names) is not tied
    assert ("model.layers.0.self_attn.q_proj.bias" in names) is (model_type == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in names) is (model_type == "qwen3")
    assert not any("inv_freq" in n for n in names)


@pytest.mark.parametrize("model_type,tied", CASES + [("qwen3_moe", False)])
def test_a_skeleton_has_every_name_and_shape_on_meta(model_type, tied):
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if model_type == "qwen3_moe" else {}
    config = ModelConfig(model_type=model_type, tie_word_embeddings=tied, **SMALL, **moe)
    built, bare = build_model(config).state_dict(), skeleton(config).state_dict()
    assert {n: t.shape for n, t in bare.items()} == {n: t.shape for n, t in built.items()}
    assert {t.device.type for t in bare.values()} == {"meta"}
    assert {n: t.dtype for n, t in bare.items()} == {n: t.dtype for n, t in built.items()}


def test_a_skeleton_runs_no_initializer_and_leaves_torch_dynamo_unimported():
    """In a fresh interpreter: on meta, torch runs nn.init through its reference kernels, whose
    first call imports torch._dynamo (seconds of CPU in every agent and server process)."""
    code = (
        "import sys, torch\n"
        "from weightsync.models import ModelConfig, skeleton\n"
        f"skeleton(ModelConfig(model_type='qwen3', **{SMALL!r}))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("model_type,tied", CASES)
def test_kv_cache_and_per_call_weights_match_full_recompute(model_type, tied):
    model = build_model(ModelConfig(model_type=model_type, tie_word_embeddings=tied, **SMALL), seed=1)
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    full = model(x)
    cache = KVCache(2)
    pieces = [model(x[:, :4], cache=cache), model(x[:, 4:5], cache=cache), model(x[:, 5:], cache=cache)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)

    weights = {k: v.clone() for k, v in model.state_dict().items()}
    torch.testing.assert_close(model(x, weights=weights), full, atol=0, rtol=0)
    other = {k: v * 1.5 for k, v in weights.items()}
    assert not torch.allclose(model(x, weights=other), full)
    assert torch.equal(model(x), full), "per-call weights must not touch the module's parameters"


def test_greedy_generation_equals_step_by_step_argmax():
    model = build_model(ModelConfig(**SMALL), seed=2)
    prompt = torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(1))
    tokens, logprobs = model.generate(prompt, max_new_tokens=6, temperature=0)
    seq = prompt
    for i in range(6):
        logits = model(seq)[:, -1]
        assert torch.equal(logits.argmax(-1), tokens[:, i])
        torch.testing.assert_close(
            torch.log_softmax(logits, -1).gather(1, tokens[:, i : i + 1]).squeeze(1),
            logprobs[:, i],
            atol=1e-5,
            rtol=1e-5,
        )
        seq = torch.cat([seq, tokens[:, i : i + 1]], dim=1)


def test_sampling_is_seeded_and_stops():
    model = build_model(ModelConfig(**SMALL), seed=3)
    prompt = torch.zeros(4, 3, dtype=torch.long)
    a, _ = model.generate(prompt, max_new_tokens=8, generator=torch.Generator().manual_seed(5), top_k=10)
    b, _ = model.generate(prompt, max_new_tokens=8, generator=torch.Generator().manual_seed(5), top_k=10)
    assert torch.equal(a, b)
    stop = int(a[0, 0])
    c, _ = model.generate(
        prompt, max_new_tokens=8, generator=torch.Generator().manual_seed(5), top_k=10, stop_token=stop
    )
    assert c[0, 0] == stop and bool((c[0] == stop).all())


@pytest.mark.parametrize("model_type,tied", CASES)
def test_hf_directory_round_trip(tmp_path, model_type, tied):
    config = ModelConfig(model_type=model_type, tie_word_embeddings=tied, **SMALL)
    model = build_model(config, seed=4)
    save_pretrained(tmp_path, config, model.state_dict())
    doc = json.loads((tmp_path / "config.json").read_text())
    assert doc["model_type"] == model_type and doc["architectures"][0].endswith("ForCausalLM")
    loaded_config, weights = load_pretrained(tmp_path)
    assert loaded_config == config
    for name, tensor in model.state_dict().items():
        assert torch.equal(weights[name], tensor.to(torch.bfloat16)), name


def test_rope_theta_is_read_where_transformers_5_writes_it():
    doc = {
        "model_type": "qwen3",
        "vocab_size": 64,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    }
    assert ModelConfig.from_hf(doc).rope_theta == 1000000.0
    assert ModelConfig.from_hf({**doc, "rope_theta": 500.0}).rope_theta == 500.0  # the top level wins
    assert ModelConfig.from_hf({k: v for k, v in doc.items() if k != "rope_parameters"}).rope_theta == 10000.0


def test_a_directory_that_does_not_fit_the_config_is_refused(tmp_path):
    config = ModelConfig(**SMALL)
    weights = build_model(config).state_dict()
    del weights["model.norm.weight"]
    save_pretrained(tmp_path, config, weights)
    with pytest.raises(ValueError, match="missing"):
        load_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig(model_type="gpt2")


def test_byte_tokenizer_round_trips_text_and_stops_at_eos():
    from weightsync.models import ByteTokenizer

    tok = ByteTokenizer()
    ids = tok.encode("12+30=42 é")
    assert ids[0] == tok.BOS and max(ids) < tok.vocab_size
    assert tok.decode(ids) == "12+30=42 é"
    assert tok.decode([*tok.encode("ab", bos=False), tok.EOS, ord("c")]) == "ab"
