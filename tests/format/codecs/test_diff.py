"""weightsync.format.codecs.diff: the device path of codec ctx, driven on CPU tensors (the same torch code runs on
CUDA). Its changes equal the host scan's field for field, chunk by chunk when a whole tensor is
diffed at once, so the payloads are identical, and applying them to the parent gives the new
tensor bit for bit (torch.equal), for every dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from weightsync.format import codecs
from weightsync.format.chunk import apply_chunk, encode_chunk
from weightsync.format.codecs import changes as change_model
from weightsync.format.codecs import ctx as ctx_codec
from weightsync.format.codecs import rans as rans_codec
from weightsync.format.codecs.choice import DEFAULT_CHOICE
from weightsync.format.codecs.diff import diff_chunk, diff_ranges
from weightsync.format.dtypes import BY_NAME, dtype_by_name
from weightsync.format.tensors import raw_bytes

DTYPES = [name for name in BY_NAME if hasattr(torch, name)]
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)


def _pair(name: str, count: int, density: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A parent like trained weights (floats: normal, std 0.015) and a child with a fraction of its
    elements moved by a few steps of their bit patterns, special values and sign flips mixed in."""
    rng = np.random.default_rng(seed)
    itemsize = dtype_by_name(name).itemsize
    if count == 0:
        empty = torch.empty(0, dtype=getattr(torch, name))
        return empty, empty.clone()
    if BY_NAME[name].floating:
        old = (torch.randn(count, generator=torch.Generator().manual_seed(seed)) * 0.015).to(getattr(torch, name))
    else:
        old = (
            torch.from_numpy(rng.integers(0, 256, count * itemsize, dtype=np.uint8)).view(getattr(torch, name))
            if name != "bool"
            else torch.from_numpy(rng.integers(0, 2, count).astype(bool))
        )
    bits = raw_bytes(old).view(UINT[itemsize]).copy()
    changed = rng.random(count) < density
    steps = rng.choice(np.array([1, 1, 1, 1, 2, 5, -1, -1, -1, -3], dtype=np.int64), count)
    new_bits = bits.astype(np.int64) + np.where(changed, steps, 0)
    new_bits = (new_bits & ((1 << (8 * itemsize)) - 1) if itemsize < 8 else new_bits).astype(UINT[itemsize])
    if count > 10:
        new_bits[3] ^= UINT[itemsize](1 << (8 * itemsize - 1))  # a sign flip
        new_bits[-1] = ~bits[-1]
    if name == "bool":
        new_bits &= 1
    new = torch.from_numpy(new_bits.view(np.uint8).copy()).view(old.dtype)
    return new, old


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("count, density", [(0, 0.0), (1, 1.0), (97, 0.05), (5000, 0.01), (70_000, 0.03)])
def test_device_diff_round_trips_bit_exactly(name, count, density):
    dtype = dtype_by_name(name)
    new, old = _pair(name, count, density, seed=count + len(name))
    changes = diff_chunk(new, old, dtype)
    new_raw, old_raw = raw_bytes(new), raw_bytes(old)
    changed = int(np.count_nonzero(new_raw.view(UINT[dtype.itemsize]) != old_raw.view(UINT[dtype.itemsize])))
    assert len(changes.positions) == changed
    if changed:  # the same fields as the host scan: the device path changes nothing in the payload
        host = change_model.scan_changes(new_raw, old_raw, name, dtype.itemsize, changed)
        for field in ("count", "class_base"):
            assert getattr(changes, field) == getattr(host, field), field
        for field in ("positions", "classes", "ranks", "old_bits", "new_bits", "class_counts"):
            assert np.array_equal(getattr(changes, field), getattr(host, field)), field
        for coder in (ctx_codec, rans_codec):
            payload = coder.emit(changes, name, dtype.itemsize, 1 << 30)
            assert payload == coder.emit(host, name, dtype.itemsize, 1 << 30)
            out = old.clone()
            coder.decode_into(payload, raw_bytes(out), name, dtype.itemsize)
            assert torch.equal(out.view(torch.uint8), new.view(torch.uint8))
    # Through the chunk API, as the publisher calls it.
    codec_id, raw_hex, obj, n = encode_chunk(new_raw, old_raw, dtype, 1, changes=changes)
    assert n == changed
    if obj is None:
        assert changed == 0
        return
    if changed / max(count, 1) <= DEFAULT_CHOICE.ctx_up_to_density:
        assert codec_id == codecs.CODEC_CTX
    out = old.clone()
    apply_chunk(obj, raw_bytes(out), dtype, raw_hex, codec_id)
    assert torch.equal(out.view(torch.uint8), new.view(torch.uint8))
    if dtype.floating and not torch.isnan(new.float()).any():
        assert torch.equal(out, new)


