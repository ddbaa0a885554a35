"""manifest: the one document per version that names every tensor, chunk and hash.

A version exists iff its manifest exists in the store. The manifest is canonical JSON (sorted
keys, no whitespace, ASCII, integers only) so that the same version always has the same bytes,
which signatures and golden tests rely on. `parse_manifest` is strict: it refuses anything that
docs/format.md does not allow, with a message that says what is wrong, before any of it is
used. Not here: how chunks are encoded (`chunk.py`) or where manifests are stored (`layout.py`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from typing import Any

from weightsync.errors import FormatError, IntegrityError, UnsupportedFormatError
from weightsync.format.boxes import Box, box_from_json, cover_error
from weightsync.format.chunk import HEADER_SIZE, MAX_CHUNK_BYTES, max_object_bytes
from weightsync.format.codecs import CODEC_IDS
from weightsync.format.dtypes import DType, dtype_by_name
from weightsync.format.hashing import is_hash_hex, xxh3_hex
from weightsync.format.layout import MAX_PACK_BYTES, MAX_VERSION, check_model_name, chunk_key, is_chunk_key, is_pack_key

# Manifest format versions this build reads. 1: first release. 2: chunk objects may live in
# packs (a chunk names its pack's key and its byte `offset` there). 3: a chunk may name a `box`
# of its tensor instead of a flat range (a tensor- or expert-parallel shard, `boxes.py`).
# Publishers write the lowest format a version needs, so versions without packs stay readable by
# format-1 readers, and versions without boxes by format-2 readers.
FORMAT_VERSION = 1
FORMAT_PACKS = 2
FORMAT_BOXES = 3
SUPPORTED_FORMATS = (1, 2, 3)

CODEC_SAME = "same"  # an unchanged chunk: no object, bytes equal to the parent's
KIND_FULL = "full"
KIND_DELTA = "delta"
WEIGHTS_KINDS = ("model", "adapter")
"""What a version holds (`producer.weights_kind`, absent: "model"): a whole model's weights, or
LoRA adapter tensors only."""

# Hard limits (docs/format.md, "Limits").
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_TENSORS = 1_000_000
MAX_CHUNKS = 10_000_000
MAX_NDIM = 64
MAX_TENSOR_BYTES = 1 << 46  # 64 TiB
MAX_NAME_LEN = 1024
MAX_FREEFORM_BYTES = 64 * 1024  # producer and stats objects
MAX_FREEFORM_DEPTH = 32  # nesting inside producer/stats; deeper would let re-encoding overflow the stack

_TOP_KEYS = {
    "format",
    "model",
    "version",
    "parent",
    "base",
    "kind",
    "step",
    "created_unix_ms",
    "tensors",
    "digest",
    "producer",
    "stats",
}
_TENSOR_KEYS = {"name", "dtype", "shape", "chunks"}
_CHUNK_KEYS = {"start", "stop", "codec", "raw", "object", "key", "size"}
_PACKED_CHUNK_KEYS = _CHUNK_KEYS | {"offset"}
_SAME_CHUNK_KEYS = {"start", "stop", "codec", "raw"}
_FLAT_KEYS = {"start", "stop"}
_BOX_KEYS = {"box"}  # a box chunk (format 3) has these instead of _FLAT_KEYS


@dataclasses.dataclass(frozen=True)
class ChunkPlacement:
    """Where a chunk object goes, sent beside it before its manifest exists (ObjectFrame fields
    5-8), so that an agent can apply it as it arrives. A hint only: the signed manifest decides
    (agents/early_apply.py)."""

    tensor: str
    start: int  # flat element range [start, stop) of the tensor
    stop: int
    parent: int  # the version the chunk was encoded against; 0 for a full chunk


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkRef:
    """One chunk of a tensor as the manifest names it: a flat element range [start, stop), or
    (format 3) a `box` of the tensor, whose elements the chunk holds in the box's row-major order."""

    codec: str  # "full", "xor", "sparse", "ctx" or "same" (no object)
    raw: str  # xxh3-128 hex of the chunk's raw bytes in this version
    object: str | None = None  # xxh3-128 hex of the object bytes (its content address)
    key: str | None = None  # key relative to the model prefix: the object's own, or its pack's
    size: int = 0  # object bytes
    offset: int | None = None  # where the object starts in its pack (None: not packed)
    start: int | None = None  # first element (flat index into the tensor); None for a box chunk
    stop: int | None = None  # one past the last element; None for a box chunk
    box: Box | None = None  # where a box chunk's elements sit (format 3); None for a flat range

    def __post_init__(self) -> None:
        if (self.box is None) == (self.start is None or self.stop is None):
            raise ValueError(f"a chunk is a flat range (start, stop) or a box, not both or neither: {self}")

    @property
    def packed(self) -> bool:
        return self.offset is not None

    @property
    def count(self) -> int:
        """Elements in the chunk."""
        return self.box.numel if self.box is not None else self.stop - self.start

    @property
    def region(self) -> tuple[int, int] | Box:
        """Where the chunk sits in its tensor: (start, stop), or its box. Two versions' chunks
        with equal regions hold the same elements."""
        return self.box if self.box is not None else (self.start, self.stop)

    def describe(self) -> str:
        """The region for messages: "[start:stop]" or the box."""
        return str(self.box) if self.box is not None else f"[{self.start}:{self.stop}]"

    @property
    def address_key(self) -> str | None:
        """The object's own content-addressed key (`chunks/..`), packed or not: where caches
        that keep objects unpacked (agents) hold it."""
        return None if self.object is None else chunk_key(self.object)

    def to_json(self) -> dict[str, Any]:
        region = {"box": self.box.to_json()} if self.box is not None else {"start": self.start, "stop": self.stop}
        doc: dict[str, Any] = {**region, "codec": self.codec, "raw": self.raw}
        if self.codec != CODEC_SAME:
            doc.update(object=self.object, key=self.key, size=self.size)
            if self.offset is not None:
                doc["offset"] = self.offset
        return doc


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkRef, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_by_name(self.dtype).itemsize

    @property
    def layout(self) -> tuple[str, str, tuple[int, ...]]:
        """What must match between a delta and its parent: name, dtype, shape."""
        return (self.name, self.dtype, self.shape)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "chunks": [c.to_json() for c in self.chunks],
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest:
    model: str
    version: int
    parent: int | None  # the version this one was diffed against (None: the first version)
    base: int  # the full version this one's delta chain starts from (itself when full)
    kind: str  # "full" or "delta"
    step: int | None  # the trainer step that produced the weights
    created_unix_ms: int
    tensors: tuple[TensorEntry, ...]  # sorted by name
    digest: str  # version digest, see compute_digest
    producer: dict[str, Any] = dataclasses.field(default_factory=dict)
    stats: dict[str, int] = dataclasses.field(default_factory=dict)
    format: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "model": self.model,
            "version": self.version,
            "parent": self.parent,
            "base": self.base,
            "kind": self.kind,
            "step": self.step,
            "created_unix_ms": self.created_unix_ms,
            "tensors": [t.to_json() for t in self.tensors],
            "digest": self.digest,
            "producer": self.producer,
            "stats": self.stats,
        }

    def to_bytes(self) -> bytes:
        return canonical_json(self.to_json())

    @property
    def layout(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        return tuple(t.layout for t in self.tensors)

    @property
    def raw_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def stored_bytes(self) -> int:
        """Bytes of the chunk objects this version names (a delta's own size on the wire)."""
        return sum(c.size for t in self.tensors for c in t.chunks)

    def objects(self) -> set[str]:
        """Keys (relative to the model prefix) of every store object this version needs: chunk
        objects and packs."""
        return {c.key for t in self.tensors for c in t.chunks if c.key is not None}

    @property
    def has_packs(self) -> bool:
        return any(c.packed for t in self.tensors for c in t.chunks)

    @property
    def has_boxes(self) -> bool:
        return any(c.box is not None for t in self.tensors for c in t.chunks)


def lowest_format(tensors: tuple[TensorEntry, ...] | list[TensorEntry]) -> int:
    """The lowest manifest format that can hold these tensors' chunks: what a publisher writes,
    so that readers of older formats keep reading every version that needs nothing newer."""
    chunks = [c for t in tensors for c in t.chunks]
    if any(c.box is not None for c in chunks):
        return FORMAT_BOXES
    return FORMAT_PACKS if any(c.packed for c in chunks) else FORMAT_VERSION


def canonical_json(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def compute_digest(tensors: tuple[TensorEntry, ...] | list[TensorEntry]) -> str:
    """The version digest: xxh3-128 over names, dtypes, shapes and chunk raw hashes, in order.

    It depends only on the weights (and their chunking), not on how they were encoded, so two
    versions with identical weights have the same digest whatever their parents were. A box chunk
    (format 3) enters as [offsets, sizes, raw] where a flat one is [start, stop, raw].
    """
    doc = [[t.name, t.dtype, list(t.shape), [[*_where(c), c.raw] for c in t.chunks]] for t in tensors]
    return xxh3_hex(canonical_json(doc))


def _where(c: ChunkRef) -> list:
    return c.box.to_json() if c.box is not None else [c.start, c.stop]


# ------------------------------------------------------------------------------------ parse


def parse_manifest(data: bytes) -> Manifest:
    """Parses and fully validates manifest bytes. Raises FormatError / IntegrityError."""
    if not isinstance(data, (bytes, bytearray)):
        raise FormatError(f"manifest must be bytes, got {type(data).__name__}")
    if len(data) > MAX_MANIFEST_BYTES:
        raise FormatError(f"manifest of {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
    try:
        doc = json.loads(
            data,
            object_pairs_hook=_no_duplicate_keys,
            parse_float=_refuse_float,
            parse_constant=_refuse_float,
        )
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"manifest is not valid JSON: {e}") from None
    manifest = manifest_from_json(doc)
    if manifest.to_bytes() != bytes(data):
        raise FormatError("manifest is not in canonical form (sorted keys, no whitespace, ASCII)")
    return manifest


def manifest_from_json(doc: Any) -> Manifest:
    if not isinstance(doc, dict):
        raise FormatError("manifest must be a JSON object")
    fmt = doc.get("format")
    if fmt not in SUPPORTED_FORMATS or isinstance(fmt, bool):
        raise UnsupportedFormatError(
            f"manifest format {fmt!r} is not supported by this build; supported: {list(SUPPORTED_FORMATS)}"
        )
    _exact_keys(doc, _TOP_KEYS, "manifest")
    model = check_model_name(doc["model"])
    version = _int(doc["version"], "version", 1, MAX_VERSION)
    kind = doc["kind"]
    if kind not in (KIND_FULL, KIND_DELTA):
        raise FormatError(f"kind must be 'full' or 'delta', got {kind!r}")
    parent = None if doc["parent"] is None else _int(doc["parent"], "parent", 1, version - 1)
    base = _int(doc["base"], "base", 1, version)
    if kind == KIND_FULL and base != version:
        raise FormatError(f"a full version is its own base: base {base} != version {version}")
    if kind == KIND_DELTA and (parent is None or not base <= parent < version):
        raise FormatError(f"a delta needs base <= parent < version, got base {base}, parent {parent}")
    step = None if doc["step"] is None else _int(doc["step"], "step", 0, 2**63 - 1)
    created = _int(doc["created_unix_ms"], "created_unix_ms", 0, 2**63 - 1)
    if not is_hash_hex(doc["digest"]):
        raise FormatError("digest must be 32 lowercase hex characters")
    producer = _freeform(doc["producer"], "producer")
    stats = _freeform(doc["stats"], "stats")
    if not all(isinstance(v, int) for v in stats.values()):
        raise FormatError("stats values must be integers")

    tensors_doc = doc["tensors"]
    if not isinstance(tensors_doc, list) or len(tensors_doc) > MAX_TENSORS:
        raise FormatError(f"tensors must be a list of at most {MAX_TENSORS}")
    tensors = []
    total_chunks = 0
    for t in tensors_doc:
        entry = _tensor_from_json(t, kind, fmt)
        total_chunks += len(entry.chunks)
        if total_chunks > MAX_CHUNKS:
            raise FormatError(f"manifest names more than {MAX_CHUNKS} chunks")
        tensors.append(entry)
    names = [t.name for t in tensors]
    if names != sorted(names) or len(set(names)) != len(names):
        raise FormatError("tensor names must be unique and sorted")
    manifest = Manifest(
        model=model,
        version=version,
        parent=parent,
        base=base,
        kind=kind,
        step=step,
        created_unix_ms=created,
        tensors=tuple(tensors),
        digest=doc["digest"],
        producer=producer,
        stats=stats,
        format=fmt,
    )
    if compute_digest(manifest.tensors) != manifest.digest:
        raise IntegrityError(f"manifest of version {version} does not match its own digest")
    _check_pack_index(manifest)
    return manifest


def _check_pack_index(manifest: Manifest) -> None:
    """The chunks a manifest places in one pack are its index: their byte ranges must not
    overlap (each object is read alone, with a ranged read, and checked by its own hash)."""
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    for t in manifest.tensors:
        for c in t.chunks:
            if c.offset is not None:
                ranges.setdefault(c.key, []).append((c.offset, c.offset + c.size, c.object))
    for key, spans in ranges.items():
        spans.sort()
        for (start, stop, obj), (next_start, _, next_obj) in itertools.pairwise(spans):
            if next_start < stop and not (next_start == start and next_obj == obj):
                raise FormatError(
                    f"pack {key}: objects at bytes {start}..{stop} and {next_start}.. overlap (a bad pack index)"
                )


def _tensor_from_json(t: Any, kind: str, fmt: int = FORMAT_VERSION) -> TensorEntry:
    if not isinstance(t, dict):
        raise FormatError("each tensor must be a JSON object")
    _exact_keys(t, _TENSOR_KEYS, "tensor")
    name = check_tensor_name(t["name"])
    try:
        dtype = dtype_by_name(t["dtype"])
    except UnsupportedFormatError as e:
        raise UnsupportedFormatError(f"tensor {name!r}: {e}") from None
    shape_doc = t["shape"]
    if not isinstance(shape_doc, list) or len(shape_doc) > MAX_NDIM:
        raise FormatError(f"tensor {name!r}: shape must be a list of at most {MAX_NDIM} sizes")
    shape = tuple(_int(s, f"tensor {name!r} shape", 0, MAX_TENSOR_BYTES) for s in shape_doc)
    numel = 1
    for s in shape:  # checked as we go so a hostile shape cannot build a huge integer
        numel *= s
        if numel * dtype.itemsize > MAX_TENSOR_BYTES:
            raise FormatError(f"tensor {name!r}: shape {shape_doc} exceeds {MAX_TENSOR_BYTES} bytes")
    chunks_doc = t["chunks"]
    if not isinstance(chunks_doc, list):
        raise FormatError(f"tensor {name!r}: chunks must be a list")
    chunks = [_chunk_from_json(c, name, dtype, kind, fmt, shape) for c in chunks_doc]
    if any(ref.box is not None for ref in chunks):
        _check_box_cover(name, shape, chunks)
    else:
        _check_flat_cover(name, numel, chunks)
    return TensorEntry(name=name, dtype=dtype.name, shape=shape, chunks=tuple(chunks))


def _check_flat_cover(name: str, numel: int, chunks: list[ChunkRef]) -> None:
    expected_start = 0
    for ref in chunks:
        if ref.start != expected_start:
            raise FormatError(
                f"tensor {name!r}: chunk starts at {ref.start}, expected {expected_start} "
                "(ranges must be contiguous, in order, without overlap)"
            )
        if ref.stop > numel:
            raise FormatError(f"tensor {name!r}: chunk [{ref.start}, {ref.stop}) beyond its {numel} elements")
        expected_start = ref.stop
    if expected_start != numel:
        raise FormatError(f"tensor {name!r}: chunks cover {expected_start} of its {numel} elements")


def _check_box_cover(name: str, shape: tuple[int, ...], chunks: list[ChunkRef]) -> None:
    """Box chunks: all of the tensor's chunks are boxes, in order of their offsets, covering it
    exactly once (`boxes.cover_error`)."""
    if any(ref.box is None for ref in chunks):
        raise FormatError(f"tensor {name!r}: chunks must be all flat ranges or all boxes, not both")
    offsets = [ref.box.offsets for ref in chunks]
    if any(a >= b for a, b in itertools.pairwise(offsets)):
        raise FormatError(f"tensor {name!r}: box chunks must be in strictly increasing order of their offsets")
    error = cover_error(shape, [ref.box for ref in chunks])
    if error is not None:
        raise FormatError(f"tensor {name!r}: {error}")


def _chunk_from_json(
    c: Any, name: str, dtype: DType, kind: str, fmt: int = FORMAT_VERSION, shape: tuple[int, ...] = ()
) -> ChunkRef:
    where = f"tensor {name!r} chunk"
    if not isinstance(c, dict):
        raise FormatError(f"{where} must be a JSON object")
    codec = c.get("codec")
    if not isinstance(codec, str):
        raise FormatError(f"{where}: codec must be a string, got {codec!r}")
    packed = "offset" in c and codec != CODEC_SAME
    if packed and fmt < FORMAT_PACKS:
        raise FormatError(f"{where}: packed chunks ('offset') need manifest format {FORMAT_PACKS}, this one is {fmt}")
    boxed = "box" in c
    if boxed and fmt < FORMAT_BOXES:
        raise FormatError(f"{where}: box chunks ('box') need manifest format {FORMAT_BOXES}, this one is {fmt}")
    region_keys = _BOX_KEYS if boxed else _FLAT_KEYS
    if codec == CODEC_SAME:
        _exact_keys(c, _SAME_CHUNK_KEYS - _FLAT_KEYS | region_keys, where)
        if kind == KIND_FULL:
            raise FormatError(f"{where}: a full version cannot have unchanged ('same') chunks")
    elif codec in CODEC_IDS:
        _exact_keys(c, (_PACKED_CHUNK_KEYS if packed else _CHUNK_KEYS) - _FLAT_KEYS | region_keys, where)
        if kind == KIND_FULL and codec != "full":
            raise FormatError(f"{where}: a full version can only hold 'full' chunks, got {codec!r}")
    else:
        raise UnsupportedFormatError(f"{where}: unknown codec {codec!r}; supported: {sorted([*CODEC_IDS, CODEC_SAME])}")
    if boxed:
        region = {"box": _box(c["box"], where, shape, dtype)}
        raw_bytes = region["box"].numel * dtype.itemsize
    else:
        start = _int(c["start"], f"{where} start", 0, MAX_TENSOR_BYTES)
        stop = _int(c["stop"], f"{where} stop", start + 1, MAX_TENSOR_BYTES)
        region = {"start": start, "stop": stop}
        raw_bytes = (stop - start) * dtype.itemsize
        if raw_bytes > MAX_CHUNK_BYTES:
            raise FormatError(f"{where} [{start}, {stop}) is {raw_bytes} bytes, over the {MAX_CHUNK_BYTES} limit")
    if not is_hash_hex(c["raw"]):
        raise FormatError(f"{where}: raw hash must be 32 lowercase hex characters")
    if codec == CODEC_SAME:
        return ChunkRef(codec=codec, raw=c["raw"], **region)
    if not is_hash_hex(c["object"]):
        raise FormatError(f"{where}: object hash must be 32 lowercase hex characters")
    size = _int(c["size"], f"{where} size", HEADER_SIZE + 1, max_object_bytes(raw_bytes))
    if not packed:
        if not is_chunk_key(c["key"]) or c["key"] != chunk_key(c["object"]):
            raise FormatError(f"{where}: key {c['key']!r} is not the content address of its object")
        return ChunkRef(codec=codec, raw=c["raw"], object=c["object"], key=c["key"], size=size, **region)
    if not is_pack_key(c["key"]):
        raise FormatError(f"{where}: key {c['key']!r} of a packed chunk is not a pack's content address")
    offset = _int(c["offset"], f"{where} offset", 0, MAX_PACK_BYTES - size)
    return ChunkRef(codec=codec, raw=c["raw"], object=c["object"], key=c["key"], size=size, offset=offset, **region)


def _box(doc: Any, where: str, shape: tuple[int, ...], dtype: DType) -> Box:
    """A chunk's box: one offset and one size per dim of its tensor, non-empty, inside it, and at
    most MAX_CHUNK_BYTES of raw bytes (the sizes multiplied with a check at each step)."""
    try:
        box = box_from_json(doc)
    except ValueError as e:
        raise FormatError(f"{where}: {e}") from None
    if len(box.sizes) != len(shape) or not box.fits(shape):
        raise FormatError(f"{where}: {box} does not lie inside the tensor's shape {list(shape)}")
    count = 1
    for size in box.sizes:
        count *= size
        if count * dtype.itemsize > MAX_CHUNK_BYTES:
            raise FormatError(f"{where}: {box} is over the {MAX_CHUNK_BYTES}-byte chunk limit")
    if count == 0:
        raise FormatError(f"{where}: {box} is empty")
    return box


def check_tensor_name(name: Any) -> str:
    """Tensor names end up as safetensors keys and in file-based adapters: no paths tricks."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LEN:
        raise FormatError(f"tensor name must be a non-empty string of at most {MAX_NAME_LEN} characters")
    if name.startswith(("/", "\\")) or "\\" in name or any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        raise FormatError(f"tensor name {name!r} is absolute or has control characters or backslashes")
    if any(part in ("..", ".") for part in name.split("/")):
        raise FormatError(f"tensor name {name!r} has a '.' or '..' path segment")
    return name


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise FormatError(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _exact_keys(doc: dict, allowed: set[str], what: str) -> None:
    keys = set(doc)
    if keys != allowed:
        missing, extra = sorted(allowed - keys), sorted(keys - allowed)
        raise FormatError(f"{what}: missing fields {missing}, unknown fields {extra}")


def _freeform(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict) or _depth(value) > MAX_FREEFORM_DEPTH:
        raise FormatError(f"{what} must be a JSON object nested at most {MAX_FREEFORM_DEPTH} levels deep")
    if len(canonical_json(value)) > MAX_FREEFORM_BYTES:
        raise FormatError(f"{what} must be a JSON object of at most {MAX_FREEFORM_BYTES} bytes")
    return value


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value, measured without recursion (json.loads accepts ~1000 levels)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_FREEFORM_DEPTH:
                break
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        raise FormatError("manifest has duplicate keys")
    return doc


def _refuse_float(text: str) -> Any:
    raise FormatError(f"manifest numbers must be integers, got {text}")
