"""cache: a sync agent's local copy of what it serves and what it is about to serve.

The cache is a store of its own (`cache_path/store`, the same layout as the upstream store), so
the agent's Reader applies versions from it exactly as from any store; beside it, the state
file names the version last served (what a restarted agent serves first). Commit order keeps it
consistent without fsync: objects, then the manifests that name them, then the state file. A
lost or damaged object after a power cut is caught by its hash and fetched again.

The cache is only a copy, so every kind of damage has one remedy, `repair`: a cached manifest
that does not read, or differs from the good copy (the one offered and checked, or the store's),
is put back from that copy, or dropped when there is none; a cached object that no longer
matches its content address is deleted (fetched again by the next sync). `collect` runs the
cache gc, repairing first when damage stops it.

Not here: deciding what to fetch or serve (`plan.py`, `gather.py`), verifying versions (the Reader), the
upstream store's gc (`weightsync/stores/retention.py`).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from weightsync.errors import FormatError, IntegrityError, ObjectNotFound, WeightsyncError
from weightsync.format import layout
from weightsync.format.chunk import object_hash
from weightsync.format.manifest import ChunkRef, Manifest, parse_manifest
from weightsync.reader import Reader
from weightsync.stores import LocalStore, Store
from weightsync.stores.retention import collect_garbage
from weightsync.versions import list_versions

log = logging.getLogger(__name__)

STATE_FILE = "agent-state.json"

GoodCopy = Callable[[int], "bytes | None"]
"""The good bytes of a version's manifest (accepted in memory, or the store's, checked), or None
when there is none."""


class AgentCache:
    """One agent's cache directory: chunk objects, manifests and the state file."""

    def __init__(self, path: Path, *, model: str, name: str, workers: int | None = None) -> None:
        self.path = Path(path)
        self.model = model
        self.name = name  # the agent's, for log lines
        self.path.mkdir(parents=True, exist_ok=True)
        # No fsync: see the module docstring.
        self.store = LocalStore(self.path / "store", fsync=False)
        # Objects are kept by their own address, also those that upstream keeps in packs.
        self.reader = Reader(self.store, model=model, workers=workers, objects_by_address=True)
        self._prefix = layout.model_prefix(model)

    # ----------------------------------------------------------------- objects and manifests

    def has_object(self, address: str) -> bool:
        return self.store.exists(self._prefix + layout.chunk_key(address))

    def put_object(self, address: str, data: bytes | memoryview) -> None:
        """An object already checked against its content address."""
        self.store.put(self._prefix + layout.chunk_key(address), data)

    def missing(self, refs: Mapping[str, ChunkRef]) -> dict[str, ChunkRef]:
        """The refs (by their objects' own keys, `ChunkRef.address_key`) whose objects are not cached."""
        return {key: ref for key, ref in refs.items() if not self.store.exists(self._prefix + key)}

    def put_manifest(self, version: int, data: bytes) -> None:
        """After every object it names is cached: the cache stays a valid store."""
        self.store.put(layout.manifest_key(self.model, version), data)

    def fetch(
        self,
        upstream: Store,
        missing: Mapping[str, ChunkRef],
        pool: cf.Executor,
        on_object: Callable[[ChunkRef, bytes], None] | None = None,
    ) -> int:
        """Fetches objects from `upstream` into the cache (each checked against its ref's size
        and hash; members of one pack in few ranged reads); `on_object` sees each one as it
        arrives. Returns the bytes fetched."""
        reader = Reader(upstream, model=self.model)

        def fetch(group: list[ChunkRef]) -> int:
            done = 0
            for ref, obj in zip(group, reader.fetch_group(group), strict=True):
                self.store.put(self._prefix + ref.address_key, obj)
                if on_object is not None:
                    on_object(ref, obj)
                done += len(obj)
            return done

        return sum(pool.map(fetch, reader.plan_reads(list(missing.values()))))

    # ----------------------------------------------------------------------------- repair

    def repair(self, versions: Iterable[int], good_copy: GoodCopy, *, objects_of: Iterable[Manifest] = ()) -> int:
        """Makes the cache agree with the good copies; returns how many entries it changed.

        For each of `versions` with a cached manifest: if that manifest differs from
        `good_copy(version)` (a damaged disk copy, or one that failed verification and has no
        good copy) it is replaced by the good copy, or deleted when there is none. Every cached
        object that a manifest of `objects_of` names is re-hashed and deleted if corrupt. A
        version without a cached manifest is left alone: nothing reads it from the cache."""
        changed = 0
        for manifest in objects_of:
            for tensor in manifest.tensors:
                for ref in tensor.chunks:
                    if ref.object is None:
                        continue
                    key = self._prefix + ref.address_key
                    try:
                        ok = object_hash(self.store.get(key)) == ref.object
                    except ObjectNotFound:
                        continue
                    if not ok:
                        log.warning("%s: cached object %s is corrupt; deleting it", self.name, ref.address_key)
                        self.store.delete(key)
                        changed += 1
        for version in versions:
            key = layout.manifest_key(self.model, version)
            try:
                cached = self.store.get(key)
            except ObjectNotFound:
                continue
            good = good_copy(version)
            if cached == good:
                continue
            if good is None:
                self.store.delete(key)
                log.info("%s: cached manifest of v%d has no good copy; dropped it", self.name, version)
            else:
                self.store.put(key, good)
                log.warning("%s: cached manifest of v%d is damaged; restored it", self.name, version)
            changed += 1
        return changed

    def unreadable_manifests(self) -> list[int]:
        """Cached versions whose manifest does not parse (bit rot, a torn write)."""
        bad = []
        for version in list_versions(self.store, self.model):
            try:
                parse_manifest(self.store.get(layout.manifest_key(self.model, version)))
            except ObjectNotFound:  # gone meanwhile
                continue
            except (FormatError, IntegrityError):
                bad.append(version)
        return bad

    # --------------------------------------------------------------------------------- gc

    def collect(self, *, keep: int, protect: set[int], grace_s: float, good_copy: GoodCopy) -> None:
        """Cache gc. It will not plan over a manifest it cannot read, so such damage is repaired
        (from `good_copy`) and the gc tried once more; other failures are only logged: the cache
        may grow, the served weights are not at risk."""
        for attempt in range(2):
            try:
                collect_garbage(self.store, self.model, keep=keep, protect=protect, grace_s=grace_s)
                return
            except (FormatError, IntegrityError) as e:
                if attempt or not self.repair(self.unreadable_manifests(), good_copy):
                    log.warning("%s: cache gc failed: %s", self.name, e)
                    return
            except WeightsyncError as e:
                log.warning("%s: cache gc failed: %s", self.name, e)
                return

    # ------------------------------------------------------------------------- state file

    def write_state(self, version: int, digest: str) -> None:
        """Records the served version: what a restarted agent serves first (atomic replace)."""
        path = self.path / STATE_FILE
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump({"model": self.model, "version": version, "digest": digest}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def read_state(self) -> tuple[int, str] | None:
        """(version, digest) the state file names for this model; None if there is none usable."""
        path = self.path / STATE_FILE
        try:
            doc = json.loads(path.read_text())
            version, digest = int(doc["version"]), str(doc["digest"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("%s: unreadable %s (%s); starting empty", self.name, path, e)
            return None
        if doc.get("model") != self.model or version < 1:
            return None
        return version, digest
