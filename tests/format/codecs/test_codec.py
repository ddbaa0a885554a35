"""Codecs and chunk objects round-trip bit for bit, through the chunk API on real torch tensors.

Covers `full` and the delta codecs (`encode_delta` / `decode_into`, via `encode_chunk` /
`apply_chunk`; `ctx` in detail in tests/format/codecs/test_ctx.py) for every itemsize (1, 2, 4, 8) and every dtype this torch build has; special
bit patterns (NaN payloads, signalling NaNs, +-0, +-inf, subnormals, extremes); empty and 0-dim
tensors; odd sizes around the sparse path's 8-byte-word scan and its tail; changes at the first
and last element, at word boundaries and everywhere; every change density (unchanged -> no
object, sparse, the ambiguous band where both codecs are tried, dense xor); sparse gaps around
the 255 escape and beyond 2**24; and that the codec chosen is the one recorded in the header.

Equality is on bit patterns (NaN != NaN and -0.0 == 0.0 numerically), and additionally on the
tensors themselves where they hold no NaN.
"""

from __future__ import annotations

import itertools
import struct

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from weightsync.format import codecs
from weightsync.format.chunk import HEADER_SIZE, apply_chunk, encode_chunk, pack_chunk, unpack_chunk
from weightsync.format.codecs.choice import DEFAULT_CHOICE, CodecChoice
from weightsync.format.dtypes import BY_NAME, DType, dtype_by_name
from weightsync.format.hashing import xxh3_digest
from weightsync.format.tensors import raw_bytes, to_tensor, torch_dtype

DTYPES = [name for name in BY_NAME if hasattr(torch, name)]  # float8 and uint16/32/64 only if this torch has them
FLOAT_DTYPES = [name for name in DTYPES if BY_NAME[name].floating]
BY_ITEMSIZE = {1: "uint8", 2: "bfloat16", 4: "float32", 8: "float64"}
ODD_SIZES = [1, 2, 3, 7, 8, 9, 63, 64, 65, 255, 256, 257, 1000, 4095, 4096, 4097]
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
HYPO = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NO_CTX = CodecChoice(highest_codec=codecs.CODEC_SPARSE)  # what readers before codec 4 decode
SPARSE_ONLY = CodecChoice(highest_codec=codecs.CODEC_SPARSE, sparse_only_below=1.0, xor_only_above=1.0)

# Bit patterns worth carrying through every codec (unsigned, little-endian as stored).
SPECIALS: dict[str, list[int]] = {
    "bfloat16": [
        0x7FC0,
        0x7FC1,
        0xFFFF,
        0xFFC0,
        0x7F81,
        0xFF81,
        0x7FBF,  # quiet/signalling NaNs, several payloads
        0x0000,
        0x8000,
        0x7F80,
        0xFF80,  # +-0, +-inf
        0x0001,
        0x8001,
        0x007F,
        0x807F,
        0x0080,  # subnormals (min, max), smallest normal
        0x7F7F,
        0xFF7F,  # max / min finite
    ],
    "float16": [
        0x7E00,
        0x7E01,
        0xFFFF,
        0xFE00,
        0x7C01,
        0xFC01,
        0x7DFF,
        0x0000,
        0x8000,
        0x7C00,
        0xFC00,
        0x0001,
        0x8001,
        0x03FF,
        0x83FF,
        0x0400,
        0x7BFF,
        0xFBFF,
    ],
    "float32": [
        0x7FC00000,
        0x7FC00001,
        0xFFFFFFFF,
        0xFFC00000,
        0x7F800001,
        0xFF800001,
        0x7FA00000,
        0x7FBFFFFF,
        0x00000000,
        0x80000000,
        0x7F800000,
        0xFF800000,
        0x00000001,
        0x80000001,
        0x007FFFFF,
        0x807FFFFF,
        0x00800000,
        0x7F7FFFFF,
        0xFF7FFFFF,
    ],
    "float64": [
        0x7FF8000000000000,
        0x7FF8000000000001,
        0xFFFFFFFFFFFFFFFF,
        0x7FF0000000000001,
        0xFFF0000000000001,
        0x7FF7FFFFFFFFFFFF,
        0x0000000000000000,
        0x8000000000000000,
        0x7FF0000000000000,
        0xFFF0000000000000,
        0x0000000000000001,
        0x8000000000000001,
        0x000FFFFFFFFFFFFF,
        0x0010000000000000,
        0x7FEFFFFFFFFFFFFF,
        0xFFEFFFFFFFFFFFFF,
    ],
    "float8_e4m3fn": [0x7F, 0xFF, 0x00, 0x80, 0x01, 0x81, 0x07, 0x08, 0x7E, 0xFE],  # NaN (only S.1111.111), ...
    "float8_e5m2": [0x7D, 0x7E, 0x7F, 0xFF, 0x00, 0x80, 0x7C, 0xFC, 0x01, 0x83, 0x04, 0x7B, 0xFB],
    "int8": [0x00, 0xFF, 0x7F, 0x80, 0x01],
    "uint8": [0x00, 0xFF, 0x01, 0x80],
    "int16": [0x0000, 0xFFFF, 0x7FFF, 0x8000],
    "uint16": [0x0000, 0xFFFF, 0x8000],
    "int32": [0, 0xFFFFFFFF, 0x7FFFFFFF, 0x80000000],
    "uint32": [0, 0xFFFFFFFF, 0x80000000],
    "int64": [0, 0xFFFFFFFFFFFFFFFF, 0x7FFFFFFFFFFFFFFF, 0x8000000000000000],
    "uint64": [0, 0xFFFFFFFFFFFFFFFF, 0x8000000000000000],
    "bool": [0, 1],
}


