"""MoE through the transport: with Hugging Face's per-expert names every expert is a tensor of its
own, so every chunk (the unit of encoding, storage, push and early apply) lies inside one expert,
and an expert whose bf16 bits did not change costs no stored byte, no pushed object, no pack
member. Checked on a real tiny Qwen3-MoE (weightsync.models), published whole and sharded over 2
ranks (threads here, as in test_sharded_publish.py), and through the trainer's own engine and
WeightPublisher on 2 real FSDP2 gloo ranks: full fine-tuning, experts frozen in bf16, and experts
frozen packed in int4 (published dequantized, the same bits every version).
"""

from __future__ import annotations

import math
import re
import threading

import pytest
import torch

from weightsync.format.manifest import CODEC_SAME, Manifest
from weightsync.models import ModelConfig, build_model
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.reader import Reader
from weightsync.shards import Placement, ShardSpec

# Experts of 64 x 64 bf16 (8 KiB): two 4 KiB chunks each, so chunk boundaries fall inside experts too.
TINY_MOE = ModelConfig(
    model_type="qwen3_moe",
    vocab_size=300,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    max_position_embeddings=128,
)
CONFIG = PublisherConfig(chunk_bytes=4096, workers=2)
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def _is_expert(name: str) -> bool:
    return _EXPERT.fullmatch(name) is not None


def _moe_state() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in build_model(TINY_MOE, seed=1).state_dict().items()}


