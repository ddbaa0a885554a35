"""fold: several consecutive deltas applied as one (a *folded* delta), for a reader that lags.

A reader k versions behind normally applies the chain: version after version, every delta
rewrites and re-hashes each chunk range it touches, so the changed ranges stream through memory
and through the hash k times. Folded, the reader goes range by range instead: it decodes the
path's objects for one range one after another while the range is hot in cache, and checks only
the target's raw hash: one hash pass and one trip through memory per range, whatever k is.

Every codec folds this way, because each decodes against the bytes its range holds (`xor` and
`sparse` XOR into them, `ctx` and `rans` read their parent's bits, `full` overwrites them), and
when a delta's turn comes the range holds exactly the previous version's bytes: every object was
checked against its content hash before it is decoded, so it is the one the publisher made. The
intermediate versions are never checked or served, and need not be: only the target is served,
and its raw hashes (covered by its digest) check every byte of the result.

`plan_route` decides between the chain and the fold and says why; the fold needs
- at least two deltas (one delta *is* its own fold),
- the same chunk boundaries in every version of the path (they MAY differ between versions).

Not here: fetching objects (`reader.py`), the codecs themselves (this package's registry, `__init__.py`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from weightsync.errors import FormatError, IntegrityError
from weightsync.format import codecs
from weightsync.format.chunk import unpack_chunk
from weightsync.format.dtypes import DType
from weightsync.format.hashing import xxh3_digest
from weightsync.format.manifest import CODEC_SAME, KIND_FULL, ChunkRef, Manifest

CHAIN, FOLDED = "chain", "folded"


@dataclasses.dataclass(frozen=True)
class Route:
    """How a reader goes from what it holds to the target: `kind` is "chain" (each manifest in
    turn) or "folded" (the deltas as one); `reason` says why, for ledgers and logs."""

    kind: str
    manifests: tuple[Manifest, ...]
    reason: str

    def describe(self) -> str:
        return f"{self.kind}: {self.reason}"


def plan_route(manifests: list[Manifest], *, fold: bool = True) -> Route:
    """The route through `manifests` (what is applied, in order)."""
    path = tuple(manifests)
    deltas = [m for m in path if m.kind != KIND_FULL]
    if not fold:
        return Route(CHAIN, path, "folding is off")
    if len(path) < 2 or len(deltas) != len(path):
        what = "a full version first" if len(deltas) != len(path) else "one delta"
        return Route(CHAIN, path, f"{what}: nothing to fold")
    first = path[0]
    for m in path[1:]:
        if [[c.region for c in t.chunks] for t in m.tensors] != [[c.region for c in t.chunks] for t in first.tensors]:
            return Route(CHAIN, path, f"chunk boundaries differ between v{first.version} and v{m.version}")
    return Route(
        FOLDED,
        path,
        f"{len(path)} deltas v{first.parent}->v{path[-1].version} applied as one: "
        f"range by range, one hash pass per chunk instead of {len(path)}",
    )


def folded_refs(route: Route, tensor_index: int, chunk_index: int) -> tuple[ChunkRef, list[ChunkRef]]:
    """(the target's ref, the path's stored refs) of one chunk range of a folded route."""
    refs = [m.tensors[tensor_index].chunks[chunk_index] for m in route.manifests]
    return refs[-1], [r for r in refs if r.codec != CODEC_SAME]


def apply_folded(objects: list[bytes], refs: list[ChunkRef], out: np.ndarray, dtype: DType, target: ChunkRef) -> None:
    """Decodes `objects` (the stored refs of one range, oldest first, each checked against its
    content hash already) into `out` in turn, starting from the range's bytes before the first
    of them, and checks the target's raw hash.

    Each object's header is checked against its ref before decoding (codec, dtype, count, raw
    hash); the decoded bytes of an intermediate version are not hashed, since nobody holds that
    version. On a mismatch `out` holds garbage and the caller must discard the whole version.
    """
    for obj, ref in zip(objects, refs, strict=True):
        header, payload = unpack_chunk(obj)
        if codecs.CODEC_NAMES.get(header.codec_id) != ref.codec:
            raise FormatError(
                f"chunk codec {codecs.CODEC_NAMES.get(header.codec_id)} differs from the manifest's {ref.codec}"
            )
        if header.dtype != dtype or header.count * dtype.itemsize != out.nbytes:
            raise FormatError(
                f"chunk holds {header.count} {header.dtype.name} elements, its range "
                f"{out.nbytes // dtype.itemsize} {dtype.name}"
            )
        if header.raw_xxh3.hex() != ref.raw:
            raise IntegrityError("chunk header's raw hash differs from the manifest's")
        codecs.decode_into(header.codec_id, payload, out, dtype.itemsize, dtype_name=dtype.name)
    if xxh3_digest(out).hex() != target.raw:
        raise IntegrityError("folded deltas produced bytes whose hash differs from the published one")