# ------------------------------------------------------------------------------------ helpers


def _dtype(name: str) -> DType:
    return dtype_by_name(name)


def _tensor(bits: np.ndarray, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A torch tensor (owning its memory) whose elements have the given unsigned bit patterns."""
    dtype = _dtype(name)
    data = np.ascontiguousarray(bits, dtype=UINT[dtype.itemsize]).view(np.uint8).copy()
    return to_tensor(data, dtype, shape).clone()


def _random_bits(rng: np.random.Generator, name: str, count: int) -> np.ndarray:
    itemsize = _dtype(name).itemsize
    if name == "bool":
        return rng.integers(0, 2, count, dtype=np.uint8)
    return rng.integers(0, 256, count * itemsize, dtype=np.uint8).view(UINT[itemsize]).copy()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-identical; and equal as tensors where comparing values is meaningful (no NaN)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(_bits(got), _bits(want))
    if not (want.is_floating_point() and torch.isnan(want.float()).any()):
        assert torch.equal(got, want)


def _changed_elements(new: torch.Tensor, old: torch.Tensor) -> int:
    itemsize = new.element_size()
    a, b = raw_bytes(new).view(UINT[itemsize]), raw_bytes(old).view(UINT[itemsize])
    return int(np.count_nonzero(a != b))


def _expected_codecs(changed: int, count: int, choice: CodecChoice) -> set[int]:
    density = changed / count
    if density <= choice.modelled_up_to_density:  # ctx, unless sparse would be smaller (random bits)
        return {codecs.CODEC_CTX, codecs.CODEC_SPARSE}
    if density <= choice.sparse_only_below:
        return {codecs.CODEC_SPARSE}
    if density > choice.xor_only_above:
        return {codecs.CODEC_XOR}
    return {codecs.CODEC_SPARSE, codecs.CODEC_XOR}


def _check_header(obj: bytes, codec_id: int, dtype: DType, count: int, level: int, raw_hex: str) -> None:
    header, payload = unpack_chunk(obj)
    assert header.codec_id == codec_id == obj[6]  # recorded in the header
    assert (header.dtype, header.count, header.zstd_level) == (dtype, count, level)
    assert header.raw_xxh3.hex() == raw_hex and header.payload_bytes == len(payload) == len(obj) - HEADER_SIZE


def _full_round_trip(new: torch.Tensor, level: int = 1) -> None:
    dtype = _dtype(str(new.dtype).removeprefix("torch."))
    raw = raw_bytes(new)
    codec_id, raw_hex, obj, changed = encode_chunk(raw, None, dtype, level)
    assert codec_id == codecs.CODEC_FULL and changed == new.numel() and raw_hex == xxh3_digest(raw).hex()
    _check_header(obj, codec_id, dtype, new.numel(), level, raw_hex)
    out = _tensor(
        np.full(new.numel(), 0xA5, dtype=np.uint64).astype(UINT[dtype.itemsize]), dtype.name, tuple(new.shape)
    )  # garbage: `full` must not depend on what the range held
    apply_chunk(obj, raw_bytes(out), dtype, raw_hex, codec_id)
    _assert_same(out, new)


def _delta_round_trip(
    new: torch.Tensor, old: torch.Tensor, level: int = 1, choice: CodecChoice = DEFAULT_CHOICE
) -> int:
    """Encodes new against old, checks everything that can be checked, returns the codec id (0: same)."""
    dtype = _dtype(str(new.dtype).removeprefix("torch."))
    count = new.numel()
    new_raw, old_raw = raw_bytes(new), raw_bytes(old)
    old_before = old.clone()
    codec_id, raw_hex, obj, changed = encode_chunk(new_raw, old_raw, dtype, level, choice=choice)
    assert torch.equal(_bits(old), _bits(old_before)) and raw_hex == xxh3_digest(new_raw).hex()
    expected_changed = _changed_elements(new, old)
    assert changed == expected_changed
    direct = codecs.encode_delta(new_raw, old_raw, dtype.itemsize, level, dtype_name=dtype.name, choice=choice)
    if expected_changed == 0:
        assert (codec_id, obj, changed) == (0, None, 0) and direct is None
        return 0
    assert codec_id in _expected_codecs(changed, count, choice)
    _check_header(obj, codec_id, dtype, count, level, raw_hex)
    assert direct == (codec_id, obj[HEADER_SIZE:], changed)  # the chunk API wraps the codec API, nothing else

    out = old.clone()  # the reader's buffer holds the parent: decode XORs into it, in place
    apply_chunk(obj, raw_bytes(out), dtype, raw_hex, codec_id)
    _assert_same(out, new)
    out = old.clone()
    codecs.decode_into(codec_id, obj[HEADER_SIZE:], raw_bytes(out), dtype.itemsize, dtype_name=dtype.name)
    _assert_same(out, new)
    return codec_id


# --------------------------------------------------------------------------------- hypothesis


@st.composite
def _tensor_pairs(draw):
    """(old, new): same dtype and shape, random bits with special patterns mixed in, and a change
    pattern drawn from densities, hand-picked positions and gap sequences."""
    name = draw(st.sampled_from(DTYPES))
    itemsize = _dtype(name).itemsize
    count = draw(st.one_of(st.sampled_from(ODD_SIZES), st.integers(0, 600)))
    if count == 0:
        shape = draw(st.sampled_from([(0,), (0, 7), (3, 0)]))
    elif count == 1:
        shape = draw(st.sampled_from([(), (1,), (1, 1)]))
    else:
        shape = draw(st.sampled_from([(count,), (1, count)]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    specials = np.array(SPECIALS[name], dtype=UINT[itemsize])
    old = _random_bits(rng, name, count)
    if count and draw(st.booleans()):
        where = rng.random(count) < draw(st.sampled_from([0.1, 0.5, 1.0]))
        old[where] = rng.choice(specials, int(where.sum()))

    mask = np.zeros(count, dtype=bool)
    if count:
        pattern = draw(st.sampled_from(["density", "first", "last", "ends", "words", "tail", "gaps"]))
        per_word = 8 // itemsize
        if pattern == "density":
            density = draw(
                st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.6, 0.9, 1.0])
            )
            mask = rng.random(count) < density if density < 1.0 else np.ones(count, dtype=bool)
        elif pattern == "first":
            mask[0] = True
        elif pattern == "last":
            mask[-1] = True
        elif pattern == "ends":
            mask[[0, -1]] = True
        elif pattern == "words":  # the elements on either side of each 8-byte word boundary
            index = np.arange(count)
            mask = (index % per_word == 0) | (index % per_word == per_word - 1)
            mask &= rng.random(count) < draw(st.sampled_from([0.05, 1.0]))
        elif pattern == "tail":  # the elements after the last whole 8-byte word (the scan's tail path)
            mask[(count // per_word) * per_word :] = True
            mask[-1] = True
        else:
            gap = draw(st.sampled_from([0, 1, 7, 253, 254, 255, 256, 257, 600]))
            mask[gap :: gap + 1] = True
    new = old.copy()
    changed = np.flatnonzero(mask)
    if len(changed):
        how = draw(st.sampled_from(["flip", "special", "lowbit"]))
        if name == "bool":
            new[changed] ^= 1
        elif how == "flip":
            noise = rng.integers(0, 2**63, len(changed), dtype=np.uint64).astype(UINT[itemsize])
            new[changed] ^= noise | 1
        elif how == "special":  # may equal the old pattern: then that element is not a change
            new[changed] = rng.choice(specials, len(changed))
        else:
            new[changed] ^= 1  # one ULP-ish: what an RL step mostly does
    return _tensor(old, name, shape), _tensor(new, name, shape)


@HYPO
@given(pair=_tensor_pairs(), level=st.sampled_from([1, 3]))
def test_delta_round_trips_bit_exactly(pair, level):
    old, new = pair
    codec_id = _delta_round_trip(new, old, level)
    event(f"{new.dtype} codec {codecs.CODEC_NAMES.get(codec_id, 'same')}")


@HYPO
@given(pair=_tensor_pairs(), level=st.sampled_from([1, 3]))
def test_full_round_trips_bit_exactly(pair, level):
    _, new = pair
    _full_round_trip(new, level)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pair=_tensor_pairs(), cuts=st.lists(st.integers(0, 10_000), max_size=4))
def test_chunks_of_a_tensor_apply_at_their_offsets(pair, cuts):
    """A tensor cut into ranges at arbitrary element offsets (odd byte offsets included): each range
    encoded on its own and applied into its slice of the parent's buffer rebuilds the tensor."""
    old, new = pair
    count = new.numel()
    bounds = sorted({0, count, *(c % (count + 1) for c in cuts)})
    dtype = _dtype(str(new.dtype).removeprefix("torch."))
    itemsize = dtype.itemsize
    out = old.clone()
    new_raw, old_raw, out_raw = raw_bytes(new), raw_bytes(old), raw_bytes(out)
    for start, stop in itertools.pairwise(bounds):
        span = slice(start * itemsize, stop * itemsize)
        codec_id, raw_hex, obj, _ = encode_chunk(new_raw[span], old_raw[span], dtype, 1)
        if obj is not None:
            apply_chunk(obj, out_raw[span], dtype, raw_hex, codec_id)
    _assert_same(out, new)


# ------------------------------------------------------------------------------ special values


@pytest.mark.parametrize("name", DTYPES)
def test_special_bit_patterns_survive_every_codec(name):
    itemsize = _dtype(name).itemsize
    specials = np.array(SPECIALS[name], dtype=UINT[itemsize])
    tensor = _tensor(specials, name, (len(specials),))
    if name == "bfloat16":  # the patterns really are what they claim to be
        assert torch.isnan(tensor[:7]).all() and torch.isinf(tensor[9:11]).all()
        assert (tensor[11:15] != 0).all() and (tensor[11:15].abs() < 1.1754944e-38).all()
        assert torch.signbit(tensor[8]) and tensor[8] == 0
    _full_round_trip(tensor)
    zeros = _tensor(np.zeros(len(specials), UINT[itemsize]), name, tensor.shape)
    _delta_round_trip(tensor, zeros)  # every special against a zero parent
    _delta_round_trip(zeros, tensor)  # and back to zeros
    rolled = _tensor(np.roll(specials, 1), name, tensor.shape)
    _delta_round_trip(tensor, rolled)  # every element changed: one special into another
    one_changed = specials.copy()
    one_changed[len(specials) // 2] = specials[0]
    _delta_round_trip(tensor, _tensor(one_changed, name, tensor.shape))
    big = _tensor(np.resize(specials, 4097), name, (4097,))  # long enough for the sparse word scan
    parent = _tensor(np.resize(np.roll(specials, 3), 4097), name, (4097,))
    _delta_round_trip(big, parent)


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32", "float64"])
def test_signed_zero_and_nan_payloads_are_bit_changes(name):
    """-0.0 == +0.0 and NaN != NaN numerically; the codec sees bits: a sign flip of zero is a change,
    and an identical NaN is not."""
    itemsize = _dtype(name).itemsize
    specials = SPECIALS[name]
    nan_a, nan_b = specials[0], specials[1]
    zero, neg_zero = 0, 1 << (8 * itemsize - 1)
    old = _tensor(np.array([zero, nan_a, 5, 5], UINT[itemsize]), name, (4,))
    same_nan = _tensor(np.array([zero, nan_a, 5, 5], UINT[itemsize]), name, (4,))
    assert _delta_round_trip(same_nan, old) == 0  # equal bits, though NaN != NaN
    sign_flip = _tensor(np.array([neg_zero, nan_a, 5, 5], UINT[itemsize]), name, (4,))
    assert torch.equal(sign_flip[:1], old[:1])  # numerically equal ...
    assert _delta_round_trip(sign_flip, old) != 0  # ... but a change
    payload = _tensor(np.array([zero, nan_b, 5, 5], UINT[itemsize]), name, (4,))
    assert _delta_round_trip(payload, old) != 0  # another NaN payload is a change too


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (0, 5), (5, 0, 3)], ids=["0-dim", "empty", "empty-2d", "empty-3d"])
def test_empty_and_zero_dim_tensors(name, shape):
    itemsize = _dtype(name).itemsize
    count = int(np.prod(shape))
    value = SPECIALS[name][-1]
    tensor = _tensor(np.full(count, value, UINT[itemsize]), name, shape)
    assert tensor.shape == shape and raw_bytes(tensor).nbytes == count * itemsize
    _full_round_trip(tensor)
    assert _delta_round_trip(tensor, tensor.clone()) == 0  # unchanged: no object
    if count:  # a 0-dim tensor that changed: one element of one, density 1.0 -> dense xor
        other = _tensor(np.full(count, SPECIALS[name][0], UINT[itemsize]), name, shape)
        assert _delta_round_trip(tensor, other) == codecs.CODEC_XOR


