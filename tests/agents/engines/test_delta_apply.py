"""The placement plan and the in-place delta applier on vLLM-shaped modules, torch only.

Stands in for vLLM's layers: modules with the attributes vLLM's loaders shard and fuse by
(`output_partition_sizes`, `num_kv_head_replicas`, `shard_indices`, `input_dim`/`output_dim`,
`moe_config`), loaded here by an independent loader written from vLLM's rules, on one rank or on
each of two tensor-parallel ranks. Real vLLM: test_vllm_delta.py.
"""

from __future__ import annotations

import types

import pytest
import torch

from weightsync.agents.engines import placement as pl
from weightsync.agents.engines import position_digest as pd
from weightsync.agents.engines.delta_apply import DeltaApplier, DeltaRefused
from weightsync.agents.engines.delta_file import TensorChanges, join_positions, split_positions, write_delta_file

VOCAB, PADDED, HIDDEN, HEAD, HEADS, KV_HEADS, INTER, EXPERTS, MOE_INTER = 10, 16, 8, 2, 4, 1, 12, 3, 6


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
    def __init__(self, tp_rank, tp_size):
        super().__init__()
        inter = MOE_INTER // tp_size
        self.w13_weight = torch.nn.Parameter(torch.zeros(EXPERTS, 2 * inter, HIDDEN, dtype=torch.bfloat16), False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(EXPERTS, HIDDEN, inter, dtype=torch.bfloat16), False)
        self.moe_config = types.SimpleNamespace(
            tp_rank=tp_rank, tp_size=tp_size, num_experts=EXPERTS, is_act_and_mul=True
        )
        self.quant_method = UnquantizedFusedMoEMethod()


