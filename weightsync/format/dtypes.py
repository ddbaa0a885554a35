"""dtypes: the element types weightsync carries, by name, with their stable wire codes.

Only names and sizes live here; the codec sees every tensor as raw bit patterns of
`itemsize` bytes, so it never needs numpy or torch to understand a dtype. Mapping to torch
dtypes is in `tensors.py`. Codes are written into chunk headers: never renumber one.
"""

from __future__ import annotations

import dataclasses

from weightsync.errors import UnsupportedFormatError


@dataclasses.dataclass(frozen=True)
class DType:
    name: str  # the torch name without the "torch." prefix, as written in manifests
    code: int  # one byte in the chunk header
    itemsize: int  # bytes per element
    floating: bool  # cast to the publish dtype when the publisher is asked to


_ALL = (
    DType("bfloat16", 1, 2, True),
    DType("float16", 2, 2, True),
    DType("float32", 3, 4, True),
    DType("float64", 4, 8, True),
    DType("float8_e4m3fn", 5, 1, True),
    DType("float8_e5m2", 6, 1, True),
    DType("int8", 7, 1, False),
    DType("uint8", 8, 1, False),
    DType("int16", 9, 2, False),
    DType("int32", 10, 4, False),
    DType("int64", 11, 8, False),
    DType("bool", 12, 1, False),
    DType("uint16", 13, 2, False),
    DType("uint32", 14, 4, False),
    DType("uint64", 15, 8, False),
)
BY_NAME = {d.name: d for d in _ALL}
BY_CODE = {d.code: d for d in _ALL}


def dtype_by_name(name: str) -> DType:
    try:
        return BY_NAME[name]
    except (KeyError, TypeError):
        raise UnsupportedFormatError(f"unsupported dtype {name!r}; supported: {', '.join(sorted(BY_NAME))}") from None


def dtype_by_code(code: int) -> DType:
    try:
        return BY_CODE[code]
    except KeyError:
        raise UnsupportedFormatError(f"unknown dtype code {code}; supported codes: {sorted(BY_CODE)}") from None