# ------------------------------------------------------------------ odd sizes, word boundaries


def _positions(pattern: str, count: int, itemsize: int) -> list[int]:
    per_word = 8 // itemsize
    if pattern == "first":
        return [0]
    if pattern == "last":
        return [count - 1]
    if pattern == "every":
        return list(range(count))
    if pattern == "word-edges":  # last element of each 8-byte word and first of the next
        edges = sorted({p for k in range(per_word, count + 1, per_word) for p in (k - 1, k) if p < count})
        return edges or [count - 1]  # fewer elements than one word: the last one
    if pattern == "tail":  # only elements past the last whole word (none when the count is whole words)
        return list(range((count // per_word) * per_word, count)) or [count - 1]
    raise AssertionError(pattern)


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("count", [1, 3, 7, 8, 9, 4095, 4096, 4097])
@pytest.mark.parametrize("pattern", ["first", "last", "every", "word-edges", "tail"])
def test_odd_sizes_and_change_positions(itemsize, count, pattern):
    name = BY_ITEMSIZE[itemsize]
    rng = np.random.default_rng(count * 10 + itemsize)
    old_bits = _random_bits(rng, name, count)
    new_bits = old_bits.copy()
    positions = _positions(pattern, count, itemsize)
    new_bits[positions] ^= UINT[itemsize](0x81)
    old, new = _tensor(old_bits, name, (count,)), _tensor(new_bits, name, (count,))
    codec_id = _delta_round_trip(new, old)
    if pattern == "every":
        assert codec_id == codecs.CODEC_XOR  # density 1.0
    if len(positions) / count <= DEFAULT_CHOICE.ctx_up_to_density:
        assert codec_id == codecs.CODEC_CTX
    _full_round_trip(new)


# -------------------------------------------------------------------------- density and choice


def _with_changes(name: str, count: int, changed: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    itemsize = _dtype(name).itemsize
    old = _random_bits(rng, name, count)
    new = old.copy()
    new[rng.choice(count, changed, replace=False)] ^= UINT[itemsize](1)
    return _tensor(old, name, (count,)), _tensor(new, name, (count,))


@pytest.mark.parametrize("name", ["uint8", "bfloat16", "float32", "int64"])
@pytest.mark.parametrize("changed", [0, 1, 500, 1999, 2000, 2001, 3000, 3999, 4000, 4001, 7000, 10_000])
def test_codec_choice_follows_density(name, changed):
    """Of 10,000 elements: <= 20 % changed -> ctx (one-ULP changes: it wins), > 40 % -> xor, in
    between the smaller of sparse and xor."""
    old, new = _with_changes(name, 10_000, changed, seed=changed)
    codec_id = _delta_round_trip(new, old)
    if changed == 0:
        assert codec_id == 0
    elif changed <= 2000:
        assert codec_id == codecs.CODEC_CTX
    elif changed > 4000:
        assert codec_id == codecs.CODEC_XOR
    else:
        assert codec_id in (codecs.CODEC_SPARSE, codecs.CODEC_XOR)


@pytest.mark.parametrize("changed", [2001, 2500, 3000, 3500, 4000])
def test_ambiguous_band_keeps_the_smaller_payload(changed):
    name = "bfloat16"
    old, new = _with_changes(name, 10_000, changed, seed=7)
    new_raw, old_raw = raw_bytes(new), raw_bytes(old)
    chosen = codecs.encode_delta(new_raw, old_raw, 2)
    sizes = {}
    for only, (sparse_below, dense_above) in {codecs.CODEC_SPARSE: (1.0, 1.0), codecs.CODEC_XOR: (0.0, 0.0)}.items():
        single = CodecChoice(sparse_only_below=sparse_below, xor_only_above=dense_above)  # one candidate left
        codec_id, payload, _ = codecs.encode_delta(new_raw, old_raw, 2, choice=single)
        assert codec_id == only
        sizes[codec_id] = len(payload)
        out = old.clone()
        codecs.decode_into(codec_id, payload, raw_bytes(out), 2)
        _assert_same(out, new)
    assert len(chosen[1]) == sizes[chosen[0]] == min(sizes.values())


@pytest.mark.parametrize("density", [0.0005, 0.05, 0.5, 1.0])
@pytest.mark.parametrize("forced", [codecs.CODEC_SPARSE, codecs.CODEC_XOR, codecs.CODEC_CTX, codecs.CODEC_RANS])
def test_every_delta_codec_decodes_at_any_density(density, forced):
    """Whatever a (future, or foreign) publisher chose, every delta codec must decode exactly,
    through the chunk API (the codec's own encoder, from the registry)."""
    count = 5000
    old, new = _with_changes("float32", count, max(1, int(count * density)), seed=3)
    dtype = _dtype("float32")
    new_raw = raw_bytes(new)
    payload = codecs.codec(forced).encode(new_raw, raw_bytes(old), 4, dtype_name="float32", level=1)
    obj = pack_chunk(forced, 1, dtype, count, xxh3_digest(new_raw), payload)
    assert unpack_chunk(obj)[0].codec_id == forced
    out = old.clone()
    apply_chunk(obj, raw_bytes(out), dtype, xxh3_digest(new_raw).hex(), forced)
    _assert_same(out, new)


def test_unchanged_chunks_have_no_object():
    for name in DTYPES:
        specials = np.array(SPECIALS[name], dtype=UINT[_dtype(name).itemsize])
        tensor = _tensor(np.resize(specials, 1001), name, (1001,))  # NaNs included: equal bits, no change
        raw = raw_bytes(tensor)
        assert codecs.encode_delta(raw, raw.copy(), _dtype(name).itemsize) is None
        codec_id, raw_hex, obj, changed = encode_chunk(raw, raw.copy(), _dtype(name), 1)
        assert (codec_id, obj, changed) == (0, None, 0) and raw_hex == xxh3_digest(raw).hex()


# --------------------------------------------------------------------------------- sparse gaps


def _sparse_streams(payload: bytes, itemsize: int) -> list[bytes]:
    """The decompressed streams of a sparse payload, read by hand from docs/format.md."""
    n = payload[0]
    assert n == 2 + itemsize
    table = [struct.unpack_from("<QQ", payload, 1 + 16 * i) for i in range(n)]
    offset, streams = 1 + 16 * n, []
    for raw_len, comp_len in table:
        frame = payload[offset : offset + comp_len]
        offset += comp_len
        streams.append(zstandard.ZstdDecompressor().decompress(frame) if raw_len else b"")
        assert len(streams[-1]) == raw_len
    assert offset == len(payload)
    return streams


@pytest.mark.parametrize("gap", [0, 1, 253, 254, 255, 256, 257, 509, 510, 511, 65_535 + 255, 70_000])
def test_sparse_gaps_around_the_escape_byte(gap):
    # sparse is what this test is about: chosen even where changes are dense (gap 0, 1)
    changes = 5
    count = (gap + 1) * changes + 3
    rng = np.random.default_rng(gap)
    old_bits = _random_bits(rng, "bfloat16", count)
    new_bits = old_bits.copy()
    positions = [gap + k * (gap + 1) for k in range(changes)]  # the first after `gap` equal elements too
    new_bits[positions] ^= np.uint16(0x8001)
    old, new = _tensor(old_bits, "bfloat16", (count,)), _tensor(new_bits, "bfloat16", (count,))
    assert _delta_round_trip(new, old, choice=SPARSE_ONLY) == codecs.CODEC_SPARSE

    _, _, obj, _ = encode_chunk(raw_bytes(new), raw_bytes(old), _dtype("bfloat16"), 1, choice=SPARSE_ONLY)
    gaps, overflow, low, high = _sparse_streams(obj[HEADER_SIZE:], 2)
    assert list(gaps) == [min(gap, 255)] * changes  # one byte per gap, 255 escapes
    escaped = changes if gap >= 255 else 0
    assert len(overflow) == 4 * escaped
    if escaped:  # gap - 255 as u32, stored as 4 byte planes one after the other
        planes = np.frombuffer(overflow, np.uint8).reshape(4, escaped).astype(np.uint64)
        values = planes[0] | planes[1] << 8 | planes[2] << 16 | planes[3] << 24
        assert list(values) == [gap - 255] * changes
    assert list(low) == [0x01] * changes and list(high) == [0x80] * changes  # planes of the XOR values


def test_sparse_gap_needing_every_overflow_byte():
    """A gap >= 2**24 + 255 uses the top byte plane of the overflow stream (1-byte elements, 16 MiB)."""
    gap = 2**24 + 300
    count = gap + 10
    old = torch.zeros(count, dtype=torch.uint8)
    new = old.clone()
    new[[gap, gap + 5]] = 7
    assert _delta_round_trip(new, old, choice=NO_CTX) == codecs.CODEC_SPARSE
    _, _, obj, _ = encode_chunk(raw_bytes(new), raw_bytes(old), _dtype("uint8"), 1, choice=NO_CTX)
    gaps, overflow, _ = _sparse_streams(obj[HEADER_SIZE:], 1)
    assert list(gaps) == [255, 4] and list(overflow) == list((gap - 255).to_bytes(4, "little"))


def test_every_zstd_level_decodes():
    old, new = _with_changes("bfloat16", 10_000, 270, seed=2)
    dtype = _dtype("bfloat16")
    for level in (0, 1, 2, 3, 9, 19, 22):
        codec_id, raw_hex, obj, _ = encode_chunk(raw_bytes(new), raw_bytes(old), dtype, level)
        assert unpack_chunk(obj)[0].zstd_level == level
        out = old.clone()
        apply_chunk(obj, raw_bytes(out), dtype, raw_hex, codec_id)
        _assert_same(out, new)
        _full_round_trip(new, level)


def test_dtype_of_a_real_tensor_matches_its_wire_dtype():
    for name in DTYPES:
        assert torch_dtype(_dtype(name)) == getattr(torch, name)
        assert raw_bytes(torch.zeros(3, dtype=getattr(torch, name))).nbytes == 3 * _dtype(name).itemsize


# ------------------------------------------------------------------------- through the publisher


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 2047, 2048, 2049, 4095, 4096, 4097, 6143]), min_size=1, max_size=4),
    dtype_name=st.sampled_from(["bfloat16", "float16", "float32", "int8", "int64"]),
    seed=st.integers(0, 2**16),
)
def test_publish_and_read_tensors_with_partial_last_chunks(tmp_path_factory, sizes, dtype_name, seed):
    """Tensors whose sizes fall just around multiples of the chunk size, through the Publisher."""
    from weightsync.publisher import Publisher, PublisherConfig
    from weightsync.reader import Reader
    from weightsync.stores import LocalStore

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


def test_ctx_is_tried_up_to_exactly_its_density():
    """The ctx scan counts the changes itself and gives up past the choice's density: the chunk at
    the boundary still gets ctx, one change more does not (the same decision as changed / count)."""
    from weightsync.format.codecs import CODEC_CTX, encode_delta
    from weightsync.format.codecs.choice import ctx_capacity

    density = DEFAULT_CHOICE.ctx_up_to_density
    for count in [1, 2, 3, 4, 5, 7, 10, 99, 1000, 1001, 12_345]:
        capacity = ctx_capacity(count, density)
        assert capacity / count <= density and (capacity == count or (capacity + 1) / count > density)
    count = 1000
    rng = np.random.default_rng(5)
    old = (rng.standard_normal(count).astype(np.float32) * 0.015).view(np.uint32)
    old = (old >> 16).astype(np.uint16)  # bf16 bit patterns
    for changed, expect_ctx in [(ctx_capacity(count, density), True), (ctx_capacity(count, density) + 1, False)]:
        new = old.copy()
        new[rng.choice(count, changed, replace=False)] += np.uint16(1)
        codec_id, payload, n = encode_delta(new.view(np.uint8), old.view(np.uint8), 2, dtype_name="bfloat16")
        assert n == changed and (codec_id == CODEC_CTX) == expect_ctx
        out = old.copy()
        codecs.decode_into(codec_id, payload, out.view(np.uint8), 2, dtype_name="bfloat16")
        assert np.array_equal(out, new)