def test_device_diff_on_a_real_checkpoint_step():
    """bf16 weights after an AdamW-like step: ~1 % move by one ULP; the parent is left untouched."""
    g = torch.Generator().manual_seed(5)
    master = torch.randn(300_000, generator=g) * 0.02
    old = master.to(torch.bfloat16)
    new = (master + 1e-6 * torch.randn(300_000, generator=g).sign()).to(torch.bfloat16)
    before = old.clone()
    changes = diff_chunk(new, old, dtype_by_name("bfloat16"))
    assert torch.equal(old, before)
    assert 0 < len(changes.positions) < 0.2 * 300_000
    codec_id, raw_hex, obj, _ = encode_chunk(
        raw_bytes(new), raw_bytes(old), dtype_by_name("bfloat16"), 1, changes=changes
    )
    big = len(changes.positions) >= DEFAULT_CHOICE.rans_from_changes
    assert codec_id == (codecs.CODEC_RANS if big else codecs.CODEC_CTX)
    out = old.clone()
    apply_chunk(obj, raw_bytes(out), dtype_by_name("bfloat16"), raw_hex, codec_id)
    assert torch.equal(out, new)


def test_tensors_must_be_alike():
    with pytest.raises(ValueError, match="alike"):
        diff_chunk(
            torch.zeros(3, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16), dtype_by_name("bfloat16")
        )


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_publisher_device_diff_publishes_versions_that_read_back_bit_exactly(tmp_path, monkeypatch, device):
    """PublisherConfig(device_diff=True) on CPU tensors drives the device path end to end: deltas
    use the device changes (ctx chunks), a cast tensor and a new tensor layout fall back cleanly,
    and every version reads back torch.equal."""
    from weightsync.format.codecs import diff
    from weightsync.publisher import Publisher, PublisherConfig
    from weightsync.reader import Reader
    from weightsync.stores import LocalStore

    diffed = []

    def counting(new, old, ranges, dtype):
        diffed.extend((stop - start, dtype.name) for start, stop in ranges)
        return diff_ranges(new, old, ranges, dtype)

    monkeypatch.setattr(diff, "diff_ranges", counting)
    g = torch.Generator().manual_seed(3)
    master = {"w": torch.randn(300, 512, generator=g) * 0.02, "b": torch.randn(4096, generator=g) * 0.02}
    master = {k: v.to(device) for k, v in master.items()}
    store = LocalStore(tmp_path)
    config = PublisherConfig(device_diff=True, chunk_bytes=64 * 1024, parent_from_store=False)
    published = []
    with Publisher(store, model="dev", config=config) as publisher:
        for step in range(4):
            state = {"w": master["w"].to(torch.bfloat16), "b": master["b"]}  # b: fp32, cast by the snapshot
            published.append({k: v.to(torch.bfloat16).cpu() for k, v in state.items()})
            result = publisher.publish(state, step=step).result()
            if step:
                codecs = {c.codec for t in result.manifest.tensors if t.name == "w" for c in t.chunks}
                assert codecs <= {"ctx", "rans", "same"} and codecs & {"ctx", "rans"}
            master = {k: v + 3e-6 * torch.randn(v.shape, generator=g).sign().to(device) for k, v in master.items()}
    chunks_of_w = -(-300 * 512 * 2 // (64 * 1024))
    assert len(diffed) == 3 * chunks_of_w and {name for _, name in diffed} == {"bfloat16"}  # w only, deltas only
    reader = Reader(store, model="dev")
    for version, want in enumerate(published, start=1):
        got = reader.read(version).state_dict()
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), (version, name)


