"""MoE in the shared decoder (models/moe.py): the same logits as HF transformers' own Qwen3-MoE and
Qwen2-MoE on the same checkpoint, HF's per-expert names both ways, dense layers where HF puts them,
the load-balancing loss as HF computes it from raw logits, and incremental decoding."""

from __future__ import annotations

import json

import pytest
import torch

from weightsync.checkpoint_io import open_checkpoint
from weightsync.models import KVCache, ModelConfig, build_model, load_pretrained, save_pretrained
from weightsync.models.moe import SparseMoeBlock, load_balancing_loss

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    mlp_only_layers=[1],  # a dense layer between two MoE layers, as HF places it
    max_position_embeddings=128,
)
HF_CASES = {
    "qwen3_moe": dict(norm_topk_prob=True),
    "qwen2_moe": dict(shared_expert_intermediate_size=48),
}


def _hf_model(model_type: str, directory):
    """A random HF model (fp32) saved by transformers as an HF checkpoint directory."""
    transformers = pytest.importorskip("transformers")
    config_class = {"qwen3_moe": transformers.Qwen3MoeConfig, "qwen2_moe": transformers.Qwen2MoeConfig}[model_type]
    model_class = {"qwen3_moe": transformers.Qwen3MoeForCausalLM, "qwen2_moe": transformers.Qwen2MoeForCausalLM}
    torch.manual_seed(0)
    config = config_class(**TINY, **HF_CASES[model_type], tie_word_embeddings=False)
    model = model_class[model_type](config).float().eval()
    with torch.no_grad():  # HF zero-initialises some of these; random ones test the wiring
        for name, p in model.named_parameters():
            if "gate" in name or "norm" in name:
                p.normal_(0.0, 0.5 if "gate" in name else 0.1).add_(1.0 if "norm" in name else 0.0)
    model.save_pretrained(directory, safe_serialization=True)
    return model


@pytest.mark.parametrize("model_type", sorted(HF_CASES))
def test_logits_match_hugging_face_on_its_own_checkpoint(model_type, tmp_path):
    hf = _hf_model(model_type, tmp_path / "hf")
    config, weights = load_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert config.model_type == model_type and config.num_experts == 8 and config.mlp_only_layers == (1,)
    ours = build_model(config)
    ours.load_state_dict(weights)
    x = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x).logits.float()
        got = ours(x)
    assert (got - want).abs().max().item() <= 1e-5, (got - want).abs().max().item()
    # Routing is not trivial here: several experts run, and the two MoE layers route differently.
    logits = []
    with torch.no_grad():
        ours(x, router_logits=logits)
    picks = [set(torch.topk(t, 2, dim=-1).indices.flatten().tolist()) for t in logits]
    assert len(logits) == 2 and all(len(p) >= 4 for p in picks), picks


@pytest.mark.parametrize("model_type", sorted(HF_CASES))
def test_our_checkpoint_loads_in_hugging_face_with_the_same_logits(model_type, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = ModelConfig(model_type=model_type, **TINY, **HF_CASES[model_type])
    model = build_model(config, seed=3)
    save_pretrained(tmp_path / "ours", config, model.state_dict(), dtype=torch.float32)
    doc = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert doc["architectures"] == [
        {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[model_type]
    ]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    x = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (model(x) - hf(x).logits.float()).abs().max().item() <= 1e-5


def test_names_are_hugging_faces_per_expert_names_and_dense_layers_stay_dense(tmp_path):
    config = ModelConfig(model_type="qwen3_moe", **TINY)
    names = set(build_model(config).state_dict())
    for layer in (0, 2):
        assert f"model.layers.{layer}.mlp.gate.weight" in names
        assert {f"model.layers.{layer}.mlp.experts.{e}.up_proj.weight" for e in range(8)} <= names
    assert "model.layers.1.mlp.gate_proj.weight" in names and not any(".1.mlp.experts" in n for n in names)
    assert not any("shared_expert" in n for n in names)
    _hf_model("qwen3_moe", tmp_path / "hf")
    assert set(open_checkpoint(tmp_path / "hf")) == names  # what transformers writes, name for name


def test_the_load_balancing_loss_is_hugging_faces_on_raw_logits():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(4)
    layers = [torch.randn(40, 8, generator=g) * 2 for _ in range(3)]
    want = load_balancing_loss_func(tuple(layers), num_experts=8, top_k=2)
    assert torch.allclose(load_balancing_loss(layers, num_experts=8, top_k=2), want, rtol=1e-6, atol=1e-7)
    uniform = [torch.zeros(40, 8)]  # equal probabilities: top_k, whichever experts the ties pick
    assert load_balancing_loss(uniform, 8, 2).item() == pytest.approx(2.0)
    assert transformers is not None
    with pytest.raises(ValueError, match="at least one MoE layer"):
        load_balancing_loss([], 8, 2)


def test_the_loss_trains_the_router_and_gives_every_expert_a_gradient():
    """Experts that no token picked get a zero gradient, not None: under FSDP2 every rank must
    reduce the same gradients, whatever its tokens were routed to."""
    config = ModelConfig(model_type="qwen3_moe", **TINY)
    model = build_model(config, seed=5)
    x = torch.randint(0, 300, (1, 2), generator=torch.Generator().manual_seed(6))  # 2 tokens: 4 experts at most
    logits = []
    out = model(x, router_logits=logits)
    (out.logsumexp(-1).mean() + config.router_aux_loss_coef * load_balancing_loss(logits, 8, 2)).backward()
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock) and block.gate.weight.grad.abs().sum() > 0
    ran = set(torch.topk(logits[0], 2, dim=-1).indices.flatten().tolist())
    assert len(ran) < 8
    for e, expert in enumerate(block.experts):
        grad = expert.up_proj.weight.grad
        assert grad is not None and bool(grad.abs().sum() > 0) is (e in ran), e


@pytest.mark.parametrize("model_type", sorted(HF_CASES))
def test_kv_cache_decoding_matches_full_recompute(model_type):
    config = ModelConfig(model_type=model_type, **TINY, **HF_CASES[model_type])
    model = build_model(config, seed=7)
    x = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        full = model(x)
        cache = KVCache(config.num_hidden_layers)
        steps = torch.cat(
            [model(x[:, :5], cache=cache), *[model(x[:, i : i + 1], cache=cache) for i in range(5, 9)]], 1
        )
    assert torch.allclose(full, steps, atol=1e-5)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(model_type="qwen3_moe", num_experts=0), "needs num_experts >= 1"),
        (
            dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=5),
            "num_experts_per_tok must be in 1..num_experts",
        ),
        (dict(model_type="qwen3", num_experts=4), "num_experts is for the MoE model types"),
        (dict(model_type="qwen3_moe", num_experts=4, shared_expert_intermediate_size=8), "Qwen2-MoE's"),
    ],
)
def test_a_config_that_is_no_moe_model_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)


def test_a_dense_config_json_is_unchanged_by_the_moe_fields(tmp_path):
    doc = ModelConfig().to_hf()
    assert not {"num_experts", "mlp_only_layers", "router_aux_loss_coef"} & set(doc)
