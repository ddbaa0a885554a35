"""vllm_layout: a stand-in for one decoder layer of vLLM's model in one worker, torch only.

Stands in for vLLM's layers where vLLM cannot run (the torch-only tests of the placement plan and
the delta applier, the mechanism benchmark): modules with the attributes vLLM's loaders shard and
fuse by (`output_partition_sizes`, `num_kv_head_replicas`, `shard_indices`, `input_dim` /
`output_dim`, `moe_config`), and `load`, an independent loader written from vLLM's rules, for one
rank of `tp_size`. Names are flat ("q_proj.weight", "experts.3.up_proj.weight").

Not here: the real vLLM (`vllm.py` starts one).
"""

from __future__ import annotations

import dataclasses
import types

import torch


@dataclasses.dataclass(frozen=True)
class Dims:
    vocab: int = 10
    padded_vocab: int = 16
    hidden: int = 8
    head: int = 2
    heads: int = 4
    kv_heads: int = 1
    inter: int = 12
    experts: int = 3
    moe_inter: int = 6
    tied: bool = True
    """lm_head is the embedding (a ParallelLMHead over its parameter, with its own kernel handle)."""


class UnquantizedLinearMethod:
    pass


class Fp8LinearMethod:
    pass


class UnquantizedFusedMoEMethod:
    moe_kernel = None


class Linear(torch.nn.Module):
    def __init__(self, rows, cols, *, quant=UnquantizedLinearMethod, **attrs):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(rows, cols, dtype=torch.bfloat16), requires_grad=False)
        self.weight.output_dim, self.quant_method = 0, quant()
        for key, value in attrs.items():
            setattr(self, key, value)


class QKVParallelLinear(Linear):
    pass


class MergedColumnParallelLinear(Linear):
    pass


class RowParallelLinear(Linear):
    pass


class VocabParallelEmbedding(Linear):
    pass


class ParallelLMHead(VocabParallelEmbedding):
    pass


class Experts(torch.nn.Module):
    def __init__(self, dims: Dims, tp_rank: int, tp_size: int):
        super().__init__()
        inter = dims.moe_inter // tp_size
        self.w13_weight = torch.nn.Parameter(
            torch.zeros(dims.experts, 2 * inter, dims.hidden, dtype=torch.bfloat16), requires_grad=False
        )
        self.w2_weight = torch.nn.Parameter(
            torch.zeros(dims.experts, dims.hidden, inter, dtype=torch.bfloat16), requires_grad=False
        )
        self.moe_config = types.SimpleNamespace(
            tp_rank=tp_rank, tp_size=tp_size, num_experts=dims.experts, is_act_and_mul=True
        )
        self.quant_method = UnquantizedFusedMoEMethod()


