"""ctx: codec 4 (`ctx`), the change model's steps and gaps range-coded under adaptive contexts.

The change model (`changes.py`) gives every changed element a class (its parent exponent) and a
step (old to new in the dtype's monotone order, +-1 for a one-ULP move). `ctx` codes:

- the change mask per class as *gaps*: how many elements of that class to skip before its next
  changed one. The gaps of a class with change probability p are geometric, and coding them with
  an adaptive model costs what coding each element's bit under its class would, but the coder
  only runs once per changed element;
- each change's step, by its sign (in the context of the parent's sign), "one ULP or more", and
  for bigger steps a slot and direct bits.

Symbols go through an adaptive binary range coder (LZMA's, with 15-bit probabilities whose
adaptation rate warms up from 1/2 to 1/128), with separate probabilities per class. The exact
layout is in docs/format.md, "Payload: codec ctx"; this module is its reference implementation
(tests/format/codecs/test_ctx.py checks it against a plain-Python decoder written from
that section).

The kernels are numba (`changes.jit`: only the first run on a machine compiles, ~20-25 s per
element width, then ~1 s to load). Every read of the payload and every position is bounds-checked
inside the kernels: a corrupt payload returns an error code, never reads or writes outside its
arrays. Decoding collects (position, new bits) first and applies them only when the whole payload
checked out, so a refused payload leaves `out` untouched.

Not here: the classes and the scan (`changes.py`), choosing between codecs (`choice.py`), chunk
headers (`weightsync.format.chunk`), the on-device diff (`diff.py`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import numpy as np

from weightsync.errors import FormatError
from weightsync.format.codecs import DEFAULT_ZSTD_LEVEL, Codec
from weightsync.format.codecs.changes import (
    FLOAT_LAYOUT,
    NUM_CLASSES,
    Changes,
    bit_length,
    cached_class_table,
    encode_forced,
    inline,
    jit,
    key,
    order_masks,
    require_numba,
    scan_changes,
    unkey,
)
from weightsync.format.codecs.elements import UINT, scratch
from weightsync.format.dtypes import dtype_by_name

HEADER = struct.Struct("<QH")  # changed elements, class_base
# Per-class probability cells (docs/format.md, "Codec ctx"). Bit trees use cells 1 .. 2^bits - 1.
GAP_TOP_BITS = 1  # bits of a gap below its leading one that are modelled (the rest: direct)
GAP_SLOT = 0  # 5-bit tree: s = bit_length(gap + 1) - 1
GAP_TOP = 32  # 2^GAP_TOP_BITS cells per slot s: a tree over the bits below the leading one
STEP_SIGN = GAP_TOP + 32 * (1 << GAP_TOP_BITS)  # 2 cells, by the parent's sign bit
STEP_ONE = STEP_SIGN + 2  # 2 cells, by the step's sign: is |step| == 1?
STEP_SLOT = STEP_ONE + 2  # 6-bit tree: s = bit_length(|step| - 1) - 1 when |step| >= 2
CELLS_PER_CLASS = STEP_SLOT + 64
TOTAL_CELLS = NUM_CLASSES * CELLS_PER_CLASS
PROB_BITS = 15
PROB_ONE = 1 << PROB_BITS
PROB_INIT = 1 << (PROB_BITS - 1)
MOVE_BITS = 7
# A cell adapts by 1/2^shift with shift = bit_length(seen + 1), at most MOVE_BITS: roughly the
# running average of its first bits (fast learning), then an exponential one (tracking).
SEEN_MAX = (1 << MOVE_BITS) - 1
_SHIFT_AFTER = np.array([min((n + 1).bit_length(), MOVE_BITS) for n in range(SEEN_MAX + 1)], dtype=np.int64)

# Kernel status codes (0 = ok).
_ERRORS = {
    1: "range coder stream does not start with a zero byte",
    2: "range coder stream truncated",
    3: "a gap points past the end of the chunk",
    4: "more changed elements than the header declares",
    5: "fewer changed elements than the header declares",
    6: "a class's last gap does not end exactly at the chunk's end",
    7: "range coder stream has trailing bytes",
    8: "a step is out of range for the element width",
    9: "range coder state is invalid",
}


# ----------------------------------------------------------------------------- numba kernels

# --- range encoder. State: low (< 2^33), rng (32 bits), cache byte, cache_size, op.


@inline
def shift_low(low, cache, cache_size, out, op):
    if low < 0xFF000000 or low >= 0x100000000:
        carry = low >> 32
        temp = cache
        while True:
            out[op] = (temp + carry) & 0xFF
            op += 1
            temp = 0xFF
            cache_size -= 1
            if cache_size == 0:
                break
        cache = (low >> 24) & 0xFF
    cache_size += 1
    low = (low & 0x00FFFFFF) << 8
    return low, cache, cache_size, op


@inline
def adapt(probs, cell, bit):
    """The cell's probability before coding `bit`, updated for it (docs/format.md: the warm-up
    shift, then P moves towards the bit). Selects, not a branch on the bit: the bits of a change
    are close to random, so such a branch would mispredict often."""
    p = np.int64(probs[cell])
    seen = np.int64(probs[cell + TOTAL_CELLS])
    move = _SHIFT_AFTER[seen]
    probs[cell + TOTAL_CELLS] = min(seen + 1, SEEN_MAX)
    mask = -bit  # all ones for a 1 bit
    probs[cell] = p + (((PROB_ONE - p) >> move) & ~mask) - ((p >> move) & mask)
    return p


@inline
def enc_bit(probs, cell, bit, low, rng, cache, cache_size, out, op):
    p = adapt(probs, cell, bit)
    bound = (rng >> PROB_BITS) * p
    mask = -bit
    low += bound & mask
    rng = bound + ((rng - 2 * bound) & mask)  # bit 0: bound; bit 1: rng - bound
    while rng < 0x1000000:
        rng <<= 8
        low, cache, cache_size, op = shift_low(low, cache, cache_size, out, op)
    return low, rng, cache, cache_size, op


@inline
def enc_direct(value, nbits, low, rng, cache, cache_size, out, op):
    for i in range(nbits - 1, -1, -1):
        rng >>= 1
        low += rng & -((value >> i) & 1)
        while rng < 0x1000000:
            rng <<= 8
            low, cache, cache_size, op = shift_low(low, cache, cache_size, out, op)
    return low, rng, cache, cache_size, op


@inline
def enc_tree(probs, base, nbits, value, low, rng, cache, cache_size, out, op):
    m = 1
    for i in range(nbits - 1, -1, -1):
        b = (value >> i) & 1
        low, rng, cache, cache_size, op = enc_bit(probs, base + m, b, low, rng, cache, cache_size, out, op)
        m = (m << 1) | b
    return low, rng, cache, cache_size, op


@inline
def enc_gap(probs, c, gap, low, rng, cache, cache_size, out, op):
    base = c * CELLS_PER_CLASS
    v = gap + 1
    s = bit_length(v) - 1
    low, rng, cache, cache_size, op = enc_tree(probs, base + GAP_SLOT, 5, s, low, rng, cache, cache_size, out, op)
    top = min(s, GAP_TOP_BITS)  # the bits below the leading one: the first ones modelled
    cell = base + GAP_TOP + s * (1 << GAP_TOP_BITS)
    j = 1
    for k in range(1, top + 1):
        b = (v >> (s - k)) & 1
        low, rng, cache, cache_size, op = enc_bit(probs, cell + j, b, low, rng, cache, cache_size, out, op)
        j = (j << 1) | b
    if s > top:  # the rest direct
        low, rng, cache, cache_size, op = enc_direct(
            v & ((np.int64(1) << (s - top)) - 1), s - top, low, rng, cache, cache_size, out, op
        )
    return low, rng, cache, cache_size, op


@inline
def enc_step(probs, c, old_sign, sign, mag, low, rng, cache, cache_size, out, op):
    """mag: |step| as uint64, >= 1."""
    base = c * CELLS_PER_CLASS
    low, rng, cache, cache_size, op = enc_bit(
        probs, base + STEP_SIGN + old_sign, sign, low, rng, cache, cache_size, out, op
    )
    big = 1 if mag != 1 else 0
    low, rng, cache, cache_size, op = enc_bit(probs, base + STEP_ONE + sign, big, low, rng, cache, cache_size, out, op)
    if big:
        v = mag - np.uint64(1)  # >= 1
        s = 0
        t = v
        while t > np.uint64(1):
            t >>= np.uint64(1)
            s += 1
        low, rng, cache, cache_size, op = enc_tree(probs, base + STEP_SLOT, 6, s, low, rng, cache, cache_size, out, op)
        for i in range(s - 1, -1, -1):  # the bits below the leading one, direct
            rng >>= 1
            low += rng & -np.int64((v >> np.uint64(i)) & np.uint64(1))
            while rng < 0x1000000:
                rng <<= 8
                low, cache, cache_size, op = shift_low(low, cache, cache_size, out, op)
    return low, rng, cache, cache_size, op


@jit
def _emit_kernel(pos, cls, rank, old_bits, new_bits, counts, is_float, width, probs, work, out):
    """Range-codes the changes that `scan` (or the device diff) found; returns the bytes
    written into out, or -1 when they would not fit (another codec is smaller then).

    pos, cls, rank, old_bits, new_bits: one entry per changed element, in position order;
    old/new_bits as uint64. counts: per class its element count, then its first position."""
    m = pos.shape[0]
    nc = NUM_CLASSES
    cnt = counts[0:nc]
    first = counts[nc : 2 * nc]
    last = work[0:nc]
    pending = work[nc : 2 * nc]
    order = work[2 * nc : 3 * nc]
    gaps = work[3 * nc :]  # m entries
    for c in range(nc):
        last[c] = 0
    for j in range(m):  # the gap before each change: skipped elements of its class
        c = cls[j]
        gaps[j] = rank[j] - last[c]
        last[c] = rank[j] + 1
    for c in range(nc):
        pending[c] = cnt[c] - last[c]  # after a class's last change: the rest of the class
    for j in range(m - 1, -1, -1):  # now: the gap *after* each change
        c = cls[j]
        g = pending[c]
        pending[c] = gaps[j]
        gaps[j] = g
    # pending[c] is each class's first gap. Classes in order of first occurrence.
    for c in range(nc):
        k = c
        while k > 0 and first[order[k - 1]] > first[c]:
            order[k] = order[k - 1]
            k -= 1
        order[k] = c
    sign_shift, mask, top, low_mask = order_masks(width)
    for k in range(TOTAL_CELLS):
        probs[k] = PROB_INIT
        probs[TOTAL_CELLS + k] = 0
    low = np.int64(0)
    rng = np.int64(0xFFFFFFFF)
    cache = np.int64(0)
    cache_size = np.int64(1)
    op = 0
    limit = out.shape[0] - 2 * (NUM_CLASSES + 1) * 32 - 64  # one change + every first gap + flush
    if limit < 0:
        return -1
    oi = 0
    while oi < nc and first[order[oi]] < 0:
        oi += 1
    for j in range(m + 1):
        p = pos[j] if j < m else np.iinfo(np.int64).max
        while oi < nc and first[order[oi]] <= p:
            c = order[oi]
            low, rng, cache, cache_size, op = enc_gap(probs, c, pending[c], low, rng, cache, cache_size, out, op)
            oi += 1
        if j == m:
            break
        if op + cache_size > limit:
            return -1
        c = cls[j]
        o = np.uint64(old_bits[j])
        x = np.uint64(new_bits[j])
        d = (key(x, is_float, sign_shift, top, low_mask) - key(o, is_float, sign_shift, top, low_mask)) & mask
        sign = np.int64((d >> sign_shift) & np.uint64(1))
        negative = np.uint64(0) - np.uint64(sign)
        mag = ((d ^ negative) - negative) & mask  # |d| as a signed w-bit integer
        low, rng, cache, cache_size, op = enc_step(
            probs, c, np.int64(o >> sign_shift), sign, mag, low, rng, cache, cache_size, out, op
        )
        low, rng, cache, cache_size, op = enc_gap(probs, c, gaps[j], low, rng, cache, cache_size, out, op)
    for _ in range(5):
        low, cache, cache_size, op = shift_low(low, cache, cache_size, out, op)
    return op


# --- range decoder. State: rng, code (32 bits each), ip; errors set `bad`.


@inline
def dec_normalize(rng, code, buf, ip):
    """`while range < 2^24: shift in a byte`. Reads past the end give zeros and still count in
    ip (the kernel refuses ip > len at the end). A branch-free version (0, 1 or 2 bytes by
    selects) measured 20 % slower: the byte loads landed on the critical path."""
    while rng < 0x1000000:
        rng <<= 8
        b = np.int64(buf[ip]) if ip < buf.shape[0] else np.int64(0)
        code = ((code << 8) | b) & 0xFFFFFFFF
        ip += 1
    return rng, code, ip


@inline
def dec_bit_with(probs, cell, p, rng, code, buf, ip):
    """A bit of `cell`, whose probability p the caller loaded already."""
    bound = (rng >> PROB_BITS) * p
    bit = np.int64(code >= bound)
    adapt(probs, cell, bit)
    mask = -bit
    code -= bound & mask
    rng = bound + ((rng - 2 * bound) & mask)
    rng, code, ip = dec_normalize(rng, code, buf, ip)
    return bit, rng, code, ip


@inline
def dec_bit(probs, cell, rng, code, buf, ip):
    return dec_bit_with(probs, cell, np.int64(probs[cell]), rng, code, buf, ip)


@inline
def dec_direct(nbits, rng, code, buf, ip):
    v = np.uint64(0)
    for _ in range(nbits):
        rng >>= 1
        bit = np.int64(code >= rng)
        code -= rng & -bit
        v = (v << np.uint64(1)) | np.uint64(bit)
        if rng < 0x1000000:
            rng <<= 8
            b = np.int64(buf[ip]) if ip < buf.shape[0] else np.int64(0)
            code = ((code << 8) | b) & 0xFFFFFFFF
            ip += 1
    return v, rng, code, ip


@inline
def dec_tree(probs, base, nbits, rng, code, buf, ip):
    m = 1
    p = np.int64(probs[base + 1])
    p0 = p1 = p
    for k in range(nbits):
        cell = base + m
        if k < nbits - 1:  # both children's probabilities, loaded while this bit is decoded
            p0 = np.int64(probs[cell + m])
            p1 = np.int64(probs[cell + m + 1])
        b, rng, code, ip = dec_bit_with(probs, cell, p, rng, code, buf, ip)
        m = (m << 1) | b
        p = p1 if b else p0
    return m - (1 << nbits), rng, code, ip


@inline
def dec_gap(probs, c, rng, code, buf, ip):
    base = c * CELLS_PER_CLASS
    s, rng, code, ip = dec_tree(probs, base + GAP_SLOT, 5, rng, code, buf, ip)
    top = min(s, GAP_TOP_BITS)
    cell = base + GAP_TOP + s * (1 << GAP_TOP_BITS)
    j = 1
    for _ in range(top):
        b, rng, code, ip = dec_bit(probs, cell + j, rng, code, buf, ip)
        j = (j << 1) | b
    v = np.int64(j)  # the leading one and the modelled bits
    if s > top:
        low_bits, rng, code, ip = dec_direct(s - top, rng, code, buf, ip)
        v = (v << (s - top)) | np.int64(low_bits)
    return v - 1, rng, code, ip


@jit
def _decode_kernel(buf, old, table, shift, is_float, width, expected, pos, vals, probs, rem):
    """Decodes into (pos, vals); returns (status, changed). Writes nothing else."""
    n = old.shape[0]
    nc = NUM_CLASSES
    for k in range(TOTAL_CELLS):
        probs[k] = PROB_INIT
        probs[TOTAL_CELLS + k] = 0
    if buf.shape[0] < 5 or buf[0] != 0:
        return (1 if buf.shape[0] >= 5 else 2), 0
    rng = np.int64(0xFFFFFFFF)
    code = np.int64(0)
    for k in range(1, 5):
        code = (code << 8) | np.int64(buf[k])
    ip = 5
    if code >= rng:
        return 9, 0
    for c in range(nc):
        rem[c] = -1
    sign_shift, mask, top, low_mask = order_masks(width)
    m = 0
    for i in range(n):
        o = old[i]
        c = table[o >> shift]
        r = rem[c]
        if r > 0:
            rem[c] = r - 1
            continue
        if r < 0:  # the class's first element: its first gap
            g, rng, code, ip = dec_gap(probs, c, rng, code, buf, ip)
            if g > n - i:
                return 3, m
            if g > 0:
                rem[c] = g - 1
                continue
        # changed: its step, then the gap to the next changed element of its class
        if m >= expected:
            return 4, m
        base = c * CELLS_PER_CLASS
        uo = np.uint64(o)
        old_sign = np.int64(uo >> sign_shift)
        sign, rng, code, ip = dec_bit(probs, base + STEP_SIGN + old_sign, rng, code, buf, ip)
        big, rng, code, ip = dec_bit(probs, base + STEP_ONE + sign, rng, code, buf, ip)
        mag = np.uint64(1)
        if big:
            s, rng, code, ip = dec_tree(probs, base + STEP_SLOT, 6, rng, code, buf, ip)
            if s >= width:
                return 8, m
            low_bits, rng, code, ip = dec_direct(s, rng, code, buf, ip)
            mag = ((np.uint64(1) << np.uint64(s)) | low_bits) + np.uint64(1)
            if mag > top or (sign == 0 and mag == top):
                return 8, m
        negative = np.uint64(0) - np.uint64(sign)
        kx = (key(uo, is_float, sign_shift, top, low_mask) + ((mag ^ negative) - negative)) & mask  # k(old) -+ mag
        x = unkey(kx, is_float, sign_shift, top, low_mask)
        pos[m] = i
        vals[m] = x
        m += 1
        g, rng, code, ip = dec_gap(probs, c, rng, code, buf, ip)
        if g > n - i - 1:
            return 3, m
        rem[c] = g
    if ip > buf.shape[0]:
        return 2, m
    if m != expected:
        return 5, m
    for c in range(nc):
        if rem[c] > 0:
            return 6, m
    if ip != buf.shape[0]:
        return 7, m
    return 0, m


# ----------------------------------------------------------------------------------- API


def emit(changes: Changes, dtype_name: str, itemsize: int, limit: int) -> bytes | None:
    """The payload for `changes`, or None if it would exceed `limit` bytes."""
    require_numba()
    m = len(changes.positions)
    probs = scratch("ctx_probs", 2 * TOTAL_CELLS, np.uint16)
    work = scratch("ctx_work", 3 * NUM_CLASSES + m, np.int64)
    out = scratch("ctx_out", limit + 4096, np.uint8)
    nbytes = _emit_kernel(
        changes.positions,
        changes.classes,
        changes.ranks,
        changes.old_bits,
        changes.new_bits,
        changes.class_counts,
        dtype_name in FLOAT_LAYOUT,
        8 * itemsize,
        probs,
        work,
        out,
    )
    if nbytes < 0 or HEADER.size + nbytes > limit:
        return None
    return HEADER.pack(m, changes.class_base) + out[:nbytes].tobytes()


def encode(
    new: np.ndarray, old: np.ndarray, dtype_name: str, itemsize: int, changed: int, limit: int | None = None
) -> bytes | None:
    """Payload of codec ctx for raw bytes `new` against `old`, which differ in `changed` elements.

    None when the payload would exceed `limit` bytes (default: the raw size of the chunk), where
    another codec is smaller anyway.
    """
    changes = scan_changes(new, old, dtype_name, itemsize, changed)
    return emit(changes, dtype_name, itemsize, new.nbytes if limit is None else limit)


def decode_into(payload: bytes | memoryview, out: np.ndarray, dtype_name: str, itemsize: int) -> None:
    """Applies a ctx payload to `out` (the parent's raw bytes of the range), in place.

    Raises FormatError on any malformed payload; `out` is untouched then.
    """
    require_numba()
    view = memoryview(payload)
    if len(view) < HEADER.size:
        raise FormatError(f"ctx payload of {len(view)} bytes is shorter than its {HEADER.size}-byte header")
    changed, class_base = HEADER.unpack_from(view, 0)
    utype = UINT[itemsize]
    target = out.view(utype)
    count = len(target)
    if changed > count:
        raise FormatError(f"ctx payload claims {changed} changed elements in a chunk of {count}")
    layout = FLOAT_LAYOUT.get(dtype_name)
    if class_base >= (1 << layout[1] if layout else 1):
        raise FormatError(f"ctx class base {class_base} is out of range for {dtype_name}")
    table, shift = cached_class_table(dtype_name, itemsize, class_base)
    stream = np.frombuffer(view, dtype=np.uint8, offset=HEADER.size)
    pos = scratch("ctx_dpos", changed, np.int64)
    vals = scratch("ctx_dvals", changed, utype)
    probs = scratch("ctx_dprobs", 2 * TOTAL_CELLS, np.uint16)
    rem = scratch("ctx_rem", NUM_CLASSES, np.int64)
    status, m = _decode_kernel(
        stream, target, table, shift, layout is not None, 8 * itemsize, changed, pos, vals, probs, rem
    )
    if status:
        raise FormatError(f"ctx payload is corrupt: {_ERRORS.get(status, status)} (after {m} changed elements)")
    target[pos[:m]] = vals[:m]


def warm_up(dtype_names: Iterable[str]) -> None:
    """Compiles (or loads from numba's cache) every kernel for the element widths of `dtype_names`,
    the scan's included, by a round trip of a small delta: a process that must not pay the first
    compile (~20-25 s per width on a fresh machine) inside a latency it measures calls this first.
    Other dtypes are skipped."""
    for name in dtype_names:
        dtype = dtype_by_name(name)
        if dtype.itemsize not in UINT:
            continue
        old = np.zeros(4096 * dtype.itemsize, dtype=np.uint8)
        new = old.copy()
        new[:: 64 * dtype.itemsize] = 1  # the low byte of every 64th element: 64 changed elements
        payload = encode(new, old, dtype.name, dtype.itemsize, 4096 // 64, limit=1 << 20)
        decode_into(payload, old, dtype.name, dtype.itemsize)
        if not np.array_equal(old, new):
            raise AssertionError(f"ctx warm-up round trip for {name} is not exact")


class CtxCodec(Codec):
    """Codec 4: the change model, range-coded under adaptive per-class contexts."""

    id = 4
    name = "ctx"

    def encode(self, new, old, itemsize, *, dtype_name, level=DEFAULT_ZSTD_LEVEL):
        return encode_forced(emit, self.name, new, old, itemsize, dtype_name)

    def decode_into(self, payload, out, itemsize, *, dtype_name):
        decode_into(payload, out, dtype_name, itemsize)

    def warm_up(self, dtype_names):
        warm_up(dtype_names)  # the module's, looked up at call time
