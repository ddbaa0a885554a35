"""Frozen experts in 8 and 4 bits (models/packed.py) and in the training engine.

Packing: within half a quantization step of the weight, lossless on its own output, a fixed
int4 byte layout. The model: a packed MoE computes exactly what a plain model computes on the
published (dequantized) weights, close to the bf16 model, and backward reaches the input (LoRA,
router) but never the packed tensors. The engine on 2 gloo ranks: the packed experts are
sharded by FSDP2, published under HF names as the same bits every step, and a DCP checkpoint
restores them. Speed and memory are measured by bench/frozen_experts.py, not here."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from harness.bits import bits_equal
from weightsync.errors import ConfigError
from weightsync.models import ModelConfig, build_model, token_logprobs
from weightsync.models.packed import (
    PackedLinear,
    PackFormat,
    dequantize,
    dequantized_state_dict,
    pack,
    pack_experts,
    pack_state_dict,
)
from weightsync.trainer import lora

CONFIG = ModelConfig(
    model_type="qwen3_moe",
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
FORMATS = ["int8", "int4", "int4:32", "int8:32"]


def _weights(seed: int, shape=(48, 256)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    w[0, :128] = 0.0  # a group of zeros
    w[1, :128] *= 1e-30  # a group far below any real weight
    w[2, 128:] *= 1e4  # and a large one
    return w


@pytest.mark.parametrize("text", FORMATS)
def test_dequantized_weight_is_within_half_a_step_and_packs_back_to_the_same_bits(text):
    fmt = PackFormat.parse(text)
    w = _weights(0)
    packed = pack(w, fmt)
    got = dequantize(packed, fmt)
    assert got.dtype == torch.bfloat16
    step = packed["scales"].float().repeat_interleave(fmt.group_size, dim=1)
    assert bool(((w - got.float()).abs() <= step / 2 * (1 + 2**-20)).all())
    # Every q * s is a bf16 number: fp32 dequantization gives the same values, and packing them
    # again gives the same tensors, bit for bit.
    assert torch.equal(dequantize(packed, fmt, torch.float32), got.float())
    again = pack(got, fmt)
    assert all(bits_equal(again[k], packed[k]) for k in packed)
    assert bits_equal(pack(w, fmt)["qweight"], packed["qweight"])  # deterministic


def test_int4_layout_two_per_byte_low_nibble_first():
    # absmax 0.7 / 7 = 0.1, rounded up to 5 significant bits: 0.1015625; q = 7, -3, 0, 1.
    packed = pack(torch.tensor([[0.7, -0.35, 0.0, 0.1]]), PackFormat("int4", group_size=4))
    assert packed["scales"].item() == 0.1015625
    assert packed["qweight"].dtype == torch.bfloat16  # a storage type for the bytes
    assert packed["qweight"].view(torch.uint8).tolist() == [[0x5F, 0x98]]  # (7+8) | (-3+8) << 4, (0+8) | (1+8) << 4
    assert torch.equal(
        dequantize(packed, PackFormat("int4", group_size=4)).float(),
        torch.tensor([[7.0, -3.0, 0.0, 1.0]]) * 0.1015625,
    )


def test_formats_that_cannot_be_used_are_refused():
    with pytest.raises(ConfigError, match="one of"):
        PackFormat.parse("int3")
    with pytest.raises(ConfigError, match="int4:64"):
        PackFormat.parse("int4:g64")
    with pytest.raises(ConfigError, match="even"):
        PackFormat.parse("int4:33")
    with pytest.raises(ConfigError, match="not a multiple of the group size 128"):
        pack(torch.zeros(4, 96), PackFormat("int4"))
    with pytest.raises(ValueError, match="NaN or infinite"):
        pack(torch.tensor([[float("nan"), 0.0]]), PackFormat("int8", group_size=2))
    assert str(PackFormat.parse("int4:64")) == "int4:64" and str(PackFormat.parse("int4")) == "int4"


def _packed_model(text: str, seed: int = 0, settings: lora.LoraSettings | None = None):
    """A plain (unsharded) model with packed experts, loaded as the engine's build loads it."""
    base = build_model(CONFIG, seed=seed)
    state = base.state_dict()
    model = build_model(CONFIG, seed=seed)
    names = lora.attach(model, settings) if settings else []
    pack_experts(model, PackFormat.parse(text))
    full = pack_state_dict(state, model)
    if settings:
        full.update(lora.initial_adapters({k: tuple(v.shape) for k, v in state.items()}, names, settings))
    model.load_state_dict(full)
    return base, model, names


