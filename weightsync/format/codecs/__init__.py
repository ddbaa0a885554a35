"""codecs: the registry of chunk codecs by id, and the calls the rest of weightsync makes on them.

A chunk is `count` elements of `itemsize` bytes, seen as little-endian unsigned integers (the
bit patterns; a codec never interprets them as numbers, so NaN payloads, -0.0 and subnormals
survive untouched). Codec ids are fixed by docs/format.md ("Codec ids"), and every id ever
written stays readable:

| id | name | module | what |
|---:|---|---|---|
| 1 | `full` | `planes.py` | byte planes of the raw bits, zstd; no parent |
| 2 | `xor` | `planes.py` | byte planes of new XOR parent, zstd |
| 3 | `sparse` | `planes.py` | gaps between changed elements and their XOR values, zstd |
| 4 | `ctx` | `ctx.py` | the change model (`changes.py`), range-coded under adaptive contexts |
| 5 | `rans` | `rans.py` | the same model under static per-chunk tables, rANS-coded |

Each codec is a `Codec` subclass in its own module, named in `_REGISTRY` as "module:Class" and
imported on first use (the way vLLM's `model_loader` registry resolves its loaders): a reader
of full versions never imports numba, and a new codec is one new file plus one line here.
Nothing else lists the kinds: names, error messages, the manifest's check and the codec
contract tests (tests/format/codecs/test_codec_contract.py) all read this registry.

Which codec a delta chunk gets is decided per chunk by `choice.py`, never above the highest
codec the publisher's `WriteFormat` allows.

Not here: chunk headers and hashes (`weightsync.format.chunk`), the choice (`choice.py`), the
kernels' warm-up (`warmup.py`), the device-side diff (`diff.py`), folded deltas (`fold.py`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

from weightsync.errors import FormatError, UnsupportedFormatError

if TYPE_CHECKING:
    import numpy as np

if sys.byteorder != "little":  # the planes and words are defined on little-endian bit patterns
    raise ImportError("weightsync supports little-endian hosts only")

CODEC_FULL = 1
CODEC_XOR = 2
CODEC_SPARSE = 3
CODEC_CTX = 4
CODEC_RANS = 5

_REGISTRY: dict[int, tuple[str, str]] = {
    CODEC_FULL: ("full", "planes:FullCodec"),
    CODEC_XOR: ("xor", "planes:XorCodec"),
    CODEC_SPARSE: ("sparse", "planes:SparseCodec"),
    CODEC_CTX: ("ctx", "ctx:CtxCodec"),
    CODEC_RANS: ("rans", "rans:RansCodec"),
}
"""codec id -> (name, "module:Class" inside this package). Ids are never reused or renumbered."""

CODEC_NAMES = {codec_id: name for codec_id, (name, _) in _REGISTRY.items()}
CODEC_IDS = {name: codec_id for codec_id, name in CODEC_NAMES.items()}


def check_highest_codec(codec_id: int) -> None:
    """Refuses a `highest_codec` setting (`WriteFormat`, `CodecChoice`) that is no codec id a
    delta can be limited to: below 3 no delta codec is left that every reader knows."""
    allowed = sorted(i for i in CODEC_NAMES if i >= CODEC_SPARSE)
    if codec_id not in allowed:
        raise ValueError(
            f"highest_codec must be one of {allowed} (3: full/xor/sparse, what every reader decodes; "
            f"4: + ctx; 5: + rans), got {codec_id!r}"
        )


DEFAULT_ZSTD_LEVEL = 1
MAX_ZSTD_LEVEL = 22  # the chunk header's zstd level field: 1..22 (informational for codecs without zstd)


class Codec:
    """What every codec is: an id and a name (as its `_REGISTRY` line has them), a decoder, and a
    forced encoder (this codec, whatever the choice would pick: for the contract tests, golden
    objects and hostile corpora).

    A codec sees raw bytes (`np.ndarray` of uint8, `count * itemsize` of them). `dtype_name` is
    the chunk's dtype (for codecs that model it; others ignore it). A delta codec (`delta`)
    decodes against the parent's bytes of the range, which `out` holds; `encode` gets them as
    `old`. Instances hold no state: one per process serves every thread.
    """

    id: ClassVar[int]
    name: ClassVar[str]
    delta: ClassVar[bool] = True
    """False: the payload overwrites its range (`old` is not used and may be None)."""
    itemsizes: ClassVar[tuple[int, ...]] = (1, 2, 4, 8)
    """Element widths it codes."""

    def encode(self, new: np.ndarray, old: np.ndarray | None, itemsize: int, *, dtype_name: str, level: int) -> bytes:
        """The payload for `new` (against `old`); an unchanged delta chunk still gets one."""
        raise NotImplementedError

    def decode_into(self, payload: bytes | memoryview, out: np.ndarray, itemsize: int, *, dtype_name: str) -> None:
        """Applies `payload` to `out`, the raw bytes of its range. Raises FormatError on anything
        malformed, and then leaves `out` as it was; never writes outside `out`."""
        raise NotImplementedError

    def warm_up(self, dtype_names: Iterable[str]) -> None:
        """Compiles (or loads from numba's cache) what this codec runs for these dtypes: nothing
        unless it has kernels."""


_resolved: dict[int, Codec] = {}


def codec(codec_id: int) -> Codec:
    """The codec of `codec_id`, imported on first use; UnsupportedFormatError if there is none."""
    found = _resolved.get(codec_id)
    if found is None:
        found = _resolved[codec_id] = _resolve(codec_id)
    return found


def _resolve(codec_id: int) -> Codec:
    entry = _REGISTRY.get(codec_id)
    if entry is None:
        raise UnsupportedFormatError(f"unknown codec id {codec_id}; supported: {sorted(_REGISTRY)}")
    name, target = entry
    module_name, class_name = target.split(":")
    cls = getattr(importlib.import_module(f"{__name__}.{module_name}"), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Codec)) or (cls.id, cls.name) != (codec_id, name):
        raise TypeError(f"registry line {codec_id}: {target} is not the Codec subclass of codec {codec_id} ({name})")
    return cls()


def decode_into(
    codec_id: int, payload: bytes | memoryview, out: np.ndarray, itemsize: int, *, dtype_name: str | None = None
) -> None:
    """Applies a payload to the raw bytes `out` of its chunk range, in place.

    `full` overwrites `out`; the delta codecs apply to it, so `out` must hold the parent's bytes
    of the same range (`ctx` and `rans` need the same `dtype_name` as their encoder). Raises
    FormatError on any malformed payload, before writing anything.
    """
    found = codec(codec_id)
    if itemsize not in found.itemsizes:
        raise UnsupportedFormatError(f"codec {found.name} codes itemsizes {list(found.itemsizes)}, not {itemsize}")
    if out.nbytes % itemsize:
        raise FormatError(f"chunk of {out.nbytes} bytes is not a whole number of {itemsize}-byte elements")
    found.decode_into(payload, out, itemsize, dtype_name=dtype_name or f"uint{8 * itemsize}")


def encode_full(raw: np.ndarray, itemsize: int, level: int = DEFAULT_ZSTD_LEVEL) -> bytes:
    """Payload of the `full` codec for the raw bytes of a chunk."""
    return codec(CODEC_FULL).encode(raw, None, itemsize, dtype_name=f"uint{8 * itemsize}", level=level)


_LAZY = {"encode_delta": "choice", "warm_up": "warmup", "BackgroundWarmUp": "warmup"}
"""Names served from the modules that define them, imported on first use (numba, for the delta
choice): `encode_delta(new, old, itemsize, level, *, dtype_name, changes, choice)` chooses each delta
chunk's codec and encodes it (`choice.py`); `warm_up` and `BackgroundWarmUp` compile the codecs'
kernels (`warmup.py`)."""


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # found directly from now on
    return value
