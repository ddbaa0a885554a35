"""checkpoint: DCP save / load of a sharded model and its optimizer, plus per-rank extras.

A checkpoint is a directory holding the torch.distributed.checkpoint files of {"model",
"optim"} (every rank writes its own shards; nobody gathers) and one `extra-rank{r}.pt` per rank
(small plain values: the optimizer step count; the TOML loop adds its step, RNG states, data
position and guard state). Both front ends write this one format: the TOML loop as
`step-NNNNNNNN/` under its checkpoint directory (`CheckpointManager`), the Training API as
`runs/<model_id>/weights/<name>/`.

Atomicity: everything is written into `.tmp-<name>/` beside the final directory; after every
rank's files are durable (DCP syncs its files, extras are fsynced, then a barrier) rank 0
renames it into place and fsyncs the parent. A crash at any point leaves either no directory of
that name or a complete one, and `list_checkpoints()` only ever sees complete ones. Leftover
`.tmp-*` directories are removed at the next save of that name and by `remove_incomplete()` at
start. Only the newest `keep_last` step checkpoints are kept; an old one is deleted only after
a newer one is complete.

The directory must be reachable by every rank at the same path (a shared filesystem on
several nodes), as DCP's FileSystemWriter requires.

Not here: what goes into the extras (the engine and the loop decide), publishing.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from weightsync.errors import FormatError, LayoutError
from weightsync.trainer.config import CheckpointConfig

log = logging.getLogger(__name__)

_DIR = re.compile(r"step-(\d{8})")
_TMP_PREFIX = ".tmp-"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first, as (step, path)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _DIR.fullmatch(path.name)
        if match and (path / ".metadata").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def save_checkpoint(
    directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]
) -> Path:
    """Writes model, optimizer and this rank's extras to `directory` and commits it (collective)."""
    rank = dist.get_rank()
    final = Path(directory)
    tmp = final.with_name(f"{_TMP_PREFIX}{final.name}")
    if rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt at this name
        tmp.mkdir()
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
    _write_durably(tmp / f"extra-rank{rank}.pt", extra)
    dist.barrier()  # every rank's part is durable
    if rank == 0:
        if final.exists():  # an earlier save of this name (one a run did not resume from, say)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(final.parent)
    dist.barrier()  # everyone sees the committed checkpoint before going on (a rollback reads it)
    log.info("checkpoint saved to %s", final)
    return final


def load_checkpoint(
    directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Restores the model (and the optimizer, unless None) in place from `directory` (collective).

    Returns this rank's extras, with own_rank = False where they are rank 0's (a checkpoint saved
    by fewer ranks: DCP reshards model and optimizer, and values that are the same on every rank
    serve), and {} when the optimizer is not restored.
    """
    path = Path(directory)
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        return {}
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _read_extra(path, dist.get_rank())


def _read_extra(path: Path, rank: int) -> dict[str, Any]:
    own = path / f"extra-rank{rank}.pt"
    if own.is_file():
        return {**torch.load(own, weights_only=True), "own_rank": True}
    if (path / "extra-rank0.pt").is_file():
        log.warning(
            "%s has no %s (saved by fewer ranks); using rank 0's extras, RNG states are not restored", path, own.name
        )
        return {**torch.load(path / "extra-rank0.pt", weights_only=True), "own_rank": False}
    # A Training API state saved before the extras had files of their own keeps its optimizer
    # step count inside the DCP checkpoint, under "extra".
    state: dict[str, Any] = {"extra": {"optim_steps": 0}}
    dcp.load(state, checkpoint_id=path)
    return {**state["extra"], "own_rank": False}


class CheckpointManager:
    """The TOML loop's checkpoints under `config.dir`: one `step-NNNNNNNN/` per saved step, the
    newest `keep_last` kept. Writing and reading one is `save_checkpoint` / `load_checkpoint`."""

    def __init__(self, config: CheckpointConfig, *, rank: int) -> None:
        if config.dir is None:
            raise ValueError("CheckpointManager needs train.checkpoint.dir")
        self.config = config
        self.root = Path(config.dir)
        self.rank = rank

    def path(self, step: int) -> Path:
        return self.root / checkpoint_name(step)

    def latest(self) -> tuple[int, Path] | None:
        checkpoints = list_checkpoints(self.root)
        return checkpoints[-1] if checkpoints else None

    def remove_incomplete(self) -> None:
        """Rank 0 deletes `.tmp-*` leftovers of crashed saves (no rank may be saving now)."""
        if self.rank == 0 and self.root.is_dir():
            for path in self.root.iterdir():
                if path.name.startswith(_TMP_PREFIX):
                    log.info("removing incomplete checkpoint %s", path)
                    shutil.rmtree(path, ignore_errors=True)
        dist.barrier()

    def prune(self) -> None:
        """Rank 0 deletes all but the newest keep_last (called after a save has committed; the
        next collective orders it before any rank reads the directory again)."""
        if self.rank != 0:
            return
        checkpoints = list_checkpoints(self.root)
        for step, path in checkpoints[: max(0, len(checkpoints) - self.config.keep_last)]:
            log.info("deleting checkpoint of step %d (keep_last = %d)", step, self.config.keep_last)
            # Rename first so that a crash mid-delete leaves a .tmp-* leftover, not a broken step-*.
            doomed = self.root / f"{_TMP_PREFIX}deleting-{path.name}"
            os.rename(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)


def _write_durably(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ reading a DCP directory
# `weightsync publish DIR` of a DCP checkpoint: what FSDP ranks wrote with
# torch.distributed.checkpoint.save (this format or any other trainer's), read tensor by tensor
# on one process, resharded from however many ranks wrote it. In a training state ({"model":
# ..., "optim": ...}) only the model's tensors are taken, under their own names.


class DcpCheckpoint(Mapping[str, torch.Tensor]):
    """Tensor name -> tensor of a torch DCP directory, each loaded (whole) on access."""

    def __init__(self, path: Path, entries: dict[str, tuple[str, torch.Size, torch.dtype]]) -> None:
        self.path = path
        self._entries = entries  # name -> (key in the checkpoint, global shape, dtype)

    def __getitem__(self, name: str) -> torch.Tensor:
        from torch.distributed.checkpoint.api import CheckpointException

        key, shape, dtype = self._entries[name]
        tensor = torch.empty(shape, dtype=dtype)
        try:
            with warnings.catch_warnings():  # "... assuming the intent is to load in a single process": it is
                warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
                dcp.load({key: tensor}, storage_reader=dcp.FileSystemReader(str(self.path)), no_dist=True)
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            raise FormatError(f"cannot read tensor {key!r} from the DCP checkpoint {self.path}: {e}") from None
        return tensor

    def dtypes(self) -> dict[str, torch.dtype]:
        return {name: dtype for name, (_, _, dtype) in self._entries.items()}

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


# Where FSDP trainers keep the model in a DCP training state, and what else such a state holds.
_DCP_MODEL_KEYS = ("model",)
_DCP_TRAINING_STATE_KEYS = ("optim", "optimizer", "optimizer_state", "extra", "lr_scheduler", "scheduler")


def open_dcp_checkpoint(path: str | os.PathLike) -> DcpCheckpoint:
    """A DCP directory's model tensors (see the module docstring for which ones)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from weightsync.checkpoint_io import DCP_METADATA

    path = Path(path)
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a truncated or foreign .metadata: pickle, EOF or attribute errors
        raise FormatError(f"{path / DCP_METADATA} is not a readable torch DCP metadata file: {e}") from None
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    tops = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
    model_top = next((top for top in _DCP_MODEL_KEYS if top in tops), None)
    if model_top is not None and tops & set(_DCP_TRAINING_STATE_KEYS):
        # A training state: the model's tensors, named as the model names them.
        entries = {k[len(model_top) + 1 :]: k for k in tensors if k.startswith(model_top + ".")}
    else:
        entries = {k: k for k in tensors}
    if not entries:
        raise LayoutError(f"the DCP checkpoint {path} holds no tensors")
    return DcpCheckpoint(
        path, {name: (key, tensors[key].size, tensors[key].properties.dtype) for name, key in sorted(entries.items())}
    )
