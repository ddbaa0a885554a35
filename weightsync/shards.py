"""shards: one version published by N trainer ranks, each encoding only its own shard.

Nobody gathers the model. Each rank encodes and uploads the chunks of its local pieces (a
`Placement`: a dim-0 FSDP shard is one flat range of the global tensor, any other piece a list of
boxes, docs/format.md "Boxes"), then writes a *part*: its chunk references with global element
ranges or boxes, and every tensor it holds, chunks or none (a replica another rank publishes),
under

    models/<model>/parts/<version>/<session>/rank-<r>.json

Rank 0 (the committer) waits until every rank's part is there, checks that they agree (same
parent, base, kind, step; same dtype and global shape for a tensor on several ranks) and that the
parts cover every tensor any rank holds exactly once (a hole or an overlap fails the version,
naming the tensor, the range or box, and the ranks), merges them into one manifest, validates it
like any reader would, and commits it with the usual create-only write. The other ranks wait for that manifest. So a version exists iff every rank's
chunks are durable, and a rank killed mid-publish means no version at all.

If the committer gives up (a part missing past the timeout, parts that disagree, a delta whose
parent never committed), it writes an abort marker next to the parts, so every rank learns the
version failed without waiting out its own timeout; every rank's next version is then a full
one, which is how the ranks re-agree on a parent. Parts are deleted after the commit; parts of
dead sessions are left for gc (`stores/retention.py`).

The session ties the ranks of one job run together: parts of another session (a crashed run
that published the same version number) are never merged. Not here: how a rank finds its pieces
and which it owns (the trainer's `pieces.py`), encoding (`publisher.py`), boxes (`format/boxes.py`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Mapping

from weightsync.errors import ObjectExists, ObjectNotFound, PublishError, VersionConflict, WeightsyncError
from weightsync.format import layout
from weightsync.format.boxes import Box, box_from_json, cover_error
from weightsync.format.manifest import ChunkRef, Manifest, TensorEntry, canonical_json
from weightsync.retry import Backoff
from weightsync.stores import Store
from weightsync.versions import read_manifest

log = logging.getLogger(__name__)

PART_FORMAT = 2  # 2: chunks may be boxes, and a rank lists the tensors it holds but does not publish
_POLL_BACKOFF = Backoff(first_s=0.02, max_s=0.5)  # how often rank 0 looks for the other ranks' parts


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardSpec:
    """This publisher's place in a sharded publish."""

    rank: int
    """This rank, 0..world_size-1; rank 0 commits the manifest."""
    world_size: int
    """Ranks that publish a part of every version."""
    session: str
    """Identical on every rank of one job run (e.g. a uuid rank 0 broadcasts at start);
    1-64 of [A-Za-z0-9._-]. Parts of other sessions are never merged."""
    commit_timeout_s: float = 600.0
    """How long rank 0 waits for the other ranks' parts (and they for its commit) before the
    version fails. A rank that is slow by more than this loses the version, not the job."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank {self.rank}, world_size {self.world_size}")
        layout.check_session(self.session)
        if self.commit_timeout_s <= 0:
            raise ValueError("commit_timeout_s must be positive")

    @property
    def is_committer(self) -> bool:
        return self.rank == 0


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a local tensor sits in its global tensor of `global_shape`, one of:

    - `start`: the flat element range [start, start + local numel) (what a dim-0 shard is);
    - `boxes`: a list of boxes of the global tensor whose elements, box after box and each in
      row-major order, are the local tensor's elements in order (`weightsync.format.boxes`): a
      tensor-parallel shard on any dim, an interleaved (strided) one, an expert slice. No boxes
      at all: the rank holds the tensor but publishes none of it (another rank owns its piece).

    What the trainer builds from a DTensor; a Megatron-style trainer builds it by hand, e.g. a
    row-parallel weight [out, in] on tensor-parallel rank r of t:
    `Placement((out, in), boxes=[Box((0, r * in // t), (out, in // t))])`.
    """

    global_shape: tuple[int, ...]
    start: int | None = None
    boxes: tuple[Box, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(s) for s in self.global_shape))
        if self.boxes is not None:
            object.__setattr__(self, "boxes", tuple(self.boxes))
        if (self.start is None) == (self.boxes is None):
            raise ValueError(f"a placement has a flat start or boxes, exactly one of them; got {self}")
        if (self.start is not None and self.start < 0) or any(s < 0 for s in self.global_shape):
            raise ValueError(f"placement start and global_shape must be non-negative, got {self}")

    def check_fits(self, name: str, local_numel: int) -> None:
        total = math.prod(self.global_shape)
        if self.boxes is None:
            if self.start + local_numel > total:
                raise ValueError(
                    f"{name!r}: local shard of {local_numel} elements at offset {self.start} does not fit "
                    f"the global shape {self.global_shape} ({total} elements)"
                )
            return
        outside = [b for b in self.boxes if not b.fits(self.global_shape)]
        if outside:
            raise ValueError(f"{name!r}: {outside[0]} does not lie inside the global shape {list(self.global_shape)}")
        held = sum(b.numel for b in self.boxes)
        if held != local_numel:
            raise ValueError(f"{name!r}: the boxes hold {held} elements, the local tensor {local_numel}")


