"""rans: codec 5 (`rans`), the change model coded with static per-chunk tables and rANS.

`ctx` (ctx.py) adapts its probabilities bit by bit, so its decoder makes ~12 dependent
binary decisions per changed element (a gap's slot tree, its direct bits, the step's sign and
size), ~4 ns each: at lr 3e-6 (3.4 % of bf16 elements changed) that caps decode+apply near
0.8 GB/s per core. `rans` keeps everything ctx knows (the parent's exponent class, gaps per
class, changes as integer steps) but codes each change as two symbols of static tables that
the chunk carries (a step alphabet has 2 + 2w symbols for w-bit elements, a gap alphabet 63):

- a gap's *slot* (bit length of gap + 1) and the bit below its leading one: one symbol;
- a step's sign and slot (or "one ULP up/down"): one symbol;
- the remaining low bits of both, which are close to uniform, go raw into a separate bit stream.

Both symbol kinds are decoded by rANS (Duda's asymmetric numeral systems; the 32-bit state,
16-bit words variant of ryg_rans) with one table lookup each, gaps and steps on two interleaved
states so their dependency chains overlap. Measured on bf16 RL deltas (4 MiB chunks of >= 4096
changes), the coded symbols and raw bits are 1-2 % smaller than ctx's whole payload (no learning
cost), and the tables take that back: a class's gaps are close to geometric, so their table is
one parameter byte, but its step frequencies cost ~10 bytes. In all, within 0.1-0.2 % of ctx, and
decoded ~1.5x faster. A chunk of a few thousand changes pays more for its tables than ctx does
for learning: the codec choice (`choice.py`) keeps ctx there.

A class's changes are counted in the table section, so classes without changes cost nothing and
a class's last change needs no closing gap. The exact layout is in docs/format.md, "Payload: codec
rans"; this module is its reference implementation (tests/format/codecs/test_rans.py checks it
against a plain-Python decoder written from that section). Kernels are numba, like ctx's: every read is
bounds-checked, a corrupt payload returns an error code, and nothing is applied to `out` until
the whole payload checked out.

Not here: the classes and the scan that finds the changes (`changes.py`), choosing a codec
(`choice.py`).
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

HEADER = struct.Struct("<QHHI")  # changed elements, class_base, classes with changes (bit c), rANS words
PROB_BITS = 11
PROB_SCALE = 1 << PROB_BITS  # every table's frequencies sum to this
STATE_LOW = 1 << 16  # a rANS state lives in [STATE_LOW, 2^32); it starts and ends at STATE_LOW
GAP_SYMBOLS = 63  # 0: gap 0; 2t - 1 + b for gap + 1 = (2 + b) * 2^(t-1) + raw, t = 1 .. 31
MAX_FREQ_BYTES = 2  # LEB128 varint of a frequency <= PROB_SCALE
# 2^32 * 2^(-j/8), rounded: a class's gap parameter g means a change probability of
# HALF_STEPS[g % 8] >> (g // 8), in units of 2^-32 (docs/format.md lists the same integers).
HALF_STEPS = np.array(
    [4294967296, 3938502376, 3611622603, 3311872529, 3037000500, 2784941738, 2553802834, 2341847524], dtype=np.uint64
)


_ERRORS = {
    1: "class table section is malformed (a class with no changes, a table size or varint out of range)",
    2: "a step table's frequencies do not sum to 2048",
    3: "per-class change counts do not add up to the header's",
    4: "class table section runs past the payload",
    5: "rANS stream is shorter than its two initial states",
    6: "rANS initial state out of range",
    7: "a gap points past the end of the chunk",
    8: "a step is out of range for the element width",
    9: "rANS stream read past its end",
    10: "rANS stream has words left over or does not end in its initial states",
    11: "raw bit stream read past its end",
    12: "raw bit stream has extra words or nonzero padding",
}

# ----------------------------------------------------------------------------- numba kernels


@jit
def _normalize(hist, base, k, freq, cum, every):
    """Scales weights hist[base:base+k] to frequencies summing to PROB_SCALE: floors, at least 1
    for every symbol of nonzero weight (every symbol if `every`), then the difference from
    PROB_SCALE goes to (or comes from) the largest frequency, the lowest symbol among equals.
    freq/cum get the table at the same offsets. Encoder and decoder both build gap tables with
    it, so it is integer arithmetic throughout."""
    total = 0
    for s in range(k):
        total += hist[base + s]
    acc = 0
    for s in range(k):
        h = hist[base + s]
        f = 0
        if h > 0 or every:
            f = max(1, (h * PROB_SCALE) // max(total, 1))
        freq[base + s] = f
        acc += f
    while acc != PROB_SCALE:
        best = base
        for s in range(base, base + k):
            if freq[s] > freq[best]:
                best = s
        if acc < PROB_SCALE:
            freq[best] += PROB_SCALE - acc
            acc = PROB_SCALE
        else:  # some symbols were raised to 1: the largest gives them their share, one at a time
            freq[best] -= 1
            acc -= 1
    c = 0
    for s in range(k):
        cum[base + s] = c
        c += freq[base + s]


@jit
def _gap_table(g, k, weights, freq, cum, base):
    """The gap table of a class with parameter g and k symbols, into freq/cum[base:base+k]:
    geometric gaps of change probability p = HALF_STEPS[g % 8] >> (g // 8) (units of 2^-32),
    symbol s weighing P(lo_s - 1 <= gap <= hi_s - 1) = q^(lo_s - 1) - q^hi_s with q = 1 - p, where
    [lo_s, hi_s] are the values of gap + 1 that s stands for. weights: int64 scratch >= base + k.

    q^e is docs/format.md's pow (square-and-multiply from the lowest bit, every product floored),
    with the squares q^(2^j) computed once for the table instead of once per power."""
    p = HALF_STEPS[g & 7] >> np.uint64(g >> 3)
    squares = weights[base + k : base + k + 32]  # q^(2^j), as the pow loop computes them
    x = (np.uint64(1) << np.uint64(32)) - p
    for j in range(32):
        squares[j] = np.int64(x)
        x = (x * x) >> np.uint64(32)
    previous = np.int64(1) << 32  # q^0
    for s in range(k):
        hi = 1
        if s > 0:
            t = (s + 1) >> 1
            hi = ((3 + ((s + 1) & 1)) << (t - 1)) - 1
        r = np.uint64(1) << np.uint64(32)
        e = hi
        j = 0
        while e:
            if e & 1:
                r = (r * np.uint64(squares[j])) >> np.uint64(32)
            e >>= 1
            j += 1
        weights[base + s] = max(previous - np.int64(r), 0)  # symbols are contiguous: lo_s - 1 = hi_(s-1)
        previous = np.int64(r)
    _normalize(weights, base, k, freq, cum, True)


@inline
def _rans_put(x, f, c, words, wp):
    """Codes a symbol of frequency f and cumulative c into state x: (new x, new wp). A word that
    must leave first goes to words[wp - 1] (the stream fills backwards). One unsigned division:
    numba's signed // and % are two, each with Python's floor fix-up."""
    if x >= (f << (32 - PROB_BITS)):
        wp -= 1
        words[wp] = x & 0xFFFF
        x >>= 16
    ux = np.uint64(x)
    uf = np.uint64(f)
    quotient = ux // uf
    return np.int64((quotient << np.uint64(PROB_BITS)) + (ux - quotient * uf) + np.uint64(c)), wp


@inline
def _put_bits(raw, bp, v, n):
    """Appends the n (< 64) low bits of v to the raw bit stream at bit bp; returns the new bp."""
    if n:
        v &= (np.uint64(1) << np.uint64(n)) - np.uint64(1)
        raw[bp >> 6] |= v << np.uint64(bp & 63)
        if (bp & 63) + n > 64:
            raw[(bp >> 6) + 1] |= v >> np.uint64(64 - (bp & 63))
    return bp + n


@jit
def _put_varint(out, op, v):
    while v >= 0x80:
        out[op] = (v & 0x7F) | 0x80
        op += 1
        v >>= 7
    out[op] = v
    return op + 1


@jit
def _emit_kernel(pos, cls, rank, old_bits, new_bits, class_sizes, is_float, width, work, raw, words, out):
    """Codes the changes (in position order, as `Changes` holds them) after the fixed
    header. Returns (table bytes, rANS words, raw words) with all three sections written one after
    the other into out, (-1, 0, 0) if out cannot hold them (the caller gave its size limit), or
    (-2, 0, 0) for changes whose ranks go back within a class.

    class_sizes: elements per class. work: int64 scratch of 4 * m + 7 * 16 * 130 + 3 * 16 entries
    (its last 16: the changes per class, for the caller). raw: uint64, zeroed by the caller, room
    for every raw bit (m * (31 + width) bits) plus a word. words: uint16, 2 * m + 8 entries."""
    m = pos.shape[0]
    nc = NUM_CLASSES
    ks = 2 + 2 * width
    gsym = work[0:m]
    ssym = work[m : 2 * m]
    nxt = work[2 * m : 3 * m]
    graw = work[3 * m : 4 * m]
    t0 = 4 * m
    ghist = work[t0 : t0 + nc * 130]
    gfreq = work[t0 + nc * 130 : t0 + 2 * nc * 130]
    gcum = work[t0 + 2 * nc * 130 : t0 + 3 * nc * 130]
    shist = work[t0 + 3 * nc * 130 : t0 + 4 * nc * 130]
    sfreq = work[t0 + 4 * nc * 130 : t0 + 5 * nc * 130]
    scum = work[t0 + 5 * nc * 130 : t0 + 6 * nc * 130]
    for k in range(nc * 130):
        ghist[k] = 0
        shist[k] = 0
    gweights = work[t0 + 6 * nc * 130 : t0 + 7 * nc * 130]  # a class's 63 weights + 32 squares fit its 130
    t1 = t0 + 7 * nc * 130
    last = work[t1 : t1 + nc]
    first = work[t1 + nc : t1 + 2 * nc]
    mc = work[t1 + 2 * nc : t1 + 3 * nc]
    for c in range(nc):
        last[c] = 0
        first[c] = -1
        mc[c] = 0
    sign_shift, mask, top, low_mask = order_masks(width)
    # Symbols. The step's raw bits are recomputed in the bit pass below; the gap's are kept.
    for j in range(m):
        c = cls[j]
        g = rank[j] - last[c]
        last[c] = rank[j] + 1
        if g < 0:  # ranks not increasing within a class: changes that do not describe one chunk
            return -2, 0, 0
        v = g + 1
        t = bit_length(v) - 1
        if t > 31:  # beyond the alphabet (chunks of at most 64 MiB never get here)
            return -1, 0, 0
        if t == 0:
            gs = 0
            graw[j] = 0
        else:
            b = (v >> (t - 1)) & 1
            gs = 2 * t - 1 + b
            graw[j] = v & ((np.int64(1) << (t - 1)) - 1)
        gsym[j] = gs
        ghist[c * 130 + gs] += 1
        o = np.uint64(old_bits[j])
        d = (
            key(np.uint64(new_bits[j]), is_float, sign_shift, top, low_mask)
            - key(o, is_float, sign_shift, top, low_mask)
        ) & mask
        sign = np.int64((d >> sign_shift) & np.uint64(1))
        negative = np.uint64(0) - np.uint64(sign)
        mag = ((d ^ negative) - negative) & mask
        if mag == 1:
            ss = sign
        else:
            ss = 2 + 2 * (bit_length(np.int64(mag - np.uint64(1))) - 1) + sign
        ssym[j] = ss
        shist[c * 130 + ss] += 1
        if first[c] < 0:
            first[c] = j
        mc[c] += 1
    for c in range(nc - 1, -1, -1):
        last[c] = -1
    for j in range(m - 1, -1, -1):  # the next change of the same class, -1 after its last
        c = cls[j]
        nxt[j] = last[c]
        last[c] = j
    # Tables.
    op = 0
    cap = out.shape[0]
    for c in range(nc):
        if mc[c] == 0:
            continue
        if op + 9 + 3 + 2 * ks > cap:
            return -1, 0, 0
        op = _put_varint(out, op, mc[c])
        # Gaps: the geometric table whose parameter codes this class's gaps smallest, among the
        # few around the class's change rate (measured: within 1 % of the gaps' own statistics,
        # for 2 bytes instead of ~25 bytes of table).
        k = GAP_SYMBOLS
        while ghist[c * 130 + k - 1] == 0:
            k -= 1
        rate = mc[c] / max(class_sizes[c], mc[c])
        guess = int(round(-8.0 * np.log2(rate)))
        best_g = 0
        best_bits = np.inf
        for g in range(max(guess - 3, 0), min(guess + 3, 255) + 1):
            _gap_table(g, k, gweights, gfreq, gcum, c * 130)
            bits = 0.0
            for s in range(k):
                h = ghist[c * 130 + s]
                if h:
                    bits += h * (PROB_BITS - np.log2(gfreq[c * 130 + s]))
            if bits < best_bits:
                best_bits = bits
                best_g = g
        _gap_table(best_g, k, gweights, gfreq, gcum, c * 130)
        out[op] = best_g
        out[op + 1] = k
        op += 2
        # Steps: their own table (the up/down balance and the rare big steps vary by class).
        k = ks
        while shist[c * 130 + k - 1] == 0:
            k -= 1
        _normalize(shist, c * 130, k, sfreq, scum, False)
        out[op] = k
        op += 1
        for s in range(k):
            op = _put_varint(out, op, sfreq[c * 130 + s])
    table_bytes = op
    # Raw bits, forward in decoding order: the first gap of each class (ascending), then per
    # change its step's bits and the next gap's of its class.
    bp = 0
    for c in range(nc):
        j = first[c]
        if j >= 0:
            bp = _put_bits(raw, bp, np.uint64(graw[j]), max((gsym[j] + 1) // 2 - 1, 0))
    for j in range(m):
        ss = ssym[j]
        if ss >= 4:  # |step| >= 3: slot u >= 1, u raw bits (|step| = 2 is slot 0: none)
            n = (ss - 2) >> 1
            d = (
                key(np.uint64(new_bits[j]), is_float, sign_shift, top, low_mask)
                - key(np.uint64(old_bits[j]), is_float, sign_shift, top, low_mask)
            ) & mask
            negative = np.uint64(0) - np.uint64(ss & 1)
            bp = _put_bits(raw, bp, (((d ^ negative) - negative) & mask) - np.uint64(1), n)
        k = nxt[j]
        if k >= 0:
            bp = _put_bits(raw, bp, np.uint64(graw[k]), max((gsym[k] + 1) // 2 - 1, 0))
    raw_words = (bp + 63) >> 6
    # rANS, backwards through the decoding order: words fill `words` from its end.
    wp = words.shape[0]
    x0 = np.int64(STATE_LOW)  # steps
    x1 = np.int64(STATE_LOW)  # gaps
    for j in range(m - 1, -1, -1):
        c = cls[j]
        k = nxt[j]
        if k >= 0:
            x1, wp = _rans_put(x1, gfreq[c * 130 + gsym[k]], gcum[c * 130 + gsym[k]], words, wp)
        x0, wp = _rans_put(x0, sfreq[c * 130 + ssym[j]], scum[c * 130 + ssym[j]], words, wp)
    for c in range(nc - 1, -1, -1):
        j = first[c]
        if j >= 0:
            x1, wp = _rans_put(x1, gfreq[c * 130 + gsym[j]], gcum[c * 130 + gsym[j]], words, wp)
    wp -= 4
    words[wp] = x0 & 0xFFFF
    words[wp + 1] = x0 >> 16
    words[wp + 2] = x1 & 0xFFFF
    words[wp + 3] = x1 >> 16
    nwords = words.shape[0] - wp
    if table_bytes + 2 * nwords + 8 * raw_words > cap:
        return -1, 0, 0
    for k in range(nwords):
        w = words[wp + k]
        out[op] = w & 0xFF
        out[op + 1] = w >> 8
        op += 2
    for k in range(raw_words):
        w = raw[k]
        for b in range(8):
            out[op] = (w >> np.uint64(8 * b)) & np.uint64(0xFF)
            op += 1
    return table_bytes, nwords, raw_words


@jit
def _get_varint(buf, ip, end):
    """(value, next ip) of a LEB128 varint of at most 9 bytes (a class's change count), or (-1, ip)
    for one that runs past `end` or is longer."""
    v = 0
    shift = 0
    for _ in range(9):
        if ip >= end:
            return -1, ip
        b = np.int64(buf[ip])
        ip += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return v, ip
    return -1, ip


@jit
def _read_tables(buf, class_mask, width, mc, slots, tables):
    """Parses the class table section at the start of buf into per-class change counts and
    decoding slots (entry: symbol | freq << 8 | (slot - cum) << 20; table 2c gaps, 2c + 1 steps).
    tables: int64 scratch of 3 * 130. Returns (status, bytes read)."""
    ks = 2 + 2 * width
    end = buf.shape[0]
    weights = tables[0:130]
    freq = tables[130:260]
    cum = tables[260:390]
    ip = 0
    for c in range(NUM_CLASSES):
        mc[c] = 0
        if not (class_mask >> c) & 1:
            continue
        v, ip = _get_varint(buf, ip, end)
        if v < 0:
            return 4, ip
        if v == 0:
            return 1, ip
        mc[c] = v
        if ip + 3 > end:
            return 4, ip
        g = np.int64(buf[ip])
        k = np.int64(buf[ip + 1])
        ip += 2
        if k == 0 or k > GAP_SYMBOLS:
            return 1, ip
        _gap_table(g, k, weights, freq, cum, 0)
        base = 2 * c * PROB_SCALE
        for s in range(k):
            f = freq[s]
            for slot in range(cum[s], cum[s] + f):
                slots[base + slot] = np.uint32(s | (f << 8) | ((slot - cum[s]) << 20))
        k = np.int64(buf[ip])
        ip += 1
        if k == 0 or k > ks:
            return 1, ip
        base = (2 * c + 1) * PROB_SCALE
        total = 0
        for s in range(k):
            f = np.int64(0)
            for b in range(MAX_FREQ_BYTES + 1):
                if b == MAX_FREQ_BYTES:
                    return 1, ip
                if ip >= end:
                    return 4, ip
                byte = np.int64(buf[ip])
                ip += 1
                f |= (byte & 0x7F) << (7 * b)
                if byte < 0x80:
                    break
            if total + f > PROB_SCALE:
                return 2, ip
            for slot in range(total, total + f):
                slots[base + slot] = np.uint32(s | (f << 8) | ((slot - total) << 20))
            total += f
        if total != PROB_SCALE:
            return 2, ip
    return 0, ip


@jit
def _decode_kernel(old, table, shift, is_float, width, expected, mc, slots, words, raw, state, pos, vals):
    """Decodes into (pos, vals), then, if the whole payload checked out, writes them into `old`;
    returns (status, changed). On an error it writes nothing but pos and vals.

    words: the rANS words plus one zero word; raw: the raw bit words plus two zero words;
    state: int64 scratch of 2 * 16."""
    n = old.shape[0]
    nc = NUM_CLASSES
    nwords = words.shape[0] - 1
    nraw = raw.shape[0] - 2
    if nwords < 4:
        return 5, 0
    x0 = np.int64(words[0]) | (np.int64(words[1]) << 16)
    x1 = np.int64(words[2]) | (np.int64(words[3]) << 16)
    if x0 < STATE_LOW or x1 < STATE_LOW:
        return 6, 0
    ip = 4
    bp = np.int64(0)
    sign_shift, mask, top, low_mask = order_masks(width)
    big = np.int64(1) << 62
    rem = state[0:nc]
    left = state[nc : 2 * nc]
    for c in range(nc):
        rem[c] = big
        left[c] = mc[c]
    scale_mask = PROB_SCALE - 1
    for c in range(nc):  # every class's first gap
        if left[c] == 0:
            continue
        e = np.int64(slots[(2 * c) * PROB_SCALE + (x1 & scale_mask)])
        x1 = ((e >> 8) & 0xFFF) * (x1 >> PROB_BITS) + (e >> 20)
        if x1 < STATE_LOW:
            x1 = (x1 << 16) | np.int64(words[min(ip, nwords)])
            ip += 1
        s = e & 0xFF
        g = 0
        if s:
            t = (s + 1) >> 1
            nb = t - 1
            idx = min(bp >> 6, nraw)
            off = np.uint64(bp & 63)
            r = (raw[idx] >> off) | ((raw[idx + 1] << np.uint64(1)) << (np.uint64(63) - off))
            g = (((2 | ((s + 1) & 1)) << nb) | np.int64(r & ((np.uint64(1) << np.uint64(nb)) - np.uint64(1)))) - 1
            bp += nb
        rem[c] = g
        left[c] -= 1
    m = 0
    # The element walk is ctx's (ctx._decode_kernel), written out in both: it is the hot
    # loop, ~0.7 ns per element, and only what happens at a change differs.
    for i in range(n):
        o = old[i]
        c = table[o >> shift]
        r = rem[c]
        if r > 0:
            rem[c] = r - 1
            continue
        # changed: its step, then (unless it was its class's last) the gap to the class's next
        e = np.int64(slots[(2 * c + 1) * PROB_SCALE + (x0 & scale_mask)])
        x0 = ((e >> 8) & 0xFFF) * (x0 >> PROB_BITS) + (e >> 20)
        need = x0 < STATE_LOW  # a select, not a branch: ~1 in 3 symbols needs a word, at random
        w = np.int64(words[min(ip, nwords)])
        x0 = ((x0 << 16) | w) if need else x0
        ip += need
        s = e & 0xFF
        sign = s & 1
        mag = np.uint64(1)
        if s >= 2:  # a branch: ~90 % of steps are one ULP, so it predicts well (a select measured slower)
            u = (s - 2) >> 1
            idx = min(bp >> 6, nraw)
            off = np.uint64(bp & 63)
            rb = (raw[idx] >> off) | ((raw[idx + 1] << np.uint64(1)) << (np.uint64(63) - off))
            mag = ((np.uint64(1) << np.uint64(u)) | (rb & ((np.uint64(1) << np.uint64(u)) - np.uint64(1)))) + np.uint64(
                1
            )
            bp += u
            if mag > top or (sign == 0 and mag == top):
                return 8, m
        uo = np.uint64(o)
        negative = np.uint64(0) - np.uint64(sign)
        kx = (key(uo, is_float, sign_shift, top, low_mask) + ((mag ^ negative) - negative)) & mask
        pos[m] = i
        vals[m] = unkey(kx, is_float, sign_shift, top, low_mask)
        m += 1
        if left[c] == 0:
            rem[c] = big
            continue
        left[c] -= 1
        e = np.int64(slots[(2 * c) * PROB_SCALE + (x1 & scale_mask)])
        x1 = ((e >> 8) & 0xFFF) * (x1 >> PROB_BITS) + (e >> 20)
        need = x1 < STATE_LOW
        w = np.int64(words[min(ip, nwords)])
        x1 = ((x1 << 16) | w) if need else x1
        ip += need
        s = e & 0xFF
        nb = max(((s + 1) >> 1) - 1, 0)
        idx = min(bp >> 6, nraw)
        off = np.uint64(bp & 63)
        rb = (raw[idx] >> off) | ((raw[idx + 1] << np.uint64(1)) << (np.uint64(63) - off))
        g = (((2 | ((s + 1) & 1)) << nb) | np.int64(rb & ((np.uint64(1) << np.uint64(nb)) - np.uint64(1)))) - 1
        rem[c] = g if s else 0
        bp += nb
    if m != expected:
        return 7, m
    if ip > nwords:
        return 9, m
    if ip != nwords or x0 != STATE_LOW or x1 != STATE_LOW:
        return 10, m
    if bp > 64 * nraw:
        return 11, m
    if (bp + 63) >> 6 != nraw:
        return 12, m
    if bp & 63 and raw[nraw - 1] >> np.uint64(bp & 63):
        return 12, m
    for k in range(m):  # the payload checked out: apply (here, without the GIL, not as numpy fancy indexing)
        old[pos[k]] = vals[k]
    return 0, m


# ----------------------------------------------------------------------------------- API


def emit(changes: Changes, dtype_name: str, itemsize: int, limit: int) -> bytes | None:
    """The payload for `changes` (as `changes.find_changes` finds them), or None if it would exceed
    `limit` bytes."""
    require_numba()
    m = len(changes.positions)
    width = 8 * itemsize
    work = scratch("rans_work", 4 * m + 7 * NUM_CLASSES * 130 + 3 * NUM_CLASSES, np.int64)
    raw = scratch("rans_raw", (m * (31 + width)) // 64 + 2, np.uint64)
    raw[:] = 0
    words = scratch("rans_words", 2 * m + 8, np.uint16)
    out = scratch("rans_out", max(limit - HEADER.size, 0), np.uint8)
    table_bytes, nwords, raw_words = _emit_kernel(
        changes.positions,
        changes.classes,
        changes.ranks,
        changes.old_bits,
        changes.new_bits,
        changes.class_counts[:NUM_CLASSES],
        dtype_name in FLOAT_LAYOUT,
        width,
        work,
        raw,
        words,
        out,
    )
    if table_bytes == -2:
        raise ValueError("rans: the changes' ranks do not increase within their classes (not one chunk's changes)")
    if table_bytes < 0:
        return None
    mask = 0
    for c in np.flatnonzero(work[len(work) - NUM_CLASSES :]):  # the kernel's changes per class
        mask |= 1 << int(c)
    body = table_bytes + 2 * nwords + 8 * raw_words
    return HEADER.pack(m, changes.class_base, mask, nwords) + out[:body].tobytes()


def decode_into(payload: bytes | memoryview, out: np.ndarray, dtype_name: str, itemsize: int) -> None:
    """Applies a rans payload to `out` (the parent's raw bytes of the range), in place.

    Raises FormatError on any malformed payload; `out` is untouched then.
    """
    require_numba()
    view = memoryview(payload)
    if len(view) < HEADER.size:
        raise FormatError(f"rans payload of {len(view)} bytes is shorter than its {HEADER.size}-byte header")
    changed, class_base, class_mask, nwords = HEADER.unpack_from(view, 0)
    utype = UINT[itemsize]
    target = out.view(utype)
    count = len(target)
    if changed > count:
        raise FormatError(f"rans payload claims {changed} changed elements in a chunk of {count}")
    layout = FLOAT_LAYOUT.get(dtype_name)
    if class_base >= (1 << layout[1] if layout else 1):
        raise FormatError(f"rans class base {class_base} is out of range for {dtype_name}")
    if layout is None and class_mask > 1:
        raise FormatError(f"rans payload has changes in classes {class_mask:#x}; {dtype_name} has one class")
    body = np.frombuffer(view, dtype=np.uint8, offset=HEADER.size)
    mc = scratch("rans_mc", NUM_CLASSES, np.int64)
    slots = scratch("rans_slots", 2 * NUM_CLASSES * PROB_SCALE, np.uint32)
    tables = scratch("rans_tables", 3 * 130, np.int64)
    status, table_bytes = _read_tables(body, class_mask, 8 * itemsize, mc, slots, tables)
    if status:
        raise FormatError(f"rans payload is corrupt: {_ERRORS[status]}")
    if int(mc.sum()) != changed:
        raise FormatError(f"rans payload is corrupt: {_ERRORS[3]}")
    rest = len(body) - table_bytes
    if 2 * nwords > rest:
        raise FormatError(f"rans payload declares {nwords} rANS words, {rest // 2} follow its tables")
    raw_bytes = rest - 2 * nwords
    if raw_bytes % 8:
        raise FormatError(f"rans raw bit stream of {raw_bytes} bytes is not whole 64-bit words")
    words = scratch("rans_dwords", nwords + 1, np.uint16)
    words[:nwords] = np.frombuffer(view, dtype="<u2", count=nwords, offset=HEADER.size + table_bytes)
    words[nwords] = 0
    raw = scratch("rans_draw", raw_bytes // 8 + 2, np.uint64)
    raw[: raw_bytes // 8] = np.frombuffer(
        view, dtype="<u8", count=raw_bytes // 8, offset=HEADER.size + table_bytes + 2 * nwords
    )
    raw[raw_bytes // 8 :] = 0
    table, shift = cached_class_table(dtype_name, itemsize, class_base)
    pos = scratch("rans_dpos", changed, np.int64)
    vals = scratch("rans_dvals", changed, utype)
    state = scratch("rans_state", 2 * NUM_CLASSES, np.int64)
    status, m = _decode_kernel(
        target, table, shift, layout is not None, 8 * itemsize, changed, mc, slots, words, raw, state, pos, vals
    )
    if status:
        raise FormatError(f"rans payload is corrupt: {_ERRORS.get(status, status)} (after {m} changed elements)")


def warm_up(dtype_names: Iterable[str]) -> None:
    """`ctx.warm_up` for this codec's kernels: a round trip of a small delta per element width."""
    for name in dtype_names:
        dtype = dtype_by_name(name)
        if dtype.itemsize not in UINT:
            continue
        old = np.zeros(4096 * dtype.itemsize, dtype=np.uint8)
        new = old.copy()
        new[:: 64 * dtype.itemsize] = 1
        changes = scan_changes(new, old, dtype.name, dtype.itemsize, 4096 // 64)
        payload = emit(changes, dtype.name, dtype.itemsize, 1 << 20)
        decode_into(payload, old, dtype.name, dtype.itemsize)
        if not np.array_equal(old, new):
            raise AssertionError(f"rans warm-up round trip for {name} is not exact")


class RansCodec(Codec):
    """Codec 5: the change model under static per-chunk tables, rANS-coded."""

    id = 5
    name = "rans"

    def encode(self, new, old, itemsize, *, dtype_name, level=DEFAULT_ZSTD_LEVEL):
        return encode_forced(emit, self.name, new, old, itemsize, dtype_name)

    def decode_into(self, payload, out, itemsize, *, dtype_name):
        decode_into(payload, out, dtype_name, itemsize)

    def warm_up(self, dtype_names):
        warm_up(dtype_names)  # the module's, looked up at call time
