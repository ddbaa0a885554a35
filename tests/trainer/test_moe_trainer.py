"""The trainer on a Mixture-of-Experts model: the router's load-balancing loss splits exactly over
ranks and padding, LoRA adapts attention, router, shared expert and dense MLPs but not the experts
(unless asked), and, on 2 gloo ranks (one torchrun launch of `moe_scenarios.py`): full fine-tuning
and LoRA learn over 20 steps with the aux loss reported, the 2-rank gradient equals one unsharded
model's, a DCP round trip is bit-exact, and the MoE TOML configs run."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from harness.torchrun import run_under_torchrun
from weightsync.errors import ConfigError
from weightsync.models import ModelConfig, build_model, token_logprobs
from weightsync.models.moe import is_sparse_layer, load_balancing_loss
from weightsync.models.probe import run_probe, unrouted_experts
from weightsync.trainer import lora
from weightsync.trainer.config import load_job_config
from weightsync.trainer.data import Datum, Example, collate, collate_datums
from weightsync.trainer.losses import load_balancing_share, router_load

SCENARIOS = Path(__file__).with_name("moe_scenarios.py")
REPO = SCENARIOS.parents[2]
TINY = ModelConfig(
    model_type="qwen2_moe",
    vocab_size=259,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    mlp_only_layers=(1,),
    shared_expert_intermediate_size=48,
)


def routed(model, tokens):
    logits = []
    model(tokens, router_logits=logits)
    return logits


# ------------------------------------------------------------------------- the aux loss


def test_load_balancing_share_of_halves_adds_up_to_the_whole_batch():
    model = build_model(TINY, seed=1)
    tokens = torch.randint(0, 259, (4, 9), generator=torch.Generator().manual_seed(0))
    whole = load_balancing_loss(routed(model, tokens), 8, 2)
    full_mask = torch.ones(4, 9, dtype=torch.bool)
    load = router_load(routed(model, tokens), full_mask, num_experts=8, top_k=2)
    assert torch.allclose(load_balancing_share(load, load.picks, load.rows, load.rows), whole)
    # Two halves (two ranks): each adds its own rows with the counts of both.
    halves = [router_load(routed(model, tokens[i::2]), full_mask[i::2], num_experts=8, top_k=2) for i in (0, 1)]
    picks, rows = sum(h.picks for h in halves), sum(h.rows for h in halves)
    assert torch.equal(picks, load.picks) and rows == 4 * 9 * 2
    assert torch.allclose(sum(load_balancing_share(h, picks, rows, rows) for h in halves), whole)


def test_padding_is_not_routed_into_the_loss():
    model = build_model(TINY, seed=1)
    tokens = torch.randint(0, 259, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[True] * 8, [True] * 5 + [False] * 3])
    logits = routed(model, tokens)
    want = load_balancing_loss([t[mask.reshape(-1)] for t in logits], 8, 2)
    load = router_load(logits, mask, num_experts=8, top_k=2)
    assert load.rows == 13 * 2 and load.picks.sum() == 13 * 2 * 2
    assert torch.allclose(load_balancing_share(load, load.picks, load.rows, load.rows), want)


def test_batches_mark_their_padding():
    examples = [
        Example(tokens=[1, 2, 3, 4, 5], loss_weights=[0, 0, 1, 1, 1]),
        Example(tokens=[1, 2], loss_weights=[0, 1]),
    ]
    mb = collate(examples, max_seq_len=16, pad_multiple=8)
    assert mb.token_mask.tolist() == [[True] * 4 + [False] * 4, [True] + [False] * 7]
    datums = [Datum(np.arange(3), {"target_tokens": np.arange(3), "weights": np.ones(3, dtype=np.float32)})]
    assert collate_datums(datums, torch.device("cpu")).token_mask.tolist() == [[True] * 3]
    assert collate_datums([], torch.device("cpu")).token_mask.tolist() == [[False]]  # a rank without datums


# ------------------------------------------------------------------------------- LoRA


def test_lora_on_moe_adapts_router_shared_expert_and_dense_mlp_not_experts():
    model = build_model(TINY)
    names = lora.target_names(model, lora.LoraSettings(rank=2, train_unembed=False))
    assert "model.layers.0.mlp.gate" in names and "model.layers.2.mlp.gate" in names
    assert "model.layers.0.mlp.shared_expert.up_proj" in names and "model.layers.1.mlp.gate_proj" in names
    assert not [n for n in names if ".experts." in n or "shared_expert_gate" in n]
    assert len(names) == 3 * 4 + 2 * (1 + 3) + 3  # attention, MoE layers (router, shared expert), dense MLP
    attn_only = lora.target_names(model, lora.LoraSettings(rank=2, train_mlp=False, train_unembed=False))
    assert all(".self_attn." in n for n in attn_only) and len(attn_only) == 12
    with_experts = lora.target_names(model, lora.LoraSettings(rank=2, train_unembed=False, train_experts=True))
    assert len([n for n in with_experts if ".experts." in n]) == 2 * 8 * 3


def test_lora_on_moe_merged_weights_keep_the_forward_pass():
    settings = lora.LoraSettings(rank=2, seed=3, train_experts=True)
    model = build_model(TINY, seed=1)
    base = model.state_dict()
    names = lora.attach(model, settings)
    adapters = lora.initial_adapters({k: tuple(v.shape) for k, v in base.items()}, names, settings)
    g = torch.Generator().manual_seed(2)
    adapters = {k: torch.randn(v.shape, generator=g) * 0.1 if ".lora_B." in k else v for k, v in adapters.items()}
    model.load_state_dict({**base, **adapters})
    merged = build_model(TINY)
    merged.load_state_dict(lora.merged_state_dict(model.state_dict(), names, settings.scale))
    assert not torch.equal(
        merged.state_dict()["model.layers.0.mlp.gate.weight"], base["model.layers.0.mlp.gate.weight"]
    )
    tokens = torch.randint(0, 259, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = token_logprobs(model(tokens[:, :-1]), tokens[:, 1:])
        got = token_logprobs(merged(tokens[:, :-1]), tokens[:, 1:])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_train_experts_needs_a_moe_model():
    dense = dataclasses.replace(TINY, model_type="qwen3", num_experts=0, shared_expert_intermediate_size=0)
    with pytest.raises(ConfigError, match="train_experts needs a Mixture-of-Experts model"):
        lora.check_fits(dense, lora.LoraSettings(rank=1, train_experts=True))


def test_moe_configs_parse():
    for name in ("sft_moe_tiny", "grpo_moe_tiny"):
        job = load_job_config(REPO / "trainer" / "configs" / f"{name}.toml")
        assert job.train.model.architecture.is_moe and job.train.model.architecture.router_aux_loss_coef > 0


# ---------------------------------------------------------------------- 2 gloo ranks


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe")
    proc = run_under_torchrun(SCENARIOS, str(out), nproc=2, timeout_s=480, cwd=REPO)
    if proc.returncode != 0:
        pytest.fail(f"moe_scenarios failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return torch.load(out / "moe.pt", weights_only=False)


def learns(history) -> bool:
    losses = [m["loss"] for m in history]
    return len(losses) == 20 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5


@pytest.mark.distributed
@pytest.mark.slow
def test_full_fine_tuning_and_lora_learn_with_the_aux_loss(moe_run):
    assert learns(moe_run["full"]) and learns(moe_run["lora"])
    for history in (moe_run["full"], moe_run["lora"], moe_run["grpo"]):
        aux = [m["moe/aux_loss"] for m in history]
        # The Switch loss is top_k (2) when the routing is balanced, and at least 1 with top-2.
        assert all(math.isfinite(a) and 1.0 <= a < 8.0 for a in aux), aux
    assert len(moe_run["grpo"]) == 3 and all(m["grpo/kl"] >= 0 for m in moe_run["grpo"])


@pytest.mark.distributed
@pytest.mark.slow
def test_lora_trains_adapters_only_and_merges_the_router(moe_run):
    trainable = moe_run["lora_trainable"]
    assert trainable and all(n.endswith(lora.SUFFIXES) for n in trainable)
    assert "model.layers.0.mlp.gate.lora_B.weight" in trainable
    assert not [n for n in trainable if ".experts." in n]
    r = moe_run["lora_router"]
    assert r["B"].abs().max() > 0  # the router adapter trained
    torch.testing.assert_close(r["merged"], r["base"] + r["scale"] * r["B"] @ r["A"], rtol=0, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_rank_gradient_with_the_aux_loss_equals_one_model(moe_run):
    g = moe_run["grads"]
    config, tokens, mask = g["architecture"], g["tokens"], g["mask"]

    def reference(coef: float) -> dict[str, torch.Tensor]:
        model = build_model(config)
        model.load_state_dict(g["initial"])
        logits = []
        logprobs = token_logprobs(model(tokens[:, :-1], router_logits=logits), tokens[:, 1:])
        loss = -(logprobs * mask).sum() / mask.sum()
        aux = load_balancing_loss([t[mask.reshape(-1)] for t in logits], config.num_experts, config.num_experts_per_tok)
        (loss + coef * aux).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    want = reference(config.router_aux_loss_coef)
    assert set(g["grads"]) == set(want)
    for name, grad in g["grads"].items():
        assert torch.allclose(grad, want[name], rtol=1e-4, atol=1e-7), name
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(reference(0.0)[router], want[router], rtol=1e-3, atol=0)  # the aux loss is in it


@pytest.mark.distributed
@pytest.mark.slow
def test_dcp_round_trip_is_bit_exact(moe_run):
    for saved, loaded in (("dcp_saved", "dcp_loaded"), ("dcp_saved_next", "dcp_loaded_next")):
        assert set(moe_run[saved]) == set(moe_run[loaded])
        assert any(".experts.7.down_proj" in k for k in moe_run[saved])
        for name, tensor in moe_run[saved].items():
            assert torch.equal(tensor, moe_run[loaded][name]), name


@pytest.mark.distributed
@pytest.mark.slow
def test_the_parity_probe_of_an_moe_records_every_layers_experts(moe_run):
    """The trainer's parity probe on 2 ranks equals one plain model's forward on the weights
    exactly as published (bf16), in bf16 and in fp32, expert choices included, to the last bit:
    what a correct engine answers. Its prompts make every router pick every expert. The probe
    leaves the training weights as they were, bit for bit."""
    for name, tensor in moe_run["dcp_saved_next"].items():
        assert torch.equal(tensor, moe_run["probe_weights"][name]), name
    weights = {n: t.to(torch.bfloat16) for n, t in moe_run["probe_weights"].items()}
    architecture, prompts = moe_run["probe_architecture"], moe_run["probe_prompts"]
    assert len(prompts) >= 2
    want = run_probe(architecture, prompts, weights.__getitem__, dtypes=[torch.bfloat16, torch.float32])
    sparse_layers = sum(is_sparse_layer(architecture, i) for i in range(architecture.num_hidden_layers))
    for dtype, got in moe_run["probe_runs"].items():
        for mine, theirs in zip(got.experts, want[dtype].experts, strict=True):
            assert mine.shape[1] == sparse_layers and torch.equal(mine, theirs)
        for mine, theirs in zip(got.logprobs, want[dtype].logprobs, strict=True):
            assert torch.equal(mine, theirs)
    assert unrouted_experts(architecture, moe_run["probe_runs"][torch.bfloat16]) == {}


@pytest.mark.distributed
@pytest.mark.slow
def test_gloo_all_to_all_on_cpu_works(moe_run):
    """What expert parallelism would dispatch tokens with (trainer/README.md, "Mixture of
    Experts"): uneven splits arrive in rank order."""
    assert moe_run["all_to_all"] == [0.0, 1.0, 1.0]
