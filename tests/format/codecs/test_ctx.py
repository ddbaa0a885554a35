"""Codec ctx (4): round trips for every dtype and step shape, the encoder's limits, and a second
decoder written in plain Python from docs/format.md ("Payload: codec ctx") alone, which must agree
with the reference implementation (`weightsync/format/codecs/ctx.py`) on every payload: the format is what
the document says, not what the numba kernels happen to do."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.errors import FormatError, UnsupportedFormatError
from weightsync.format.codecs import changes as change_model
from weightsync.format.codecs import ctx as ctx_codec
from weightsync.format.dtypes import BY_NAME, dtype_by_name

DTYPES = [name for name in BY_NAME if hasattr(torch, name)]
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
FLOATS = {
    "bfloat16": (7, 8),
    "float16": (10, 5),
    "float32": (23, 8),
    "float64": (52, 11),
    "float8_e4m3fn": (3, 4),
    "float8_e5m2": (2, 5),
}  # (M, E), the table in the document
HYPO = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------ the document's decoder


class _Decoder:
    """The range decoder of docs/format.md, bit for bit."""

    def __init__(self, data: bytes) -> None:
        if len(data) < 5 or data[0] != 0:
            raise FormatError("stream")
        self.data, self.pos = data, 5
        self.range, self.code = 0xFFFFFFFF, int.from_bytes(data[1:5], "big")
        if self.code >= self.range:
            raise FormatError("code")
        self.p: dict[int, int] = {}
        self.n: dict[int, int] = {}

    def _normalize(self) -> None:
        while self.range < 1 << 24:
            if self.pos >= len(self.data):
                raise FormatError("read past the end")
            self.range = (self.range << 8) & 0xFFFFFFFF
            self.code = ((self.code << 8) | self.data[self.pos]) & 0xFFFFFFFF
            self.pos += 1

    def bit(self, cell: int) -> int:
        p, n = self.p.get(cell, 1 << 14), self.n.get(cell, 0)
        shift = min((n + 1).bit_length(), 7)
        self.n[cell] = min(n + 1, 127)
        bound = (self.range >> 15) * p
        if self.code < bound:
            self.range, bit = bound, 0
            self.p[cell] = p + (((1 << 15) - p) >> shift)
        else:
            self.code -= bound
            self.range -= bound
            bit = 1
            self.p[cell] = p - (p >> shift)
        self._normalize()
        return bit

    def direct(self, count: int) -> int:
        v = 0
        for _ in range(count):
            self.range >>= 1
            b = 1 if self.code >= self.range else 0
            if b:
                self.code -= self.range
            v = (v << 1) | b
            self._normalize()
        return v

    def tree(self, base: int, bits: int) -> int:
        j = 1
        for _ in range(bits):
            j = (j << 1) | self.bit(base + j)
        return j - (1 << bits)


def doc_decode(payload: bytes, parent: list[int], dtype_name: str, itemsize: int) -> list[int]:
    """The new bit patterns of a chunk, from its ctx payload and its parent's bit patterns."""
    m, class_base = struct.unpack_from("<QH", payload, 0)
    w = 8 * itemsize
    top, mask = 1 << (w - 1), (1 << w) - 1
    layout = FLOATS.get(dtype_name)
    count = len(parent)
    assert m <= count

    def klass(x: int) -> int:
        if layout is None:
            return 0
        mant, e_bits = layout
        return min(max(((x >> mant) & ((1 << e_bits) - 1)) - class_base, 0), 15)

    def key(x: int) -> int:
        return ((~x & mask) if x >= top else x + top) if layout else x

    def unkey(y: int) -> int:
        return ((y - top) if y >= top else (~y & mask)) if layout else y

    rc = _Decoder(payload[10:])

    def gap(c: int) -> int:
        t = rc.tree(164 * c, 5)
        v = 1
        if t >= 1:
            v = (v << 1) | rc.bit(164 * c + 32 + 2 * t + 1)
            v = (v << (t - 1)) | rc.direct(t - 1)
        return v - 1

    out = list(parent)
    r: dict[int, int] = {}
    changed = 0
    for i, x in enumerate(parent):
        c = klass(x)
        if c not in r:
            r[c] = gap(c)
        if r[c] > 0:
            r[c] -= 1
            continue
        s = rc.bit(164 * c + 96 + (x >> (w - 1)))
        a = 1
        if rc.bit(164 * c + 98 + s):
            u = rc.tree(164 * c + 100, 6)
            assert u < w
            a = ((1 << u) | rc.direct(u)) + 1
        assert a < top or (a == top and s == 1)
        out[i] = unkey((key(x) - a if s else key(x) + a) & mask)
        changed += 1
        r[c] = gap(c)
        assert r[c] <= count - i - 1
    assert changed == m and all(v == 0 for v in r.values()) and rc.pos == len(rc.data)
    return out