SCAN_FIELDS = ("positions", "classes", "ranks", "old_bits", "new_bits", "class_counts")


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("slab", [1, 9000, 1 << 21])
@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("count, per_chunk", [(1, 1), (97, 10), (5000, 700), (70_000, 4096), (70_000, 70_000)])
def test_a_whole_tensor_diffs_as_each_chunk_alone(monkeypatch, name, count, per_chunk, slab, device):
    """diff_ranges over every chunk of a tensor at once gives, for each chunk, the host scan of
    that chunk (class bases, ranks and first positions are the chunk's own, not the tensor's),
    whether the chunks are diffed one by one, a few together or all in one slab."""
    from weightsync.format.codecs import diff

    monkeypatch.setitem(diff.SLAB_ELEMENTS, device, slab)
    dtype = dtype_by_name(name)
    new, old = _pair(name, count, 0.03, seed=count + per_chunk)
    scaled = dtype.floating and not name.startswith("float8") and count > 2000
    if scaled:  # weights whose scale grows along the tensor: each chunk picks its own class base
        scale = torch.logspace(-3, 3, count).to(old.dtype)
        old, new = old * scale, new * scale
    ranges = [(s, min(s + per_chunk, count)) for s in range(0, count, per_chunk)]
    got = diff_ranges(new.to(device), old.to(device), ranges, dtype)
    assert list(got) == [s for s, _ in ranges]
    if scaled and len(ranges) > 2:
        assert len({changes.class_base for changes in got.values()}) > 1
    utype = UINT[dtype.itemsize]
    for start, stop in ranges:
        n, o = raw_bytes(new[start:stop]), raw_bytes(old[start:stop])
        changed = int(np.count_nonzero(n.view(utype) != o.view(utype)))
        changes = got[start]
        assert changes.count == stop - start and len(changes.positions) == changed
        alone = diff_chunk(new[start:stop], old[start:stop], dtype)
        assert changes.class_base == alone.class_base
        for field in SCAN_FIELDS:
            assert np.array_equal(getattr(changes, field), getattr(alone, field)), (start, field)
        if changed:
            host = change_model.scan_changes(n, o, name, dtype.itemsize, changed)
            assert changes.class_base == host.class_base
            for field in SCAN_FIELDS:
                assert np.array_equal(getattr(changes, field), getattr(host, field)), (start, field)


@pytest.mark.parametrize("ranges", [[], [(0, 5)], [(0, 4), (5, 10)], [(0, 6), (5, 10)], [(0, 5), (5, 5), (5, 10)]])
def test_ranges_must_cover_the_tensor_exactly(ranges):
    t = torch.zeros(10, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="covering all 10 elements"):
        diff_ranges(t, t.clone(), ranges, dtype_by_name("bfloat16"))


@pytest.mark.parametrize("block", [1, 7, 64, 256, 4096])
def test_ranks_are_the_host_scans_for_any_block_length(monkeypatch, block):
    """Ranks within a class add the counts of earlier blocks to those earlier in the own block
    (read in batches of changed elements)."""
    from weightsync.format.codecs import diff

    monkeypatch.setattr(diff, "_RANK_BLOCK", block)
    monkeypatch.setattr(diff, "_WITHIN_BYTES", 7 * block)  # the changed elements' blocks, 7 at a time
    g = torch.Generator().manual_seed(1)
    old = (torch.randn(50_000, generator=g) * 0.02).to(torch.bfloat16)
    bits = old.view(torch.int16).clone()
    bits[torch.rand(50_000, generator=g) < 0.05] += 1
    new = bits.view(torch.bfloat16)
    ranges = [(0, 20_000), (20_000, 33_333), (33_333, 50_000)]
    got = diff_ranges(new, old, ranges, dtype_by_name("bfloat16"))
    for start, stop in ranges:
        n, o = (t[start:stop].view(torch.int16).numpy().view(np.uint16) for t in (new, old))
        want = change_model.scan_changes(n, o, "bfloat16", 2, int((n != o).sum()))
        for field in SCAN_FIELDS:
            assert np.array_equal(getattr(got[start], field), getattr(want, field)), field
