"""changes: the change model `ctx` and `rans` share, and the scan that finds a chunk's changes.

Between two RL checkpoints one step apart, ~1-5 % of bf16 elements change, ~90 % of those by
exactly one ULP, and whether an element changes depends mostly on its exponent (an update of a
given size crosses a rounding boundary far more often where the ULP is small). The receiver
holds the parent, so both facts can be used losslessly; this module is what both context-
modelled codecs know about a delta:

- every element gets a *class*: its parent exponent, clamped into a window of 16 exponents
  whose lowest (`class_base`) the encoder picks per chunk (integers and bool: one class);
- a changed element is its position, class, rank among its class's elements, and old and new
  bits (`Changes`), found by one scan of the chunk (`find_changes`) or on the tensors' device
  (`diff.py`);
- its value is a *step*: the signed distance between old and new bits in the dtype's monotone
  order (`key` / `unkey`: floats' sign-magnitude turned into an unsigned order; integers: plain
  modular difference). A one-ULP move is a step of +-1.

docs/format.md ("Payload: codec ctx": element order, classes) is the specification. The numba
setup (`jit`, `inline`) lives here too, for every codec with kernels: `nogil`, so chunk-parallel
threads run them in parallel; `cache=True`, so only the first run on a machine compiles.

Not here: coding the changes (`ctx.py`, `rans.py`), choosing a codec (`choice.py`).
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from weightsync.format.codecs.elements import UINT, scratch

try:
    import numba
except ImportError as e:  # a dependency of weightsync; this only happens in a broken install
    numba = None
    _NUMBA_ERROR: ImportError | None = e

    def jit(fn):  # the kernels stay plain functions, never called: require_numba refuses first
        return fn

    inline = jit
else:
    from numba.cpython.unsafe.numbers import trailing_zeros

    _NUMBA_ERROR = None
    # No NRT: with it, every array handed to a helper is reference-counted (an atomic increment
    # and decrement per call), which made the coder ~5x slower. The kernels allocate nothing;
    # the caller passes every work array. Kernels are module-level functions, so that numba's
    # on-disk cache finds them again (kernels made inside a function are new closures every run
    # and recompile every time).
    jit = numba.njit(nogil=True, cache=True, _nrt=False)
    # The coders' helpers are inlined into the kernels (numba's own inliner): as separate
    # functions each call passed every array as a 7-field struct and returned a tuple through
    # memory, ~15 calls per changed element; inlined, the kernels run 12-17 % faster at lr 3e-6
    # (bench.codec_cpu), for a longer first compile (~20-25 s per element width instead of ~12).
    inline = numba.njit(nogil=True, cache=True, _nrt=False, inline="always")

NUM_CLASSES = 16

FLOAT_LAYOUT = {
    "bfloat16": (7, 8),
    "float16": (10, 5),
    "float32": (23, 8),
    "float64": (52, 11),
    "float8_e4m3fn": (3, 4),
    "float8_e5m2": (2, 5),
}
"""Float dtypes' exponent layout, (mantissa bits, exponent bits), by dtype name; integers and bool
have no exponent (docs/format.md, "Classes")."""

_local = threading.local()


def require_numba() -> None:
    if numba is None:
        raise ImportError(f"the codecs ctx and rans need numba (pip install 'numba>=0.60'): {_NUMBA_ERROR}")


# -------------------------------------------------------------------------------- contexts


def class_table(dtype_name: str, itemsize: int, class_base: int) -> tuple[np.ndarray, int]:
    """(table, shift): an element `x`'s class is `table[x >> shift]`.

    Floats: `x >> mantissa_bits` is sign and exponent; the class is the exponent minus
    `class_base`, clamped to 0 .. NUM_CLASSES - 1. Everything else has one class.
    """
    layout = FLOAT_LAYOUT.get(dtype_name)
    if layout is None:
        return np.zeros(2, dtype=np.uint8), 8 * itemsize - 1
    mant, exp_bits = layout
    exponents = np.arange(1 << (exp_bits + 1), dtype=np.int64) & ((1 << exp_bits) - 1)
    table = np.clip(exponents - class_base, 0, NUM_CLASSES - 1).astype(np.uint8)
    return table, mant


def cached_class_table(dtype_name: str, itemsize: int, class_base: int) -> tuple[np.ndarray, int]:
    """`class_table`, kept per thread (decoders need one per chunk; tables are never written)."""
    cache = _local.__dict__.setdefault("tables", {})
    key = (dtype_name, itemsize, class_base)
    if key not in cache:
        cache[key] = class_table(dtype_name, itemsize, class_base)
    return cache[key]


def float_layout(dtype_name: str) -> tuple[int, int] | None:
    """(mantissa bits, exponent bits) of a float dtype; None for integers and bool."""
    return FLOAT_LAYOUT.get(dtype_name)


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
    layout = FLOAT_LAYOUT.get(dtype_name)
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


@inline
def bit_length(v):
    """Of 0 <= v < 2^63, by halving the search range: no loop whose length depends on v (its
    exit was a mispredicted branch per gap)."""
    n = 0
    for half in (32, 16, 8, 4, 2, 1):
        up = (v >> half) != 0
        n += half if up else 0
        v = (v >> half) if up else v
    return n + (1 if v else 0)


@inline
def order_masks(width):
    """(sign_shift, mask, top, low_mask) of w-bit elements, as `key`, `unkey` and the steps use them."""
    sign_shift = np.uint64(width - 1)
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) if width == 64 else (np.uint64(1) << np.uint64(width)) - np.uint64(1)
    top = np.uint64(1) << sign_shift
    return sign_shift, mask, top, mask ^ top


@inline
def key(x, is_float, sign_shift, top, low_mask):
    """The dtype's monotone order of bit pattern x (docs/format.md, "Element order"), branch-free:
    the sign of a weight is a coin flip, a branch on it mispredicts half the time."""
    if not is_float:
        return x
    negative = np.uint64(0) - (x >> sign_shift)  # all ones for a negative x
    return x ^ top ^ (low_mask & negative)


@inline
def unkey(y, is_float, sign_shift, top, low_mask):
    """The inverse of `key`."""
    if not is_float:
        return y
    positive = np.uint64(0) - (np.uint64(1) ^ (y >> sign_shift))
    return y ^ top ^ (low_mask & positive)


SCAN_BLOCK = 64  # elements per block of the scan: one bit each in a 64-bit change mask


@inline
def class_of(x, shift, exponent_mask, class_base):
    """An element's class, as `class_table` has it, computed (a select, so block loops vectorize)."""
    return min(max(np.int64((x >> shift) & exponent_mask) - class_base, 0), NUM_CLASSES - 1)


