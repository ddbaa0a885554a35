"""reader: reconstructs a committed version from its base and deltas, verifying every byte.

`Reader.read(version)` applies the version's chain (base first) into one set of buffers, so
memory is one model plus the objects in flight, however long the chain.
`Reader.advance(state, version)` moves an existing state forward by applying only the deltas
after it (what an agent or a resumed publisher does); `advance_route` may fold several deltas
into one apply pass (`format/codecs/fold.py`) and says which route it took. Every object's hash is checked before
decoding and every chunk's raw hash after applying; at the target version every byte is
covered by a checked raw hash, and the manifest's digest covers the raw hashes.

Objects are fetched on an I/O pool of `store.io_concurrency` threads, ahead of the CPU pool
(`workers`) that decodes and applies them, with at most 2 x io_concurrency reads fetched or
in flight at once. Members of a pack (`pack.py`) that lie close together are fetched in one
ranged read, so a packed delta costs a few requests however many chunks it has. An object whose
size or hash is off is fetched again on its own (corruption in flight is transient; a corrupt
stored object is not) before the read fails with IntegrityError.

A failure mid-apply leaves the buffers half-updated: the state is marked invalid (its
manifest becomes None) and the caller reads again from a base. Not here: writing (`publisher.py`).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
from collections.abc import Callable, Collection

import numpy as np

from weightsync.cpus import usable_cpus
from weightsync.delta_capture import DeltaCapture
from weightsync.errors import IntegrityError, LayoutError, ObjectNotFound, ObjectTooShort, VersionNotFound
from weightsync.format import layout
from weightsync.format.chunk import apply_chunk, object_hash
from weightsync.format.codecs import CODEC_IDS
from weightsync.format.codecs.fold import CHAIN, FOLDED, Route, apply_folded, folded_refs, plan_route
from weightsync.format.dtypes import dtype_by_name
from weightsync.format.hashing import xxh3_hex
from weightsync.format.manifest import CODEC_SAME, KIND_FULL, ChunkRef, Manifest, TensorEntry
from weightsync.format.pack import group_span, plan_reads
from weightsync.format.regions import read_region, writable_region
from weightsync.format.tensors import describe_layout_change, to_tensor
from weightsync.retry import Backoff, GaveUp, retry_call
from weightsync.stores import Store
from weightsync.versions import latest_version, resolve_chain

log = logging.getLogger(__name__)

FETCH_ATTEMPTS = 3
"""Fetches of a chunk object whose size or hash does not match its manifest before giving up."""
_REFETCH = Backoff(first_s=0.0, max_s=0.0)  # corruption in flight: fetch again at once


class _Mismatch(IntegrityError):
    """A fetched object whose size or hash is not its manifest's (fetched again)."""


Progress = Callable[[int], None]  # called with raw bytes done


@dataclasses.dataclass
class WeightsState:
    """The weights of one version as raw bytes: one flat uint8 buffer per tensor."""

    manifest: Manifest | None  # None once a failed apply has left the buffers inconsistent
    buffers: dict[str, np.ndarray]

    def state_dict(self) -> dict:
        """torch tensors over the buffers (no copy; they change if the state advances)."""
        if self.manifest is None:
            raise IntegrityError("weights state is invalid after a failed apply; read the version again")
        return {t.name: to_tensor(self.buffers[t.name], dtype_by_name(t.dtype), t.shape) for t in self.manifest.tensors}