def test_a_stopped_background_warm_up_compiles_nothing_after_the_kernel_under_way(monkeypatch):
    # close() before a short-lived process exits waits for one compile, not for every kernel.
    import threading

    from weightsync.format.codecs import ctx as ctx_codec
    from weightsync.format.codecs import rans as rans_codec

    under_way, release, calls = threading.Event(), threading.Event(), []

    def ctx_warm_up(names):
        calls.append(("ctx", *names))
        under_way.set()
        assert release.wait(60)

    monkeypatch.setattr(ctx_codec, "warm_up", ctx_warm_up)
    monkeypatch.setattr(rans_codec, "warm_up", lambda names: calls.append(("rans", *names)))
    warm_up = codecs.BackgroundWarmUp(["float32", "bfloat16", "bfloat16"], thread_name="test-warm-up")
    assert under_way.wait(60)
    warm_up.stop()
    release.set()
    assert warm_up.wait(60)
    assert calls == [("ctx", "bfloat16")]


def test_a_background_warm_up_compiles_each_codec_for_each_dtype_and_survives_a_failure(monkeypatch, caplog):
    from weightsync.format.codecs import ctx as ctx_codec
    from weightsync.format.codecs import rans as rans_codec

    calls = []

    def ctx_warm_up(names):
        calls.append(("ctx", *names))
        if names == ["bfloat16"]:
            raise RuntimeError("no compiler")

    monkeypatch.setattr(ctx_codec, "warm_up", ctx_warm_up)
    monkeypatch.setattr(rans_codec, "warm_up", lambda names: calls.append(("rans", *names)))
    warm_up = codecs.BackgroundWarmUp(["float32", "bfloat16"], thread_name="test-warm-up")
    assert warm_up.wait(60)
    warm_up.close()
    assert calls == [("ctx", "bfloat16"), ("rans", "bfloat16"), ("ctx", "float32"), ("rans", "float32")]
    assert "warming up" in caplog.text and "no compiler" in caplog.text
