"""versions: a model's committed versions in a store — list, read, commit, resolve chains.

This is the commit protocol's reading and writing side: a version exists iff its manifest
exists; a manifest is written with a create-only put after every chunk it names is durable.
Not here: encoding (`publisher.py`) or reconstructing weights (`reader.py`).
"""

from __future__ import annotations

from weightsync.errors import (
    FormatError,
    IntegrityError,
    ObjectExists,
    ObjectNotFound,
    VersionConflict,
    VersionNotFound,
)
from weightsync.format.hashing import xxh3_hex
from weightsync.format.layout import manifest_key, signature_key, version_from_key, versions_prefix
from weightsync.format.manifest import KIND_FULL, Manifest, parse_manifest
from weightsync.stores import Store


def list_versions(store: Store, model: str) -> list[int]:
    """Committed versions of `model`, ascending."""
    versions = (version_from_key(model, info.key) for info in store.list(versions_prefix(model)))
    return sorted(v for v in versions if v is not None)


def list_models(store: Store) -> list[str]:
    """The models a store holds: the names under models/ that have a versions/ folder (a name may
    be org/name), sorted."""
    models = set()
    for info in store.list("models/"):
        parts = info.key.split("/")
        for i in (2, 3):  # models/<name>/versions/... or models/<org>/<name>/versions/...
            if len(parts) > i + 1 and parts[i] == "versions":
                models.add("/".join(parts[1:i]))
    return sorted(models)


def latest_version(store: Store, model: str) -> int | None:
    versions = list_versions(store, model)
    return versions[-1] if versions else None


def read_manifest(store: Store, model: str, version: int) -> Manifest:
    """The validated manifest of a committed version; VersionNotFound if there is none."""
    return read_manifest_bytes(store, model, version)[0]


def read_manifest_bytes(store: Store, model: str, version: int) -> tuple[Manifest, bytes]:
    """The validated manifest of a committed version and its exact bytes (what signatures cover)."""
    key = manifest_key(model, version)
    try:
        data = store.get(key)
    except ObjectNotFound:
        raise VersionNotFound(f"{model} version {version} is not in {store.uri}") from None
    try:
        manifest = parse_manifest(data)
    except (FormatError, IntegrityError) as e:
        raise type(e)(f"{store.uri}/{key}: {e}") from None
    if manifest.model != model or manifest.version != version:
        raise FormatError(
            f"{store.uri}/{key} holds {manifest.model} version {manifest.version}, not {model} version {version}"
        )
    return manifest, data


def read_signature(store: Store, model: str, version: int, manifest_bytes: bytes) -> bytes | None:
    """The publisher's signature document for these manifest bytes, or None if unsigned."""
    try:
        return store.get(signature_key(model, version, xxh3_hex(manifest_bytes)))
    except ObjectNotFound:
        return None


def commit_manifest(store: Store, manifest: Manifest, signature: bytes | None = None) -> None:
    """Makes a version visible. Its chunks must already be durable in the store; a signature,
    if given, is made durable first, so a version that requires one is never visible without it."""
    data = manifest.to_bytes()
    if signature is not None:
        store.put(signature_key(manifest.model, manifest.version, xxh3_hex(data)), signature)
    try:
        store.put_new(manifest_key(manifest.model, manifest.version), data)
    except ObjectExists:
        raise VersionConflict(
            f"{manifest.model} version {manifest.version} was already committed to {store.uri} "
            "by another publisher; nothing was overwritten"
        ) from None


def resolve_chain(store: Store, model: str, version: int) -> list[Manifest]:
    """The manifests to apply, base first, to reconstruct `version` from nothing."""
    chain = [read_manifest(store, model, version)]
    while chain[-1].kind != KIND_FULL:
        parent = chain[-1].parent
        assert parent is not None  # parse_manifest guarantees deltas have parents
        manifest = read_manifest(store, model, parent)
        if manifest.base != chain[-1].base:
            raise FormatError(
                f"{model} version {chain[-1].version} says its base is {chain[-1].base}, "
                f"but its parent {parent} has base {manifest.base}"
            )
        chain.append(manifest)
    chain.reverse()
    return chain
