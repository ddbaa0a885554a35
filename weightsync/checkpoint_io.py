"""checkpoint_io: safetensors checkpoints in (files or an HF-style directory) and out.

`open_checkpoint` returns a lazy read-only mapping, so publishing a checkpoint never holds it
twice in memory: each tensor is read when the publisher's snapshot asks for it. A torch DCP
directory is recognised here (`is_dcp_checkpoint`) and read by the trainer layer
(`weightsync.trainer.checkpoint.open_dcp_checkpoint`).
`write_safetensors` writes `model.safetensors`, or HF-style shards plus an index, atomically:
files appear under their final names only when complete. It replaces the checkpoint files an
earlier write left in the directory, and refuses to touch any it did not write. Not here: stores or versions.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from weightsync.errors import ConfigError, FormatError, LayoutError, StoreError
from weightsync.format.hashing import xxh3_hex
from weightsync.format.tensors import raw_bytes

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
WRITTEN_BY = {"written_by": "weightsync"}  # in every file's metadata: what a later write may replace


class SafetensorsCheckpoint(Mapping[str, torch.Tensor]):
    """Tensor name -> tensor over one or more safetensors files, loaded on access."""

    def __init__(self, files: dict[str, Path]) -> None:
        self._files = files  # tensor name -> file holding it

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self._files[name]
        try:
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise FormatError(f"cannot read tensor {name!r} from {path}: {e}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    @property
    def files(self) -> list[Path]:
        return sorted(set(self._files.values()))


SAFETENSORS_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
}  # fmt: skip
"""safetensors' dtype names -> torch dtypes (None: one this torch build lacks); the one table."""


