"""pack: many small chunk objects stored as one store object, read back with ranged reads.

A delta at RL change rates is a few tens of kB per 4 MiB chunk, so one store object per chunk
makes a version cost O(model size / chunk size) requests: 256 PUTs for a 1 GiB model, and as
many GETs for a reader, each paying a round trip. A *pack* is chunk objects written back to back
(each a whole object, header included, so a pack is also readable on its own by walking the
headers) and stored under the xxh3-128 of its bytes (`packs/<2 hex>/<32 hex>`). The manifest is
the pack's index: a packed chunk names its pack's key, its byte `offset` there, its `size` and its
own object hash, so a reader fetches any run of members with one ranged read and checks each
member against its own hash, as it would a chunk object. docs/format.md, "Packs", is the contract.

`PackWriter` fills packs as the publisher's encoders finish chunks (any thread, any order) and
hands each one to an upload callback as soon as it is full, so uploads overlap encoding.
`plan_reads` groups the refs a reader needs into ranged reads.
Not here: the chunk object format (`chunk.py`), where packs are written (`publisher.py`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable

from weightsync.format.hashing import xxh3_hex
from weightsync.format.manifest import ChunkRef

DEFAULT_PACK_BYTES = 8 * 1024 * 1024
"""A pack is sealed (and its upload starts) once it holds this many bytes: a few store requests
per version, yet big deltas still upload while later chunks encode."""
READ_BYTES = 8 * 1024 * 1024
"""Nearby members of one pack are read together in ranged reads of up to this many bytes."""
GAP_BYTES = 1024 * 1024
"""Members at most this far apart share a read (the bytes between are read and dropped)."""


class Pack:
    """A pack being filled; its key is known once it is sealed."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.nbytes = 0
        self.key: str | None = None  # relative to the model prefix, set by seal()


@dataclasses.dataclass(frozen=True)
class PackSlot:
    """Where one object went: its pack (key known after sealing) and its byte offset there."""

    pack: Pack
    offset: int


class PackWriter:
    """Collects one version's objects into packs; thread-safe.

    `upload(key, data)` is called (from the thread that sealed the pack) for every sealed pack,
    with the key relative to the model prefix, and returns what `finish` hands back for waiting
    on (the publisher's upload future).
    """

    def __init__(self, pack_bytes: int, upload: Callable[[str, bytes], object], key_of: Callable[[str], str]) -> None:
        self.pack_bytes = pack_bytes
        self._upload = upload
        self._key_of = key_of
        self._lock = threading.Lock()
        self._open = Pack()
        self._uploads: list[object] = []

    def add(self, obj: bytes) -> PackSlot:
        with self._lock:
            pack = self._open
            slot = PackSlot(pack, pack.nbytes)
            pack.parts.append(obj)
            pack.nbytes += len(obj)
            full = pack.nbytes >= self.pack_bytes
            if full:
                self._open = Pack()
        if full:
            self._seal(pack)
        return slot

    def finish(self) -> list[object]:
        """Seals the last pack; returns every upload's handle (in sealing order)."""
        with self._lock:
            pack, self._open = self._open, Pack()
        if pack.parts:
            self._seal(pack)
        with self._lock:
            return list(self._uploads)

    def _seal(self, pack: Pack) -> None:
        data = b"".join(pack.parts)
        pack.parts = []
        pack.key = self._key_of(xxh3_hex(data))
        handle = self._upload(pack.key, data)
        with self._lock:
            self._uploads.append(handle)


def plan_reads(refs: Iterable[ChunkRef], max_bytes: int = READ_BYTES, max_gap: int = GAP_BYTES) -> list[list[ChunkRef]]:
    """The refs grouped into reads: members of one pack within `max_gap` bytes of each other (in
    offset order) share a ranged read of at most `max_bytes` (a few unneeded bytes cost less than
    a round trip); any other ref is a read of its own."""
    groups: list[list[ChunkRef]] = []
    by_pack: dict[str, list[ChunkRef]] = {}
    for ref in refs:
        if ref.offset is None:
            groups.append([ref])
        else:
            by_pack.setdefault(ref.key, []).append(ref)
    for members in by_pack.values():
        members.sort(key=lambda r: r.offset)
        run: list[ChunkRef] = []
        for ref in members:
            if run:
                end = max(r.offset + r.size for r in run)
                if ref.offset - end > max_gap or max(end, ref.offset + ref.size) - run[0].offset > max_bytes:
                    groups.append(run)
                    run = []
            run.append(ref)
        groups.append(run)
    return groups


def group_span(group: list[ChunkRef]) -> tuple[int, int]:
    """(start, length) of the bytes a group of pack members covers."""
    start = group[0].offset
    return start, max(r.offset + r.size for r in group) - start
