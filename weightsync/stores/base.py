"""stores.base: the `Store` contract every backend keeps. Bytes in, bytes out, under string keys.
No JSON, no manifests, no versions.

Every backend implements the `Store` protocol below and passes the same contract suite
(tests/stores/test_store_contract.py). The commit protocol of docs/format.md needs exactly two
kinds of write: `put` for immutable content-addressed objects (a retry or a duplicate is
harmless) and `put_new`, a create-only write that fails if the key exists, for manifests.

Not here: the backends (`local.py`, `s3.py`), choosing one by URI scheme (`stores/__init__.py`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from weightsync.errors import StoreError

TEMP_PREFIX = ".tmp-"  # a write in progress (local.py); never a valid key
_KEY_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    modified_unix_s: float


@runtime_checkable
class Store(Protocol):
    """The contract every backend keeps.

    - Keys are relative POSIX paths of `[A-Za-z0-9._-]` segments; no `..`, no leading `/`.
    - `get` returns the whole object or raises ObjectNotFound.
    - `get_range` returns exactly `length` bytes from byte `start` of an object (one request on
      an object store: how pack members are read); ObjectNotFound if the object is missing,
      ObjectTooShort (a StoreError) if the range runs past its end.
    - `put` makes the object durable before returning; concurrent or repeated puts of the same
      bytes are harmless. Readers never see a partially written object.
    - `put_new` is create-only: it raises ObjectExists if the key exists, atomically with
      respect to other writers (exactly one of two racing writers wins).
    - `touch` refreshes an object's modification time (GC's grace period counts from it) and
      raises ObjectNotFound if it is gone.
    - `list` yields every object under a key prefix in key order, with size and mtime.
    - `delete` removes an object; deleting a missing key is not an error.
    - `io_concurrency` is how many transfers callers should run at once to use the backend well
      (publisher uploads and reader fetches run on a pool of that size, apart from the CPU work).
    """

    uri: str
    io_concurrency: int

    def get(self, key: str) -> bytes: ...

    def get_range(self, key: str, start: int, length: int) -> bytes: ...

    def put(self, key: str, data: bytes | memoryview) -> None: ...

    def put_new(self, key: str, data: bytes | memoryview) -> None: ...

    def touch(self, key: str) -> None: ...

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]: ...

    def delete(self, key: str) -> None: ...


def check_key(key: str) -> str:
    if not isinstance(key, str) or not key or len(key) > 1024:
        raise StoreError(f"invalid store key {key!r}")
    parts = key.split("/")
    if any(not _KEY_SEGMENT.fullmatch(p) or p in (".", "..") or p.startswith(TEMP_PREFIX) for p in parts):
        raise StoreError(
            f"invalid store key {key!r}: segments must be [A-Za-z0-9._-], not '.', '..' or '{TEMP_PREFIX}*'"
        )
    return key


def check_range(start: int, length: int) -> None:
    if (
        not isinstance(start, int)
        or not isinstance(length, int)
        or isinstance(start, bool)
        or isinstance(length, bool)
        or start < 0
        or length < 1
    ):
        raise StoreError(f"invalid byte range: start {start!r}, length {length!r} (need start >= 0, length >= 1)")