def safetensors_layout(files: Iterable[str | os.PathLike]) -> dict[str, tuple[torch.dtype | None, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor in safetensors files, from their headers alone."""
    layout = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                piece = f.get_slice(name)
                layout[name] = (SAFETENSORS_DTYPES.get(piece.get_dtype()), tuple(piece.get_shape()))
    return layout


def checkpoint_dtypes(checkpoint: Mapping[str, torch.Tensor]) -> dict[str, torch.dtype | None]:
    """Each tensor's dtype as stored, read from the files' headers (no tensor is loaded); None for
    a dtype this torch build does not have."""
    if isinstance(checkpoint, SafetensorsCheckpoint):
        out: dict[str, torch.dtype | None] = {}
        for file in checkpoint.files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name in checkpoint:
                        out[name] = SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())
        return out
    dtypes = getattr(checkpoint, "dtypes", None)  # a lazy mapping that knows them (a DCP checkpoint)
    if callable(dtypes):
        return dtypes()
    return {name: tensor.dtype for name, tensor in checkpoint.items()}


DCP_METADATA = ".metadata"


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    """A torch DCP directory (`.metadata` + `*.distcp`): the trainer layer reads those
    (`weightsync.trainer.checkpoint.open_dcp_checkpoint`), since the library does not depend on
    torch.distributed."""
    return (Path(path) / DCP_METADATA).is_file()


def open_checkpoint(paths: list[str | os.PathLike] | str | os.PathLike) -> SafetensorsCheckpoint:
    """Opens `.safetensors` files and/or HF-style directories as one checkpoint."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise LayoutError("no checkpoint given: pass .safetensors files, a directory, or a torch DCP directory")
    dcp = [p for p in paths if is_dcp_checkpoint(p)]
    if dcp:
        raise LayoutError(
            f"{dcp[0]} is a torch DCP checkpoint: open it with weightsync.trainer.checkpoint."
            "open_dcp_checkpoint (what `weightsync publish` does)"
        )
    files: dict[str, Path] = {}
    for path in map(Path, paths):
        for file in _checkpoint_files(path):
            for name in _tensor_names(file):
                if name in files:
                    raise LayoutError(f"tensor {name!r} is in both {files[name]} and {file}")
                files[name] = file
    return SafetensorsCheckpoint(files)


def _checkpoint_files(path: Path) -> list[Path]:
    if not path.exists():
        raise StoreError(f"checkpoint path {path} does not exist")
    if path.is_file():
        return [path]
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise FormatError(f"{index} is not a safetensors index with a weight_map: {e}") from None
        files = []
        for name in sorted(set(weight_map.values())):
            file = (path / name).resolve()
            if path.resolve() not in file.parents:
                raise FormatError(f"{index} names {name!r}, which is outside {path}")
            if not file.is_file():
                raise StoreError(f"{index} names {name}, which does not exist")
            files.append(file)
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise LayoutError(f"{path} holds no .safetensors files (nor a torch DCP checkpoint's {DCP_METADATA})")
    return files


def _tensor_names(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as e:
        raise FormatError(f"{file} is not a readable safetensors file: {e}") from None


def write_safetensors(
    state_dict: Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Writes a checkpoint into `out_dir`; returns the files written (index last, if any).

    Everything is written to a temporary directory next to `out_dir` and renamed into place, so
    an interrupted write never leaves a partial file under a final name.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _refuse_foreign_checkpoint_files(out)
    shards = plan_shards(state_dict, max_shard_bytes)
    # "format": "pt" is what HF transformers checks before it loads a safetensors file as torch;
    # WRITTEN_BY marks the files a later write may replace.
    metadata = {"format": "pt", **{k: str(v) for k, v in (metadata or {}).items()}, **WRITTEN_BY}
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-weightsync-", dir=out))
    try:
        written = []
        weight_map = {}
        for i, names in enumerate(shards):
            file = SINGLE_NAME if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: state_dict[n].contiguous() for n in names}, str(tmp / file), metadata=metadata)
            weight_map.update({n: file for n in names})
            written.append(file)
        if len(shards) > 1:
            total = sum(t.numel() * t.element_size() for t in (state_dict[n] for n in weight_map))
            index = {"metadata": {"total_size": total, **metadata}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2))
            written.append(INDEX_NAME)
        for file in written:
            os.replace(tmp / file, out / file)
        # A previous checkpoint written here (other shard count) must not linger; foreign files
        # were refused above.
        for stale in [*out.glob("model-*-of-*.safetensors"), out / INDEX_NAME, out / SINGLE_NAME]:
            if stale.name not in written and stale.exists():
                stale.unlink()
        return [out / file for file in written]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_safetensors_file(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """One safetensors file, written tensor by tensor in name order (no serialized copy of the whole
    file in memory, unlike `safetensors.torch.save_file`; device tensors are copied to host first);
    {name: xxh3 of its bytes}, hashed as written. The caller publishes the path when it is complete
    (vLLM's handoff: a fresh file per swap, named to the workers only after this returns)."""
    dtype_names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items() if dtype is not None}
    header, offset, contiguous = {}, 0, {}
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        if tensor.dtype not in dtype_names:
            raise LayoutError(f"{name} is {tensor.dtype}, which safetensors cannot hold")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": dtype_names[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        contiguous[name] = tensor
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-aligned
    hashes = {}
    with open(path, "wb") as f:
        f.write(len(header_bytes).to_bytes(8, "little"))
        f.write(header_bytes)
        for name, tensor in contiguous.items():
            data = raw_bytes(tensor) if tensor.numel() else b""
            hashes[name] = xxh3_hex(data)
            f.write(data)
    return hashes


def _checkpoint_files_in(out: Path) -> list[Path]:
    return [p for p in [out / SINGLE_NAME, *out.glob("model-*-of-*.safetensors"), out / INDEX_NAME] if p.is_file()]


def _written_by_weightsync(path: Path) -> bool:
    try:
        if path.name == INDEX_NAME:
            found = json.loads(path.read_text()).get("metadata", {})
        else:
            with safe_open(str(path), framework="pt") as f:
                found = f.metadata() or {}
    except (ValueError, OSError, SafetensorError, AttributeError):
        return False
    return all(found.get(k) == v for k, v in WRITTEN_BY.items())


def _refuse_foreign_checkpoint_files(out: Path) -> None:
    """A write replaces the checkpoint files a previous write put in `out`, never anyone else's."""
    foreign = [p.name for p in _checkpoint_files_in(out) if not _written_by_weightsync(p)]
    if foreign:
        raise ConfigError(
            f"{out} holds {', '.join(sorted(foreign))}, which weightsync did not write and would replace; "
            "write into an empty directory, or remove them"
        )


def plan_shards(state_dict: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names, in the order given, cut into shards of at most `max_shard_bytes` (a larger
    tensor is a shard of its own): HF's layout of a sharded checkpoint."""
    if max_shard_bytes < 1:
        raise ValueError("max_shard_bytes must be positive")
    shards: list[list[str]] = [[]]
    size = 0
    for name in state_dict:
        nbytes = state_dict[name].numel() * state_dict[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards
