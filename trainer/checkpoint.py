"""checkpoint: DCP save / resume of the sharded model and optimizer, plus per-rank extras.

A checkpoint is a directory `step-NNNNNNNN/` holding the torch.distributed.checkpoint files of
{"model", "optim"} (every rank writes its own shards; nobody gathers) and one
`extra-rank{r}.pt` per rank (step, RNG states, data position, guard state: small plain values).

Atomicity: everything is written into `.tmp-step-NNNNNNNN/`; after every rank's files are
durable (DCP syncs its files, extras are fsynced, then a barrier) rank 0 renames the directory
into place and fsyncs the parent. A crash at any point leaves either no `step-*` directory for
that step or a complete one, and `latest()` only ever sees complete ones. Leftover `.tmp-*`
directories are removed at the next save of that step and by `remove_incomplete()` at start.
Only the newest `keep_last` checkpoints are kept; an old one is deleted only after a newer one
is complete.

The directory must be reachable by every rank at the same path (a shared filesystem on
several nodes), as DCP's FileSystemWriter requires.

Not here: what goes into the extras (the trainer decides), publishing.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

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


class CheckpointManager:
    """Saves and restores checkpoints of one run under `config.dir` (collective calls: every
    rank calls save/load together)."""

    def __init__(self, config: CheckpointConfig, *, rank: int) -> None:
        if config.dir is None:
            raise ValueError("CheckpointManager needs train.checkpoint.dir")
        self.config = config
        self.root = Path(config.dir)
        self.rank = rank

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

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> Path:
        """Writes the checkpoint of `step` and commits it; returns its directory."""
        final = self.root / checkpoint_name(step)
        tmp = self.root / f"{_TMP_PREFIX}{final.name}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt at this step
            tmp.mkdir()
        dist.barrier()
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
        _write_durably(tmp / f"extra-rank{self.rank}.pt", extra)
        dist.barrier()  # every rank's part is durable
        if self.rank == 0:
            if final.exists():  # left by an earlier run that this one did not resume from
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            self._prune()
        dist.barrier()  # everyone sees the committed checkpoint before going on (rollback reads it)
        log.info("checkpoint of step %d saved to %s", step, final)
        return final

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Restores model and optimizer in place from `path`; returns this rank's extras (rank
        0's, with own_rank = False, when the checkpoint came from a job with fewer ranks)."""
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra_path = path / f"extra-rank{self.rank}.pt"
        own = extra_path.is_file()
        if not own:
            # Written by a job with fewer ranks: DCP reshards model and optimizer; the step and the
            # (globally numbered) data position are the same on every rank, so rank 0's serve.
            log.warning(
                "%s has no %s (saved by fewer ranks); using rank 0's extras, RNG states are not restored",
                path,
                extra_path.name,
            )
            extra_path = path / "extra-rank0.pt"
        extra = torch.load(extra_path, weights_only=True)
        extra["own_rank"] = own
        log.info("resumed from %s (step %d)", path, extra["step"])
        return extra

    def _prune(self) -> None:
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