class Reader:
    """Reads versions of one model from one store."""

    def __init__(
        self, store: Store, *, model: str, workers: int | None = None, objects_by_address: bool = False
    ) -> None:
        self.store = store
        # A cache (an agent's) holds every object under its own content address, packed upstream
        # or not; a publisher's store holds packed objects in their packs.
        self.objects_by_address = objects_by_address
        self.model = layout.check_model_name(model)
        self.workers = workers or usable_cpus()
        self.io_workers = max(1, int(getattr(store, "io_concurrency", 4)))  # fetches wait on the store, not the CPU
        self._prefix = layout.model_prefix(model)

    def latest(self) -> int | None:
        return latest_version(self.store, self.model)

    def read(self, version: int | None = None, *, progress: Progress | None = None) -> WeightsState:
        """The weights of `version` (default: latest), rebuilt from its base and verified."""
        version = self.resolve(version)
        chain = resolve_chain(self.store, self.model, version)
        state = WeightsState(manifest=None, buffers={})
        self._apply_chain(state, chain, progress)
        return state

    def advance(
        self, state: WeightsState, version: int | None = None, *, progress: Progress | None = None
    ) -> WeightsState:
        """Moves `state` to `version` in place, by deltas when its chain passes through it."""
        self.advance_route(state, version, progress=progress, fold=False)
        return state

    def advance_route(
        self,
        state: WeightsState,
        version: int | None = None,
        *,
        progress: Progress | None = None,
        fold: bool = True,
        done: Collection[tuple[str, int, int]] = (),
        capture: DeltaCapture | None = None,
    ) -> Route | None:
        """`advance`, folding the deltas into one when that is cheaper (`fold.plan_route`);
        returns the route taken and why (None: `state` already held `version`). `done`: chunk
        ranges (tensor, start, stop) of `version` that `state` holds already, checked against its
        manifest by the caller (an agent's early apply); used when `version` is one delta on.
        `capture` records every element the route changes (`delta_capture.py`)."""
        version = self.resolve(version)
        current = state.manifest
        if current is not None and current.version == version:
            return None
        chain = resolve_chain(self.store, self.model, version)
        if current is not None:
            versions = [m.version for m in chain]
            if current.version in versions and chain[versions.index(current.version)].digest == current.digest:
                route = plan_route(chain[versions.index(current.version) + 1 :], fold=fold)
                early = done if len(route.manifests) == 1 else ()
                if capture is not None and early:
                    capture.refuse("chunks were applied before the reader ran (early apply)")
                if route.kind == FOLDED:
                    self._apply_folded(state, route, progress, capture)
                else:
                    self._apply_chain(state, list(route.manifests), progress, done=early, capture=capture)
                return route
        route = Route(CHAIN, tuple(chain), f"from the base v{chain[0].version}: the state is not on its chain")
        if capture is not None:
            capture.refuse(route.reason)
        self._apply_chain(state, chain, progress)
        return route

    def verify(self, version: int, *, progress: Progress | None = None) -> Manifest:
        """Reads `version` fully, checking every hash; returns its manifest."""
        return self.read(version, progress=progress).manifest

    def resolve(self, version: int | None = None) -> int:
        """`version`, or the latest one when None; VersionNotFound if the model has none."""
        if version is not None:
            return version
        latest = self.latest()
        if latest is None:
            raise VersionNotFound(f"{self.model} has no versions in {self.store.uri}")
        return latest

    # ------------------------------------------------------------------------------ private

    def _apply_chain(
        self,
        state: WeightsState,
        chain: list[Manifest],
        progress: Progress | None,
        *,
        done: Collection[tuple[str, int, int]] = (),
        capture: DeltaCapture | None = None,
    ) -> None:
        cpu = cf.ThreadPoolExecutor(self.workers, thread_name_prefix="ws-apply")
        io = cf.ThreadPoolExecutor(self.io_workers, thread_name_prefix="ws-fetch")
        try:
            for i, manifest in enumerate(chain):
                final = i == len(chain) - 1
                state_manifest, state.manifest = state.manifest, None  # invalid until this one is applied
                if capture is not None:
                    capture.next_version(manifest)
                    if manifest.kind == KIND_FULL:
                        capture.refuse(f"v{manifest.version} is a full version")
                try:
                    self._apply_version(
                        state,
                        state_manifest,
                        manifest,
                        cpu,
                        io,
                        verify_same=final,
                        progress=progress if final else None,
                        done=done if final else (),
                        capture=capture,
                    )
                except BaseException:
                    state.buffers.clear()
                    raise
                state.manifest = manifest
                log.debug("%s: applied v%d (%s)", self.model, manifest.version, manifest.kind)
        finally:
            io.shutdown(wait=True, cancel_futures=True)
            cpu.shutdown(wait=True, cancel_futures=True)

    def _apply_folded(
        self, state: WeightsState, route: Route, progress: Progress | None, capture: DeltaCapture | None = None
    ) -> None:
        """Applies a folded route: per chunk range, the path's objects decoded one after another
        and the target's hash checked once (`fold.apply_folded`), unchanged ranges hashed; the
        state is invalid until done."""
        first, target = route.manifests[0], route.manifests[-1]
        current = state.manifest
        if current is None or current.version != first.parent:
            raise IntegrityError(
                f"{self.model}: folded deltas start on v{first.parent}, "
                f"but the state holds {current.version if current else 'nothing'}"
            )
        check_delta_layout(self.model, current, target)
        state.manifest = None
        if capture is not None:
            capture.next_version(target)
        cpu = cf.ThreadPoolExecutor(self.workers, thread_name_prefix="ws-fold")
        try:
            futures = []
            for ti, tensor in enumerate(target.tensors):
                buffer = state.buffers[tensor.name]
                for ci in range(len(tensor.chunks)):
                    ref, stored = folded_refs(route, ti, ci)
                    if stored:
                        futures.append(cpu.submit(self._fold_range, buffer, tensor, ref, stored, capture))
                    else:
                        futures.append(cpu.submit(self._check_same, buffer, tensor, ref))
            for future in cf.as_completed(futures):
                done = future.result()
                if progress is not None:
                    progress(done)
        except BaseException:
            for future in futures:
                future.cancel()
            state.buffers.clear()
            raise
        finally:
            cpu.shutdown(wait=True, cancel_futures=True)
        state.manifest = target
        log.debug("%s: applied %s", self.model, route.describe())

    def _fold_range(
        self,
        buffer: np.ndarray,
        tensor: TensorEntry,
        target: ChunkRef,
        stored: list[ChunkRef],
        capture: DeltaCapture | None = None,
    ) -> int:
        objects = [self.fetch_object(ref) for ref in stored]
        with writable_region(buffer, tensor, target) as out:
            old = capture.before(tensor, target, out) if capture is not None else None
            apply_folded(objects, stored, out, dtype_by_name(tensor.dtype), target)
            if capture is not None:
                capture.after(tensor, target, out, old)
        return out.nbytes

    def _apply_version(
        self,
        state: WeightsState,
        current: Manifest | None,
        manifest: Manifest,
        cpu: cf.Executor,
        io: cf.Executor,
        *,
        verify_same: bool,
        progress: Progress | None,
        done: Collection[tuple[str, int, int]] = (),
        capture: DeltaCapture | None = None,
    ) -> None:
        if manifest.kind == KIND_FULL:
            # Reuse buffers of the right size (an agent re-basing keeps its memory).
            old = state.buffers
            state.buffers = {}
            for t in manifest.tensors:
                buf = old.pop(t.name, None)
                state.buffers[t.name] = buf if buf is not None and buf.nbytes == t.nbytes else _allocate(t, manifest)
            old.clear()
        else:
            if current is None or current.version != manifest.parent:
                raise IntegrityError(
                    f"{self.model} v{manifest.version} is a delta on v{manifest.parent}, "
                    f"but the state holds {current.version if current else 'nothing'}"
                )
            check_delta_layout(self.model, current, manifest)
        self._fetch_and_apply(
            state.buffers,
            manifest,
            cpu,
            io,
            verify_same=verify_same,
            progress=progress,
            done=done if manifest.kind != KIND_FULL else (),
            capture=capture if manifest.kind != KIND_FULL else None,
        )

    def _fetch_and_apply(
        self,
        buffers: dict[str, np.ndarray],
        manifest: Manifest,
        cpu: cf.Executor,
        io: cf.Executor,
        *,
        verify_same: bool,
        progress: Progress | None,
        done: Collection[tuple[str, int, int]] = (),
        capture: DeltaCapture | None = None,
    ) -> None:
        """Fetches the version's objects on `io`, applies them on `cpu` as they arrive, and (with
        verify_same) hashes its unchanged ranges; returns when all are done, raises the first error.
        Ranges in `done` are in the buffers already (see advance_route)."""
        tensor_of = {id(c): t for t in manifest.tensors for c in t.chunks}
        groups = iter(
            self.plan_reads(
                [
                    c
                    for t in manifest.tensors
                    for c in t.chunks
                    if c.codec != CODEC_SAME and (t.name, c.start, c.stop) not in done
                ]
            )
        )
        window = 2 * self.io_workers  # reads fetching, fetched or being applied: the memory bound
        # Each running future maps to its stage: ("fetch", group), ("apply",) or ("check",).
        running: dict[cf.Future, tuple] = {
            cpu.submit(self._check_same, buffers[t.name], t, c): ("check",)
            for t in manifest.tensors
            for c in t.chunks
            if c.codec == CODEC_SAME and verify_same
        }
        held = 0
        try:
            while True:
                while held < window and (group := next(groups, None)) is not None:
                    running[io.submit(self.fetch_group, group)] = ("fetch", group)
                    held += 1
                if not running:
                    return
                done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
                for future in done:
                    stage = running.pop(future)
                    if stage[0] == "fetch":
                        group = stage[1]
                        apply = cpu.submit(self._apply_objects, buffers, tensor_of, group, future.result(), capture)
                        running[apply] = ("apply",)
                        continue
                    done_bytes = future.result()
                    held -= stage[0] == "apply"
                    if progress is not None:
                        progress(done_bytes)
        except BaseException:
            for future in running:
                future.cancel()
            raise

    def _check_same(self, buffer: np.ndarray, tensor: TensorEntry, ref: ChunkRef) -> int:
        """An unchanged range (no object) still holds the bytes the manifest says."""
        out = read_region(buffer, tensor, ref)
        if xxh3_hex(out) != ref.raw:
            raise IntegrityError(f"{tensor.name}{ref.describe()} differs from the published bytes")
        return out.nbytes

    def _apply_objects(
        self,
        buffers: dict[str, np.ndarray],
        tensor_of: dict[int, TensorEntry],
        group: list[ChunkRef],
        objects: list[bytes],
        capture: DeltaCapture | None = None,
    ) -> int:
        done = 0
        for ref, obj in zip(group, objects, strict=True):
            tensor = tensor_of[id(ref)]
            done += self._apply_object(buffers[tensor.name], tensor, ref, obj, capture)
        return done

    def _apply_object(
        self, buffer: np.ndarray, tensor: TensorEntry, ref: ChunkRef, obj: bytes, capture: DeltaCapture | None = None
    ) -> int:
        with writable_region(buffer, tensor, ref) as out:
            old = capture.before(tensor, ref, out) if capture is not None else None
            apply_chunk(obj, out, dtype_by_name(tensor.dtype), ref.raw, CODEC_IDS[ref.codec])
            if capture is not None:
                capture.after(tensor, ref, out, old)
        return out.nbytes

    def plan_reads(self, refs: list[ChunkRef]) -> list[list[ChunkRef]]:
        """`refs` grouped into store reads (see `fetch_group`)."""
        if self.objects_by_address:
            return [[ref] for ref in refs]
        return plan_reads(refs)

    def fetch_group(self, group: list[ChunkRef]) -> list[bytes]:
        """The objects of one read of `plan_reads`, each checked against its ref's size and hash:
        members of a pack in one ranged read; one that does not match is fetched again alone."""
        if len(group) == 1 or self.objects_by_address:
            return [self.fetch_object(ref) for ref in group]
        start, length = group_span(group)
        data = memoryview(self._read(group[0], start, length))
        objects = []
        for ref in group:
            obj = bytes(data[ref.offset - start : ref.offset - start + ref.size])
            objects.append(obj if object_hash(obj) == ref.object else self.fetch_object(ref))
        return objects

    def fetch_object(self, ref: ChunkRef) -> bytes:
        """A chunk object from the store (its own key, or a ranged read of its pack), checked
        against the manifest's size and hash.

        A mismatch is fetched again (a byte flipped in flight is transient) up to FETCH_ATTEMPTS
        times in all, then IntegrityError; a missing object or pack, or a pack shorter than the
        manifest's index says, is an IntegrityError at once.
        """
        where = self._where(ref)

        def fetch() -> bytes:
            if ref.offset is None or self.objects_by_address:
                obj = self._read(ref, None, None)
            else:
                obj = self._read(ref, ref.offset, ref.size)
            if len(obj) != ref.size or object_hash(obj) != ref.object:
                raise _Mismatch(f"{where} does not match its manifest ({len(obj)} of {ref.size} bytes)")
            return obj

        try:
            return retry_call(
                f"fetch {where}", fetch, attempts=FETCH_ATTEMPTS, backoff=_REFETCH, retry_on=(_Mismatch,), log=log
            )
        except GaveUp:
            raise IntegrityError(f"{where} is corrupt (size or hash mismatch in {FETCH_ATTEMPTS} fetches)") from None

    def _where(self, ref: ChunkRef) -> str:
        if ref.offset is None or self.objects_by_address:
            return f"chunk object {self._prefix + ref.address_key} in {self.store.uri}"
        return (
            f"chunk object {ref.object} at bytes {ref.offset}..{ref.offset + ref.size} of pack "
            f"{self._prefix + ref.key} in {self.store.uri}"
        )

    def _read(self, ref: ChunkRef, start: int | None, length: int | None) -> bytes:
        """The whole object (start None) or a byte range of `ref`'s pack, errors made clear."""
        if start is None:
            key = self._prefix + (ref.address_key if self.objects_by_address else ref.key)
            try:
                return self.store.get(key)
            except ObjectNotFound:
                raise IntegrityError(
                    f"chunk object {key} named by a manifest is missing from {self.store.uri}"
                ) from None
        key = self._prefix + ref.key
        try:
            return self.store.get_range(key, start, length)
        except ObjectNotFound:
            raise IntegrityError(f"pack {key} named by a manifest is missing from {self.store.uri}") from None
        except ObjectTooShort:
            raise IntegrityError(
                f"pack {key} in {self.store.uri} is shorter than the manifest's index says "
                f"(bytes {start}..{start + length}): truncated, or a bad index"
            ) from None


def check_delta_layout(model: str, parent: Manifest, delta: Manifest) -> None:
    """LayoutError when a delta's tensors (names, dtypes, shapes) are not its parent's: the layout
    changes only at a rebase (a full version)."""
    if parent.layout != delta.layout:
        change = describe_layout_change(
            _by_name(parent.layout), _by_name(delta.layout), expected_is=f"v{parent.version}"
        )
        raise LayoutError(f"{model} v{delta.version} changes tensor layout without a rebase: {change}")


def _by_name(layout: tuple[tuple[str, str, tuple[int, ...]], ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (dtype, shape) for name, dtype, shape in layout}


def _allocate(tensor: TensorEntry, manifest: Manifest) -> np.ndarray:
    try:
        return np.empty(tensor.nbytes, np.uint8)
    except MemoryError:
        raise LayoutError(
            f"{manifest.model} v{manifest.version}: cannot allocate {tensor.nbytes} bytes for {tensor.name!r} "
            f"(the version holds {manifest.raw_bytes} bytes)"
        ) from None