def placements_for(
    planned: Mapping[str, tuple[object, tuple[int, ...]]], given: Mapping[str, Placement]
) -> dict[str, Placement]:
    """Every tensor's placement (`planned`: name -> (dtype, local shape)): the given one
    (checked to fit), else the whole tensor."""
    out = {}
    for name, (_, shape) in planned.items():
        placement = given.get(name)
        if placement is None:
            placement = Placement(global_shape=shape, start=0)
        placement.check_fits(name, math.prod(shape))
        out[name] = placement
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartHeader:
    """What every rank's part of one version must agree on."""

    version: int
    parent: int | None
    base: int
    kind: str
    step: int | None


# ---------------------------------------------------------------------------------- writing


def write_part(
    store: Store, model: str, spec: ShardSpec, header: PartHeader, tensors: list[TensorEntry], stats: dict[str, int]
) -> None:
    """Records this rank's chunk references; its chunks must already be durable."""
    doc = {
        "format": PART_FORMAT,
        "model": model,
        "session": spec.session,
        "rank": spec.rank,
        "world_size": spec.world_size,
        **dataclasses.asdict(header),
        "tensors": [t.to_json() for t in tensors],
        "stats": stats,
    }
    store.put(layout.part_key(model, header.version, spec.session, spec.rank), canonical_json(doc))


def write_abort(store: Store, model: str, version: int, session: str, reason: str) -> None:
    """Marks `version` failed for every rank of the session; the first reason written stays."""
    doc = {"version": version, "session": session, "reason": reason[:4000]}
    try:
        store.put_new(layout.abort_key(model, version, session), canonical_json(doc))
    except ObjectExists:
        pass
    except WeightsyncError as e:  # the other ranks then learn it from their timeout
        log.warning("%s v%d: could not write the abort marker: %s", model, version, e)


def delete_parts(store: Store, model: str, version: int, session: str) -> None:
    """Best-effort cleanup after a commit; gc removes whatever this misses."""
    try:
        for info in list(store.list(layout.parts_prefix(model, version, session))):
            store.delete(info.key)
    except WeightsyncError as e:
        log.debug("%s v%d: parts left for gc: %s", model, version, e)


# ---------------------------------------------------------------------------------- waiting


class _Timeout(PublishError):
    """_poll ran out of time (the caller words the error)."""


def _poll(deadline: float, check):
    """Calls `check()` with backoff until it returns non-None; _Timeout at the deadline."""
    looks = 0
    while True:
        result = check()
        if result is not None:
            return result
        if time.monotonic() >= deadline:
            raise _Timeout("timed out")
        looks += 1
        time.sleep(min(_POLL_BACKOFF.pause_s(looks), max(0.0, deadline - time.monotonic())))


def _abort_reason(store: Store, model: str, version: int, session: str) -> str | None:
    try:
        data = store.get(layout.abort_key(model, version, session))
    except ObjectNotFound:
        return None
    try:
        return str(json.loads(data)["reason"])
    except (ValueError, KeyError, TypeError):
        return "aborted (unreadable abort marker)"


def wait_for_parts(store: Store, model: str, spec: ShardSpec, version: int) -> list[dict]:
    """Rank 0: every rank's part of `version` (this session), ordered by rank."""
    wanted = {layout.part_key(model, version, spec.session, r): r for r in range(spec.world_size)}
    abort = layout.abort_key(model, version, spec.session)
    present: set[str] = set()

    def check():
        present.clear()
        present.update(info.key for info in store.list(layout.parts_prefix(model, version, spec.session)))
        if abort in present:
            raise PublishError(f"{model} v{version}: {_abort_reason(store, model, version, spec.session)}")
        return True if wanted.keys() <= present else None

    try:
        _poll(time.monotonic() + spec.commit_timeout_s, check)
    except _Timeout:
        missing = sorted(r for key, r in wanted.items() if key not in present)
        raise PublishError(
            f"{model} v{version}: no part from ranks {missing} within {spec.commit_timeout_s:.0f} s"
        ) from None
    parts = []
    for key in sorted(wanted, key=wanted.get):
        try:
            parts.append(json.loads(store.get(key)))
        except (ValueError, ObjectNotFound) as e:
            raise PublishError(f"{model} v{version}: unreadable part {key}: {e}") from None
    return parts