class LayerModel(torch.nn.Module):
    """The embedding, one attention and MLP block, a MoE block (when dims.experts), the final norm
    and the LM head, as one rank of `tp_size` holds them."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, dims: Dims, tp_rank: int = 0, tp_size: int = 1, *, quantized_down: bool = False):
        super().__init__()
        tp = {"tp_rank": tp_rank, "tp_size": tp_size}
        replicas = max(1, tp_size // dims.kv_heads)
        q, kv = dims.heads * dims.head // tp_size, max(1, dims.kv_heads // tp_size) * dims.head
        rows = dims.padded_vocab // tp_size
        shard = types.SimpleNamespace(
            org_vocab_start_index=min(dims.vocab, tp_rank * rows),
            org_vocab_end_index=min(dims.vocab, (tp_rank + 1) * rows),
        )
        self.embed = VocabParallelEmbedding(rows, dims.hidden, org_vocab_size=dims.vocab, shard_indices=shard, **tp)
        self.qkv_proj = QKVParallelLinear(
            q + 2 * kv, dims.hidden, output_partition_sizes=[q, kv, kv], num_kv_head_replicas=replicas, **tp
        )
        self.o_proj = RowParallelLinear(dims.hidden, dims.heads * dims.head // tp_size, **tp)
        self.o_proj.weight.input_dim = 1
        self.gate_up_proj = MergedColumnParallelLinear(
            2 * dims.inter // tp_size, dims.hidden, output_partition_sizes=[dims.inter // tp_size] * 2, **tp
        )
        quant = Fp8LinearMethod if quantized_down else UnquantizedLinearMethod
        self.down_proj = RowParallelLinear(dims.hidden, dims.inter // tp_size, quant=quant, **tp)
        self.down_proj.weight.input_dim = 1
        self.norm = torch.nn.Parameter(torch.zeros(dims.hidden, dtype=torch.bfloat16), requires_grad=False)
        if dims.experts:
            self.experts = Experts(dims, tp_rank, tp_size)
        if dims.tied:
            self.lm_head = ParallelLMHead(rows, dims.hidden, org_vocab_size=dims.vocab, shard_indices=shard, **tp)
            self.lm_head.weight = self.embed.weight
            self.lm_head.cpu_linear = ("handle", None)


def hf_shapes(dims: Dims) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors and shapes."""
    shapes = {
        "embed.weight": (dims.vocab, dims.hidden),
        "q_proj.weight": (dims.heads * dims.head, dims.hidden),
        "k_proj.weight": (dims.kv_heads * dims.head, dims.hidden),
        "v_proj.weight": (dims.kv_heads * dims.head, dims.hidden),
        "o_proj.weight": (dims.hidden, dims.heads * dims.head),
        "gate_proj.weight": (dims.inter, dims.hidden),
        "up_proj.weight": (dims.inter, dims.hidden),
        "down_proj.weight": (dims.hidden, dims.inter),
        "norm": (dims.hidden,),
    }
    for e in range(dims.experts):
        shapes[f"experts.{e}.gate_proj.weight"] = (dims.moe_inter, dims.hidden)
        shapes[f"experts.{e}.up_proj.weight"] = (dims.moe_inter, dims.hidden)
        shapes[f"experts.{e}.down_proj.weight"] = (dims.hidden, dims.moe_inter)
    return shapes


def load(model: LayerModel, hf: dict[str, torch.Tensor], dims: Dims, tp_rank: int = 0, tp_size: int = 1) -> None:
    """vLLM's loading rules, written out independently of weightsync's plan."""

    def rows(t, size):
        return t.narrow(0, tp_rank * size, size)

    with torch.no_grad():
        per_rank = dims.padded_vocab // tp_size
        start, stop = min(dims.vocab, tp_rank * per_rank), min(dims.vocab, (tp_rank + 1) * per_rank)
        model.embed.weight.zero_()
        model.embed.weight[: stop - start] = hf["embed.weight"][start:stop]
        q = dims.heads * dims.head // tp_size
        kv_rank = tp_rank // max(1, tp_size // dims.kv_heads)
        kv = max(1, dims.kv_heads // tp_size) * dims.head
        qkv = [rows(hf["q_proj.weight"], q)] + [hf[f"{p}_proj.weight"].narrow(0, kv_rank * kv, kv) for p in "kv"]
        model.qkv_proj.weight.copy_(torch.cat(qkv))
        model.o_proj.weight.copy_(hf["o_proj.weight"].narrow(1, tp_rank * q, q))
        inter = dims.inter // tp_size
        gate_up = [rows(hf["gate_proj.weight"], inter), rows(hf["up_proj.weight"], inter)]
        model.gate_up_proj.weight.copy_(torch.cat(gate_up))
        model.down_proj.weight.copy_(hf["down_proj.weight"].narrow(1, tp_rank * inter, inter))
        model.norm.copy_(hf["norm"])
        mi = dims.moe_inter // tp_size
        for e in range(dims.experts):
            gate, up = (rows(hf[f"experts.{e}.{p}_proj.weight"], mi) for p in ("gate", "up"))
            model.experts.w13_weight[e].copy_(torch.cat([gate, up]))
            model.experts.w2_weight[e].copy_(hf[f"experts.{e}.down_proj.weight"].narrow(1, tp_rank * mi, mi))
