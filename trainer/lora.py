"""lora: low-rank adapters on the decoder's linear layers, and merging them into the weights.

A target `nn.Linear` W (out x in) gets two children, `lora_A` (rank x in, random) and `lora_B`
(out x rank, zeros, so training starts from the base model), and computes

    y = x W^T + scale * (x A^T) B^T,      scale = LORA_ALPHA / rank

The base weights are frozen; only A and B train. The adapters are attached before FSDP2
shards the model (they are sharded with their layer like any parameter) and their names are the
base layer's plus `.lora_A.weight` / `.lora_B.weight`, so DCP checkpoints carry them.

Targets (the SDK's LoraConfig): train_attn -> q/k/v/o_proj, train_mlp -> gate/up/down_proj,
train_unembed -> lm_head (a model with tied embeddings has no lm_head module: refused).

On a Mixture-of-Experts model, train_mlp adapts what every token goes through: the router
(`mlp.gate`), Qwen2-MoE's shared expert (`mlp.shared_expert.{gate,up,down}_proj`) and the dense
layers' MLPs. The experts (`mlp.experts.E.{gate,up,down}_proj`, most of the model) stay frozen,
which is what lets them be stored packed in a LoRA run; `train_experts` (not in the SDK's
LoraConfig) adapts them too. The shared expert's 1-row gate (`mlp.shared_expert_gate`) stays
frozen: a rank-r adapter of it would be larger than the weight.

Merging for engines that serve plain weights: W' = W + scale * B A. Each rank merges its own
piece of W, whatever the layout (FSDP rows, tensor-parallel column blocks, both): the piece's
rows of the whole (small) B times its columns of the whole A (`pieces.local_indices`).

Not here: building and sharding the model (engine.py), publishing (publish.py), checking a
request's lora_config (the Training API's front end).
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from weightsync.errors import ConfigError
from weightsync.models import ModelConfig
from weightsync.trainer.pieces import local_indices

LORA_ALPHA = 32.0
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ROUTER = "gate"
"""A MoE layer's router: `model.layers.N.mlp.gate` (a dense MLP's `gate_proj` is another name)."""
EXPERTS = "experts"
SUFFIXES = (".lora_A.weight", ".lora_B.weight")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraSettings:
    """Which layers get adapters, and of what rank (the Tinker SDK's LoraConfig)."""

    rank: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    seed: int | None = None
    """Seed of the adapters' initial A (None: 0)."""
    train_experts: bool = False
    """MoE models: adapters on every expert's gate/up/down_proj too (train_mlp alone adapts the
    router, the shared expert and dense MLPs; the experts stay frozen)."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
        if not (self.train_attn or self.train_mlp or self.train_unembed or self.train_experts):
            raise ConfigError("LoRA needs at least one of train_attn, train_mlp, train_unembed (or train_experts)")

    @property
    def scale(self) -> float:
        return LORA_ALPHA / self.rank


def check_fits(config: ModelConfig, settings: LoraSettings) -> None:
    """Raises ConfigError if these adapters cannot be attached to a model of `config`."""
    if settings.train_unembed and config.tie_word_embeddings:
        raise ConfigError(
            "train_unembed needs a separate lm_head, but this model ties its embeddings; set train_unembed=False"
        )
    if settings.train_experts and not config.is_moe:
        raise ConfigError(
            f"train_experts needs a Mixture-of-Experts model, but this one is {config.model_type!r}; "
            "set train_experts=False"
        )


def target_names(model: nn.Module, settings: LoraSettings) -> list[str]:
    """Module names (as in named_modules) of the linear layers that get adapters."""
    check_fits(model.config, settings)
    names = [
        name for name, module in model.named_modules() if isinstance(module, nn.Linear) and _is_target(name, settings)
    ]
    if settings.train_unembed:
        names.append("lm_head")
    return names


def _is_target(name: str, settings: LoraSettings) -> bool:
    """Whether the linear layer `name` gets an adapter (the module docstring's rules)."""
    parts = name.split(".")
    if EXPERTS in parts[:-1]:  # mlp.experts.E.gate_proj: an expert (never the shared_expert)
        return settings.train_experts and parts[-1] in MLP
    if parts[-1] in ATTN:
        return settings.train_attn
    if parts[-1] in MLP or (parts[-1] == ROUTER and parts[-2:-1] == ["mlp"]):
        return settings.train_mlp
    return False


def attach(model: nn.Module, settings: LoraSettings) -> list[str]:
    """Adds adapters to the target layers (on whatever device the model is, meta included) and
    freezes everything else; returns the target names."""
    names = target_names(model, settings)
    model.requires_grad_(False)
    for name in names:
        linear = model.get_submodule(name)
        linear.lora_A = nn.Linear(linear.in_features, settings.rank, bias=False, device=linear.weight.device)
        linear.lora_B = nn.Linear(settings.rank, linear.out_features, bias=False, device=linear.weight.device)
        linear.lora_scale = settings.scale
        linear.forward = types.MethodType(_lora_forward, linear)
    return names


def _lora_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, self.weight, self.bias) + self.lora_scale * self.lora_B(self.lora_A(x))


def initial_adapters(
    model_shapes: Mapping[str, tuple[int, ...]], names: list[str], settings: LoraSettings
) -> dict[str, torch.Tensor]:
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) (Kaiming-uniform with a=sqrt(5), as PEFT), drawn from
    `seed` in name order; B = 0."""
    generator = torch.Generator().manual_seed(0 if settings.seed is None else int(settings.seed))
    tensors = {}
    for name in names:
        out_features, in_features = model_shapes[f"{name}.weight"]
        bound = 1.0 / math.sqrt(in_features)
        tensors[f"{name}.lora_A.weight"] = torch.empty(settings.rank, in_features).uniform_(
            -bound, bound, generator=generator
        )
        tensors[f"{name}.lora_B.weight"] = torch.zeros(out_features, settings.rank)
    return tensors


def merged_state_dict(state: Mapping[str, torch.Tensor], names: list[str], scale: float) -> dict[str, torch.Tensor]:
    """The plain-model state dict (HF names, no adapters) with W + scale * B A for each target.

    Works on DTensors (each rank merges its own piece; A and B are gathered) and on plain tensors.
    """
    merged = {k: v for k, v in state.items() if not k.endswith(SUFFIXES)}
    for name in names:
        weight, a, b = state[f"{name}.weight"], state[f"{name}.lora_A.weight"], state[f"{name}.lora_B.weight"]
        with torch.no_grad():
            if isinstance(weight, DTensor):
                rows, cols = local_indices(weight)
                local = weight.to_local() + scale * (_whole(b)[rows] @ _whole(a)[:, cols])
                merged[f"{name}.weight"] = DTensor.from_local(
                    local, weight.device_mesh, weight.placements, shape=weight.shape, stride=weight.stride()
                )
            else:
                merged[f"{name}.weight"] = weight + scale * (b @ a)
    return merged


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def adapter_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Only the adapters (what an engine that serves LoRA adapters needs)."""
    return {k: v for k, v in state.items() if k.endswith(SUFFIXES)}
