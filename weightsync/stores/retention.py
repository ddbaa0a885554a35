"""retention: which versions and chunk objects a model keeps, and deleting the rest safely.

Kept: the newest `keep` versions, any version a caller protects (an agent still needs it),
and every version on their delta chains back to the base. Kept objects: everything a kept
manifest names (chunk objects; packs: a pack is kept whole while any kept version names one
of its members; an agent's cache, which keeps packed objects unpacked, keeps them under their own
addresses; the model files of its producer.files), and the signatures of kept versions. An object no kept manifest names is
deleted only if it is older than the grace period: a publisher writes (or touches) its chunks
before committing the manifest that names them, and the grace period is what keeps those
chunks alive until that commit. Signatures of deleted versions go with them; sharded-publish
parts (normally removed at commit) go once older than the grace period: a part that old belongs
to a version that committed or failed long ago.

The sweep runs in the order that makes a concurrent commit safe: objects are listed first,
manifests second, so a manifest committed during the sweep is seen and protects its chunks.
Not here: deciding when to run (the CLI's `gc`, a cron, an agent).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from weightsync.errors import FormatError, IntegrityError, VersionNotFound
from weightsync.format import layout
from weightsync.model_files import model_files_index
from weightsync.stores import LocalStore, Store
from weightsync.versions import list_versions, read_manifest

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 3600.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class GcPlan:
    model: str
    keep_versions: tuple[int, ...]  # kept, including chain ancestors of the newest `keep`
    delete_versions: tuple[int, ...]
    delete_objects: tuple[str, ...]  # store keys
    delete_bytes: int  # bytes of the objects to delete
    young_unreferenced: int  # objects no manifest names, spared by the grace period

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "keep_versions": list(self.keep_versions),
            "delete_versions": list(self.delete_versions),
            "delete_objects": len(self.delete_objects),
            "delete_bytes": self.delete_bytes,
            "young_unreferenced_objects": self.young_unreferenced,
        }


def plan_gc(
    store: Store,
    model: str,
    *,
    keep: int,
    protect: frozenset[int] | set[int] = frozenset(),
    grace_s: float = DEFAULT_GRACE_S,
    now_unix_s: float | None = None,
) -> GcPlan:
    """What a gc would delete; deletes nothing.

    Raises FormatError/IntegrityError if a manifest cannot be read: without it we cannot know
    which objects it needs, so nothing may be deleted until it is repaired or removed.
    """
    if keep < 1:
        raise ValueError("keep must be at least 1: gc never deletes the newest version")
    now = time.time() if now_unix_s is None else now_unix_s
    prefix = layout.model_prefix(model)
    # Before manifests: see module doc.
    objects = [info for content in _content_prefixes(model) for info in store.list(content)]
    signatures = list(store.list(layout.signatures_prefix(model)))
    parts = list(store.list(layout.parts_prefix(model)))
    versions = list_versions(store, model)
    manifests = {}
    for version in versions:
        try:
            manifests[version] = read_manifest(store, model, version)
        except VersionNotFound:  # deleted by a concurrent gc
            continue
        except (FormatError, IntegrityError) as e:
            raise type(e)(f"gc stopped, nothing deleted: {e}; run `weightsync verify` and repair") from None

    keep_set = set(versions[-keep:]) | {v for v in protect if v in manifests}
    for version in list(keep_set):
        manifest = manifests[version]
        while manifest.kind != "full":
            keep_set.add(manifest.parent)
            if manifest.parent not in manifests:
                raise IntegrityError(f"{model} v{manifest.version} needs v{manifest.parent}, which is missing")
            manifest = manifests[manifest.parent]
    referenced = {prefix + key for v in keep_set for key in manifests[v].objects()}
    # The same objects under their own addresses: where a cache (agents) keeps packed ones.
    referenced |= {prefix + c.address_key for v in keep_set for t in manifests[v].tensors for c in t.chunks if c.packed}
    for version in keep_set:  # the model's files the kept versions name (docs/format.md, "Model files")
        try:
            index = model_files_index(manifests[version]) or {}
        except FormatError as e:
            raise FormatError(f"gc stopped, nothing deleted: {e}") from None
        referenced |= {prefix + ref.key for ref in index.values()}
    delete_objects, delete_bytes, young = [], 0, 0
    for info in objects:
        if info.key in referenced:
            continue
        if now - info.modified_unix_s < grace_s:
            young += 1
            continue
        delete_objects.append(info.key)
        delete_bytes += info.size
    deleted_versions = {v for v in versions if v not in keep_set and v in manifests}
    for info in signatures:  # a signature of a kept version stays; a stray one ages out like a chunk
        version = layout.version_from_signature_key(model, info.key)
        if version in deleted_versions or (version not in keep_set and now - info.modified_unix_s >= grace_s):
            delete_objects.append(info.key)
            delete_bytes += info.size
    for info in parts:
        if now - info.modified_unix_s >= grace_s:
            delete_objects.append(info.key)
            delete_bytes += info.size
    return GcPlan(
        model=model,
        keep_versions=tuple(sorted(keep_set)),
        delete_versions=tuple(sorted(deleted_versions)),
        delete_objects=tuple(delete_objects),
        delete_bytes=delete_bytes,
        young_unreferenced=young,
    )


def apply_gc(store: Store, plan: GcPlan, *, grace_s: float = DEFAULT_GRACE_S) -> None:
    """Deletes what `plan` names: manifests first (oldest first), then objects.

    Manifests go first so that a crash midway leaves orphaned objects (collected next time),
    never a manifest whose objects are gone. Objects are re-listed just before deletion: one
    that a publisher touched since the plan was made (to reuse it in a version it is about to
    commit) is young again and spared.
    """
    for version in plan.delete_versions:
        store.delete(layout.manifest_key(plan.model, version))
    content = _content_prefixes(plan.model)
    # Listed again only when the plan deletes content: an agent plans after every sync, and its
    # cache's objects are mostly younger than the grace period, so most plans delete none.
    deletes_content = any(key.startswith(content) for key in plan.delete_objects)
    listed = (info for prefix in content for info in store.list(prefix)) if deletes_content else ()
    modified = {info.key: info.modified_unix_s for info in listed}
    now = time.time()
    for key in plan.delete_objects:
        if not key.startswith(content):
            store.delete(key)  # signatures of deleted versions, stale parts: nothing can reuse them
        elif key in modified and now - modified[key] >= grace_s:
            store.delete(key)
    if isinstance(store, LocalStore):
        now = time.time()
        for info in store.temp_files():
            if now - info.modified_unix_s >= grace_s:
                store.delete_temp(info.key)
    abort_stale_uploads = getattr(store, "abort_stale_uploads", None)
    if abort_stale_uploads is not None:  # S3: multipart uploads a killed writer left open
        abort_stale_uploads(older_than_s=grace_s)
    log.info(
        "gc %s: deleted %d versions, %d objects (%.1f MB); kept %s",
        plan.model,
        len(plan.delete_versions),
        len(plan.delete_objects),
        plan.delete_bytes / 1e6,
        list(plan.keep_versions),
    )


def _content_prefixes(model: str) -> tuple[str, ...]:
    """Where the content-addressed objects that manifests name live: chunks, packs, model files.
    (The older per-model files/<name> copies are not among them: gc never deletes those.)"""
    return (layout.chunks_prefix(model), layout.packs_prefix(model), layout.model_files_prefix(model))


def collect_garbage(
    store: Store,
    model: str,
    *,
    keep: int,
    protect: frozenset[int] | set[int] = frozenset(),
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
) -> GcPlan:
    """Plans and (unless dry_run) applies a gc; returns the plan."""
    plan = plan_gc(store, model, keep=keep, protect=protect, grace_s=grace_s)
    if not dry_run:
        apply_gc(store, plan, grace_s=grace_s)
    return plan
