"""ctx_codec: codec 4 (`ctx`), a delta coded as integer steps under contexts from the parent's bits.

Between two RL checkpoints one step apart, ~1-5 % of bf16 elements change, ~90 % of those by
exactly one ULP, and whether an element changes depends mostly on its exponent (an update of a
given size crosses a rounding boundary far more often where the ULP is small). The receiver holds
the parent, so both facts can be used losslessly:

- every element gets a *class*: its parent exponent, clamped into a window of 16 exponents
  whose lowest (`class_base`) the encoder picks per chunk (integers and bool: one class);
- the change mask is coded per class as *gaps*: how many elements of that class to skip before
  its next changed one. The gaps of a class with change probability p are geometric, and coding
  them with an adaptive model costs what coding each element's bit under its class would, but
  the coder only runs once per changed element;
- a changed element's value is coded as its *step*: the signed distance between the old and the
  new bit pattern in the monotone order of the dtype (floats: sign-magnitude turned into an
  unsigned order; integers: plain modular difference). A one-ULP move is a step of +-1.

Symbols go through an adaptive binary range coder (LZMA's, with 15-bit probabilities whose
adaptation rate warms up from 1/2 to 1/128), with separate probabilities per class. The exact
layout is in docs/format.md, "Payload: codec ctx"; this module is its reference implementation
(tests/format/codecs/test_ctx_codec.py checks it against a plain-Python decoder written from that section).

The kernels are numba (`nogil`, so chunk-parallel threads run them in parallel; `cache=True`, so
only the first run on a machine compiles, ~20-25 s per element width, then ~1 s to load). Every read of the payload
and every position is bounds-checked inside the kernels: a corrupt payload returns an error code,
never reads or writes outside its arrays. Decoding collects (position, new bits) first and
applies them only when the whole payload checked out, so a refused payload leaves `out` untouched.

Not here: choosing between codecs (`codec.py`), chunk headers (`chunk.py`), the on-device diff
(`diff.py`).
"""

from __future__ import annotations

import dataclasses
import struct
import threading
from collections.abc import Iterable

import numpy as np

from weightsync.errors import FormatError
from weightsync.format.dtypes import dtype_by_name

try:
    import numba
except ImportError as e:  # a dependency of weightsync; this only happens in a broken install
    numba = None
    _NUMBA_ERROR: ImportError | None = e

    def _jit(fn):  # the kernels stay plain functions, never called: _get_kernels refuses first
        return fn

    _inline = _jit
else:
    from numba.cpython.unsafe.numbers import trailing_zeros

    _NUMBA_ERROR = None
    _jit = numba.njit(nogil=True, cache=True, _nrt=False)
    # The coder's helpers are inlined into the kernels (numba's own inliner): as separate
    # functions each call passed every array as a 7-field struct and returned a tuple through
    # memory, ~15 calls per changed element; inlined, the kernels run 12-17 % faster at lr 3e-6
    # (bench.codec_cpu), for a longer first compile (~20-25 s per element width instead of ~12).
    _inline = numba.njit(nogil=True, cache=True, _nrt=False, inline="always")

NUM_CLASSES = 16
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

# Float dtypes by itemsize and exponent layout: (mantissa bits, exponent bits). Keyed by dtype
# name in `float_layout`; integers and bool have no exponent.
_FLOAT_LAYOUT = {
    "bfloat16": (7, 8),
    "float16": (10, 5),
    "float32": (23, 8),
    "float64": (52, 11),
    "float8_e4m3fn": (3, 4),
    "float8_e5m2": (2, 5),
}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

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

_local = threading.local()


def require_numba() -> None:
    if numba is None:
        raise ImportError(f"codec ctx needs numba (pip install 'numba>=0.60'): {_NUMBA_ERROR}")


# -------------------------------------------------------------------------------- contexts


