"""layout: where a model's manifests and chunk objects live inside a store.

    models/<model>/versions/<version, 12 digits>.json   one manifest per committed version
    models/<model>/signatures/<version>-<manifest xxh3>.sig  the publisher's signature of a manifest
    models/<model>/chunks/<2 hex>/<32 hex>             content-addressed chunk objects
    models/<model>/packs/<2 hex>/<32 hex>              content-addressed packs of chunk objects
    models/<model>/parts/<version>/<session>/<rank>.json  a sharded publish's per-rank parts,
                                                        before the one manifest commits
    models/<model>/model-files/<2 hex>/<32 hex>        content-addressed files beside the weights an
                                                        engine loads (config.json, tokenizer...),
                                                        named by manifests' producer.files
    models/<model>/files/<name>                         the same files as publishers before
                                                        producer.files kept them: as of the latest
                                                        publish that carried them

Zero-padded versions make lexicographic order numeric order. Keys are relative to the store's
root (a directory or an S3 prefix). Not here: reading or writing them (`store.py`).
"""

from __future__ import annotations

import re

from weightsync.errors import FormatError

VERSION_DIGITS = 12
MAX_VERSION = 10**VERSION_DIGITS - 1
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9][A-Za-z0-9._-]{0,127})?")
_VERSION_FILE = re.compile(rf"(\d{{{VERSION_DIGITS}}})\.json")
_CHUNK_KEY = re.compile(r"chunks/([0-9a-f]{2})/([0-9a-f]{32})")
_PACK_KEY = re.compile(r"packs/([0-9a-f]{2})/([0-9a-f]{32})")
_MODEL_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_PACK_BYTES = 1 << 32  # 4 GiB: far above what a publisher writes (PublisherConfig.pack_bytes)


def check_model_name(model: object) -> str:
    """A model name: letters, digits, `._-`, optionally one `org/` prefix (like HF repo ids)."""
    if not isinstance(model, str) or not _MODEL_NAME.fullmatch(model):
        raise FormatError(
            f"invalid model name {model!r}: use letters, digits, '.', '_', '-' (max 128), "
            "optionally prefixed by one 'org/'"
        )
    return model


def model_prefix(model: str) -> str:
    return f"models/{check_model_name(model)}/"


def check_model_file_name(name: object) -> str:
    """A file beside the weights: a plain file name, no path (a reader writes it into a directory)."""
    if not isinstance(name, str) or not _MODEL_FILE_NAME.fullmatch(name):
        raise FormatError(f"invalid model file name {name!r}: a plain file name of [A-Za-z0-9._-], at most 128")
    return name


def model_file_key(model: str, name: str) -> str:
    """Where publishers before producer.files kept a file beside the weights (config.json,
    tokenizer.json...), one mutable copy per model; `name` is a plain file name."""
    return f"{model_prefix(model)}files/{check_model_file_name(name)}"


def model_files_prefix(model: str) -> str:
    return f"{model_prefix(model)}model-files/"


def model_file_object_key(object_xxh3: str) -> str:
    """The key of a model file's object relative to its model's prefix (docs/format.md, "Model files")."""
    return f"model-files/{object_xxh3[:2]}/{object_xxh3}"


def versions_prefix(model: str) -> str:
    return f"{model_prefix(model)}versions/"


def manifest_key(model: str, version: int) -> str:
    if not 0 < version <= MAX_VERSION:
        raise FormatError(f"version {version} outside 1..{MAX_VERSION}")
    return f"{versions_prefix(model)}{version:0{VERSION_DIGITS}d}.json"


def version_from_key(model: str, key: str) -> int | None:
    """The version a listed key names, or None for anything else (temp files, strays)."""
    prefix = versions_prefix(model)
    if not key.startswith(prefix):
        return None
    match = _VERSION_FILE.fullmatch(key[len(prefix) :])
    return int(match.group(1)) if match else None


def signature_key(model: str, version: int, manifest_xxh3: str) -> str:
    """Keyed by the manifest's own hash too, so a publisher that loses a commit race cannot
    overwrite the winner's signature with one for a manifest that never committed."""
    manifest_key(model, version)  # validates the version
    if not re.fullmatch(r"[0-9a-f]{32}", manifest_xxh3):
        raise FormatError(f"invalid manifest hash {manifest_xxh3!r}")
    return f"{signatures_prefix(model)}{version:0{VERSION_DIGITS}d}-{manifest_xxh3}.sig"


def signatures_prefix(model: str) -> str:
    return f"{model_prefix(model)}signatures/"


_SIGNATURE_FILE = re.compile(rf"(\d{{{VERSION_DIGITS}}})-[0-9a-f]{{32}}\.sig")


def version_from_signature_key(model: str, key: str) -> int | None:
    prefix = signatures_prefix(model)
    match = _SIGNATURE_FILE.fullmatch(key[len(prefix) :]) if key.startswith(prefix) else None
    return int(match.group(1)) if match else None


def parts_prefix(model: str, version: int | None = None, session: str | None = None) -> str:
    """Where a sharded publish's parts go: all of them, one version's, or one session's."""
    prefix = f"{model_prefix(model)}parts/"
    if version is not None:
        prefix += f"{version:0{VERSION_DIGITS}d}/"
        if session is not None:
            prefix += f"{check_session(session)}/"
    return prefix


def part_key(model: str, version: int, session: str, rank: int) -> str:
    return f"{parts_prefix(model, version, session)}rank-{rank:05d}.json"


def abort_key(model: str, version: int, session: str) -> str:
    return f"{parts_prefix(model, version, session)}abort.json"


_SESSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_session(session: object) -> str:
    """A sharded publish session id: what ties the ranks of one job run together."""
    if not isinstance(session, str) or not _SESSION.fullmatch(session):
        raise FormatError(f"invalid session {session!r}: 1-64 of [A-Za-z0-9._-], starting with a letter or digit")
    return session


def chunks_prefix(model: str) -> str:
    return f"{model_prefix(model)}chunks/"


def chunk_key(object_xxh3: str) -> str:
    """The key of a chunk object relative to its model's prefix (as written in manifests)."""
    return f"chunks/{object_xxh3[:2]}/{object_xxh3}"


def is_chunk_key(key: object) -> bool:
    if not isinstance(key, str):
        return False
    match = _CHUNK_KEY.fullmatch(key)
    return match is not None and match.group(2).startswith(match.group(1))


def packs_prefix(model: str) -> str:
    return f"{model_prefix(model)}packs/"


def pack_key(pack_xxh3: str) -> str:
    """The key of a pack relative to its model's prefix (as written in manifests)."""
    return f"packs/{pack_xxh3[:2]}/{pack_xxh3}"


def is_pack_key(key: object) -> bool:
    if not isinstance(key, str):
        return False
    match = _PACK_KEY.fullmatch(key)
    return match is not None and match.group(2).startswith(match.group(1))
