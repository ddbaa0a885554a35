"""moe: the sparse Mixture-of-Experts feed-forward block, with Hugging Face tensor names.

A layer's `mlp` is either the dense SwiGLU (`SwiGLU`) or this block: a router (`mlp.gate`, a
linear map to one logit per expert) picks the top-k experts of each token, and the token's output
is the experts' SwiGLU outputs weighted by their router probabilities (softmax over all experts,
the top-k renormalised to sum to 1 where `norm_topk_prob` says so). Qwen2-MoE adds a shared expert
every token goes through, scaled by a sigmoid gate (`mlp.shared_expert`, `mlp.shared_expert_gate`).

Experts are a ModuleList of SwiGLUs, so `state_dict()` has the per-expert names HF checkpoints
use (`mlp.experts.E.{gate,up,down}_proj.weight`; transformers 5 fuses them in memory but writes
these), what vLLM and HF both load, and what the publisher chunks per expert.

`load_balancing_loss` is the Switch Transformer auxiliary loss the trainer adds (times
`router_aux_loss_coef`) to keep the router from collapsing onto a few experts.

Not here: attention and the decoder (`decoder.py`), training (`trainer/`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from weightsync.models.decoder import ModelConfig


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): a dense layer's MLP, one expert, or the shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def is_sparse_layer(c: ModelConfig, layer: int) -> bool:
    """Whether `layer`'s MLP is a MoE block: HF's rule (every `decoder_sparse_step`-th layer,
    except those in `mlp_only_layers`)."""
    return c.num_experts > 0 and layer not in c.mlp_only_layers and (layer + 1) % c.decoder_sparse_step == 0


class SparseMoeBlock(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = c.num_experts, c.num_experts_per_tok, c.norm_topk_prob
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(c.hidden_size, c.moe_intermediate_size) for _ in range(c.num_experts))
        if c.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(c.hidden_size, c.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits (tokens, experts), top-k weights (tokens, k) in x's dtype, top-k expert
        ids (tokens, k)) for the tokens x (tokens, hidden). Probabilities in fp32, as HF does: in
        bf16, near-ties between experts would pick differently from run to run of other kernels."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor, router_logits: list[torch.Tensor] | None = None) -> torch.Tensor:
        """x (batch, tokens, hidden). `router_logits`, when given, gets this layer's (tokens,
        experts) logits appended, for `load_balancing_loss`."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, weights, experts = self.route(x)
        if router_logits is not None:
            router_logits.append(logits)
        out = torch.zeros_like(x)
        # Each expert runs once, on the tokens routed to it. While training, an expert nobody
        # picked runs on no tokens, so its gradient is zero rather than None: FSDP2 reduces only
        # the gradients that exist, and ranks that routed differently must reduce the same tensors.
        hit = range(self.num_experts) if torch.is_grad_enabled() else experts.unique().tolist()
        for expert in hit:
            token, slot = torch.where(experts == expert)
            y = self.experts[expert](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)


def load_balancing_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """The Switch Transformer auxiliary loss over every MoE layer's router logits (each (tokens,
    experts)): num_experts * sum over the k slots and experts e of (fraction of tokens whose slot
    picks e) * (mean probability of e); top_k when the router's probabilities are uniform. HF's load_balancing_loss_func with raw logits (transformers 5
    records softmaxed ones and applies softmax again; this follows the paper)."""
    if not router_logits:
        raise ValueError("load_balancing_loss needs the router logits of at least one MoE layer")
    logits = torch.cat([t.float() for t in router_logits], dim=0)
    probs = torch.softmax(logits, dim=-1)
    picked = F.one_hot(torch.topk(probs, top_k, dim=-1).indices, num_experts).float()  # (tokens, k, experts)
    return num_experts * torch.sum(picked.mean(dim=0) * probs.mean(dim=0).unsqueeze(0))
