"""runs: what a training service keeps on disk for each model it trains, and the record of a loaded one.

Under `<state_dir>/runs/<model_id>/`:

    run.json                               how to rebuild the model: base model and directory, LoRA
                                           settings, how MoE experts are held (a restarted server
                                           recreates a model from any saved state with it)
    weights/<name>/                        a DCP checkpoint of model and optimizer (save_state),
                                           named tinker://<model_id>/weights/<name>
    sampler_weights/<name>/sampler.json    where save_weights_for_sampler published (store, store
                                           model, version), named tinker://<model_id>/sampler_weights/<name>

Every JSON document is replaced atomically.

Not here: writing checkpoints (the trainer), publishing (`sampler_weights.py`), the routes (`service.py`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
from pathlib import Path
from typing import Any

from weightsync.app.training.errors import NotFound, UserInputError
from weightsync.app.training.ordering import SeqIdOrder
from weightsync.trainer.lora import LoraSettings

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_TINKER_PATH = re.compile(r"tinker://([^/]+)/(weights|sampler_weights)/([^/]+)")


@dataclasses.dataclass
class ModelRecord:
    """A model loaded on the ranks."""

    model_id: str
    base_model: str
    base_dir: str
    lora: LoraSettings | None
    vocab_size: int
    model_type: str
    order: SeqIdOrder


def check_name(name: Any, what: str) -> str:
    """A checkpoint or sampler-weights name given by a client: one path component of safe characters."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise UserInputError(
            f"{what} name {name!r} must be 1-128 characters of letters, digits, '.', '_' or '-' (no '/')"
        )
    return name


class Runs:
    """The `runs/` directory of one service's state directory (see the module docstring)."""

    def __init__(self, state_dir: Path) -> None:
        self.root = state_dir / "runs"

    def run_dir(self, model_id: str) -> Path:
        if "/" in model_id or model_id in ("", ".", ".."):
            raise UserInputError(f"invalid model id {model_id!r}")
        return self.root / model_id

    def write_run(self, record: ModelRecord, *, frozen_experts: str | None) -> None:
        run_dir = self.run_dir(record.model_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(
            run_dir / "run.json",
            {
                "model_id": record.model_id,
                "base_model": record.base_model,
                "base_dir": record.base_dir,
                "lora": dataclasses.asdict(record.lora) if record.lora else None,
                "frozen_experts": frozen_experts,
            },
        )

    def read_run(self, model_id: str) -> dict[str, Any]:
        return json.loads((self.run_dir(model_id) / "run.json").read_text())

    def checkpoint(self, model_id: str, name: str) -> tuple[str, Path]:
        """(tinker path, directory) of a training-state checkpoint to write."""
        return f"tinker://{model_id}/weights/{name}", self.run_dir(model_id) / "weights" / name

    def saved_checkpoint(self, path: str) -> tuple[str, Path]:
        """(model id, directory) of the saved training state a tinker path names."""
        model_id, name = _parse(path, "weights", "a training-state path", "as returned by save_state")
        directory = self.run_dir(model_id) / "weights" / name
        if not (directory / ".metadata").is_file():
            raise NotFound(f"no saved state at {path} (nothing under {directory})")
        return model_id, directory

    def write_sampler(self, model_id: str, name: str, meta: dict[str, Any]) -> str:
        """Records where sampler weights were published; their tinker path."""
        directory = self.run_dir(model_id) / "sampler_weights" / name
        directory.mkdir(parents=True, exist_ok=True)
        write_json(directory / "sampler.json", meta)
        return f"tinker://{model_id}/sampler_weights/{name}"

    def read_sampler(self, path: Any) -> tuple[str, dict[str, Any]]:
        """(model id, sampler.json) of the sampler weights a tinker path names."""
        model_id, name = _parse(
            path, "sampler_weights", "sampler weights", "from save_weights_for_sampler", field="model_path"
        )
        meta_path = self.run_dir(model_id) / "sampler_weights" / name / "sampler.json"
        if not meta_path.is_file():
            raise NotFound(f"no sampler weights at {path}")
        return model_id, json.loads(meta_path.read_text())

    def list_checkpoints(self, model_id: str) -> list[dict[str, Any]]:
        found = []
        for kind, checkpoint_type in (("weights", "training"), ("sampler_weights", "sampler")):
            root = self.run_dir(model_id) / kind
            for directory in sorted(root.iterdir()) if root.is_dir() else []:
                if directory.name.startswith("."):
                    continue
                found.append(
                    {
                        "checkpoint_id": f"{kind}/{directory.name}",
                        "checkpoint_type": checkpoint_type,
                        "time": _iso_time(directory.stat().st_mtime),
                        "tinker_path": f"tinker://{model_id}/{kind}/{directory.name}",
                    }
                )
        return found


def _parse(path: Any, kind: str, what: str, origin: str, *, field: str = "") -> tuple[str, str]:
    match = _TINKER_PATH.fullmatch(path) if isinstance(path, str) else None
    if not match or match.group(2) != kind:
        named = f"{field} {path!r}" if field else repr(path)
        raise UserInputError(f"{named} is not {what}; expected tinker://<model_id>/{kind}/<name> {origin}")
    return match.group(1), match.group(3)


def write_json(path: Path, doc: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True))
    os.replace(tmp, path)


def _iso_time(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, tz=datetime.timezone.utc).isoformat()
