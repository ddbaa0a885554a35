"""expert_parallel: a MoE model's experts partitioned over the "ep" ranks, tokens sent to them.

Each ep rank keeps num_experts / ep consecutive experts of every MoE layer (`partition_experts`,
on the meta model before FSDP): the block's `experts` becomes a ModuleDict keyed by the global
expert id, so the state dict keeps the HF names (`mlp.experts.E.gate_proj.weight`) and every rank
holds only its own experts' weights. The forward (`dispatch_forward`) routes every token as the
whole model would, then per layer:

    dispatch   each (token, slot) pair goes to the ep rank that holds its expert: one
               all_to_all of the counts, one of the hidden states, one of the expert ids
    compute    each rank runs its experts on what it received (every local expert, with or
               without tokens, while training: FSDP reduces the same gradients on every rank)
    combine    the outputs go back by the reverse all_to_all and are summed per token with their
               router weights

The all_to_alls carry gradients (backward is the reverse exchange), so an expert's gradient sums
the tokens of every ep rank that routed to it; FSDP then reduces it over dp_shard with its divide
factor set to the number of data-parallel ranks (parallel.apply_fsdp): it is not averaged over
the ep ranks. Collective: every rank runs every MoE layer, in the same order, with or without
gradients (the probe and the reference model too). gloo runs all_to_all on CPU.

Not here: routing and the expert MLP (`weightsync.models.moe`), the mesh (parallel.py).
"""

from __future__ import annotations

import re
import types
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor

from weightsync.models import CausalLM
from weightsync.models.moe import SparseMoeBlock


def check_ep_fits(num_experts: int, ep: int) -> None:
    """ValueError unless `ep` ranks can hold equal shares of the experts."""
    if num_experts % ep:
        raise ValueError(f"parallel.ep = {ep} must divide the model's num_experts ({num_experts})")


def local_experts(num_experts: int, ep: int, ep_rank: int) -> range:
    per_rank = num_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


_EXPERT_NAME = re.compile(r"^(?P<head>.+\.experts\.)(?P<expert>\d+)(?P<tail>\..+)$")


def is_expert_weight(name: str) -> bool:
    return _EXPERT_NAME.match(name) is not None


def whole_expert(
    name: str, held: Mapping[str, torch.Tensor], group: dist.ProcessGroup, num_experts: int
) -> torch.Tensor:
    """Expert weight `name`, whole, on every ep rank of `group`: gathered (over dp_shard) on the
    ranks that hold it (`held`: this rank's shards by name), broadcast from there to the others.
    Collective over the ep group and the owner's dp_shard group: every rank asks for the same
    names in the same order (the probe walks the model layer by layer)."""
    match = _EXPERT_NAME.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not an expert's weight (…experts.E.…)")
    ep = group.size()
    owner = int(match["expert"]) // (num_experts // ep)
    if name in held:
        tensor = held[name]
        tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    else:  # another rank's expert: shaped like this rank's own of the same layer
        mine = local_experts(num_experts, ep, dist.get_rank(group))
        like = held[f"{match['head']}{mine.start}{match['tail']}"]
        tensor = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    dist.broadcast(tensor, src=dist.get_global_rank(group, owner), group=group)
    return tensor


class LocalExperts(nn.ModuleDict):
    """This rank's experts of one layer, by global id (the state dict's names stay HF's), run as
    one module: FSDP unshards them together when `forward` is called."""

    def forward(self, tokens: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Each row of `tokens` through the expert `expert_ids` names (every expert while
        training, each with its rows or none; only those with rows otherwise)."""
        out = torch.zeros_like(tokens)
        keys = self.keys() if torch.is_grad_enabled() else [str(e) for e in expert_ids.unique().tolist()]
        for key in keys:
            rows = torch.where(expert_ids == int(key))[0]
            out = out.index_add(0, rows, self[key](tokens[rows]).to(out.dtype))
        return out


def partition_experts(model: CausalLM, group: dist.ProcessGroup, ep: int, ep_rank: int) -> list[nn.Module]:
    """Keeps this rank's experts of every MoE layer and makes the layer dispatch to the others;
    returns each layer's expert container (FSDP wraps them apart from their layer)."""
    containers = []
    for block in model.modules():
        if not isinstance(block, SparseMoeBlock):
            continue
        mine = local_experts(block.num_experts, ep, ep_rank)
        block.experts = LocalExperts({str(e): block.experts[e] for e in mine})
        block.ep_group, block.ep, block.experts_per_rank = group, ep, len(mine)
        block.forward = types.MethodType(dispatch_forward, block)
        containers.append(block.experts)
    return containers


def dispatch_forward(
    self: SparseMoeBlock, x: torch.Tensor, router_logits: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """SparseMoeBlock.forward with the experts on their ep ranks (the module docstring)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    logits, weights, experts = self.route(x)
    if router_logits is not None:
        router_logits.append(logits)
    tokens, k = experts.shape
    chosen = experts.reshape(-1)  # (tokens * k,): token t's slot s at t * k + s
    owner = torch.div(chosen, self.experts_per_rank, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)
    send_counts = torch.bincount(owner, minlength=self.ep)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=self.ep_group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    sent = x[torch.div(order, k, rounding_mode="floor")]
    received = funcol.all_to_all_single_autograd(sent, recv, send, self.ep_group)
    received_ids = chosen.new_empty(sum(recv))
    dist.all_to_all_single(received_ids, chosen[order].contiguous(), recv, send, group=self.ep_group)
    out = self.experts(received, received_ids)
    back = funcol.all_to_all_single_autograd(out, send, recv, self.ep_group)
    slots = torch.empty_like(back).index_copy(0, order, back).reshape(tokens, k, shape[-1])
    y = (slots * weights.unsqueeze(-1)).sum(dim=1)
    if hasattr(self, "shared_expert"):
        y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
    return y.reshape(shape)