def class_table(dtype_name: str, itemsize: int, class_base: int) -> tuple[np.ndarray, int]:
    """(table, shift): an element `x`'s class is `table[x >> shift]`.

    Floats: `x >> mantissa_bits` is sign and exponent; the class is the exponent minus
    `class_base`, clamped to 0 .. NUM_CLASSES - 1. Everything else has one class.
    """
    layout = _FLOAT_LAYOUT.get(dtype_name)
    if layout is None:
        return np.zeros(2, dtype=np.uint8), 8 * itemsize - 1
    mant, exp_bits = layout
    exponents = np.arange(1 << (exp_bits + 1), dtype=np.int64) & ((1 << exp_bits) - 1)
    table = np.clip(exponents - class_base, 0, NUM_CLASSES - 1).astype(np.uint8)
    return table, mant


def _table(dtype_name: str, itemsize: int, class_base: int) -> tuple[np.ndarray, int]:
    cache = _local.__dict__.setdefault("tables", {})
    key = (dtype_name, itemsize, class_base)
    if key not in cache:
        cache[key] = class_table(dtype_name, itemsize, class_base)
    return cache[key]


def float_layout(dtype_name: str) -> tuple[int, int] | None:
    """(mantissa bits, exponent bits) of a float dtype; None for integers and bool."""
    return _FLOAT_LAYOUT.get(dtype_name)


def sample_step(count: int) -> int:
    """Every sample_step-th element of the parent is sampled to choose the class base."""
    return max(1, count // 4096)


def choose_class_base(old: np.ndarray, dtype_name: str) -> int:
    """The lowest exponent of the class window, from a sample of the parent.

    Small weights change most often and their change rate doubles with every exponent step
    down, so the window starts at the smallest nonzero exponent of a sample of ~4096 elements
    (measured best among quantiles and sample sizes: lumping small exponents together costs
    most); larger ones share the top classes, where changes are rare anyway. Any base decodes;
    this is only the encoder's choice (weightsync.format.codecs.diff makes the same one on the device).
    """
    layout = _FLOAT_LAYOUT.get(dtype_name)
    if layout is None or len(old) == 0:
        return 0
    mant, exp_bits = layout
    sample = old[:: sample_step(len(old))]
    exponents = (sample >> mant).astype(np.int64) & ((1 << exp_bits) - 1)
    exponents = exponents[exponents > 0]  # zeros and subnormals sit in class 0 whatever the base
    if len(exponents) == 0:
        return 0
    return int(exponents.min())


# ----------------------------------------------------------------------------- numba kernels


# No NRT: with it, every array handed to a helper is reference-counted (an atomic increment and
# decrement per call), which made the coder ~5x slower. The kernels allocate nothing; the caller
# passes every work array. Module-level functions, so that numba's on-disk cache finds them again
# (kernels made inside a function are new closures every run and recompile every time).

# --- range encoder. State: low (< 2^33), rng (32 bits), cache byte, cache_size, op.


@_inline
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


@_inline
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


@_inline
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


@_inline
def enc_direct(value, nbits, low, rng, cache, cache_size, out, op):
    for i in range(nbits - 1, -1, -1):
        rng >>= 1
        low += rng & -((value >> i) & 1)
        while rng < 0x1000000:
            rng <<= 8
            low, cache, cache_size, op = shift_low(low, cache, cache_size, out, op)
    return low, rng, cache, cache_size, op


@_inline
def enc_tree(probs, base, nbits, value, low, rng, cache, cache_size, out, op):
    m = 1
    for i in range(nbits - 1, -1, -1):
        b = (value >> i) & 1
        low, rng, cache, cache_size, op = enc_bit(probs, base + m, b, low, rng, cache, cache_size, out, op)
        m = (m << 1) | b
    return low, rng, cache, cache_size, op


@_inline
def bit_length(v):
    """Of 0 <= v < 2^63, by halving the search range: no loop whose length depends on v (its
    exit was a mispredicted branch per gap)."""
    n = 0
    for half in (32, 16, 8, 4, 2, 1):
        up = (v >> half) != 0
        n += half if up else 0
        v = (v >> half) if up else v
    return n + (1 if v else 0)


@_inline
def order_masks(width):
    """(sign_shift, mask, top, low_mask) of w-bit elements, as `key`, `unkey` and the steps use them."""
    sign_shift = np.uint64(width - 1)
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) if width == 64 else (np.uint64(1) << np.uint64(width)) - np.uint64(1)
    top = np.uint64(1) << sign_shift
    return sign_shift, mask, top, mask ^ top


