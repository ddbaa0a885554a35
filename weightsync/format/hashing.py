"""hashing: xxh3-128, the one hash weightsync writes (chunks, objects, version digests).

xxh3 detects corruption, not malice: it is not collision resistant against an attacker who
can write the store. Publisher signatures over the manifest are the defence there
(docs/security.md). Hex digests are lowercase, 32 characters.
"""

from __future__ import annotations

import re

import xxhash

HASH_HEX_LEN = 32
_HEX = re.compile(r"[0-9a-f]{32}")


def xxh3_hex(*parts: bytes | memoryview) -> str:
    """xxh3-128 of the concatenation of `parts`, without concatenating them."""
    if len(parts) == 1:
        return xxhash.xxh3_128_hexdigest(parts[0])
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return h.hexdigest()


def xxh3_digest(data: bytes | memoryview) -> bytes:
    """The 16 raw bytes of xxh3-128 (big-endian, as xxhash canonical form)."""
    return xxhash.xxh3_128_digest(data)


def is_hash_hex(value: object) -> bool:
    return isinstance(value, str) and _HEX.fullmatch(value) is not None
