"""Codec rans (5): round trips for every dtype and step shape, the encoder's limit, the choice
between ctx and rans, and a second decoder written in plain Python from docs/format.md ("Payload:
codec rans") alone, which must agree with the reference implementation (`weightsync/format/codecs/rans.py`)
on every payload: the format is what the document says, not what the numba kernels happen to do."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given
from test_ctx import DTYPES, FLOATS, HYPO, _pairs, extreme_pairs

from weightsync.errors import FormatError, UnsupportedFormatError
from weightsync.format import codecs
from weightsync.format.chunk import apply_chunk, encode_chunk
from weightsync.format.codecs import changes as change_model
from weightsync.format.codecs import ctx as ctx_codec
from weightsync.format.codecs import rans as rans_codec
from weightsync.format.codecs.choice import DEFAULT_CHOICE, CodecChoice
from weightsync.format.dtypes import BY_NAME, dtype_by_name

# ------------------------------------------------------------------ the document's decoder

H = [4294967296, 3938502376, 3611622603, 3311872529, 3037000500, 2784941738, 2553802834, 2341847524]


def _pow(x: int, e: int) -> int:
    r = 1 << 32
    while e > 0:
        if e & 1:
            r = (r * x) >> 32
        x = (x * x) >> 32
        e >>= 1
    return r


def _normalize(weights: list[int]) -> list[int]:
    total = sum(weights)
    f = [max(1, w * 2048 // max(total, 1)) for w in weights]
    while sum(f) != 2048:
        largest = f.index(max(f))
        if sum(f) < 2048:
            f[largest] += 2048 - sum(f)
        else:
            f[largest] -= 1
    return f


def _gap_frequencies(gamma: int, k: int) -> list[int]:
    p = H[gamma % 8] >> (gamma // 8)
    q = (1 << 32) - p
    weights = []
    for sym in range(k):
        if sym == 0:
            lo = hi = 1
        else:
            t, b = (sym + 1) // 2, (sym + 1) % 2
            lo, hi = (2 + b) << (t - 1), ((3 + b) << (t - 1)) - 1
        weights.append(max(0, _pow(q, lo - 1) - _pow(q, hi)))
    return _normalize(weights)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise FormatError("tables past the end")
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self, most: int) -> int:
        v = 0
        for k in range(most):
            b = self.byte()
            v |= (b & 0x7F) << (7 * k)
            if b < 0x80:
                return v
        raise FormatError("varint too long")


def doc_decode(payload: bytes, parent: list[int], dtype_name: str, itemsize: int) -> list[int]:
    """The section's decoder, in plain Python integers: the new bit patterns of the chunk."""
    w = 8 * itemsize
    top, mask = 1 << (w - 1), (1 << w) - 1
    m, class_base, class_mask, n_words = struct.unpack_from("<QHHI", payload, 0)
    tables = _Reader(payload[16:])
    m_c, gap_f, step_f = {}, {}, {}
    for c in range(16):
        if class_mask >> c & 1:
            m_c[c] = tables.varint(9)
            assert m_c[c] >= 1
            gamma, k_gap, k_step = tables.byte(), tables.byte(), tables.byte()
            assert 1 <= k_gap <= 63 and 1 <= k_step <= 2 + 2 * w
            gap_f[c] = _gap_frequencies(gamma, k_gap)
            step_f[c] = [tables.varint(2) for _ in range(k_step)]
            assert sum(step_f[c]) == 2048
    assert sum(m_c.values()) == m
    at = 16 + tables.pos
    words = list(struct.unpack_from(f"<{n_words}H", payload, at))
    raw_words = list(struct.unpack_from(f"<{(len(payload) - at - 2 * n_words) // 8}Q", payload, at + 2 * n_words))
    state = [words[0] | words[1] << 16, words[2] | words[3] << 16]
    assert min(state) >= 1 << 16
    cursor = {"word": 4, "bit": 0}

    def symbol(which: int, freqs: list[int]) -> int:
        x = state[which]
        slot = x % 2048
        cum = 0
        for sym, f in enumerate(freqs):  # noqa: B007 (the symbol found is returned)
            if cum <= slot < cum + f:
                break
            cum += f
        x = f * (x >> 11) + slot - cum
        if x < 1 << 16:
            x = (x << 16) | words[cursor["word"]]
            cursor["word"] += 1
        state[which] = x
        return sym

    def raw(n: int) -> int:
        v = 0
        for k in range(n):
            j = cursor["bit"] + k
            v |= (raw_words[j // 64] >> (j % 64) & 1) << k
        cursor["bit"] += n
        return v

    def gap(c: int) -> int:
        sym = symbol(1, gap_f[c])
        if sym == 0:
            return 0
        t, b = (sym + 1) // 2, (sym + 1) % 2
        return (((2 + b) << (t - 1)) | raw(t - 1)) - 1

    layout = FLOATS.get(dtype_name)

    def key(x):
        return (~x & mask if x >= top else x + top) if layout else x

    def unkey(y):
        return (y - top if y >= top else ~y & mask) if layout else y

    def cls(x):
        return min(max(((x >> layout[0]) % (1 << layout[1])) - class_base, 0), 15) if layout else 0

    r, left = {}, dict(m_c)
    for c in sorted(m_c):
        r[c] = gap(c)
        left[c] -= 1
    out = list(parent)
    placed = 0
    for i, x in enumerate(parent):
        c = cls(x)
        if c not in r:
            continue
        if r[c] > 0:
            r[c] -= 1
            continue
        sym = symbol(0, step_f[c])
        if sym < 2:
            s, a = sym, 1
        else:
            u, s = (sym - 2) // 2, sym % 2
            a = ((1 << u) | raw(u)) + 1
        assert a < top or (a == top and s == 1)
        out[i] = unkey((key(x) + (-a if s else a)) & mask)
        placed += 1
        if left[c]:
            r[c] = gap(c)
            left[c] -= 1
        else:
            del r[c]
    assert placed == m
    assert cursor["word"] == n_words and state == [1 << 16, 1 << 16]
    assert len(raw_words) == -(-cursor["bit"] // 64)
    assert cursor["bit"] % 64 == 0 or raw_words[-1] >> (cursor["bit"] % 64) == 0
    return out


# ------------------------------------------------------------------------------- tests


def _emit(name: str, old_bits: np.ndarray, new_bits: np.ndarray, limit: int = 1 << 30) -> bytes | None:
    itemsize = old_bits.itemsize
    changed = int(np.count_nonzero(old_bits != new_bits))
    changes = change_model.scan_changes(new_bits.view(np.uint8), old_bits.view(np.uint8), name, itemsize, changed)
    return rans_codec.emit(changes, name, itemsize, limit)


def _round_trip(name: str, old_bits: np.ndarray, new_bits: np.ndarray) -> bytes:
    payload = _emit(name, old_bits, new_bits)
    out = old_bits.copy()
    rans_codec.decode_into(payload, out.view(np.uint8), name, old_bits.itemsize)
    assert np.array_equal(out, new_bits)
    assert doc_decode(payload, [int(x) for x in old_bits], name, old_bits.itemsize) == [int(x) for x in new_bits]
    return payload


@HYPO
@given(pair=_pairs())
def test_round_trip_agrees_with_the_documented_decoder(pair):
    _round_trip(*pair)


@pytest.mark.parametrize("name", DTYPES)
def test_extreme_steps_and_sign_crossings(name):
    """Steps of +-1, of half the key space (the most negative step), sign crossings through zero,
    every pattern to its complement: all exact."""
    _round_trip(name, *extreme_pairs(name))


@pytest.mark.parametrize("changed", [1, 5000, 100_000])
def test_a_big_bf16_step_round_trips_and_is_about_ctx_size(changed):
    """bf16 weights of std 0.02, moved by one ULP mostly (a few by more), as at RL change rates."""
    g = torch.Generator().manual_seed(changed)
    old = (torch.randn(1 << 20, generator=g) * 0.02).to(torch.bfloat16)
    old_bits = old.view(torch.int16).numpy().view(np.uint16).copy()
    new_bits = old_bits.copy()
    rng = np.random.default_rng(changed)
    idx = rng.choice(len(old_bits), changed, replace=False)
    new_bits[idx] = (new_bits[idx].astype(np.int64) + rng.choice([-1, 1, 1, 2, -3], changed)).astype(np.uint16)
    payload = _emit("bfloat16", old_bits, new_bits)
    out = old_bits.copy()
    rans_codec.decode_into(payload, out.view(np.uint8), "bfloat16", 2)
    assert np.array_equal(out, new_bits)
    if changed == 5000:  # the documented decoder on a chunk with every class and a real gap table
        assert doc_decode(payload, old_bits.tolist(), "bfloat16", 2) == new_bits.tolist()
    if changed >= DEFAULT_CHOICE.rans_from_changes:  # where publishers choose it: within a few % of ctx
        ctx = ctx_codec.encode(new_bits.view(np.uint8), old_bits.view(np.uint8), "bfloat16", 2, changed)
        assert len(payload) < 1.03 * len(ctx)


def test_the_encoder_gives_up_past_its_limit():
    rng = np.random.default_rng(2)
    old = rng.integers(0, 2**16, 10_000, dtype=np.uint16)
    new = rng.integers(0, 2**16, 10_000, dtype=np.uint16)
    assert _emit("bfloat16", old, new, limit=1000) is None
    _round_trip("bfloat16", old, new)


def test_publishers_choose_rans_on_big_chunks_only():
    g = torch.Generator().manual_seed(3)
    old = (torch.randn(200_000, generator=g) * 0.02).to(torch.bfloat16)
    for changed, expect in (
        (DEFAULT_CHOICE.rans_from_changes - 1, codecs.CODEC_CTX),
        (DEFAULT_CHOICE.rans_from_changes, codecs.CODEC_RANS),
    ):
        new = old.clone()
        new.view(torch.int16)[torch.randperm(200_000, generator=g)[:changed]] += 1
        raw_old, raw_new = old.view(torch.uint8).numpy(), new.view(torch.uint8).numpy()
        codec_id, raw_hex, obj, n = encode_chunk(raw_new, raw_old, dtype_by_name("bfloat16"), 1)
        assert (codec_id, n) == (expect, changed)
        out = raw_old.copy()
        apply_chunk(obj, out, dtype_by_name("bfloat16"), raw_hex, codec_id)
        assert np.array_equal(out, raw_new)
    for_older_readers = CodecChoice(highest_codec=codecs.CODEC_CTX)  # readers that predate codec 5
    assert encode_chunk(raw_new, raw_old, dtype_by_name("bfloat16"), 1, choice=for_older_readers)[0] == codecs.CODEC_CTX


def test_a_refused_payload_leaves_the_range_untouched():
    rng = np.random.default_rng(4)
    old = rng.integers(0, 2**16, 50_000, dtype=np.uint16)
    new = old.copy()
    new[rng.choice(50_000, 3000, replace=False)] += np.uint16(1)
    payload = bytearray(_emit("bfloat16", old, new))
    payload[len(payload) // 2] ^= 0x40  # somewhere in the rANS words
    out = old.copy()
    with pytest.raises(FormatError, match="rans payload"):
        rans_codec.decode_into(bytes(payload), out.view(np.uint8), "bfloat16", 2)
    assert np.array_equal(out, old)
    with pytest.raises(FormatError, match="one class"):  # an integer dtype has only class 0
        rans_codec.decode_into(struct.pack("<QHHI", 0, 0, 2, 4) + bytes(8), out.view(np.uint8), "int16", 2)


def test_warm_up_round_trips_every_dtype_it_is_given():
    codecs.warm_up(sorted(BY_NAME))
    with pytest.raises(UnsupportedFormatError, match="no_such_dtype"):
        codecs.warm_up(["no_such_dtype"])
