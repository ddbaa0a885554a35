"""Publishing from any parallel layout (manifest format 3, `weightsync/format/boxes.py`).

Ranks are threads, each with its own Publisher over one store, as N trainer processes would be;
their pieces are built by hand, without DTensor, the way a Megatron-style trainer holds them:
column-parallel fused weights (several row blocks per rank), row-parallel weights (a column
block: no flat range), uneven splits, a vocab-parallel embedding (flat dim-0 ranges, in the same
manifest), expert slices, a replicated norm that one rank publishes and the others only declare,
and a two-stage pipeline split in which each stage's tensors live on its ranks only. Each version
reads back bit-exactly (by the chain, folded, and through `weightsync pull`); a hole, an overlap
and two ranks that disagree on a shape each fail the version, naming the tensor and the box. The
trainer's own layouts (DTensor TP/EP over torchrun) are tests/trainer/test_parallel_trainer.py.
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch
from safetensors.torch import load_file

from weightsync.app.cli import main as cli
from weightsync.errors import PublishError, UnsupportedFormatError
from weightsync.format import manifest as manifest_module
from weightsync.format.boxes import Box
from weightsync.format.codecs.fold import FOLDED
from weightsync.format.manifest import FORMAT_BOXES, parse_manifest
from weightsync.format.write_format import WriteFormat
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.reader import Reader
from weightsync.shards import Placement, ShardSpec
from weightsync.versions import list_versions, read_manifest, read_manifest_bytes

CONFIG = PublisherConfig(chunk_bytes=4096, workers=2, max_in_flight=1)
TP = 4
WAIT_S = 60


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(50, 64, generator=g),  # vocab-parallel: 13, 13, 12, 12 rows
        "layers.0.qkv.weight": torch.randn(3 * 64, 64, generator=g),  # fused q, k, v: column-parallel
        "layers.0.o.weight": torch.randn(160, 64, generator=g),  # row-parallel: 160 x 16 per rank, 2 chunks
        "layers.0.gate_up.weight": torch.randn(2 * 96, 64, generator=g),  # fused gate, up: column-parallel
        "layers.0.down.weight": torch.randn(64, 98, generator=g),  # row-parallel, uneven: 25, 25, 24, 24
        "layers.0.norm.weight": 1 + 0.1 * torch.randn(64, generator=g),  # replicated
        "layers.0.experts.w2": torch.randn(4, 40, 32, generator=g),  # 2 experts x half the columns per rank
    }


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk-like uneven bounds: the first ranks get one more."""
    sizes = [n // parts + (i < n % parts) for i in range(parts)]
    starts = [sum(sizes[:i]) for i in range(parts)]
    return [(s, s + size) for s, size in zip(starts, sizes, strict=True)]


def _megatron_piece(name: str, full: torch.Tensor, rank: int) -> tuple[torch.Tensor, Placement]:
    """Rank `rank`'s local tensor of `name` and where it sits, as a Megatron-style trainer holds it."""
    shape = tuple(full.shape)
    if name == "embed.weight":
        lo, hi = _split(shape[0], TP)[rank]
        return full[lo:hi], Placement(shape, start=lo * shape[1])
    if name in ("layers.0.qkv.weight", "layers.0.gate_up.weight"):
        parts = 3 if "qkv" in name else 2
        block = shape[0] // parts
        lo, hi = _split(block, TP)[rank]
        boxes = [Box((p * block + lo, 0), (hi - lo, shape[1])) for p in range(parts)]
        local = torch.cat([full[p * block + lo : p * block + hi] for p in range(parts)])
        return local, Placement(shape, boxes=boxes)
    if name in ("layers.0.o.weight", "layers.0.down.weight"):
        lo, hi = _split(shape[1], TP)[rank]
        return full[:, lo:hi].contiguous(), Placement(shape, boxes=[Box((0, lo), (shape[0], hi - lo))])
    if name == "layers.0.norm.weight":  # rank 0 owns it; the others hold a replica and declare it
        if rank == 0:
            return full, Placement(shape, start=0)
        return full[:0], Placement(shape, boxes=())
    if name == "layers.0.experts.w2":  # ep 2 (experts) x tp 2 (columns)
        e0, c0 = 2 * (rank // 2), 16 * (rank % 2)
        box = Box((e0, 0, c0), (2, shape[1], 16))
        return full[e0 : e0 + 2, :, c0 : c0 + 16].contiguous(), Placement(shape, boxes=[box])
    raise KeyError(name)


def _pieces(full: dict[str, torch.Tensor], rank: int) -> tuple[dict, dict]:
    tensors, placements = {}, {}
    for name, t in full.items():
        tensors[name], placements[name] = _megatron_piece(name, t, rank)
    return tensors, placements


def _ranks(store, world: int, session: str, config: PublisherConfig = CONFIG) -> list[Publisher]:
    return [
        Publisher(
            store,
            model="m",
            config=config,
            shard=ShardSpec(rank=r, world_size=world, session=session, commit_timeout_s=WAIT_S),
        )
        for r in range(world)
    ]


def _publish(ranks, pieces_of, step: int, **kwargs) -> list[cf.Future]:
    """Each rank's publish of `pieces_of(rank)` = (tensors, placements)."""
    futures = []
    for rank, publisher in enumerate(ranks):
        tensors, placements = pieces_of(rank)
        futures.append(publisher.publish(tensors, step=step, placements=placements, **kwargs))
    return futures


def _bf16(sd: dict) -> dict:
    return {k: v.to(torch.bfloat16) for k, v in sd.items()}


def test_megatron_style_placements_publish_without_a_gather_and_read_back_bit_exactly(
    tmp_store, tmp_path, perturb, assert_bit_equal, capsys
):
    ranks = _ranks(tmp_store, TP, "megatron")
    states = {}
    full = _model(1)
    for step in range(4):
        results = [f.result(timeout=WAIT_S) for f in _publish(ranks, lambda r, full=full: _pieces(full, r), step)]
        states[results[0].version] = _bf16(full)
        full = perturb(full, 0.05, step)
    for p in ranks:
        p.close()
    assert list_versions(tmp_store, "m") == [1, 2, 3, 4]
    reader = Reader(tmp_store, model="m")
    for version, want in states.items():
        state = reader.read(version)
        assert state.manifest.format == FORMAT_BOXES and state.manifest.has_boxes
        assert_bit_equal(state.state_dict(), want)
    assert [read_manifest(tmp_store, "m", v).kind for v in states] == ["full", "delta", "delta", "delta"]
    first = read_manifest(tmp_store, "m", 1)
    by_name = {t.name: t for t in first.tensors}
    assert all(c.box is None for c in by_name["embed.weight"].chunks), "dim-0 pieces stay flat ranges"
    o_boxes = [c.box for c in by_name["layers.0.o.weight"].chunks]
    assert Box((0, 16), (80, 16)) in o_boxes and len(o_boxes) == 8, "each 160 x 16 column block in 2 chunks"
    # An agent three deltas behind folds them: one pass per box chunk.
    state = reader.read(1)
    route = reader.advance_route(state, 4)
    assert route.kind == FOLDED
    assert_bit_equal(state.state_dict(), states[4])
    # `weightsync pull` scatters the boxes into whole tensors in the safetensors it writes.
    out = tmp_path / "pulled"
    assert cli(["pull", "--store", tmp_store.uri, "--model", "m", "--out", str(out)]) == 0
    capsys.readouterr()
    assert_bit_equal(load_file(out / "model.safetensors"), states[4])


def test_a_two_stage_pipeline_split_publishes_each_stages_tensors(tmp_store, make_state_dict, assert_bit_equal):
    """Pipeline parallelism: stage 0 (ranks 0, 1) holds the embedding and layer 0, stage 1 (ranks
    2, 3) layer 1 and the rest; each stage shards its tensors on dim 0 over its two ranks (FSDP
    inside a stage), and plain tensors are whole on the stage's first rank."""
    full = make_state_dict(4)
    stages = [
        {n for n in full if n.startswith(("embed", "layers.0"))},
        {n for n in full if not n.startswith(("embed", "layers.0"))},
    ]

    def pieces(rank: int):
        stage, inner = divmod(rank, 2)
        tensors, placements = {}, {}
        for name in sorted(stages[stage]):
            t = full[name]
            if t.dim() >= 1 and t.shape[0] >= 2:
                lo, hi = _split(t.shape[0], 2)[inner]
                tensors[name] = t[lo:hi]
                placements[name] = Placement(tuple(t.shape), start=lo * (t.numel() // t.shape[0]))
            elif inner == 0:
                tensors[name] = t
        return tensors, placements

    ranks = _ranks(tmp_store, 4, "pipeline")
    results = [f.result(timeout=WAIT_S) for f in _publish(ranks, pieces, 0)]
    for p in ranks:
        p.close()
    assert {r.version for r in results} == {1}
    state = Reader(tmp_store, model="m").read(1)
    assert set(state.state_dict()) == set(full)
    assert_bit_equal(
        state.state_dict(), {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in full.items()}
    )


@pytest.mark.parametrize(
    "fault, match",
    [
        ("hole", r"tensor 'layers.0.o.weight': box\(offsets=\[0, 48\], sizes=\[160, 16\]\) is covered by no chunk"),
        (
            "overlap",
            r"tensor 'layers.0.o.weight': box\(offsets=\[0, 32\], sizes=\[80, 16\]\) \(rank 3\) overlaps "
            r"box\(offsets=\[0, 32\], sizes=\[80, 16\]\) \(rank 2\)",
        ),
        (
            "shape",
            r"ranks disagree on tensor 'layers.0.down.weight': bfloat16 \[64, 98\] \(rank 0\) vs "
            r"bfloat16 \[64, 99\] \(rank 1\)",
        ),
    ],
)
def test_a_hole_an_overlap_or_a_shape_disagreement_fails_the_version_naming_the_tensor(
    tmp_store, assert_bit_equal, fault, match
):
    full = _model(2)

    def faulty(rank: int):
        tensors, placements = _pieces(full, rank)
        name = "layers.0.down.weight" if fault == "shape" else "layers.0.o.weight"
        if fault == "hole" and rank == 3:  # rank 3 holds its piece but publishes none of it
            tensors[name], placements[name] = tensors[name][:0], Placement(placements[name].global_shape, boxes=())
        if fault == "overlap" and rank == 3:  # rank 3 says it holds rank 2's columns
            tensors[name], placements[name] = _megatron_piece(name, full[name], 2)
        if fault == "shape" and rank == 1:
            placements[name] = Placement((64, 99), boxes=placements[name].boxes)
        return tensors, placements

    ranks = _ranks(tmp_store, TP, f"faulty-{fault}")
    for future in _publish(ranks, faulty, 0):
        with pytest.raises(PublishError, match=match):
            future.result(timeout=WAIT_S)
    assert list_versions(tmp_store, "m") == [], "a version that does not cover the model never exists"
    # The next version, with every piece in place, commits (full: its predecessor failed).
    results = [f.result(timeout=WAIT_S) for f in _publish(ranks, lambda r: _pieces(full, r), 1)]
    for p in ranks:
        p.close()
    assert results[0].manifest.kind == "full"
    assert_bit_equal(Reader(tmp_store, model="m").read(results[0].version).state_dict(), _bf16(full))


def test_a_layout_change_makes_the_next_version_full_on_every_rank(tmp_store, perturb, assert_bit_equal):
    """A new job layout (layout_key, the same on every rank) rebases every rank at once; a change
    of one rank's own placements that the others did not see fails that version (the ranks
    disagree on full vs delta), never writes a wrong delta, and the next one is full."""
    full = _model(3)
    ranks = _ranks(tmp_store, TP, "relayout")

    def publish(pieces_of, step, key):
        return _publish(ranks, pieces_of, step, layout_key=key)

    assert [f.result(timeout=WAIT_S).manifest.kind for f in publish(lambda r: _pieces(full, r), 0, "tp4")] == [
        "full"
    ] * TP
    full = perturb(full, 0.05, 1)
    assert publish(lambda r: _pieces(full, r), 1, "tp4")[0].result(timeout=WAIT_S).manifest.kind == "delta"

    def swapped(rank: int):  # ranks 0 and 1 trade their row-parallel columns: a new layout
        tensors, placements = _pieces(full, rank)
        if rank in (0, 1):
            name = "layers.0.o.weight"
            tensors[name], placements[name] = _megatron_piece(name, full[name], 1 - rank)
        return tensors, placements

    full = perturb(full, 0.05, 2)
    results = [f.result(timeout=WAIT_S) for f in publish(swapped, 2, "tp4-swapped")]
    assert results[0].manifest.kind == "full" and "layout changed" in results[0].full_reason
    assert_bit_equal(Reader(tmp_store, model="m").read(3).state_dict(), _bf16(full))

    full = perturb(full, 0.05, 3)
    futures = publish(lambda r: _pieces(full, r) if r == 0 else swapped(r), 3, "tp4-swapped")  # rank 0 alone moved
    for future in futures:
        with pytest.raises(PublishError, match="ranks disagree on the version's parent/base/kind/step"):
            future.result(timeout=WAIT_S)
    full = perturb(full, 0.05, 4)
    results = [f.result(timeout=WAIT_S) for f in publish(lambda r: _pieces(full, r), 4, "tp4-swapped")]
    for p in ranks:
        p.close()
    assert results[0].manifest.kind == "full"
    assert_bit_equal(Reader(tmp_store, model="m").read(results[0].version).state_dict(), _bf16(full))


def test_boxes_need_manifest_format_3_and_older_readers_refuse_it(tmp_store, monkeypatch):
    full = _model(5)
    config = PublisherConfig(chunk_bytes=4096, workers=2, write_format=WriteFormat(manifest_format=2))
    publisher = Publisher(tmp_store, model="m", config=config, shard=ShardSpec(rank=0, world_size=1, session="s"))
    tensors, placements = _megatron_piece("layers.0.o.weight", full["layers.0.o.weight"], 0)
    with pytest.raises(ValueError, match=r"'w' is placed as boxes .* needs manifest format 3"):
        publisher.publish({"w": tensors}, placements={"w": placements})
    publisher.close()

    ranks = _ranks(tmp_store, TP, "s")
    for f in _publish(ranks, lambda r: _pieces(full, r), 0):
        f.result(timeout=WAIT_S)
    for p in ranks:
        p.close()
    _, data = read_manifest_bytes(tmp_store, "m", 1)
    assert parse_manifest(data).format == 3
    # A reader built before boxes supported manifest formats 1 and 2: it refuses the version with
    # the format error, before reading anything else of it.
    monkeypatch.setattr(manifest_module, "SUPPORTED_FORMATS", (1, 2))
    with pytest.raises(
        UnsupportedFormatError, match=r"manifest format 3 is not supported by this build; supported: \[1, 2\]"
    ):
        parse_manifest(data)
