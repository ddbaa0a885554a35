"""delta_file: the one small file per swap that carries a version's changed elements to the workers.

The agent writes it on tmpfs (the engine's handoff_dir) and names it in the RPC; every worker of
the server reads it (memory-mapped safetensors, so nothing is copied over the network). Its size
is O(changed elements): per changed HF tensor, the changed flat positions and their new bit
patterns, 4 bytes per changed bf16 element (about 3 % of the model at 1.5 % changed), plus, for
tensors of layers the workers cannot patch in place (`placement.py`: quantized, repacked, ...),
the whole new tensor, which those layers reload through the engine's own loader.

Layout (safetensors; tensor i is the i-th entry of the metadata's "tensors" list):

    "{i}.low"     int16   the low 16 bits of each changed position, ascending
    "{i}.blocks"  int32   per block of 65536 elements of the tensor: how many positions fall in it
                          (a position is block * 65536 + low, so positions cost 2 bytes, not 8)
    "{i}.bits"    the tensor's dtype: the new values at those positions
    "{i}.dense"   the tensor's dtype and shape: the whole new tensor (dense entries only; no
                  low/blocks/bits then)
    metadata "weightsync_delta": JSON {"format": 1, "parent": tag, "version": tag,
                  "tensors": [[name, dtype, shape, changed, dense], ...]}

`parent` and `version` are the engine's tags of the version the workers must hold and of the one
the file makes (e.g. "v12:<digest>"): a worker that holds another version refuses the file.

This module imports torch, safetensors and the standard library only: the workers read it.
Not here: deciding what changed (the agent, `weightsync/delta_capture.py`), placing it
(`placement.py`), applying it (`delta_apply.py`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

FORMAT = 1
BLOCK_SHIFT = 16  # positions are block * 2^16 + a 16-bit low part
METADATA_KEY = "weightsync_delta"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorChanges:
    """One HF tensor's part of a swap: its changed positions and their new values, or the whole
    new tensor (`dense`)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    positions: torch.Tensor | None = None
    """int64, ascending flat positions (None for a dense entry)."""
    values: torch.Tensor | None = None
    """The new values at `positions`, in `dtype` (1-D)."""
    dense: torch.Tensor | None = None
    """The whole new tensor, for layers that reload it through the engine's own loader."""

    @property
    def changed(self) -> int:
        return int(self.positions.numel()) if self.positions is not None else self.numel

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n


def split_positions(positions: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(low 16 bits as int16, count per 2^16-element block as int32) of ascending positions."""
    blocks = max(1, (numel + (1 << BLOCK_SHIFT) - 1) >> BLOCK_SHIFT)
    counts = torch.bincount(positions >> BLOCK_SHIFT, minlength=blocks).to(torch.int32)
    low = (positions & 0xFFFF).to(torch.int32)
    low = torch.where(low >= 1 << 15, low - (1 << 16), low).to(torch.int16)  # uint16 bits in an int16
    return low, counts


def join_positions(low: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The int64 positions `split_positions` encoded."""
    blocks = torch.repeat_interleave(torch.arange(counts.numel(), dtype=torch.int64), counts.to(torch.int64))
    return (blocks << BLOCK_SHIFT) | (low.to(torch.int64) & 0xFFFF)


def write_delta_file(path: Path, entries: Iterable[TensorChanges], *, parent: str, version: str) -> int:
    """Writes the file (then fsyncs nothing: tmpfs, read at once); returns its size in bytes."""
    from safetensors.torch import save_file  # its writer needs numpy: the agent's side only

    tensors: dict[str, torch.Tensor] = {}
    listing = []
    for i, entry in enumerate(entries):
        dtype = str(entry.dtype).removeprefix("torch.")
        if entry.dense is not None:
            tensors[f"{i}.dense"] = entry.dense.detach().contiguous()
            listing.append([entry.name, dtype, list(entry.shape), entry.numel, True])
            continue
        low, counts = split_positions(entry.positions, entry.numel)
        tensors[f"{i}.low"], tensors[f"{i}.blocks"] = low, counts
        tensors[f"{i}.bits"] = entry.values.detach().reshape(-1).contiguous()
        listing.append([entry.name, dtype, list(entry.shape), int(entry.positions.numel()), False])
    metadata = {METADATA_KEY: json.dumps({"format": FORMAT, "parent": parent, "version": version, "tensors": listing})}
    save_file(tensors, str(path), metadata=metadata)
    return os.path.getsize(path)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeltaFile:
    """A read delta file: the tags and its entries, in the order written."""

    parent: str
    version: str
    entries: list[TensorChanges]


def read_delta_file(path: str | Path) -> DeltaFile:
    """Reads a file `write_delta_file` wrote; ValueError on anything else."""
    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get(METADATA_KEY)
        if raw is None:
            raise ValueError(f"{path} is not a weightsync delta file (no {METADATA_KEY} metadata)")
        doc = json.loads(raw)
        if doc.get("format") != FORMAT:
            raise ValueError(f"{path}: delta file format {doc.get('format')!r}, this worker reads {FORMAT}")
        entries = []
        for i, (name, dtype, shape, changed, dense) in enumerate(doc["tensors"]):
            torch_dtype = getattr(torch, dtype)
            if dense:
                tensor = f.get_tensor(f"{i}.dense")
                if tensor.dtype != torch_dtype or list(tensor.shape) != list(shape):
                    raise ValueError(f"{path}: {name} is {tensor.dtype} {list(tensor.shape)}, listed {dtype} {shape}")
                entries.append(TensorChanges(name=name, dtype=torch_dtype, shape=tuple(shape), dense=tensor))
                continue
            positions = join_positions(f.get_tensor(f"{i}.low"), f.get_tensor(f"{i}.blocks"))
            values = f.get_tensor(f"{i}.bits")
            if positions.numel() != changed or values.numel() != changed or values.dtype != torch_dtype:
                raise ValueError(f"{path}: {name} lists {changed} {dtype} changes, holds {values.numel()}")
            entries.append(
                TensorChanges(name=name, dtype=torch_dtype, shape=tuple(shape), positions=positions, values=values)
            )
    return DeltaFile(parent=doc["parent"], version=doc["version"], entries=entries)
