"""safetensors_dir: a copying engine that writes each version as an HF-style directory and
asks the inference server to reload from it.

This is how SGLang's `POST /update_weights_from_disk` ({"model_path": DIR}) and vLLM's
reload-from-disk hooks are driven. Layout of `root`:

    root/v000000000012/      one complete snapshot per version: model.safetensors (or shards +
                             index), config.json and the other non-weight files of the template,
                             weightsync.json (version, digest)
    root/current -> v000000000012    the version last handed to the server
    (the directory's mechanics, crash safety and lock: `snapshot_dir.py`)

`swap` states (a crash in any of them leaves `current` naming a complete snapshot):
    write   snapshot into root/.tmp-*, fsync files and directory
    place   rename .tmp-* to v<version> (atomic); fsync root
    point   new symlink renamed over `current` (atomic); fsync root
    reload  HTTP call to the server, bounded retries; a failure re-points `current` to the previous
            snapshot, removes the new one, and raises: the previous version stays served
    prune   keep the newest `keep_snapshots` snapshots (and always `current`)

It keeps no reference to the tensors it is handed (`zero_copy` is False). Swaps must fit the
layout (names, shapes, dtypes) of the template's safetensors, else of the snapshot `current`
names, else of the first swap; it never builds a model to learn one, so it fits any architecture
an inference server loads. Not here: verifying versions (the agent), loading weights (the
inference server does that), the swap checks every engine shares (`base.py`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from weightsync.agents.engines.base import (
    EngineState,
    Layout,
    SwapReport,
    check_fits,
    check_layout,
    check_swap_args,
    layout_of,
)
from weightsync.agents.engines.snapshot_dir import (
    CONFIG_NAME,
    SNAPSHOT_META,
    SnapshotDir,
    find_template_files,
    fsync,
    read_meta,
    snapshot_name,
)
from weightsync.agents.engines.swap_policy import SwapPolicy
from weightsync.checkpoint_io import DEFAULT_MAX_SHARD_BYTES, safetensors_layout, write_safetensors
from weightsync.errors import WeightsyncError
from weightsync.retry import Backoff, GaveUp, retry_call
from weightsync.transport.json_http import HttpClient, HttpError, Reply

logger = logging.getLogger(__name__)

_PLACEHOLDERS = ("{path}", "{version}", "{digest}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SafetensorsDirConfig:
    """Where snapshots go and how the inference server is told to reload.

    The snapshot's config.json comes from `template_dir` if it has one, else from `model`: give at
    least one of them. Swaps are checked against the template's tensors when it has some.
    SGLang: reload_url="http://HOST:PORT/update_weights_from_disk" with the default body. vLLM:
    the URL and body of the reload endpoint your deployment exposes.
    """

    root: str
    """Directory holding the snapshots and the `current` symlink (created if missing)."""
    reload_url: str | None = None
    """http(s) URL called after each snapshot is in place; None: only write and re-point
    `current` (for a server that watches the directory, or one restarted on `current`)."""
    reload_method: str = "POST"
    reload_body: Any = dataclasses.field(default_factory=lambda: {"model_path": "{path}"})
    """JSON document sent as the body (None: no body). In its strings "{path}" becomes the snapshot
    directory (absolute), "{version}" the version number and "{digest}" the version digest. SGLang
    accepts e.g. {"model_path": "{path}", "weight_version": "{version}"}."""
    reload_headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Extra request headers, e.g. {"Authorization": "Bearer ..."} for a server started with an API key."""
    reload_timeout_s: float = 600.0
    """Per attempt; a large model takes a while to load."""
    reload_retries: int = 2
    """Further attempts after a connection error, timeout, 408, 429 or 5xx reply (other 4xx are final)."""
    reload_backoff_s: float = 1.0
    """Sleep before retry n is reload_backoff_s * 2**(n-1)."""
    template_dir: str | None = None
    """An HF model directory whose non-weight files (config.json, tokenizer, generation config) are
    copied into every snapshot; its safetensors, if any, fix the expected tensor layout."""
    model: Any = None
    """The snapshot's config.json when the template has none: an HF config.json document (a dict
    with "architectures"), or a `weightsync.models.ModelConfig` or a dict of its fields. Only
    written out, never used to check swaps."""
    keep_snapshots: int = 2
    """Snapshots kept on disk, newest versions first (the one `current` names is always kept)."""
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    """Larger snapshots are written as HF-style shards plus an index."""

    def __post_init__(self) -> None:
        if not isinstance(self.root, (str, os.PathLike)) or not str(self.root):
            raise ValueError("root must be a directory path for the snapshots")
        object.__setattr__(self, "root", str(self.root))
        object.__setattr__(self, "model", as_config_source(self.model))
        if self.model is None and self.template_dir is None:
            raise ValueError("give template_dir (an HF model directory) and/or model, so snapshots get a config.json")
        if self.reload_url is not None and not re.match(r"https?://[^/]+", self.reload_url):
            raise ValueError(f"reload_url must be an http:// or https:// URL, got {self.reload_url!r}")
        if self.reload_method not in ("POST", "PUT", "GET"):
            raise ValueError(f"reload_method must be POST, PUT or GET, got {self.reload_method!r}")
        try:
            json.dumps(self.reload_body)
        except (TypeError, ValueError) as e:
            raise ValueError(f"reload_body must be a JSON document: {e}") from None
        if not self.reload_timeout_s > 0 or self.reload_backoff_s < 0:
            raise ValueError("reload_timeout_s must be > 0 and reload_backoff_s >= 0 seconds")
        for name in ("reload_retries", "keep_snapshots", "max_shard_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "reload_retries" else 1):
                raise ValueError(f"{name} must be an int >= {0 if name == 'reload_retries' else 1}, got {value!r}")

    def open(self) -> SafetensorsDirEngine:
        """The engine this config describes (the registry's "safetensors_dir" engine)."""
        return SafetensorsDirEngine(self)


class SafetensorsDirEngine:
    """A copying `Engine` (name "safetensors_dir"): snapshot directory + reload hook."""

    name = "safetensors_dir"
    zero_copy = False
    swap_policies = (SwapPolicy.DRAIN,)  # what running requests see is up to the server the reload hook drives
    weights_kinds = ("model",)
    url = None  # it knows the server's reload hook, not where clients reach it

    def __init__(self, config: SafetensorsDirConfig) -> None:
        self.config = config
        self.dir = SnapshotDir(config.root)
        self.root = self.dir.root
        self._lock = threading.Lock()
        self._closed = False
        # The server's state before our first swap is unknown (a crash may have come between
        # re-pointing `current` and the reload), so nothing counts as served until a swap succeeds.
        self._served: int | None = None
        self._template_files = find_template_files(config.template_dir, need_config=config.model is None)
        self._layout = self._initial_layout()
        self.dir.remove_leftovers()

    # ------------------------------------------------------------------ Engine protocol

    def swap(
        self, version: int, weights: Mapping[str, torch.Tensor], *, digest: str, policy: SwapPolicy = SwapPolicy.DRAIN
    ) -> SwapReport:
        """Writes, places and points at snapshot `version`, then has the server reload it."""
        started = time.perf_counter()
        check_swap_args(version, digest, policy, self.swap_policies)
        with self._lock:
            if self._closed:
                raise WeightsyncError(f"the safetensors_dir engine on {self.root} is closed")
            check_layout(self._layout, weights)
            target = self.root / snapshot_name(version)
            previous = self.current_dir()
            created = False
            if target.exists() and read_meta(target).get("digest") == digest:
                logger.info("snapshot %s already holds version %d (digest %s); reusing it", target, version, digest)
            else:
                if target.exists():
                    if previous is not None and previous.name == target.name:
                        raise WeightsyncError(
                            f"{target} is current and holds another digest than {digest}; "
                            "a version number must not be reused for other weights"
                        )
                    self.dir.discard(target)
                self._write_snapshot(target, version, weights, digest)
                created = True
            self.dir.point_current(target.name)
            try:
                pause_s = self._reload(target, version, digest)
            except BaseException:
                self.dir.point_current(previous.name if previous is not None else None)
                if created:
                    self.dir.discard(target)
                raise
            self._served = version
            self._layout = layout_of(weights)
            current = self.current_dir()
            self.dir.prune(self.config.keep_snapshots, {target.name} | ({current.name} if current else set()))
        total_s = time.perf_counter() - started
        logger.info("version %d in %s; reload %.2fs, swap %.2fs", version, target, pause_s, total_s)
        return SwapReport(version=version, pause_s=pause_s, total_s=total_s)

    def served_version(self) -> int | None:
        return self._served

    def wait_unused(self, version: int, timeout_s: float) -> bool:
        return True  # swap copied the tensors to disk; nothing here refers to the agent's memory

    def check_fit(self, layout: Layout) -> None:
        check_fits(self._layout, layout)

    def state(self) -> EngineState:
        """Serving the version whose reload the server last answered with success; it asks no
        server (the reload hook is the only route it knows)."""
        if self._served is None:
            return EngineState(state="empty", reason="no reload has succeeded since the agent started")
        return EngineState(state="serving", version=self._served)

    def verify_held(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """None: the server that reloaded the snapshot has no route to report what it loaded."""
        return None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.dir.close()

    # ------------------------------------------------------------------ inspection

    def current_dir(self) -> Path | None:
        """The snapshot `current` names, or None."""
        return self.dir.current()

    def snapshots(self) -> list[int]:
        """Versions with a snapshot on disk, ascending."""
        return self.dir.versions()

    # ------------------------------------------------------------------ steps

    def _write_snapshot(self, target: Path, version: int, weights: Mapping[str, torch.Tensor], digest: str) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        free = shutil.disk_usage(self.root).free
        if nbytes > free:  # fail before writing rather than on ENOSPC halfway through
            raise WeightsyncError(
                f"version {version} needs {nbytes / 2**30:.2f} GiB, {self.root} has "
                f"{free / 2**30:.2f} GiB free; lower keep_snapshots or free space"
            )
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=self.root))
        try:
            # "format": "pt" is what HF loaders expect in safetensors metadata.
            write_safetensors(
                {n: t.detach().cpu() for n, t in weights.items()},
                tmp,
                max_shard_bytes=self.config.max_shard_bytes,
                metadata={"format": "pt", "weightsync_version": str(version)},
            )
            for src in self._template_files:
                shutil.copyfile(src, tmp / src.name)
            if not (tmp / CONFIG_NAME).exists():
                (tmp / CONFIG_NAME).write_text(json.dumps(config_json(self.config.model), indent=2, sort_keys=True))
            (tmp / SNAPSHOT_META).write_text(json.dumps({"version": version, "digest": digest}))
            for file in tmp.iterdir():
                fsync(file)
            fsync(tmp)
            os.rename(tmp, target)
            fsync(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _reload(self, path: Path, version: int, digest: str) -> float:
        """Seconds spent in reload attempts; WeightsyncError when the server did not reload."""
        if self.config.reload_url is None:
            return 0.0
        values = {"{path}": str(path), "{version}": str(version), "{digest}": digest}
        body = None if self.config.reload_body is None else _fill(self.config.reload_body, values)
        client = HttpClient(
            self.config.reload_url, headers=self.config.reload_headers, timeout_s=self.config.reload_timeout_s
        )
        spent = 0.0

        def attempt() -> Reply:
            nonlocal spent
            started = time.perf_counter()
            try:
                return client.request(self.config.reload_method, body=body)
            except HttpError as e:
                if not e.transient:  # the server understood and refused: a retry would only repeat it
                    raise WeightsyncError(f"reload of version {version} refused: {e}") from None
                raise
            finally:
                spent += time.perf_counter() - started

        retries = self.config.reload_retries
        try:
            reply = retry_call(
                f"reload version {version}",
                attempt,
                attempts=retries + 1,
                backoff=Backoff(first_s=self.config.reload_backoff_s, max_s=self.config.reload_backoff_s * 2**retries),
                retry_on=(HttpError,),
                log=logger,
            )
        except GaveUp as e:
            raise WeightsyncError(f"reload of version {version} failed after {e.attempts} attempts: {e.last}") from None
        if _reports_failure(reply.text):  # SGLang says {"success": false, "message": ...} on failure
            raise WeightsyncError(f"reload of version {version} failed: {reply.text[:500]}")
        return spent

    # ------------------------------------------------------------------ open

    def _initial_layout(self) -> Layout | None:
        """What swaps must match: the template's weights (their headers only), else the snapshot
        `current` names, else nothing until the first swap (whose layout then holds)."""
        sources = [Path(self.config.template_dir)] if self.config.template_dir else []
        sources += [d for d in [self.current_dir()] if d is not None]
        for directory in sources:
            files = sorted(directory.glob("*.safetensors"))
            if files:
                return safetensors_layout(files)
        return None


def as_config_source(value: Any) -> Any:
    """`model` as given, checked: None, an HF config.json dict, or something with `to_hf()`."""
    if value is None or hasattr(value, "to_hf"):
        return value
    if isinstance(value, Mapping) and "architectures" in value:
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"model (an HF config.json document) must be JSON: {e}") from None
        return dict(value)
    if isinstance(value, Mapping):  # the fields of our own ModelConfig (a config file's table)
        from weightsync.models import as_model_config  # only then: the engine needs no model code

        return as_model_config(value)
    raise ValueError(
        f'model must be an HF config.json dict (with "architectures"), a ModelConfig or a dict '
        f"of its fields, got {type(value).__name__}"
    )


def config_json(model: Any) -> dict[str, Any]:
    """The config.json document of a checked `model` (`as_config_source`) written with a snapshot."""
    return dict(model) if isinstance(model, Mapping) else model.to_hf()


def _fill(template: Any, values: dict[str, str]) -> Any:
    if isinstance(template, str):
        for placeholder in _PLACEHOLDERS:
            template = template.replace(placeholder, values[placeholder])
        return template
    if isinstance(template, dict):
        return {key: _fill(value, values) for key, value in template.items()}
    if isinstance(template, list):
        return [_fill(value, values) for value in template]
    return template


def _reports_failure(text: str) -> bool:
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("success") is False
