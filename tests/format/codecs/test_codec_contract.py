"""The codec contract, over every codec in the registry: a codec added there is covered here with
no edit to this file.

For each registered codec, through its own (forced) encoder and the registry's `decode_into`:

- round trips are bit-exact (hypothesis): every itemsize it codes and every dtype of that width,
  NaN payloads, +-0, subnormals and infinities among the bits, empty chunks, every change density
  and shape of change; a delta codec against its parent, `full` over garbage; encoding is
  deterministic (objects are content-addressed);
- hostile payloads raise FormatError, leave the range as it was and never write outside it
  (guard bytes on both sides): truncated at any byte, with trailing bytes, with a declared count
  or length made huge; any corrupted byte raises FormatError or decodes to *some* bytes (the raw
  hash catches those), but never raises anything else or writes outside the range;
- the registry itself: ids and names as registered, an unknown id refused with the known ones.

Codec-specific layouts and their documented decoders are tested in test_codec.py,
test_ctx.py and test_rans.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.errors import FormatError, UnsupportedFormatError
from weightsync.format import codecs
from weightsync.format.dtypes import BY_NAME

REGISTERED = sorted(codecs.CODEC_NAMES)
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
GUARD = 64  # bytes on either side of the range that no decoder may touch
HYPO = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Bit patterns worth carrying, by element width: NaNs with payloads, +-0, +-inf, subnormals and
# the extremes of every float format of that width, and the integers' extremes.
SPECIALS = {
    1: [0x7F, 0xFF, 0x00, 0x80, 0x01, 0x81, 0x07, 0x7D, 0x7C, 0xFC, 0x83, 0x7B],
    2: [0x7FC0, 0x7FC1, 0xFFFF, 0x7F81, 0x0000, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x7E01, 0x7C00, 0x03FF, 0x7FFF],
    4: [0x7FC00001, 0xFFFFFFFF, 0x7F800001, 0x00000000, 0x80000000, 0x7F800000, 0x00000001, 0x807FFFFF, 0x7FFFFFFF],
    8: [0x7FF8000000000001, 0xFFFFFFFFFFFFFFFF, 0, 1 << 63, 0x7FF0000000000000, 1, 0x000FFFFFFFFFFFFF, (1 << 63) - 1],
}


def _codec_id(codec_id: int) -> str:
    return f"{codec_id}-{codecs.CODEC_NAMES[codec_id]}"


@st.composite
def _chunks(draw, codec_id: int):
    """(itemsize, dtype name, parent bits or None, new bits) for `codec_id` to code."""
    found = codecs.codec(codec_id)
    itemsize = draw(st.sampled_from(found.itemsizes))
    dtype_name = draw(st.sampled_from(sorted(n for n, d in BY_NAME.items() if d.itemsize == itemsize)))
    count = draw(st.one_of(st.sampled_from([0, 1, 2, 7, 8, 9, 63, 64, 65, 255, 256, 257, 4097]), st.integers(0, 700)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    utype = UINT[itemsize]
    old = rng.integers(0, 256, count * itemsize, dtype=np.uint8).view(utype).copy()
    if count and draw(st.booleans()):
        where = rng.random(count) < draw(st.sampled_from([0.1, 0.5, 1.0]))
        old[where] = rng.choice(np.array(SPECIALS[itemsize], dtype=utype), int(where.sum()))
    new = old.copy()
    density = draw(st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.2, 0.3, 0.5, 1.0]))
    changed = np.flatnonzero(rng.random(count) < density) if density < 1 else np.arange(count)
    how = draw(st.sampled_from(["ulp", "flip", "special"]))
    if how == "ulp":  # one step in the integer order: what an RL step mostly does to a float
        new[changed] += rng.choice(np.array([1, -1]).astype(utype), len(changed))  # -1 wraps: one step down
    elif how == "flip":
        new[changed] ^= rng.integers(0, 2**63, len(changed), dtype=np.uint64).astype(utype) | utype(1)
    else:
        new[changed] = rng.choice(np.array(SPECIALS[itemsize], dtype=utype), len(changed))
    return itemsize, dtype_name, (old if found.delta else None), new


def _encode(codec_id: int, chunk) -> bytes:
    itemsize, dtype_name, old, new = chunk
    parent = None if old is None else old.view(np.uint8)
    return codecs.codec(codec_id).encode(new.view(np.uint8), parent, itemsize, dtype_name=dtype_name, level=1)


def _guarded(chunk, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(buffer with guard bytes, the range inside it): the range holds the parent's bytes (garbage
    for a codec that needs none)."""
    itemsize, _, old, new = chunk
    nbytes = new.nbytes
    buffer = rng.integers(0, 256, nbytes + 2 * GUARD, dtype=np.uint8)
    out = buffer[GUARD : GUARD + nbytes]
    if old is not None:
        out[:] = old.view(np.uint8)
    return buffer, out


def _decode(codec_id: int, payload: bytes, out: np.ndarray, chunk) -> None:
    itemsize, dtype_name, _, _ = chunk
    codecs.decode_into(codec_id, payload, out, itemsize, dtype_name=dtype_name)