def _logprobs(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(model(tokens[:, :-1]), tokens[:, 1:])


@pytest.mark.parametrize("text", ["bf16", "int8:32", "int4:32"])
def test_packed_model_computes_what_a_plain_model_computes_on_the_published_weights(text):
    base, model, _ = _packed_model(text)
    published = dequantized_state_dict(model, model.state_dict())
    assert published.keys() == base.state_dict().keys()  # HF names, no qweight/scales
    assert published["model.layers.0.mlp.experts.3.down_proj.weight"].dtype == torch.bfloat16
    plain = build_model(CONFIG)
    plain.load_state_dict({k: v.float() for k, v in published.items()})
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    packed_lp = _logprobs(model, tokens)
    assert torch.equal(packed_lp, _logprobs(plain, tokens))
    # ... and close to the model with bf16 experts: int8 within 1e-3, int4 2e-2.
    bf16 = build_model(CONFIG)
    bf16.load_state_dict({k: v.bfloat16().float() if ".experts." in k else v for k, v in base.state_dict().items()})
    tolerance = {"bf16": 0.0, "int8:32": 1e-3, "int4:32": 2e-2}[text]
    diff = (packed_lp - _logprobs(bf16, tokens)).abs().max().item()
    assert diff <= tolerance


def test_backward_reaches_the_adapters_and_router_but_never_the_packed_experts():
    settings = lora.LoraSettings(rank=4, seed=1)
    _, model, names = _packed_model("int4:32", settings=settings)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 2 * 8 * 3
    assert not any(p.requires_grad for m in packed for p in m.parameters())
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(2))
    # A trained B: gradients then flow through every adapter into A as well.
    with torch.no_grad():
        for name in names:
            model.get_submodule(name).lora_B.weight.normal_(0.0, 0.1)
    (-token_logprobs(model(tokens[:, :-1]), tokens[:, 1:]).mean()).backward()
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained.values())
    assert any(".mlp.gate.lora_" in n for n in trained)  # the router's adapters
    assert all(p.grad is None for m in packed for p in m.parameters())

    # The input's gradient is that of F.linear on the dequantized weight.
    layer = packed[0]
    x = torch.randn(5, layer.in_features, requires_grad=True)
    layer(x).pow(2).sum().backward()
    want_x = x.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(want_x, layer.dequantize(torch.float32)).pow(2).sum().backward()
    assert torch.equal(x.grad, want_x.grad)


@pytest.mark.parametrize("text", ["bf16", "int8:32", "int4:32"])
def test_an_expert_no_token_picked_gives_empty_outputs_and_gradients(text):
    layer = PackedLinear(64, 32, PackFormat.parse(text))
    x = torch.zeros(0, 64, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 32)
    y.sum().backward()
    assert x.grad.shape == (0, 64)


def test_adapters_on_experts_cannot_sit_on_packed_weights():
    model = build_model(CONFIG)
    if "train_experts" not in lora.LoraSettings.__dataclass_fields__:
        pytest.skip("this lora.py has no train_experts setting")
    lora.attach(model, lora.LoraSettings(rank=2, train_experts=True))
    with pytest.raises(ConfigError, match="train_experts=False"):
        pack_experts(model, PackFormat("int4", group_size=32))


# ------------------------------------------------------------------------------- the engine, 2 ranks