@_inline
def key(x, is_float, sign_shift, top, low_mask):
    """The dtype's monotone order of bit pattern x (docs/format.md, "Element order"), branch-free:
    the sign of a weight is a coin flip, a branch on it mispredicts half the time."""
    if not is_float:
        return x
    negative = np.uint64(0) - (x >> sign_shift)  # all ones for a negative x
    return x ^ top ^ (low_mask & negative)


@_inline
def unkey(y, is_float, sign_shift, top, low_mask):
    """The inverse of `key`."""
    if not is_float:
        return y
    positive = np.uint64(0) - (np.uint64(1) ^ (y >> sign_shift))
    return y ^ top ^ (low_mask & positive)


@_inline
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


@_inline
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


SCAN_BLOCK = 64  # elements per block of the scan: one bit each in a 64-bit change mask


@_inline
def class_of(x, shift, exponent_mask, class_base):
    """An element's class, as `class_table` has it, computed (a select, so block loops vectorize)."""
    return min(max(np.int64((x >> shift) & exponent_mask) - class_base, 0), NUM_CLASSES - 1)


@_jit
def _scan_kernel(old, new, shift, exponent_mask, class_base, pos, cls, rank, old_bits, new_bits, counts, scratch):
    """The per-element pass: for each changed element its position, class, rank in its class and
    old and new bits (as uint64); per class its element count (counts[:nc]) and first position
    (counts[nc:], -1: none). Returns the number of changed elements, or -1 if there are more than
    pos can hold. A class is clip(((x >> shift) & exponent_mask) - class_base, 0, nc - 1), as
    `class_table` makes it (integers: exponent_mask 0, one class).

    Blocks of 64 elements, in loops of fixed length, which LLVM can turn into vector code: the block's
    classes (into `blk`), its change mask, and per class a count in each of 64 byte lanes (`lanes`,
    added up into `total` every 255 blocks, before a byte could overflow). A changed element's
    rank is then its class's total, its lanes' sum, and its class's elements before it in the
    block. An element at a time, with counters per class in memory (four banks of them), the
    counts were a chain of load-add-store: 0.51 CPU-s per GiB of the benchmark's bf16 at 1.65 %
    changed, with a gather of the bits afterwards from a chunk out of cache by then; this takes
    0.37 (reading both inputs alone ~0.14), and less than the old way at every density up to ctx's.

    scratch: uint8, at least (nc + 1) * 64 + 8 * nc bytes, the last 8 * nc of them 8-byte aligned."""
    nc = NUM_CLASSES
    b = SCAN_BLOCK
    n = old.shape[0]
    lanes = scratch[: nc * b]
    blk = scratch[nc * b : (nc + 1) * b]
    total = scratch[(nc + 1) * b : (nc + 1) * b + 8 * nc].view(np.int64)
    for k in range(nc * b):
        lanes[k] = 0
    for c in range(nc):
        total[c] = 0
    m = 0
    blocks = n // b
    since_flush = 0
    for q in range(blocks):
        s = q * b
        mask = np.uint64(0)
        for k in range(b):
            blk[k] = class_of(old[s + k], shift, exponent_mask, class_base)
            mask |= np.uint64(old[s + k] != new[s + k]) << np.uint64(k)
        while mask:  # the block's changes, in order (counted before the block's own counts go in)
            k = np.int64(trailing_zeros(mask))
            mask &= mask - np.uint64(1)
            if m == pos.shape[0]:
                return -1
            c = np.int64(blk[k])
            r = total[c]
            for j in range(b):
                r += lanes[c * b + j]
            for j in range(b):
                r += (blk[j] == c) & (j < k)
            pos[m] = s + k
            cls[m] = c
            rank[m] = r
            old_bits[m] = old[s + k]
            new_bits[m] = new[s + k]
            m += 1
        for c in range(nc):
            for k in range(b):
                lanes[c * b + k] += blk[k] == c
        since_flush += 1
        if since_flush == 255:
            for c in range(nc):
                for k in range(b):
                    total[c] += lanes[c * b + k]
                    lanes[c * b + k] = 0
            since_flush = 0
    for c in range(nc):
        for k in range(b):
            total[c] += lanes[c * b + k]
    for i in range(blocks * b, n):  # the last 0-63 elements, one at a time
        c = class_of(old[i], shift, exponent_mask, class_base)
        if old[i] != new[i]:
            if m == pos.shape[0]:
                return -1
            pos[m] = i
            cls[m] = c
            rank[m] = total[c]
            old_bits[m] = old[i]
            new_bits[m] = new[i]
            m += 1
        total[c] += 1
    # First positions: a walk from the start that stops once every class with elements was seen
    # (within a few elements for the common ones; one rare class can make it read the chunk again).
    left = 0
    for c in range(nc):
        counts[c] = total[c]
        counts[nc + c] = -1
        if total[c]:
            left += 1
    i = 0
    while left:
        c = class_of(old[i], shift, exponent_mask, class_base)
        if counts[nc + c] < 0:
            counts[nc + c] = i
            left -= 1
        i += 1
    return m