def _step_attention_and_router(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """What a step that trains only attention and router (experts frozen) does: those tensors move
    by ~1e-3 relative (enough to flip many bf16 bits), every expert keeps its exact values."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        if ".self_attn." in name or name.endswith(".mlp.gate.weight"):
            t = t * (1.0 + 1e-3 * torch.randn(t.shape, generator=g))
        out[name] = t.clone()
    return out


class _Objects:
    """Records each encoded object's placement, as the push client (and so early apply) sees it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.placements = []

    def on_object(self, version, object_xxh3, obj, placement) -> None:
        with self.lock:
            self.placements.append((version, placement))

    def on_commit(self, manifest, manifest_bytes, signature) -> None:
        pass

    def on_failure(self, version, error) -> None:
        pass


def _stored_bytes(manifest: Manifest) -> dict[str, int]:
    return {t.name: sum(c.size for c in t.chunks if c.codec != CODEC_SAME) for t in manifest.tensors}


def _assert_only_named_tensors_cost_bytes(manifest: Manifest, changed: set[str]) -> None:
    stored = _stored_bytes(manifest)
    experts = [n for n in stored if _is_expert(n)]
    assert len(experts) == 2 * 8 * 3, "every expert of both layers is a tensor of its own"
    for name, nbytes in stored.items():
        if name in changed:
            assert nbytes > 0, f"{name} changed but stored nothing"
        else:
            assert nbytes == 0, f"{name} did not change but stored {nbytes} bytes"
            entry = next(t for t in manifest.tensors if t.name == name)
            assert all(c.codec == CODEC_SAME and c.object is None for c in entry.chunks)


def _assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype and g.shape == t.shape and torch.equal(g.view(torch.int16), t.view(torch.int16)), name


def test_frozen_experts_store_nothing_and_every_chunk_lies_in_one_expert(tmp_store):
    objects = _Objects()
    state = _moe_state()
    with Publisher(tmp_store, model="moe", config=CONFIG, listeners=[objects]) as publisher:
        v1 = publisher.publish(state, step=0).result(timeout=60).manifest
        stepped = _step_attention_and_router(state, seed=1)
        v2 = publisher.publish(stepped, step=1).result(timeout=60).manifest
    assert v1.kind == "full" and v2.kind == "delta"

    # Each expert tensor is cut into its own chunks, covering exactly its own elements.
    for entry in v1.tensors:
        if _is_expert(entry.name):
            assert entry.numel == 64 * 64 and [(c.start, c.stop) for c in entry.chunks] == [(0, 2048), (2048, 4096)]

    changed = {n for n in state if ".self_attn." in n or n.endswith(".mlp.gate.weight")}
    changed = {n for n in changed if not torch.equal(state[n].bfloat16(), stepped[n].bfloat16())}
    assert len(changed) >= 2 * 5, "attention (q, k, v, o and its norms) and the routers moved"
    _assert_only_named_tensors_cost_bytes(v2, changed)

    # The pack members and the pushed objects (what early apply gets) are the changed tensors'
    # chunks only, each placed inside one tensor.
    assert all(c.packed for t in v2.tensors for c in t.chunks if c.codec != CODEC_SAME)
    numel = {t.name: t.numel for t in v2.tensors}
    pushed = [p for v, p in objects.placements if v == 2]
    assert pushed and {p.tensor for p in pushed} == changed
    assert all(0 <= p.start < p.stop <= numel[p.tensor] and p.parent == 1 for p in pushed)

    _assert_bit_equal(
        Reader(tmp_store, model="moe").read(2).state_dict(), {k: v.bfloat16() for k, v in stepped.items()}
    )


def test_one_changed_expert_costs_only_its_changed_chunk(tmp_store):
    state = _moe_state()
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    with Publisher(tmp_store, model="moe", config=CONFIG) as publisher:
        publisher.publish(state, step=0).result(timeout=60)
        stepped = {k: v.clone() for k, v in state.items()}
        stepped[name].view(-1)[3000] += 0.5  # one element in the expert's second chunk
        v2 = publisher.publish(stepped, step=1).result(timeout=60).manifest
    entry = next(t for t in v2.tensors if t.name == name)
    assert [c.codec == CODEC_SAME for c in entry.chunks] == [True, False]
    _assert_only_named_tensors_cost_bytes(v2, {name})
    _assert_bit_equal(
        Reader(tmp_store, model="moe").read(2).state_dict(), {k: v.bfloat16() for k, v in stepped.items()}
    )


def _dim0_shard(full: dict[str, torch.Tensor], rank: int, world: int) -> tuple[dict, dict]:
    """Rank `rank`'s dim-0 shard of every tensor, FSDP2's split (torch.chunk: ceil rows per rank)."""
    tensors, placements = {}, {}
    for name, t in full.items():
        rows = math.ceil(t.shape[0] / world)
        lo, hi = min(rank * rows, t.shape[0]), min((rank + 1) * rows, t.shape[0])
        tensors[name] = t[lo:hi]
        placements[name] = Placement(global_shape=tuple(t.shape), start=lo * math.prod(t.shape[1:]))
    return tensors, placements


def test_sharded_over_two_ranks_frozen_experts_store_nothing(tmp_store):
    world = 2
    objects = [_Objects() for _ in range(world)]
    publishers = [
        Publisher(
            tmp_store,
            model="moe",
            config=CONFIG,
            shard=ShardSpec(rank=r, world_size=world, session="s1", commit_timeout_s=60),
            listeners=[objects[r]],
        )
        for r in range(world)
    ]
    state = _moe_state()
    stepped = _step_attention_and_router(state, seed=2)
    try:
        for step, sd in enumerate((state, stepped)):
            shards = [_dim0_shard(sd, r, world) for r in range(world)]
            futures = [p.publish(t, step=step, placements=pl) for p, (t, pl) in zip(publishers, shards, strict=True)]
            manifests = [f.result(timeout=60).manifest for f in futures]
    finally:
        for p in publishers:
            p.close()
    v2 = manifests[0]
    assert v2.kind == "delta" and v2.producer["ranks"] == world
    changed = {n for n in state if not torch.equal(state[n].bfloat16(), stepped[n].bfloat16())}
    assert changed and not any(_is_expert(n) for n in changed)
    _assert_only_named_tensors_cost_bytes(v2, changed)
    # Each expert tensor is split at its middle row: rank 0's chunks cover its first half, rank 1's
    # the second, and no chunk crosses the split (or leaves the expert).
    for entry in v2.tensors:
        if _is_expert(entry.name):
            assert [(c.start, c.stop) for c in entry.chunks] == [(0, 2048), (2048, 4096)]
    for rank, seen in enumerate(objects):
        half = 32 * 64
        for version, p in seen.placements:
            if version == 2:
                assert not _is_expert(p.tensor)
            elif _is_expert(p.tensor):
                assert rank * half <= p.start < p.stop <= (rank + 1) * half
    _assert_bit_equal(
        Reader(tmp_store, model="moe").read(2).state_dict(), {k: v.bfloat16() for k, v in stepped.items()}
    )


@pytest.mark.parametrize(
    ("chunk_bytes", "want"),
    [
        # an expert (48 x 64 bf16, 6 KiB) is larger than a chunk: two 3 KiB chunks each
        (4096, [(e * 3072 + h * 1536, e * 3072 + (h + 1) * 1536) for e in range(8) for h in range(2)]),
        # two whole experts fit a 16 KiB chunk: chunks of two experts, never one and a half
        (16384, [(c * 6144, (c + 1) * 6144) for c in range(4)]),
    ],
)
def test_fused_experts_are_chunked_at_expert_boundaries(tmp_store, chunk_bytes, want):
    """Experts fused in one (experts, rows, cols) tensor (torchtitan's grouped experts,
    transformers 5 in memory): no chunk spans two experts, so one changed expert stores only its
    own chunks, whole and in each rank's dim-0 shard."""
    g = torch.Generator().manual_seed(0)
    state = {"mlp.experts.gate_up_proj": torch.randn(8, 48, 64, generator=g), "mlp.gate.weight": torch.randn(8, 64)}
    stepped = {k: v.clone() for k, v in state.items()}
    stepped["mlp.experts.gate_up_proj"][5, 40, 3] += 0.5
    config = PublisherConfig(chunk_bytes=chunk_bytes, workers=2)
    changed = {c for c, (lo, hi) in enumerate(want) if lo <= 5 * 3072 + 40 * 64 + 3 < hi}
    for world in (1, 2):
        model = f"fused-{world}"
        publishers = [
            Publisher(
                tmp_store,
                model=model,
                config=config,
                shard=ShardSpec(rank=r, world_size=world, session="s", commit_timeout_s=60) if world > 1 else None,
            )
            for r in range(world)
        ]
        try:
            for step, sd in enumerate((state, stepped)):
                if world == 1:
                    futures = [publishers[0].publish(sd, step=step)]
                else:
                    shards = [_dim0_shard(sd, r, world) for r in range(world)]
                    futures = [
                        p.publish(t, step=step, placements=pl) for p, (t, pl) in zip(publishers, shards, strict=True)
                    ]
                manifest = [f.result(timeout=60).manifest for f in futures][0]
        finally:
            for p in publishers:
                p.close()
        (entry,) = [t for t in manifest.tensors if t.name == "mlp.experts.gate_up_proj"]
        assert [(c.start, c.stop) for c in entry.chunks] == want
        assert {i for i, c in enumerate(entry.chunks) if c.codec != CODEC_SAME} == changed
        got = Reader(tmp_store, model=model).read(2).state_dict()
        _assert_bit_equal(got, {k: v.bfloat16() for k, v in stepped.items()})


def _fsdp2_rank(rank: int, world: int, port: int, out: str) -> None:
    """One gloo rank: the trainer's engine on a tiny Qwen3-MoE sharded by FSDP2, published by the
    trainer's WeightPublisher (each rank its own dim-0 shards). Model "moe": v1 the initial
    weights, v2 after a full fine-tuning step, v3 after a step with every expert frozen. Model
    "moe-int4": experts frozen and packed in 4 bits (`parallel.frozen_experts`), v1 and v2 a
    step apart."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from weightsync.trainer.config import ParallelConfig, PublishConfig
    from weightsync.trainer.engine import TrainingEngine
    from weightsync.trainer.losses import LossSums
    from weightsync.trainer.optim import AdamWParams, build_optimizer
    from weightsync.trainer.parallel import build_mesh, close_runtime, exit_worker, init_runtime
    from weightsync.trainer.pieces import Ownership
    from weightsync.trainer.publish import WeightPublisher

    runtime = init_runtime(ParallelConfig(device="cpu"), timeout_s=120)
    initial = build_model(TINY_MOE, seed=1).state_dict() if rank == 0 else None
    tokens = torch.randint(0, TINY_MOE.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))[rank::world]
    saved = {}

    def run(model: str, parallel: ParallelConfig, versions: int, freeze_at: int | None) -> None:
        mesh = build_mesh(parallel, runtime)
        engine = TrainingEngine.build(TINY_MOE, initial, mesh=mesh, parallel=parallel, device=runtime.device)
        publisher = WeightPublisher(
            PublishConfig(store=f"file://{out}/store", model=model, publisher=CONFIG, commit_timeout_s=60),
            rank=rank,
            world_size=world,
        )
        saved[model] = {"placements": Ownership().collect(engine.weights())[1], "gathered": []}
        for version in range(1, versions + 1):
            if version == freeze_at:
                for name, p in engine.model.named_parameters():
                    p.requires_grad_(not _is_expert(name))
                engine.optimizer = build_optimizer(engine.model)
            if version > 1:
                engine.forward_backward(tokens[:, :-1], tokens[:, 1:], lambda lp: LossSums(-lp.sum(), {}), divisor=64.0)
                engine.optimizer_step(AdamWParams(lr=1e-3))
            publisher.publish(engine.weights(), step=version)
            publisher.collect(wait=True)
            state = engine.full_state_dict()
            saved[model]["gathered"].append({k: v.bfloat16() for k, v in state.items()} if rank == 0 else None)
        publisher.close()

    run("moe", ParallelConfig(device="cpu"), versions=3, freeze_at=3)
    run("moe-int4", ParallelConfig(device="cpu", frozen_experts="int4:32"), versions=2, freeze_at=None)
    torch.save(saved, f"{out}/rank-{rank}.pt")
    close_runtime(runtime)
    exit_worker(0)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp2_ranks_publish_their_own_expert_rows_and_frozen_experts_store_nothing(tmp_path):
    import socket

    import torch.multiprocessing as mp

    from weightsync.stores import LocalStore
    from weightsync.versions import read_manifest

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_fsdp2_rank, args=(2, port, str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank-{r}.pt", weights_only=False) for r in range(2)]
    # Every expert tensor is split by rows between the ranks: rank 0 publishes the first 32 rows
    # (elements [0, 2048)), rank 1 the rest; both publish every expert, packed ones too.
    for rank, got in enumerate(ranks):
        for model in ("moe", "moe-int4"):
            experts = {n: p for n, p in got[model]["placements"].items() if _is_expert(n)}
            assert len(experts) == 2 * 8 * 3, model
            assert all(p.global_shape == (64, 64) and p.start == rank * 2048 for p in experts.values()), model

    store = LocalStore(tmp_path / "store")
    manifests = [read_manifest(store, "moe", v) for v in (1, 2, 3)]
    assert [m.kind for m in manifests] == ["full", "delta", "delta"] and manifests[1].producer["ranks"] == 2
    full_step = _stored_bytes(manifests[1])
    assert all(full_step[n] > 0 for n in full_step if _is_expert(n)), "a full fine-tuning step moves every expert"
    for model, frozen_step in (("moe", 3), ("moe-int4", 2)):
        gathered = ranks[0][model]["gathered"]
        before, after = gathered[frozen_step - 2], gathered[frozen_step - 1]
        changed = {n for n in after if not torch.equal(before[n], after[n])}
        assert changed and not any(_is_expert(n) for n in changed), model
        _assert_only_named_tensors_cost_bytes(read_manifest(store, model, frozen_step), changed)
        reader = Reader(store, model=model)
        for version, want in enumerate(gathered, start=1):
            _assert_bit_equal(reader.read(version).state_dict(), want)