# ------------------------------------------------------------------------------ inputs


def _bits_of(name: str, values: np.ndarray) -> np.ndarray:
    return values.view(UINT[dtype_by_name(name).itemsize])


@st.composite
def _pairs(draw):
    name = draw(st.sampled_from(DTYPES))
    itemsize = dtype_by_name(name).itemsize
    count = draw(st.integers(1, 400))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["weights", "random", "specials"]))
    if kind == "weights" and name in FLOATS and name != "float8_e4m3fn" and name != "float8_e5m2":
        old = (torch.randn(count, generator=torch.Generator().manual_seed(seed)) * 0.02).to(getattr(torch, name))
        old_bits = old.view(getattr(torch, {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}[itemsize])).numpy()
        old_bits = old_bits.view(UINT[itemsize]).copy()
    elif kind == "specials":
        top = 1 << (8 * itemsize - 1)
        pool = [0, top, 1, top + 1, top - 1, (1 << (8 * itemsize)) - 1, top >> 1, (top >> 1) + top]
        old_bits = np.array(pool, dtype=np.uint64).astype(UINT[itemsize])[rng.integers(0, len(pool), count)]
    else:
        old_bits = rng.integers(0, 256, count * itemsize, dtype=np.uint8).view(UINT[itemsize]).copy()
    if name == "bool":
        old_bits &= 1
    density = draw(st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0]))
    changed = rng.random(count) < density
    step = draw(st.sampled_from(["ulp", "small", "any"]))
    if step == "ulp":
        deltas = rng.choice([-1, 1], count)
    elif step == "small":
        deltas = rng.integers(-40, 41, count)
    else:
        deltas = rng.integers(-(2**62), 2**62, count)
    new_bits = old_bits.copy()
    idx = np.flatnonzero(changed)
    wrapped = [(int(old_bits[i]) + int(deltas[i])) % (1 << (8 * itemsize)) for i in idx]
    new_bits[idx] = np.array(wrapped, dtype=np.uint64).astype(UINT[itemsize]) if len(idx) else new_bits[idx]
    if name == "bool":
        new_bits &= 1
    return name, old_bits, new_bits