class Model(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, tp_rank, tp_size, *, quantized_down=False):
        super().__init__()
        tp = {"tp_rank": tp_rank, "tp_size": tp_size}
        replicas = max(1, tp_size // KV_HEADS)
        q, kv = HEADS * HEAD // tp_size, max(1, KV_HEADS // tp_size) * HEAD
        rows = PADDED // tp_size
        shard = types.SimpleNamespace(
            org_vocab_start_index=min(VOCAB, tp_rank * rows), org_vocab_end_index=min(VOCAB, (tp_rank + 1) * rows)
        )
        self.embed = VocabParallelEmbedding(rows, HIDDEN, org_vocab_size=VOCAB, shard_indices=shard, **tp)
        self.qkv_proj = QKVParallelLinear(
            q + 2 * kv, HIDDEN, output_partition_sizes=[q, kv, kv], num_kv_head_replicas=replicas, **tp
        )
        self.o_proj = RowParallelLinear(HIDDEN, HEADS * HEAD // tp_size, **tp)
        self.o_proj.weight.input_dim = 1
        self.gate_up_proj = MergedColumnParallelLinear(
            2 * INTER // tp_size, HIDDEN, output_partition_sizes=[INTER // tp_size] * 2, **tp
        )
        self.down_proj = RowParallelLinear(
            HIDDEN, INTER // tp_size, quant=Fp8LinearMethod if quantized_down else UnquantizedLinearMethod, **tp
        )
        self.down_proj.weight.input_dim = 1
        self.norm = torch.nn.Parameter(torch.zeros(HIDDEN, dtype=torch.bfloat16), requires_grad=False)
        self.experts = Experts(tp_rank, tp_size)
        self.lm_head = ParallelLMHead(rows, HIDDEN, org_vocab_size=VOCAB, shard_indices=shard, **tp)
        self.lm_head.weight = self.embed.weight  # tied
        self.lm_head.cpu_linear = ("handle", None)


HF_SHAPES = {
    "embed.weight": (VOCAB, HIDDEN),
    "q_proj.weight": (HEADS * HEAD, HIDDEN),
    "k_proj.weight": (KV_HEADS * HEAD, HIDDEN),
    "v_proj.weight": (KV_HEADS * HEAD, HIDDEN),
    "o_proj.weight": (HIDDEN, HEADS * HEAD),
    "gate_proj.weight": (INTER, HIDDEN),
    "up_proj.weight": (INTER, HIDDEN),
    "down_proj.weight": (HIDDEN, INTER),
    "norm": (HIDDEN,),
    **{f"experts.{e}.{p}_proj.weight": (MOE_INTER, HIDDEN) for e in range(EXPERTS) for p in ("gate", "up")},
    **{f"experts.{e}.down_proj.weight": (HIDDEN, MOE_INTER) for e in range(EXPERTS)},
}


def load(model: Model, hf: dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> None:
    """vLLM's loading rules, written out independently of weightsync's plan."""

    def rows(t, size):
        return t.narrow(0, tp_rank * size, size)

    with torch.no_grad():
        emb = torch.zeros(PADDED // tp_size, HIDDEN, dtype=torch.bfloat16)
        start = min(VOCAB, tp_rank * (PADDED // tp_size))
        stop = min(VOCAB, (tp_rank + 1) * (PADDED // tp_size))
        emb[: stop - start] = hf["embed.weight"][start:stop]
        model.embed.weight.copy_(emb)
        q = HEADS * HEAD // tp_size
        kv_rank = tp_rank // max(1, tp_size // KV_HEADS)
        kv = max(1, KV_HEADS // tp_size) * HEAD
        model.qkv_proj.weight.copy_(
            torch.cat(
                [rows(hf["q_proj.weight"], q)]
                + [hf[f"{p}_proj.weight"].narrow(0, kv_rank * kv, kv) for p in ("k", "v")]
            )
        )
        model.o_proj.weight.copy_(hf["o_proj.weight"].narrow(1, tp_rank * q, q))
        inter = INTER // tp_size
        model.gate_up_proj.weight.copy_(
            torch.cat([rows(hf["gate_proj.weight"], inter), rows(hf["up_proj.weight"], inter)])
        )
        model.down_proj.weight.copy_(hf["down_proj.weight"].narrow(1, tp_rank * inter, inter))
        model.norm.copy_(hf["norm"])
        mi = MOE_INTER // tp_size
        for e in range(EXPERTS):
            gate, up = (rows(hf[f"experts.{e}.{p}_proj.weight"], mi) for p in ("gate", "up"))
            model.experts.w13_weight[e].copy_(torch.cat([gate, up]))
            model.experts.w2_weight[e].copy_(hf[f"experts.{e}.down_proj.weight"].narrow(1, tp_rank * mi, mi))


def held_state(model: Model, applier: DeltaApplier) -> dict[str, torch.Tensor]:
    """What the rank serves: live parameters, and the unpacked copies standing in for emptied ones."""
    out = {n: p.detach().clone() for n, p in model.named_parameters() if p.numel()}
    for key, target in applier.plan.targets.items():
        out[key] = target.view(applier.plan.shapes[key]).clone()
    return out


def random_hf(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in HF_SHAPES.items()}


def rl_step(hf: dict[str, torch.Tensor], seed: int, fraction: float = 0.05) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in hf.items():
        mask = torch.rand(t.shape, generator=g) < fraction
        out[n] = torch.where(mask, (t.float() * (1 + 2**-6)).to(t.dtype), t)
    return out


def changes_of(old: dict, new: dict) -> list[TensorChanges]:
    out = []
    for name in sorted(new):
        flat_old, flat_new = old[name].reshape(-1), new[name].reshape(-1)
        positions = torch.nonzero(flat_old.view(torch.int16) != flat_new.view(torch.int16)).reshape(-1)
        out.append(
            TensorChanges(
                name=name,
                dtype=flat_new.dtype,
                shape=tuple(new[name].shape),
                positions=positions,
                values=flat_new[positions],
            )
        )
    return out


def agent_sum(hf: dict, changes: list[TensorChanges]) -> int:
    return pd.add(
        *(
            pd.position_sum(pd.tensor_id(c.name), c.positions, pd.element_bits(hf[c.name].reshape(-1)[c.positions]))
            for c in changes
        )
    )


def build_ranks(hf, tp_size, **kw):
    """Per rank: (model, applier), loaded with `hf`; down_proj's weight emptied as the CPU kernel
    does, its unpacked copy kept."""
    ranks = []
    for rank in range(tp_size):
        model = Model(rank, tp_size, **kw)
        load(model, hf, rank, tp_size)
        copies = {"down_proj.weight": pl.keep_copy(model.down_proj.weight)}
        model.down_proj.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
        model.down_proj.cpu_linear = ("handle", copies["down_proj.weight"].clone())

        def build(module, weight):
            return ("handle", weight.clone())

        applier = DeltaApplier(build)
        applier.reset("v1", pl.build_plan(model, copies))
        ranks.append((model, applier))
    return ranks


def expected_state(hf, rank, tp_size, **kw) -> dict[str, torch.Tensor]:
    model = Model(rank, tp_size, **kw)
    load(model, hf, rank, tp_size)
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tp_size", [1, 2])
def test_every_hf_element_is_placed_once_owned_and_read_back(tp_size):
    hf = random_hf(0)
    ranks = build_ranks(hf, tp_size)
    owned_numel = {name: 0 for name in HF_SHAPES}
    for model, applier in ranks:
        plan = applier.plan
        assert set(plan.placements) == set(HF_SHAPES)
        for name, places in plan.placements.items():
            for place in places:
                assert place.hf_shape == HF_SHAPES[name], name
                piece = hf[name][tuple(slice(s, s + n) for s, n in place.box)]
                assert torch.equal(pl.read_box(place, plan), piece), name
                owned_numel[name] += place.numel if place.owned else 0
        assert plan.handles["embed.weight"] == [model.lm_head]  # the tied head, not the embedding
        assert plan.handles["down_proj.weight"] == [model.down_proj] and not plan.live["down_proj.weight"]
    assert owned_numel == {n: torch.Size(s).numel() for n, s in HF_SHAPES.items()}, "each element owned once"


@pytest.mark.parametrize("tp_size", [1, 2])
def test_ten_delta_swaps_land_bit_exactly_with_sums_that_add_up_and_undo_restores(tmp_path, tp_size):
    hf = random_hf(1)
    ranks = build_ranks(hf, tp_size)
    for step in range(1, 11):
        new = rl_step(hf, seed=100 + step)
        changes = changes_of(hf, new)
        path = tmp_path / f"d{step}.safetensors"
        write_delta_file(path, changes, parent=f"v{step}", version=f"v{step + 1}")
        staged = [applier.stage(str(path)) for _, applier in ranks]
        assert pd.add(*(int(s["old_sum"]) for s in staged)) == agent_sum(hf, changes), "old bits, over the ranks"
        assert pd.add(*(int(s["new_sum"]) for s in staged)) == agent_sum(new, changes), "staged new bits"
        for model, _applier in ranks:  # staged only: what is served has not changed
            assert torch.equal(model.norm, expected_state(hf, 0, 1)["norm"])
            assert model.down_proj.cpu_linear[1] is not None
        assert all(applier.commit()["landed"] for _, applier in ranks), "the written bits read back as staged"
        for rank, (model, applier) in enumerate(ranks):
            want = expected_state(new, rank, tp_size)
            got = held_state(model, applier)
            for name, tensor in want.items():
                assert torch.equal(got[name], tensor), f"step {step} rank {rank} {name}"
            assert torch.equal(model.down_proj.cpu_linear[1], want["down_proj.weight"]), "handle rebuilt"
            assert torch.equal(model.lm_head.cpu_linear[1], want["embed.weight"]), "tied head's handle rebuilt"
        previous, hf = hf, new
    for _, applier in ranks:  # a parity refuse: the last swap goes back from the undo log
        applier.stage_undo("v11")
        applier.commit()
        assert applier.held == "v10"
    for rank, (model, applier) in enumerate(ranks):
        for name, tensor in expected_state(previous, rank, tp_size).items():
            assert torch.equal(held_state(model, applier)[name], tensor), f"undo rank {rank} {name}"


@pytest.mark.parametrize("tp_size", [1, 2])
def test_the_audit_sums_what_the_ranks_hold_across_a_swap_mid_pass(tmp_path, tp_size):
    hf = random_hf(2)
    ranks = build_ranks(hf, tp_size)
    new = rl_step(hf, seed=7)
    path = tmp_path / "d.safetensors"
    write_delta_file(path, changes_of(hf, new), parent="v1", version="v2")
    sums = []
    for _, applier in ranks:
        assert applier.audit_step(40, "p1") == {"done": False}  # a pass under way ...
        applier.stage(str(path))
        assert applier.audit_step(40, "p1") == {"busy": True}
        applier.commit()  # ... meets a swap
        while not (step := applier.audit_step(40, "p1"))["done"]:
            pass
        sums.append(int(step["sum"]))
    assert pd.add(*sums) == pd.weights_sum(new), "the pass ends on the version held at its end"

    model, applier = ranks[0]
    applier.poke("norm", 3, 0x3F80)
    while not (step := applier.audit_step(10_000, "p2"))["done"]:
        pass
    others = [int(a.audit_step(10_000, "p2")["sum"]) for _, a in ranks[1:]]
    assert pd.add(int(step["sum"]), *others) != pd.weights_sum(new), "a poked element changes the audit's sum"


def test_a_corrupted_element_changes_the_old_bit_sum_and_a_stale_parent_is_refused(tmp_path):
    hf = random_hf(3)
    ((model, applier),) = build_ranks(hf, 1)
    new = rl_step(hf, seed=9)
    changes = changes_of(hf, new)
    touched = next(c for c in changes if c.name == "q_proj.weight")
    applier.poke("q_proj.weight", int(touched.positions[0]), 0x1234)
    path = tmp_path / "d.safetensors"
    write_delta_file(path, changes, parent="v1", version="v2")
    assert int(applier.stage(str(path))["old_sum"]) != agent_sum(hf, changes)
    applier.discard()
    write_delta_file(path, changes, parent="v7", version="v8")
    with pytest.raises(DeltaRefused, match="holds v1, the delta is on v7"):
        applier.stage(str(path))


def test_a_quantized_layer_is_planned_for_a_native_reload_of_all_it_loads(tmp_path):
    hf = random_hf(4)
    ((model, applier),) = build_ranks(hf, 1, quantized_down=True)
    assert applier.plan.native == {
        "down_proj": {
            "reason": "quantized by Fp8LinearMethod: its weights are not the checkpoint's bits",
            "hf_names": ["down_proj.weight"],
        }
    }
    assert "down_proj.weight" not in applier.plan.placements
    new = rl_step(hf, seed=11)
    changes = [c for c in changes_of(hf, new) if c.name != "down_proj.weight"]
    dense = TensorChanges(
        name="down_proj.weight",
        dtype=torch.bfloat16,
        shape=HF_SHAPES["down_proj.weight"],
        dense=new["down_proj.weight"],
    )
    path = tmp_path / "d.safetensors"
    write_delta_file(path, [*changes, dense], parent="v1", version="v2")
    assert applier.stage(str(path))["dense"] == ["down_proj.weight"]
    reloaded = []
    applier.commit(native_reload=reloaded.extend)
    assert [n for n, _ in reloaded] == ["down_proj.weight"] and torch.equal(reloaded[0][1], new["down_proj.weight"])
    with pytest.raises(DeltaRefused, match="reloaded layers natively"):
        applier.stage_undo("v2")


def test_positions_travel_as_two_bytes_each():
    positions = torch.tensor([0, 1, 65535, 65536, 200_000, 1 << 20], dtype=torch.int64)
    low, counts = split_positions(positions, (1 << 20) + 1)
    assert low.dtype == torch.int16 and low.numel() == positions.numel()
    assert torch.equal(join_positions(low, counts), positions)