@_jit
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


@_inline
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


@_inline
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


@_inline
def dec_bit(probs, cell, rng, code, buf, ip):
    return dec_bit_with(probs, cell, np.int64(probs[cell]), rng, code, buf, ip)


@_inline
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


@_inline
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


@_inline
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


@_jit
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


def _get_kernels():
    """(scan, emit, decode); numba compiles each per element width on first use (or loads it from
    its cache: ~20-25 s the very first time on a machine, well under a second after)."""
    require_numba()
    return _scan_kernel, _emit_kernel, _decode_kernel


def _scratch(name: str, count: int, dtype) -> np.ndarray:
    buf = _local.__dict__.get(name)
    if buf is None or buf.nbytes < count * np.dtype(dtype).itemsize:
        buf = np.empty(max(count * np.dtype(dtype).itemsize, 1 << 16), dtype=np.uint8)
        _local.__dict__[name] = buf
    return buf[: count * np.dtype(dtype).itemsize].view(dtype)


# ----------------------------------------------------------------------------------- API


@dataclasses.dataclass(frozen=True)
class Changes:
    """The changed elements of a chunk, everything `emit` needs and nothing per unchanged element.

    Made by `scan_changes` on the host or by `weightsync.format.codecs.diff` on the tensors' device. Arrays
    have one entry per changed element, in position order.
    """

    count: int  # elements in the chunk
    class_base: int
    positions: np.ndarray  # int64
    classes: np.ndarray  # int64, the class of each changed element
    ranks: np.ndarray  # int64, its index among the chunk's elements of its class
    old_bits: np.ndarray  # uint64, its parent bit pattern
    new_bits: np.ndarray  # uint64, its new bit pattern
    class_counts: np.ndarray  # int64, 2 * NUM_CLASSES: elements per class, then first position (-1: none)


def find_changes(new: np.ndarray, old: np.ndarray, dtype_name: str, itemsize: int, at_most: int) -> Changes | None:
    """The host path: the changes of raw bytes `new` against `old`, or None if more than
    `at_most` elements changed (the caller then needs no ctx, and this pass doubles as its count).

    The arrays of the result are per-thread scratch, valid until this thread's next call."""
    scan_kernel, _, _ = _get_kernels()
    utype = _UINT[itemsize]
    o, x = old.view(utype), new.view(utype)
    class_base = choose_class_base(o, dtype_name)
    shift, exponent_bits = _FLOAT_LAYOUT.get(dtype_name, (0, 0))
    pos = _scratch("pos", at_most, np.int64)
    cls = _scratch("cls", at_most, np.int64)
    rank = _scratch("rank", at_most, np.int64)
    old_bits = _scratch("old_bits", at_most, np.uint64)
    new_bits = _scratch("new_bits", at_most, np.uint64)
    counts = np.empty(2 * NUM_CLASSES, dtype=np.int64)
    scratch = _scratch("scan", (NUM_CLASSES + 1) * SCAN_BLOCK + 8 * NUM_CLASSES, np.uint8)
    found = scan_kernel(
        o, x, shift, (1 << exponent_bits) - 1, class_base, pos, cls, rank, old_bits, new_bits, counts, scratch
    )
    if found < 0:
        return None
    return Changes(
        count=len(o),
        class_base=class_base,
        positions=pos[:found],
        classes=cls[:found],
        ranks=rank[:found],
        old_bits=old_bits[:found],
        new_bits=new_bits[:found],
        class_counts=counts,
    )


