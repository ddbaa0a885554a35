"""The placement plan and the in-place delta applier on vLLM-shaped modules, torch only.

harness/vllm_layout.py stands in for vLLM's layers (the attributes its loaders shard and fuse by,
and an independent loader written from its rules), on one rank or on each of two
tensor-parallel ranks. Real vLLM: test_vllm_delta.py.
"""

from __future__ import annotations

import pytest
import torch

from harness import vllm_layout as vl
from weightsync.agents.engines import placement as pl
from weightsync.agents.engines import position_digest as pd
from weightsync.agents.engines.delta_apply import DeltaApplier, DeltaRefused
from weightsync.agents.engines.delta_file import TensorChanges, join_positions, split_positions, write_delta_file

DIMS = vl.Dims()
HF_SHAPES = vl.hf_shapes(DIMS)


def Model(tp_rank, tp_size, **kw):  # noqa: N802 - a model class, as the tests below use it
    return vl.LayerModel(DIMS, tp_rank, tp_size, **kw)


def load(model, hf, tp_rank, tp_size):
    vl.load(model, hf, DIMS, tp_rank, tp_size)


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
