"""model_files: the files beside the weights that an engine needs to load a model (config.json,
generation_config.json, the tokenizer's files), kept in the store with the versions.

A publisher that has them (the trainer, `weightsync publish` of an HF-style directory) stores each
as an immutable content-addressed object and names them in every manifest's `producer.files`
(`put_model_file_objects`, `files_index_doc`), so that a version carries its own files: `weightsync
pull --out DIR` writes a directory vLLM or transformers loads as it is, and an agent given only a
store reads the architecture from it (docs/format.md, "Model files"). Versions without
`producer.files` (older publishers, or `WriteFormat(model_files=False)`) have one mutable copy
per model under `files/<name>` (`put_model_file_copies`), which `get_model_files` falls back to.
`write_model_files` never replaces a file that differs from the one it would write.

Not here: the weights (`checkpoint_io.py`), where keys live (format/layout.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from weightsync.errors import ConfigError, FormatError, IntegrityError, ObjectNotFound
from weightsync.format.hashing import is_hash_hex, xxh3_hex
from weightsync.format.layout import check_model_file_name, model_file_key, model_file_object_key, model_prefix
from weightsync.format.manifest import Manifest
from weightsync.stores.base import Store

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "preprocessor_config.json",
)
"""The files of an HF-style directory that travel with the weights."""
MAX_MODEL_FILE_BYTES = 64 * 1024 * 1024  # a large tokenizer.json is ~30 MB
MAX_MODEL_FILES = 32
"""Entries of one manifest's producer.files (docs/format.md, "Limits")."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelFileRef:
    """One entry of a manifest's producer.files: a file's content address and length."""

    name: str
    object: str
    """xxh3-128 hex of the file's bytes: its object's key is `model-files/<object[:2]>/<object>`."""
    size: int

    @property
    def key(self) -> str:
        """The object's key relative to the model's prefix."""
        return model_file_object_key(self.object)


def read_model_files(directory: str | os.PathLike) -> dict[str, bytes]:
    """The MODEL_FILES present in a local model directory."""
    found = {}
    for name in MODEL_FILES:
        path = Path(directory) / name
        if path.is_file():
            if path.stat().st_size > MAX_MODEL_FILE_BYTES:
                raise ConfigError(f"{path} is over {MAX_MODEL_FILE_BYTES >> 20} MiB; is it really a {name}?")
            found[name] = path.read_bytes()
    return found


def files_index_doc(files: Mapping[str, bytes]) -> dict[str, dict[str, Any]]:
    """The producer.files document naming `files` ({name: bytes}); FormatError past the limits."""
    if len(files) > MAX_MODEL_FILES:
        raise FormatError(f"{len(files)} model files; a version names at most {MAX_MODEL_FILES}")
    doc = {}
    for name, data in sorted(files.items()):
        check_model_file_name(name)
        if len(data) > MAX_MODEL_FILE_BYTES:
            raise FormatError(f"model file {name} is {len(data)} bytes, over the {MAX_MODEL_FILE_BYTES}-byte limit")
        doc[name] = {"object": xxh3_hex(data), "size": len(data)}
    return doc


def put_model_file_objects(store: Store, model: str, files: Mapping[str, bytes]) -> dict[str, dict[str, Any]]:
    """Writes each file as its content-addressed object (durable before any manifest names it);
    returns the producer.files document that names them."""
    doc = files_index_doc(files)
    prefix = model_prefix(model)
    for name, entry in doc.items():
        key = prefix + model_file_object_key(entry["object"])
        # Content-addressed: one that exists holds these bytes. Touched, so gc's grace period
        # protects it until a manifest names it.
        try:
            store.touch(key)
        except ObjectNotFound:
            store.put(key, files[name])
    return doc


def put_model_file_copies(store: Store, model: str, files: Mapping[str, bytes]) -> None:
    """One mutable copy per model under files/<name>: where publishers before producer.files kept
    them, and what their `pull` reads (`WriteFormat(model_files=False)`)."""
    for name, data in files.items():
        store.put(model_file_key(model, name), data)


def model_files_index(manifest: Manifest) -> dict[str, ModelFileRef] | None:
    """The version's producer.files, checked; None when its publisher wrote none. FormatError
    for an index that breaks docs/format.md's rules (the weights stay readable)."""
    doc = manifest.producer.get("files")
    if doc is None:
        return None
    where = f"{manifest.model} v{manifest.version} producer.files"
    if not isinstance(doc, dict) or len(doc) > MAX_MODEL_FILES:
        raise FormatError(f"{where} must be an object of at most {MAX_MODEL_FILES} entries")
    index = {}
    for name, entry in doc.items():
        try:
            check_model_file_name(name)
        except FormatError as e:
            raise FormatError(f"{where}: {e}") from None
        if not isinstance(entry, dict) or set(entry) != {"object", "size"}:
            raise FormatError(f'{where}: {name} must be {{"object": <32 hex>, "size": <bytes>}}, got {entry!r}')
        size = entry["size"]
        if not is_hash_hex(entry["object"]):
            raise FormatError(f"{where}: {name} object must be 32 lowercase hex characters")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_MODEL_FILE_BYTES:
            raise FormatError(f"{where}: {name} size must be an integer in [0, {MAX_MODEL_FILE_BYTES}], got {size!r}")
        index[name] = ModelFileRef(name=name, object=entry["object"], size=size)
    return index


def get_model_files(store: Store, model: str, manifest: Manifest) -> dict[str, bytes]:
    """The files of `manifest`'s version: those its producer.files names, each checked against
    its length and hash; for a version without one, the model's copies under files/<name>."""
    index = model_files_index(manifest)
    if index is None:
        return _get_model_file_copies(store, model)
    prefix = model_prefix(model)
    found = {}
    for name, ref in sorted(index.items()):
        try:
            data = store.get(prefix + ref.key)
        except ObjectNotFound:
            raise IntegrityError(
                f"{model} v{manifest.version}: its {name} ({ref.key}) is missing from {store.uri}"
            ) from None
        if len(data) != ref.size:
            raise IntegrityError(
                f"{model} v{manifest.version}: its {name} ({ref.key}) is {len(data)} bytes, {ref.size} expected"
            )
        if xxh3_hex(data) != ref.object:
            raise IntegrityError(f"{model} v{manifest.version}: its {name} ({ref.key}) does not match its hash")
        found[name] = data
    return found


def _get_model_file_copies(store: Store, model: str) -> dict[str, bytes]:
    found = {}
    for name in MODEL_FILES:
        try:
            found[name] = store.get(model_file_key(model, name))
        except ObjectNotFound:
            continue
    return found


def refuse_clashes(out_dir: str | os.PathLike, files: Mapping[str, bytes]) -> None:
    """ConfigError if `out_dir` holds one of these files with other bytes (the user may have put it
    there): call it before writing anything."""
    out = Path(out_dir)
    clashes = [name for name, data in files.items() if (out / name).exists() and (out / name).read_bytes() != data]
    if clashes:
        raise ConfigError(
            f"{out} already holds {', '.join(clashes)} with other contents; pull into an empty "
            "directory, or remove them"
        )


def write_model_files(out_dir: str | os.PathLike, files: Mapping[str, bytes]) -> list[Path]:
    """Writes the files into `out_dir`, never replacing one whose bytes differ (`refuse_clashes`)."""
    out = Path(out_dir)
    refuse_clashes(out, files)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in sorted(files.items()):
        tmp = out / f".tmp-{name}"
        tmp.write_bytes(data)
        os.replace(tmp, out / name)
        written.append(out / name)
    return written