def extreme_pairs(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(old, new) bit patterns: steps of +-1, of half the key space (the most negative step), sign
    crossings through zero, every pattern to its complement."""
    itemsize = dtype_by_name(name).itemsize
    w = 8 * itemsize
    top, mask = 1 << (w - 1), (1 << w) - 1
    olds = [0, top, 1, top + 1, top - 1, mask, 5, top + 5, 0, top]
    news = [top, 0, 0, top, top, 0, (5 + top) & mask, 5, mask, top - 1]
    if name == "bool":
        olds, news = [0, 1, 1, 0], [1, 0, 1, 1]
    return np.array(olds, dtype=UINT[itemsize]), np.array(news, dtype=UINT[itemsize])


def _encode(name: str, old_bits: np.ndarray, new_bits: np.ndarray) -> bytes | None:
    itemsize = old_bits.itemsize
    changed = int(np.count_nonzero(old_bits != new_bits))
    return ctx_codec.encode(new_bits.view(np.uint8), old_bits.view(np.uint8), name, itemsize, changed, limit=1 << 30)


# ------------------------------------------------------------------------------- tests


@HYPO
@given(pair=_pairs())
def test_round_trip_agrees_with_the_documented_decoder(pair):
    name, old_bits, new_bits = pair
    payload = _encode(name, old_bits, new_bits)
    out = old_bits.copy()
    ctx_codec.decode_into(payload, out.view(np.uint8), name, old_bits.itemsize)
    assert np.array_equal(out, new_bits)
    assert doc_decode(payload, [int(x) for x in old_bits], name, old_bits.itemsize) == [int(x) for x in new_bits]


@pytest.mark.parametrize("name", DTYPES)
def test_extreme_steps_and_sign_crossings(name):
    """Steps of +-1, of half the key space (the most negative step), sign crossings through zero,
    every pattern to its complement: all exact."""
    old_bits, new_bits = extreme_pairs(name)
    itemsize = old_bits.itemsize
    payload = _encode(name, old_bits, new_bits)
    out = old_bits.copy()
    ctx_codec.decode_into(payload, out.view(np.uint8), name, itemsize)
    assert np.array_equal(out, new_bits)
    assert doc_decode(payload, [int(x) for x in old_bits], name, itemsize) == [int(x) for x in new_bits]


def test_one_ulp_moves_are_cheap():
    """bf16 weights of std 0.02, 2 % moved by one ULP: a few bits per changed element, far below
    the 16 + position bits of the XOR codecs."""
    g = torch.Generator().manual_seed(1)
    old = (torch.randn(200_000, generator=g) * 0.02).to(torch.bfloat16)
    old_bits = old.view(torch.int16).numpy().view(np.uint16).copy()
    new_bits = old_bits.copy()
    idx = np.random.default_rng(1).choice(len(old_bits), 4000, replace=False)
    new_bits[idx] += np.uint16(1)
    payload = _encode("bfloat16", old_bits, new_bits)
    assert 8 * len(payload) / 4000 < 9.5


def test_the_encoder_gives_up_past_its_limit():
    rng = np.random.default_rng(2)
    old = rng.integers(0, 2**16, 10_000, dtype=np.uint16)
    new = rng.integers(0, 2**16, 10_000, dtype=np.uint16)  # random bits: no context helps
    changed = int(np.count_nonzero(old != new))
    assert ctx_codec.encode(new.view(np.uint8), old.view(np.uint8), "bfloat16", 2, changed, limit=1000) is None
    assert ctx_codec.encode(new.view(np.uint8), old.view(np.uint8), "bfloat16", 2, changed) is None  # > raw size
    payload = ctx_codec.encode(new.view(np.uint8), old.view(np.uint8), "bfloat16", 2, changed, limit=1 << 20)
    out = old.copy()
    ctx_codec.decode_into(payload, out.view(np.uint8), "bfloat16", 2)
    assert np.array_equal(out, new)


def test_warm_up_round_trips_every_dtype_it_is_given():
    """What bench/chaos runs before its cluster starts, so no process compiles inside a measured bound."""
    ctx_codec.warm_up(sorted(BY_NAME))
    with pytest.raises(UnsupportedFormatError, match="no_such_dtype"):
        ctx_codec.warm_up(["no_such_dtype"])


def test_a_wrong_changed_count_is_a_caller_bug():
    old = np.zeros(10, np.uint16)
    new = old.copy()
    new[[2, 5]] = 1
    with pytest.raises(ValueError, match="caller counted 1"):
        ctx_codec.encode(new.view(np.uint8), old.view(np.uint8), "bfloat16", 2, 1)


def test_class_base_is_checked_per_dtype():
    old = np.zeros(10, np.uint8)
    new = old.copy()
    new[3] = 1
    payload = bytearray(_encode("float8_e4m3fn", old, new))
    struct.pack_into("<H", payload, 8, 16)  # e4m3 has 4 exponent bits: bases 0..15
    with pytest.raises(FormatError, match="class base 16 is out of range for float8_e4m3fn"):
        ctx_codec.decode_into(bytes(payload), old.copy(), "float8_e4m3fn", 1)
    out = old.copy()
    struct.pack_into("<H", payload, 8, 1)  # any base in range decodes (to other bytes here, or refuses)
    try:
        ctx_codec.decode_into(bytes(payload), out, "float8_e4m3fn", 1)
    except FormatError:
        assert np.array_equal(out, old)  # refused: untouched


# ------------------------------------------------------------------- the host scan (find_changes)


def _scan_reference(name: str, old_bits: np.ndarray, new_bits: np.ndarray) -> dict:
    """What `find_changes` must give, in plain numpy from its definition (per changed element its
    position, class and rank among its class's elements; per class its count and first position)."""
    class_base = change_model.choose_class_base(old_bits, name)
    table, shift = change_model.class_table(name, old_bits.itemsize, class_base)
    classes = table[(old_bits >> shift).astype(np.int64)].astype(np.int64)
    positions = np.flatnonzero(old_bits != new_bits)
    ranks = np.empty(len(old_bits), np.int64)
    counts = np.zeros(2 * change_model.NUM_CLASSES, np.int64)
    counts[change_model.NUM_CLASSES :] = -1
    for c in range(change_model.NUM_CLASSES):
        members = np.flatnonzero(classes == c)
        ranks[members] = np.arange(len(members))
        counts[c] = len(members)
        if len(members):
            counts[change_model.NUM_CLASSES + c] = members[0]
    return {
        "class_base": class_base,
        "positions": positions,
        "classes": classes[positions],
        "ranks": ranks[positions],
        "class_counts": counts,
    }


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("count", [1, 2, 3, 63, 64, 65, 127, 128, 1001, 255 * 64, 255 * 64 + 1, 40_003])
@pytest.mark.parametrize("density", [0.0, 0.03, 0.5, 1.0])
def test_the_scan_finds_every_change_with_its_class_and_rank(name, count, density):
    """The scan works in blocks of 64 elements, with the last 0-63 apart, and adds its byte-wide
    counters up every 255 blocks: lengths around both, none / some / all changed, every dtype."""
    itemsize = dtype_by_name(name).itemsize
    rng = np.random.default_rng(count * 7 + int(density * 100))
    old_bits = rng.integers(0, 256, count * itemsize, dtype=np.uint8).view(UINT[itemsize]).copy()
    old_bits[rng.random(count) < 0.5] = old_bits[0]  # long runs of one class too
    new_bits = old_bits.copy()
    idx = np.flatnonzero(rng.random(count) < density)
    new_bits[idx] ^= UINT[itemsize](1)
    want = _scan_reference(name, old_bits, new_bits)
    got = change_model.find_changes(new_bits.view(np.uint8), old_bits.view(np.uint8), name, itemsize, count)
    assert got.count == count and got.class_base == want["class_base"]
    for field in ("positions", "classes", "ranks", "class_counts"):
        assert np.array_equal(getattr(got, field), want[field]), field
    assert np.array_equal(got.old_bits, old_bits[idx].astype(np.uint64))
    assert np.array_equal(got.new_bits, new_bits[idx].astype(np.uint64))
    if len(idx):  # one change more than allowed: the scan gives up
        assert (
            change_model.find_changes(new_bits.view(np.uint8), old_bits.view(np.uint8), name, itemsize, len(idx) - 1)
            is None
        )


def test_threads_code_chunks_at_once_with_their_own_scratch():
    """The kernels release the GIL and every work array is per thread: chunks coded on 2 threads
    give exactly the bytes (and decode to exactly the chunks) they give on one."""
    import concurrent.futures as cf

    chunks = []
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        old = (torch.randn(50_000 + seed, generator=g) * 0.015).to(torch.bfloat16)
        old_bits = old.view(torch.int16).numpy().view(np.uint16).copy()
        new_bits = old_bits.copy()
        idx = np.random.default_rng(seed).choice(len(old_bits), 300 * (seed + 1), replace=False)
        new_bits[idx] += np.uint16(1)
        chunks.append((old_bits, new_bits))
    alone = [_encode("bfloat16", o, x) for o, x in chunks]

    def round_trip(pair):
        (o, x), payload = pair
        out = o.copy()
        ctx_codec.decode_into(payload, out.view(np.uint8), "bfloat16", 2)
        return _encode("bfloat16", o, x), out

    with cf.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(round_trip, zip(chunks * 3, alone * 3, strict=True)))
    for ((_, x), payload), (again, out) in zip(zip(chunks * 3, alone * 3, strict=True), results, strict=True):
        assert again == payload and np.array_equal(out, x)
