"""Codec and chunk objects round-trip bit for bit: every dtype, special values, odd sizes, every
change density, and the codec chosen is the one recorded."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync import codec
from weightsync.chunk import apply_chunk, encode_chunk, unpack_chunk
from weightsync.dtypes import BY_NAME, dtype_by_name
from weightsync.tensors import raw_bytes, to_tensor

TORCH_DTYPES = [name for name in BY_NAME if hasattr(torch, name)]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _roundtrip(new: np.ndarray, old: np.ndarray | None, dtype_name: str) -> tuple[int, np.ndarray]:
    """Encodes `new` (against `old`), applies the object onto `old` (or garbage), returns result."""
    dtype = dtype_by_name(dtype_name)
    codec_id, raw_hex, obj, changed = encode_chunk(new, old, dtype, 1)
    if obj is None:  # unchanged: the parent's bytes are the new bytes
        assert old is not None and np.array_equal(old, new) and changed == 0
        return 0, old.copy()
    out = old.copy() if old is not None else np.full(new.nbytes, 0xA5, dtype=np.uint8)
    header, _ = unpack_chunk(obj)
    assert header.codec_id == codec_id and header.dtype == dtype and header.count * dtype.itemsize == new.nbytes
    apply_chunk(obj, out, dtype, raw_hex, codec_id)
    return codec_id, out


@st.composite
def _chunk_pair(draw):
    dtype_name = draw(st.sampled_from(TORCH_DTYPES))
    itemsize = dtype_by_name(dtype_name).itemsize
    count = draw(st.sampled_from([1, 2, 3, 7, 8, 9, 63, 64, 65, 255, 256, 257, 1000, 4095, 4097]))
    old = np.frombuffer(draw(st.binary(min_size=count * itemsize, max_size=count * itemsize)), dtype=np.uint8)
    new = old.copy()
    density = draw(st.sampled_from([0.0, 0.001, 0.01, 0.1, 0.25, 0.35, 0.6, 1.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    words = new.view(codec._UINT[itemsize])
    mask = rng.random(count) < density
    words[mask] ^= rng.integers(1, 2 ** (8 * itemsize) - 1, mask.sum(), dtype=np.uint64).astype(words.dtype) | 1
    return dtype_name, old, new


@SETTINGS
@given(_chunk_pair())
def test_delta_and_full_round_trip_bit_exactly(pair):
    dtype_name, old, new = pair
    _, out = _roundtrip(new, old, dtype_name)
    assert np.array_equal(out, new)
    codec_id, out = _roundtrip(new, None, dtype_name)
    assert codec_id == codec.CODEC_FULL and np.array_equal(out, new)


def _special_values(dtype: torch.dtype) -> torch.Tensor:
    """NaNs with several payloads, +-0, +-inf, subnormals, extremes — built from bit patterns."""
    if dtype == torch.bfloat16:
        bits = [0x7FC0, 0x7FC1, 0xFFFF, 0x7F81, 0x0000, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x7F7F, 0xFF7F]
        return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    if dtype == torch.float16:
        bits = [0x7E00, 0x7E01, 0xFFFF, 0x7C01, 0x0000, 0x8000, 0x7C00, 0xFC00, 0x0001, 0x83FF, 0x7BFF, 0xFBFF]
        return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.float16)
    if dtype == torch.float32:
        bits = [0x7FC00000, 0x7FA00001, -1, 0x7F800001, 0, -(2**31), 0x7F800000, -8388608, 1, 0x007FFFFF, 0x7F7FFFFF]
        return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)  # every fp8 pattern


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"])
def test_special_float_values_survive(dtype_name):
    if not hasattr(torch, dtype_name):
        pytest.skip(f"torch has no {dtype_name}")
    tensor = _special_values(getattr(torch, dtype_name))
    new = raw_bytes(tensor.contiguous())
    old = np.roll(new, 3)  # a parent that differs almost everywhere
    for parent in (None, old):
        _, out = _roundtrip(new, parent, dtype_name)
        back = to_tensor(out, dtype_by_name(dtype_name), tuple(tensor.shape))
        assert torch.equal(_bits(back), _bits(tensor))


def test_empty_and_zero_dim_tensors_round_trip():
    for tensor in (torch.tensor(-0.0, dtype=torch.bfloat16), torch.tensor(7, dtype=torch.int64)):
        dtype = dtype_by_name(str(tensor.dtype).removeprefix("torch."))
        _, out = _roundtrip(raw_bytes(tensor), None, dtype.name)
        assert torch.equal(_bits(to_tensor(out, dtype, ())), _bits(tensor))
    empty = to_tensor(np.empty(0, np.uint8), dtype_by_name("bfloat16"), (0, 5))
    assert empty.shape == (0, 5) and empty.dtype == torch.bfloat16


@pytest.mark.parametrize("gap", [0, 1, 253, 254, 255, 256, 257, 511, 70_000])
def test_sparse_gaps_around_the_escape_byte(gap):
    count = 2 * gap + 10
    old = np.arange(count, dtype=np.uint16).view(np.uint8).copy()
    new = old.copy()
    words = new.view(np.uint16)
    for position in (gap, 2 * gap + 1):  # first change after `gap` equal elements, then another
        words[position] ^= 1
    codec_id, out = _roundtrip(new, old, "bfloat16")
    assert codec_id == codec.CODEC_SPARSE and np.array_equal(out, new)


@pytest.mark.parametrize("positions", [[0], [8191], [3, 4, 7, 8], list(range(0, 8192, 4))], ids=["first", "last", "word-edges", "every-4th"])
def test_changes_at_word_boundaries_and_the_tail(positions):
    for count in (8192, 8191, 8189):  # whole 8-byte words, and tails of 3 and 1 elements
        old = np.random.default_rng(0).integers(0, 2**16, count, dtype=np.uint16).view(np.uint8)
        new = old.copy()
        for p in positions:
            if p < count:
                new.view(np.uint16)[p] ^= 0x8001
        _, out = _roundtrip(new, old, "bfloat16")
        assert np.array_equal(out, new)


@pytest.mark.parametrize(
    "density, expected",
    [(0.01, {codec.CODEC_SPARSE}), (0.3, {codec.CODEC_SPARSE, codec.CODEC_XOR}), (0.9, {codec.CODEC_XOR})],
)
def test_codec_choice_follows_density_and_is_recorded(density, expected):
    rng = np.random.default_rng(1)
    old = rng.integers(0, 2**16, 50_000, dtype=np.uint16)
    new = old.copy()
    mask = rng.random(len(new)) < density
    new[mask] ^= 1
    codec_id, out = _roundtrip(new.view(np.uint8), old.view(np.uint8), "bfloat16")
    assert codec_id in expected and np.array_equal(out, new.view(np.uint8))


def test_unchanged_chunk_has_no_object():
    data = np.arange(1000, dtype=np.uint16).view(np.uint8)
    codec_id, raw_hex, obj, changed = encode_chunk(data, data.copy(), dtype_by_name("bfloat16"), 1)
    assert (codec_id, obj, changed) == (0, None, 0) and len(raw_hex) == 32


def test_every_zstd_level_decodes():
    rng = np.random.default_rng(2)
    old = rng.integers(0, 2**16, 10_000, dtype=np.uint16).view(np.uint8)
    new = old.copy()
    new.view(np.uint16)[::37] ^= 3
    for level in (1, 3, 9, 19):
        codec_id, raw_hex, obj, _ = encode_chunk(new, old, dtype_by_name("bfloat16"), level)
        assert unpack_chunk(obj)[0].zstd_level == level
        out = old.copy()
        apply_chunk(obj, out, dtype_by_name("bfloat16"), raw_hex, codec_id)
        assert np.array_equal(out, new)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.sampled_from([0, 1, 2047, 2048, 2049, 4095, 4096, 4097, 6143]), min_size=1, max_size=4),
    dtype_name=st.sampled_from(["bfloat16", "float16", "float32", "int8", "int64"]),
    seed=st.integers(0, 2**16),
)
def test_publish_and_read_tensors_with_partial_last_chunks(tmp_path_factory, sizes, dtype_name, seed):
    """Tensors whose sizes fall just around multiples of the chunk size, through the Publisher."""
    from weightsync.publisher import Publisher, PublisherConfig
    from weightsync.reader import Reader
    from weightsync.store import LocalStore

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(seed)
    first = {f"t{i}": torch.randint(-100, 100, (n,), generator=g).to(dtype) for i, n in enumerate(sizes)}
    second = {}
    for name, t in first.items():
        changed = t.clone()
        if t.numel():
            index = torch.randint(0, t.numel(), (max(1, t.numel() // 50),), generator=g)
            changed[index] = changed[index] + 1
        second[name] = changed
    store = LocalStore(tmp_path_factory.mktemp("store"), fsync=False)
    config = PublisherConfig(chunk_bytes=4096, cast_floats_to=None, parent_from_store=False)
    with Publisher(store, model="edges", config=config) as publisher:
        publisher.publish(first).result()
        publisher.publish(second).result()
    reader = Reader(store, model="edges")
    for version, expected in ((1, first), (2, second)):
        got = reader.read(version).state_dict()
        assert got.keys() == expected.keys()
        for name in expected:
            assert got[name].dtype == expected[name].dtype and torch.equal(_bits(got[name]), _bits(expected[name]))
