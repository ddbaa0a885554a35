"""model_files: the files beside the weights that an engine needs to load a model (config.json,
generation_config.json, the tokenizer's files), kept in the store per model.

`weightsync publish` of an HF-style directory stores them (`put_model_files`) so that
`weightsync pull --out DIR` can write a directory vLLM or transformers loads as it is; `--template
DIR` takes them from a local model directory instead. They are the model's, not a version's: a
pull gets them as of the latest publish that carried them (their layout: format/layout.py).
`write_model_files` never replaces a file that differs from the one it would write.

Not here: the weights (`checkpoint_io.py`).
"""

from __future__ import annotations

import os
from pathlib import Path

from weightsync.errors import ConfigError, ObjectNotFound
from weightsync.format.layout import model_file_key
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
MAX_MODEL_FILE_BYTES = 64 * 1024 * 1024  # a large tokenizer.json is ~30 MB


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


def put_model_files(store: Store, model: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        store.put(model_file_key(model, name), data)


def get_model_files(store: Store, model: str) -> dict[str, bytes]:
    found = {}
    for name in MODEL_FILES:
        try:
            found[name] = store.get(model_file_key(model, name))
        except ObjectNotFound:
            continue
    return found


def refuse_clashes(out_dir: str | os.PathLike, files: dict[str, bytes]) -> None:
    """ConfigError if `out_dir` holds one of these files with other bytes (the user may have put it
    there): call it before writing anything."""
    out = Path(out_dir)
    clashes = [name for name, data in files.items() if (out / name).exists() and (out / name).read_bytes() != data]
    if clashes:
        raise ConfigError(
            f"{out} already holds {', '.join(clashes)} with other contents; pull into an empty "
            "directory, or remove them"
        )


def write_model_files(out_dir: str | os.PathLike, files: dict[str, bytes]) -> list[Path]:
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