def _assert_refused(codec_id: int, payload: bytes, chunk, seed: int) -> None:
    """FormatError, with the range and the guards exactly as they were."""
    buffer, out = _guarded(chunk, np.random.default_rng(seed))
    before = buffer.copy()
    with pytest.raises(FormatError):
        _decode(codec_id, payload, out, chunk)
    assert np.array_equal(buffer, before), "a refused payload changed the buffer"


# ------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("codec_id", REGISTERED, ids=_codec_id)
def test_round_trips_bit_exactly(codec_id):
    @HYPO
    @given(chunk=_chunks(codec_id), seed=st.integers(0, 2**32 - 1))
    def check(chunk, seed):
        payload = _encode(codec_id, chunk)
        assert _encode(codec_id, chunk) == payload  # deterministic: objects are content-addressed
        buffer, out = _guarded(chunk, np.random.default_rng(seed))
        guards = buffer[:GUARD].copy(), buffer[-GUARD:].copy()
        _decode(codec_id, payload, out, chunk)
        assert np.array_equal(out, chunk[3].view(np.uint8))  # bit patterns: NaN payloads and -0 included
        assert np.array_equal(buffer[:GUARD], guards[0]) and np.array_equal(buffer[-GUARD:], guards[1])

    check()


# ------------------------------------------------------------------------------------- hostile


@pytest.mark.parametrize("codec_id", REGISTERED, ids=_codec_id)
def test_truncated_payloads_are_refused(codec_id):
    @HYPO
    @given(chunk=_chunks(codec_id), cut=st.integers(0, 2**32), seed=st.integers(0, 2**32 - 1))
    def check(chunk, cut, seed):
        payload = _encode(codec_id, chunk)
        _assert_refused(codec_id, payload[: cut % len(payload)], chunk, seed)

    check()


@pytest.mark.parametrize("codec_id", REGISTERED, ids=_codec_id)
def test_trailing_bytes_are_refused(codec_id):
    @HYPO
    @given(chunk=_chunks(codec_id), extra=st.binary(min_size=1, max_size=24), seed=st.integers(0, 2**32 - 1))
    def check(chunk, extra, seed):
        _assert_refused(codec_id, _encode(codec_id, chunk) + extra, chunk, seed)

    check()


@pytest.mark.parametrize("codec_id", REGISTERED, ids=_codec_id)
def test_huge_declared_counts_and_lengths_are_refused(codec_id):
    """Eight bytes of 0xFF at any offset among the first 16: wherever a payload declares its counts
    and lengths (streams, changed elements), one of them claims more than the chunk can hold."""

    @HYPO
    @given(chunk=_chunks(codec_id), at=st.integers(0, 8), seed=st.integers(0, 2**32 - 1))
    def check(chunk, at, seed):
        payload = bytearray(_encode(codec_id, chunk))
        at = min(at, len(payload) - 8)
        payload[at : at + 8] = b"\xff" * 8
        _assert_refused(codec_id, bytes(payload), chunk, seed)

    check()


@pytest.mark.parametrize("codec_id", REGISTERED, ids=_codec_id)
def test_corrupt_bytes_never_escape_the_range(codec_id):
    """Any bytes flipped: FormatError (range untouched) or a decode to some bytes the raw hash will
    catch; nothing else is raised, and nothing outside the range is written either way."""

    @HYPO
    @given(
        chunk=_chunks(codec_id),
        flips=st.lists(st.tuples(st.integers(0, 2**32), st.integers(1, 255)), min_size=1, max_size=4),
        seed=st.integers(0, 2**32 - 1),
    )
    def check(chunk, flips, seed):
        payload = bytearray(_encode(codec_id, chunk))
        for at, mask in flips:
            payload[at % len(payload)] ^= mask
        buffer, out = _guarded(chunk, np.random.default_rng(seed))
        before = buffer.copy()
        try:
            _decode(codec_id, bytes(payload), out, chunk)
        except FormatError:
            assert np.array_equal(buffer, before), "a refused payload changed the buffer"
        assert np.array_equal(buffer[:GUARD], before[:GUARD]) and np.array_equal(buffer[-GUARD:], before[-GUARD:])

    check()


# ------------------------------------------------------------------------------------ registry


@pytest.mark.parametrize("codec_id", REGISTERED, ids=_codec_id)
def test_each_registered_codec_is_what_its_registry_line_says(codec_id):
    found = codecs.codec(codec_id)
    assert isinstance(found, codecs.Codec) and codecs.codec(codec_id) is found  # resolved once
    assert (found.id, found.name) == (codec_id, codecs.CODEC_NAMES[codec_id])
    assert codecs.CODEC_IDS[found.name] == codec_id
    assert found.itemsizes and set(found.itemsizes) <= set(UINT)


def test_an_unknown_codec_id_is_refused_with_the_known_ones():
    unknown = max(REGISTERED) + 1 if max(REGISTERED) < 255 else min(set(range(256)) - set(REGISTERED))
    with pytest.raises(UnsupportedFormatError, match=re.escape(f"unknown codec id {unknown}; supported: {REGISTERED}")):
        codecs.decode_into(unknown, b"", np.zeros(4, np.uint8), 2)


@pytest.mark.parametrize("codec_id", REGISTERED, ids=_codec_id)
def test_a_width_the_codec_does_not_code_is_refused(codec_id):
    with pytest.raises(UnsupportedFormatError, match="itemsizes"):
        codecs.decode_into(codec_id, b"", np.zeros(6, np.uint8), 3)