def _engine_ranks(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    import torch.distributed as dist

    from weightsync.trainer.config import ParallelConfig
    from weightsync.trainer.engine import TrainingEngine
    from weightsync.trainer.losses import LossSums
    from weightsync.trainer.optim import AdamWParams
    from weightsync.trainer.parallel import build_mesh, close_runtime, init_runtime

    results: dict = {}
    runtime = init_runtime(ParallelConfig(device="cpu"))
    initial = build_model(CONFIG, seed=3).state_dict() if rank == 0 else None
    tokens = torch.randint(0, CONFIG.vocab_size, (4, 13), generator=torch.Generator().manual_seed(0))
    mine = tokens[rank::world]
    adamw = AdamWParams(lr=1e-2)

    def build(parallel: ParallelConfig, settings: lora.LoraSettings | None) -> TrainingEngine:
        mesh = build_mesh(parallel, runtime)
        return TrainingEngine.build(CONFIG, initial, mesh=mesh, parallel=parallel, device=runtime.device, lora=settings)

    def step(engine: TrainingEngine) -> float:
        _, result = engine.forward_backward(
            mine[:, :-1], mine[:, 1:], lambda lp: LossSums(-lp.sum(), {}), divisor=float(tokens[:, 1:].numel())
        )
        engine.clip_gradients(0.0)
        engine.optimizer_step(adamw)
        return float(result.loss)

    def local(state: dict) -> dict:
        return {k: v.to_local().detach().clone() for k, v in state.items()}

    # LoRA, bf16 mixed precision: the packed (uint8) experts go through FSDP2's all-gather uncast.
    parallel = ParallelConfig(device="cpu", mixed_precision="bf16", frozen_experts="int4:32")
    engine = build(parallel, lora.LoraSettings(rank=4, seed=1))
    results["packed_params"] = sorted(
        {type(p.to_local()).__name__ + ":" + str(p.dtype) for n, p in engine.model.named_parameters() if "experts" in n}
    )
    results["trainable_expert_params"] = [
        n for n, p in engine.model.named_parameters() if "experts" in n and p.requires_grad
    ]
    merged = [local(engine.weights("merged"))]
    results["losses"] = [step(engine), step(engine)]
    merged.append(local(engine.weights("merged")))
    results["merged"] = merged
    engine.save(os.path.join(out, "ckpt"))
    after_save = local(engine.model.state_dict())
    fresh = build(parallel, lora.LoraSettings(rank=4, seed=1))
    fresh.load(os.path.join(out, "ckpt"))
    results["restored_equal"] = (
        all(bits_equal(v, after_save[k]) for k, v in local(fresh.model.state_dict()).items())
        and after_save.keys() == local(fresh.model.state_dict()).keys()
    )
    results["restored_loss"] = step(fresh)
    results["continued_loss"] = step(engine)
    results["full"] = engine.full_state_dict()  # gathered on rank 0, dequantized experts

    # Full fine-tuning with experts frozen by config: everything but the experts trains.
    ft = build(ParallelConfig(device="cpu", frozen_experts="int8:32"), None)
    before = local(ft.weights())
    results["ft_loss"] = step(ft)
    after = local(ft.weights())
    results["ft_changed"] = sorted(k for k in before if not torch.equal(before[k], after[k]))
    results["ft_names"] = sorted(before)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    close_runtime(runtime)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_engine_on_two_ranks_shards_publishes_and_restores_packed_experts(tmp_path):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_engine_ranks, args=(2, port, str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    initial = build_model(CONFIG, seed=3).state_dict()
    fmt = PackFormat("int4", group_size=32)
    expert = "model.layers.1.mlp.experts.5.up_proj.weight"
    for rank, results in enumerate(ranks):
        assert results["packed_params"] == ["Tensor:torch.bfloat16"]
        assert results["trainable_expert_params"] == []
        first, second = results["merged"]
        assert first.keys() == second.keys() and expert in first and not any(".qweight" in k for k in first)
        experts = [k for k in first if ".experts." in k]
        assert len(experts) == 2 * 8 * 3
        # Frozen experts publish identical bits every step (no delta bytes); the rest moves.
        assert all(torch.equal(first[k], second[k]) for k in experts)
        assert not torch.equal(first["model.layers.0.mlp.gate.weight"], second["model.layers.0.mlp.gate.weight"])
        # Each rank's shard is its rows of the whole weight, packed from the fp32 initial weights.
        rows = dequantize(pack(initial[expert], fmt), fmt).chunk(2)[rank]
        assert torch.equal(first[expert], rows)
        assert results["restored_equal"]
        assert results["restored_loss"] == results["continued_loss"]
        assert all(".experts." not in k for k in results["ft_changed"])
        assert "model.layers.0.mlp.gate.weight" in results["ft_changed"]
        assert not any(k.endswith(".qweight") for k in results["ft_names"])
    full = ranks[0]["full"]
    assert torch.equal(full[expert], dequantize(pack(initial[expert], fmt), fmt))
