"""bits: bit-for-bit equality of tensors and state dicts, the product's lossless contract as a check.

torch.equal compares values: it calls two NaNs with the same payload unequal and -0.0 equal to 0.0.
Both are wrong for "the agent serves exactly the bytes the trainer published", so these compare
dtype, shape and the raw bytes. Not here: tolerances (nothing in weightsync is approximate).
"""

from __future__ import annotations

import torch


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, same shape, same bytes (NaN payloads and the sign of zero included)."""
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(_raw(a), _raw(b))


def assert_bit_equal(actual: dict, expected: dict) -> None:
    """Same names, and for each the same dtype, shape and bytes; the message names the first mismatch."""
    assert sorted(actual) == sorted(expected), f"names differ: {sorted(set(actual) ^ set(expected))}"
    for name, want in expected.items():
        got = actual[name]
        assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
        assert tuple(got.shape) == tuple(want.shape), f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(_raw(got), _raw(want)), f"{name}: bytes differ"