def wait_for_commit(store: Store, model: str, spec: ShardSpec, version: int) -> Manifest:
    """Ranks > 0: the manifest rank 0 committed for `version`, or PublishError if any rank aborted it."""

    def check():
        # The manifest first: a rank that fails after the commit may still write an abort marker.
        try:
            return read_manifest(store, model, version)
        except WeightsyncError:  # not committed yet
            pass
        reason = _abort_reason(store, model, version, spec.session)
        if reason is not None:
            raise PublishError(f"{model} v{version} was aborted: {reason}")
        return None

    # Rank 0 starts its commit_timeout_s wait only once its own part is written, which may be
    # up to a timeout later than ours; then it merges and commits.
    try:
        manifest = _poll(time.monotonic() + 2 * spec.commit_timeout_s + 10, check)
    except _Timeout:
        raise PublishError(f"{model} v{version}: rank 0 neither committed nor aborted it in time") from None
    if manifest.producer.get("session") != spec.session:
        raise VersionConflict(
            f"{model} v{version} was committed by another job (session "
            f"{manifest.producer.get('session')!r}, ours {spec.session!r})"
        )
    return manifest


# ---------------------------------------------------------------------------------- merging


def merge_parts(model: str, spec: ShardSpec, parts: list[dict]) -> tuple[PartHeader, list[TensorEntry], dict]:
    """One manifest's header, tensors and stats from every rank's part; PublishError if they
    disagree, or if the union is not exactly the model: a tensor some rank holds whose elements
    are not each covered by exactly one chunk (a hole, or an overlap), named with the box or range
    and the ranks. The model's tensor set is what the ranks hold: each lists every tensor it holds,
    with the chunks of the piece it owns (none for a replica another rank publishes)."""
    headers = set()
    for part in parts:
        if part.get("format") != PART_FORMAT or part.get("session") != spec.session or part.get("model") != model:
            raise PublishError(
                f"{model}: part of rank {part.get('rank')} is not a format-{PART_FORMAT} part of this session"
            )
        headers.add(PartHeader(**{f.name: part.get(f.name) for f in dataclasses.fields(PartHeader)}))
    if len(headers) != 1:
        raise PublishError(
            f"{model}: ranks disagree on the version's parent/base/kind/step: {sorted(map(str, headers))}"
        )
    header = headers.pop()
    merged: dict[str, dict] = {}
    stats = {"changed_elements": 0, "total_elements": 0}
    for part in parts:
        for key in stats:
            stats[key] += int(part["stats"].get(key, 0))
        for t in part["tensors"]:
            entry = merged.setdefault(
                t["name"], {"dtype": t["dtype"], "shape": tuple(t["shape"]), "rank": part["rank"], "chunks": []}
            )
            if (entry["dtype"], entry["shape"]) != (t["dtype"], tuple(t["shape"])):
                raise PublishError(
                    f"{model} v{header.version}: ranks disagree on tensor {t['name']!r}: {entry['dtype']} "
                    f"{list(entry['shape'])} (rank {entry['rank']}) vs {t['dtype']} {list(t['shape'])} "
                    f"(rank {part['rank']})"
                )
            entry["chunks"].extend((_chunk_of_part(c), part["rank"]) for c in t["chunks"])
    tensors = []
    for name, e in sorted(merged.items()):
        chunks = sorted(e["chunks"], key=lambda item: item[0].box.offsets if item[0].box else item[0].start)
        error = _cover_error(e["shape"], chunks)
        if error is not None:
            raise PublishError(f"{model} v{header.version}: tensor {name!r}: {error}")
        tensors.append(TensorEntry(name=name, dtype=e["dtype"], shape=e["shape"], chunks=tuple(c for c, _ in chunks)))
    return header, tensors, stats


def _chunk_of_part(doc: dict) -> ChunkRef:
    """A chunk as a part (written by this build: trusted) holds it."""
    return ChunkRef(**{**doc, "box": box_from_json(doc["box"])}) if "box" in doc else ChunkRef(**doc)


def _cover_error(shape: tuple[int, ...], chunks: list[tuple[ChunkRef, int]]) -> str | None:
    """Why the merged chunks (in order, each with its rank) do not cover the tensor exactly once."""
    forms = {c.box is None for c, _ in chunks}
    if len(forms) > 1:
        flat = sorted({r for c, r in chunks if c.box is None})
        boxed = sorted({r for c, r in chunks if c.box is not None})
        return f"ranks {flat} publish flat ranges and ranks {boxed} boxes of it: give every piece in one form"
    if forms == {False}:
        return cover_error(shape, [c.box for c, _ in chunks], [f"rank {r}" for _, r in chunks])
    numel, at = math.prod(shape), 0
    for i, (c, rank) in enumerate(chunks):
        if c.start > at:
            return f"elements [{at}:{c.start}] are covered by no rank (a hole)"
        if c.start < at:
            return (
                f"elements [{c.start}:{min(at, c.stop)}] of rank {rank} are also rank {chunks[i - 1][1]}'s (an overlap)"
            )
        at = c.stop
    return f"elements [{at}:{numel}] are covered by no rank (a hole)" if at < numel else None
