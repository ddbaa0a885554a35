"""position_digest: the position-keyed additive digest an engine's workers keep of what they hold.

A version's digest is the sum mod 2^64, over every element of every HF tensor, of a 64-bit mix of
(tensor id, flat index, bit pattern):

    D(v) = sum over tensors t, elements i of  mix(id(t), i, bits_t[i])   (mod 2^64)
    id(t)         = xxh3-64 of the tensor's HF name (utf-8)
    bits          = the element's bit pattern, zero-extended to 64 bits (bf16: 16 bits, ...)
    mix(t, i, b)  = fmix64((i * K1 + t) XOR (b * K2)), fmix64 being MurmurHash3's finalizer

Because it is a sum, it is updated in O(changed elements): D(v') = D(v) - sum of mix over the old
bits at the changed positions + sum over the new bits there. Because the index is mixed in, a
value moved to another position changes it (an XOR-reduce of values would not see that). For a
fixed (tensor, index) the mix is a bijection of the bits, so any single changed element always
changes the sum. Under tensor parallelism each element counts on exactly one owner rank, so the
ranks' partial sums add up to D(v), whatever the layout.

One implementation in torch (`mix`, `position_sum`, `tensor_sum`) serves the vLLM/SGLang workers
(this module imports only torch, xxhash and the standard library, so it runs in an inference image)
and the agent's O(delta) sums; the agent's O(model) sum of a whole version uses a numba kernel of
the same function (`weights_sum`, imported lazily: numba is not in the inference image), tested to
give the same figure.

Not here: which worker holds which element (`placement.py`), applying deltas (`delta_apply.py`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import xxhash

MOD = 1 << 64
_MASK64 = MOD - 1


def _signed(value: int) -> int:
    """A 64-bit constant as torch's int64 holds it (two's complement)."""
    value &= _MASK64
    return value - MOD if value >= 1 << 63 else value


K1 = _signed(0x9E3779B97F4A7C15)
K2 = _signed(0xC2B2AE3D27D4EB4F)
M1 = _signed(0xFF51AFD7ED558CCD)
M2 = _signed(0xC4CEB53FE1A85EC9)
_LOW31 = (1 << 31) - 1  # what an arithmetic shift right by 33 keeps of a logical one
BLOCK_ELEMENTS = 1 << 22  # elements mixed at a time by `tensor_sum` (memory: a few int64 work arrays)


def tensor_id(name: str) -> int:
    """The tensor's id in the mix: xxh3-64 of its HF name, as a signed int64."""
    return _signed(xxhash.xxh3_64_intdigest(name.encode()))


def element_bits(flat: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a 1-D tensor's elements, zero-extended into int64."""
    size = flat.element_size()
    if size == 8:
        return flat.view(torch.int64).clone()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[size]
    bits = flat.view(view).to(torch.int64)
    return bits if size == 1 else bits.bitwise_and_((1 << (8 * size)) - 1)


def mix(tid: int, index: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """mix(id, i, b) of int64 tensors `index` and `bits` (same shape), as int64 (wrapping). In place
    on two work tensors: each temporary is a pass over memory, and this runs over every changed
    element of every swap."""
    h = index * K1
    h += tid
    work = bits * K2
    h ^= work
    for multiplier in (M1, M2):  # MurmurHash3's 64-bit finalizer; a logical shift is arithmetic + mask
        torch.bitwise_right_shift(h, 33, out=work)
        work &= _LOW31
        h ^= work
        h *= multiplier
    torch.bitwise_right_shift(h, 33, out=work)
    work &= _LOW31
    h ^= work
    return h


def fold(value: int | torch.Tensor) -> int:
    """A wrapped int64 sum as the digest's unsigned value in [0, 2^64)."""
    return int(value) & _MASK64


def position_sum(tid: int, index: torch.Tensor, bits: torch.Tensor) -> int:
    """Sum mod 2^64 of mix over (index, bits) pairs of one tensor (int64 tensors of one shape)."""
    if index.numel() == 0:
        return 0
    return fold(mix(tid, index.to(torch.int64), bits).sum())


def tensor_sum(name: str, tensor: torch.Tensor, *, start: int = 0) -> int:
    """The digest's sum over every element of `tensor` (flat indices start, start + 1, ...), in
    blocks of BLOCK_ELEMENTS so that work memory stays bounded."""
    tid = tensor_id(name)
    flat = tensor.detach().reshape(-1)
    total = 0
    for begin in range(0, flat.numel(), BLOCK_ELEMENTS):
        piece = flat[begin : begin + BLOCK_ELEMENTS]
        index = torch.arange(start + begin, start + begin + piece.numel(), dtype=torch.int64, device=piece.device)
        total += position_sum(tid, index, element_bits(piece))
    return total & _MASK64


def add(*values: int) -> int:
    """Sum mod 2^64."""
    return sum(values) & _MASK64


def sub(a: int, b: int) -> int:
    """a - b mod 2^64."""
    return (a - b) & _MASK64


def weights_sum(weights: Mapping[str, torch.Tensor]) -> int:
    """D(v) of a whole state dict (HF names -> tensors on the CPU): numba kernel, O(model), one
    pass; what the agent's engine computes of each version it swaps in whole."""
    import numpy as np  # the agent's side only: not in the inference image

    kernel = _numba_kernel()
    total = 0
    for name, tensor in weights.items():
        flat = tensor.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        if flat.device.type != "cpu":
            flat = flat.cpu()
        size = flat.element_size()
        view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
        words = flat.contiguous().view(view).numpy().view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size])
        total += int(kernel(words, np.uint64(tensor_id(name) & _MASK64)))
    return total & _MASK64


_KERNEL = None


def _numba_kernel():
    global _KERNEL
    if _KERNEL is None:
        import numba
        import numpy as np

        k1, k2, m1, m2 = (np.uint64(k & _MASK64) for k in (K1, K2, M1, M2))
        s33 = np.uint64(33)

        @numba.njit(nogil=True, cache=True)
        def _sum(words, tid):  # pragma: no cover - compiled
            total = np.uint64(0)
            for i in range(words.shape[0]):
                h = np.uint64(i) * k1 + tid
                h ^= np.uint64(words[i]) * k2
                h ^= h >> s33
                h *= m1
                h ^= h >> s33
                h *= m2
                h ^= h >> s33
                total += h
            return total

        _KERNEL = _sum
    return _KERNEL
