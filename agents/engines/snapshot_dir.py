"""snapshot_dir: a directory of complete weight snapshots and a `current` symlink, crash-safe.

What the engines that hand weights to a server through the filesystem share (`safetensors_dir`,
`sglang`). Layout of `root`:

    root/v000000000012/      one complete snapshot per version (written by the engine)
    root/current -> v000000000012    the snapshot last handed to the server (relative link)
    root/.lock               held (flock) by the one engine using root
    root/.tmp-*, .trash-*, .current.tmp-*    work in progress; removed on open

Every change is a rename: a snapshot appears whole (the engine renames its .tmp-* into place),
`current` is replaced atomically, and a snapshot is renamed to .trash-* before it is deleted, so
a crash at any moment leaves `current` naming a complete snapshot or nothing.

Not here: what goes into a snapshot, or how a server is told to load it (the engines).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

from weightsync.checkpoint_io import INDEX_NAME
from weightsync.errors import WeightsyncError
from weightsync.format.layout import VERSION_DIGITS

logger = logging.getLogger(__name__)

CURRENT = "current"
CONFIG_NAME = "config.json"
SNAPSHOT_META = "weightsync.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
_SNAPSHOT = re.compile(rf"v(\d{{{VERSION_DIGITS}}})")


class SnapshotDir:
    """`root` as above, locked for this process while open."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.root / ".lock", "a")  # noqa: SIM115 - held until close()
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            raise WeightsyncError(f"another engine is using {self.root}; give each engine its own root") from None

    def close(self) -> None:
        self._lock_file.close()  # releases the flock

    def current(self) -> Path | None:
        """The snapshot `current` names, or None."""
        try:
            return self.root / os.readlink(self.root / CURRENT)
        except FileNotFoundError:
            return None

    def versions(self) -> list[int]:
        """Versions with a snapshot on disk, ascending."""
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _SNAPSHOT.fullmatch(p.name)))

    def point_current(self, name: str | None) -> None:
        """`current` names snapshot `name` (None: removes it), atomically and durably."""
        link = self.root / CURRENT
        if name is None:
            link.unlink(missing_ok=True)
        else:
            tmp = self.root / f".current.tmp-{uuid.uuid4().hex}"
            os.symlink(name, tmp)  # relative: the root can be moved or mounted elsewhere
            os.replace(tmp, link)
        fsync(self.root)

    def discard(self, path: Path) -> None:
        # Renamed away first: a crash mid-delete leaves a .trash-* dir, never a partial snapshot.
        trash = self.root / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
        os.rename(path, trash)
        fsync(self.root)
        shutil.rmtree(trash, ignore_errors=True)

    def prune(self, keep_newest: int, keep: set[str]) -> None:
        """Deletes every snapshot but the newest `keep_newest` and those named in `keep`."""
        names = [snapshot_name(v) for v in self.versions()]
        kept = set(names[-keep_newest:]) | keep
        for name in names:
            if name not in kept:
                self.discard(self.root / name)

    def remove_leftovers(self) -> None:
        """What a crash left of unfinished work."""
        for path in self.root.iterdir():
            if path.name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(path, ignore_errors=True)
                logger.info("removed leftover %s", path)
            elif path.name.startswith(".current.tmp-"):
                path.unlink(missing_ok=True)
        current = self.current()
        if current is not None and not current.is_dir():
            logger.warning("%s/%s points at missing %s; the next swap re-points it", self.root, CURRENT, current)


def find_template_files(template_dir: str | None, *, need_config: bool) -> list[Path]:
    """The non-weight files of an HF model directory (config.json, tokenizer, generation
    config), copied into every snapshot; `need_config`: it must have a config.json."""
    if template_dir is None:
        return []
    template = Path(template_dir)
    if not template.is_dir():
        raise WeightsyncError(f"template_dir {template} is not a directory")
    files = [
        p
        for p in sorted(template.iterdir())
        if p.is_file() and p.name != INDEX_NAME and not p.name.endswith(WEIGHT_SUFFIXES) and not p.name.startswith(".")
    ]
    if need_config and not any(p.name == CONFIG_NAME for p in files):
        raise WeightsyncError(f"template_dir {template} has no {CONFIG_NAME}; add one or give model")
    return files


def snapshot_name(version: int) -> str:
    return f"v{version:0{VERSION_DIGITS}d}"


def read_meta(directory: Path) -> dict[str, Any]:
    """The snapshot's weightsync.json ({} when missing or unreadable)."""
    try:
        doc = json.loads((directory / SNAPSHOT_META).read_text())
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