@jit
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


# ----------------------------------------------------------------------------------- API


@dataclasses.dataclass(frozen=True)
class Changes:
    """The changed elements of a chunk: everything `ctx.emit` and `rans.emit` need, nothing per
    unchanged element.

    Made by `find_changes` on the host or by `weightsync.format.codecs.diff` on the tensors'
    device. Arrays have one entry per changed element, in position order.
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
    `at_most` elements changed (the caller then wants no modelled codec, and this pass doubles
    as its count).

    The arrays of the result are per-thread scratch, valid until this thread's next call."""
    require_numba()
    utype = UINT[itemsize]
    o, x = old.view(utype), new.view(utype)
    class_base = choose_class_base(o, dtype_name)
    shift, exponent_bits = FLOAT_LAYOUT.get(dtype_name, (0, 0))
    pos = scratch("scan_pos", at_most, np.int64)
    cls = scratch("scan_cls", at_most, np.int64)
    rank = scratch("scan_rank", at_most, np.int64)
    old_bits = scratch("scan_old_bits", at_most, np.uint64)
    new_bits = scratch("scan_new_bits", at_most, np.uint64)
    counts = np.empty(2 * NUM_CLASSES, dtype=np.int64)
    work = scratch("scan_work", (NUM_CLASSES + 1) * SCAN_BLOCK + 8 * NUM_CLASSES, np.uint8)
    found = _scan_kernel(
        o, x, shift, (1 << exponent_bits) - 1, class_base, pos, cls, rank, old_bits, new_bits, counts, work
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


def encode_forced(emit, codec_name: str, new: np.ndarray, old: np.ndarray, itemsize: int, dtype_name: str) -> bytes:
    """`Codec.encode` of a codec of this model, whose `emit(changes, dtype_name, itemsize, limit)`
    codes the changes: every chunk gets a payload, whatever the choice would pick. The limit is far
    above what `ctx` and `rans` write even on random bits (where the choice never picks them)."""
    limit = 4 * new.nbytes + 4096
    payload = emit(find_changes(new, old, dtype_name, itemsize, new.nbytes // itemsize), dtype_name, itemsize, limit)
    if payload is None:
        raise ValueError(f"{codec_name}: a payload of {new.nbytes} raw bytes exceeds {limit} bytes")
    return payload


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
