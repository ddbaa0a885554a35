"""Codec ctx's bytes and refusals are frozen: the payloads of a fixed corpus of chunks (every
dtype, edge-case sizes and change densities, bf16 weights at RL change rates) and the errors that
corrupted copies of them get must stay what the first implementation produced.

`tests/format/codecs/ctx_regression.json` was written by that implementation (before the kernels were made
faster: branch-free coder, fused scan) with `python -m tests.test_ctx_regression`; rewriting it is
only right for a deliberate format change, which needs a new codec id anyway.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from weightsync.errors import FormatError
from weightsync.format.codecs import ctx as ctx_codec
from weightsync.format.dtypes import BY_NAME, dtype_by_name
from weightsync.format.hashing import xxh3_hex

DATA = Path(__file__).with_name("ctx_regression.json")
DTYPES = sorted(name for name in BY_NAME if hasattr(torch, name))
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
FLOATS = ("bfloat16", "float16", "float32", "float64")


def _case(index: int) -> tuple[str, np.ndarray, np.ndarray]:
    """Chunk `index` of the corpus: (dtype name, parent bits, new bits), fully determined by index."""
    rng = np.random.default_rng(index)
    if index < 8:  # bf16 weights of std 0.015 at RL change rates, one-ULP moves mostly
        name, count = "bfloat16", [1, 7, 4096, 65_537, 200_000, 200_000, 300_001, 100_000][index]
        density = [1.0, 0.5, 0.014, 0.014, 0.014, 0.034, 0.034, 0.2][index]
    else:
        name = DTYPES[index % len(DTYPES)]
        count = int(rng.choice([1, 2, 3, 5, 8, 63, 64, 65, 1000, 4097, 20_001]))
        density = float(rng.choice([0.0, 0.001, 0.014, 0.034, 0.2, 0.6, 1.0]))
    itemsize = dtype_by_name(name).itemsize
    utype = UINT[itemsize]
    if name in FLOATS and index % 3 != 1:
        values = torch.from_numpy(rng.standard_normal(count).astype(np.float32) * 0.015).to(getattr(torch, name))
        signed = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
        old = values.view(signed).numpy().view(utype).copy()
    else:
        old = rng.integers(0, 256, count * itemsize, dtype=np.uint8).view(utype).copy()
    if name == "bool":
        old &= 1
    changed = np.flatnonzero(rng.random(count) < density)
    kind = ["ulp", "small", "any"][index % 3] if index >= 8 else "ulp"
    if kind == "ulp":
        deltas = rng.choice([-1, 1], len(changed), p=[0.3, 0.7])
    elif kind == "small":
        deltas = rng.integers(-40, 41, len(changed))
    else:
        deltas = rng.integers(-(2**62), 2**62, len(changed))
    new = old.copy()
    modulus = 1 << (8 * itemsize)
    new[changed] = np.array(
        [(int(old[i]) + int(d)) % modulus for i, d in zip(changed, deltas, strict=True)], dtype=np.uint64
    ).astype(utype)
    if name == "bool":
        new &= 1
    return name, old, new


CASES = 120


def _encode(name: str, old: np.ndarray, new: np.ndarray) -> bytes:
    changed = int(np.count_nonzero(old != new))
    payload = ctx_codec.encode(new.view(np.uint8), old.view(np.uint8), name, old.itemsize, changed, limit=1 << 30)
    assert payload is not None
    return payload


def _corruptions(payload: bytes, index: int) -> list[bytes]:
    """Damaged copies of a payload: bit flips in the stream, truncations, trailing bytes."""
    rng = np.random.default_rng(10_000 + index)
    out = []
    for _ in range(3):
        damaged = bytearray(payload)
        at = int(rng.integers(10, len(damaged))) if len(damaged) > 10 else len(damaged) - 1
        damaged[at] ^= 1 << int(rng.integers(0, 8))
        out.append(bytes(damaged))
    out += [payload[: max(len(payload) - k, 0)] for k in (1, 2, 7)]
    out += [payload + b"\x00", payload + b"\xff\x17"]
    return out


def _outcome(payload: bytes, name: str, old: np.ndarray) -> str:
    """What decoding gives: the xxh3 of the result, or the error (with the parent untouched)."""
    out = old.copy()
    try:
        ctx_codec.decode_into(payload, out.view(np.uint8), name, old.itemsize)
    except FormatError as e:
        assert np.array_equal(out, old), "a refused payload changed the chunk"
        return f"error: {e}"
    return xxh3_hex(out.view(np.uint8))


def _record(index: int) -> dict:
    name, old, new = _case(index)
    payload = _encode(name, old, new)
    return {
        "dtype": name,
        "count": len(old),
        "payload": xxh3_hex(payload),
        "bytes": len(payload),
        "corrupted": [_outcome(p, name, old) for p in _corruptions(payload, index)],
    }


@pytest.fixture(scope="module")
def frozen() -> list[dict]:
    return json.loads(DATA.read_text())


@pytest.mark.parametrize("index", range(CASES))
def test_payloads_and_refusals_are_unchanged(index, frozen):
    name, old, new = _case(index)
    assert _outcome(_encode(name, old, new), name, old) == xxh3_hex(new.view(np.uint8))
    assert _record(index) == frozen[index]


if __name__ == "__main__":
    DATA.write_text(json.dumps([_record(i) for i in range(CASES)], indent=0) + "\n")