def scan_changes(new: np.ndarray, old: np.ndarray, dtype_name: str, itemsize: int, changed: int) -> Changes:
    """`find_changes` for a caller that counted the changes already (`changed` of them)."""
    changes = find_changes(new, old, dtype_name, itemsize, changed)
    found = -1 if changes is None else len(changes.positions)
    if found != changed:
        raise ValueError(
            f"ctx scan: the chunk has {'more than ' if found < 0 else ''}{max(found, changed)} changed "
            f"elements, the caller counted {changed}"
        )
    return changes


def emit(changes: Changes, dtype_name: str, itemsize: int, limit: int) -> bytes | None:
    """The payload for `changes`, or None if it would exceed `limit` bytes."""
    _, emit_kernel, _ = _get_kernels()
    m = len(changes.positions)
    probs = _scratch("probs", 2 * TOTAL_CELLS, np.uint16)
    work = _scratch("work", 3 * NUM_CLASSES + m, np.int64)
    out = _scratch("out", limit + 4096, np.uint8)
    nbytes = emit_kernel(
        changes.positions,
        changes.classes,
        changes.ranks,
        changes.old_bits,
        changes.new_bits,
        changes.class_counts,
        dtype_name in _FLOAT_LAYOUT,
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
    _, _, decode_kernel = _get_kernels()
    view = memoryview(payload)
    if len(view) < HEADER.size:
        raise FormatError(f"ctx payload of {len(view)} bytes is shorter than its {HEADER.size}-byte header")
    changed, class_base = HEADER.unpack_from(view, 0)
    utype = _UINT[itemsize]
    target = out.view(utype)
    count = len(target)
    if changed > count:
        raise FormatError(f"ctx payload claims {changed} changed elements in a chunk of {count}")
    layout = _FLOAT_LAYOUT.get(dtype_name)
    if class_base >= (1 << layout[1] if layout else 1):
        raise FormatError(f"ctx class base {class_base} is out of range for {dtype_name}")
    table, shift = _table(dtype_name, itemsize, class_base)
    stream = np.frombuffer(view, dtype=np.uint8, offset=HEADER.size)
    pos = _scratch("dpos", changed, np.int64)
    vals = _scratch("dvals", changed, utype)
    probs = _scratch("dprobs", 2 * TOTAL_CELLS, np.uint16)
    rem = _scratch("rem", NUM_CLASSES, np.int64)
    status, m = decode_kernel(
        stream, target, table, shift, layout is not None, 8 * itemsize, changed, pos, vals, probs, rem
    )
    if status:
        raise FormatError(f"ctx payload is corrupt: {_ERRORS.get(status, status)} (after {m} changed elements)")
    target[pos[:m]] = vals[:m]


def warm_up(dtype_names: Iterable[str]) -> None:
    """Compiles (or loads from numba's cache) every kernel for the element widths of `dtype_names`,
    by a round trip of a small delta: a process that must not pay the first compile (~20-25 s per
    width on a fresh machine) inside a latency it measures calls this first. Other dtypes are skipped."""
    for name in dtype_names:
        dtype = dtype_by_name(name)
        if dtype.itemsize not in _UINT:
            continue
        old = np.zeros(4096 * dtype.itemsize, dtype=np.uint8)
        new = old.copy()
        new[:: 64 * dtype.itemsize] = 1  # the low byte of every 64th element: 64 changed elements
        payload = encode(new, old, dtype.name, dtype.itemsize, 4096 // 64, limit=1 << 20)
        decode_into(payload, old, dtype.name, dtype.itemsize)
        if not np.array_equal(old, new):
            raise AssertionError(f"ctx warm-up round trip for {name} is not exact")
