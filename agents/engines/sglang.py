"""sglang: a copying engine that drives a running SGLang server over its HTTP routes.

Each version becomes a complete HF-style snapshot directory under `root`, and the server is told
to load it with `POST /update_weights_from_disk`. What SGLang does, read from its source
(`entrypoints/http_server.py`, `managers/tokenizer_manager.py`), and what this engine relies on:

- Every generate request holds the reader side of `model_update_lock` from tokenization to its
  last token; `update_weights_from_disk` on a server that is not paused takes the writer side.
  So the reload waits for in-flight requests, holds new ones, and no request runs on two
  versions. That is drain "wait" (the default): no pause call at all.
- `pause_generation` has modes "abort" (abort in-flight requests, then hold new ones), "in_place"
  and "retract". While paused, the reload skips the lock, so in_place/retract would let paused
  requests continue on the new weights (mixed versions) with KV computed by the old ones, whose
  tokens neither version would produce: this engine offers "abort" only. Swap policies
  (`SwapPolicy`): DRAIN is drain "wait" (or "abort" where the config says so, its older
  spelling), ABORT pauses with mode abort, IN_FLIGHT is refused (the agent will not start).
- On a failed load SGLang reloads the weights of its previous model_path and answers 400
  {"success": false, "message": ...}; on success it sets `weight_version` (if given), which
  `GET /get_weight_version` and every response's meta_info report. `flush_cache=true` in the
  reload body flushes the radix cache once the new weights are in (`/flush_cache` alone is
  refused while requests are pending).

Layout of `root`:

    root/v000000000012/   config.json and other template files, model-0000i-of-0000n.safetensors,
                          model.safetensors.index.json, weightsync.json (version, digest, per-file
                          fingerprints). The grouping of tensors into files is fixed by the first
                          snapshot, so a file whose tensors did not change is a hard link to the
                          previous snapshot's file, not a copy.
    root/current -> v000000000012    the snapshot last loaded successfully
    root/.tmp-*, .trash-*            work in progress; removed on open

`swap` states:
    write     snapshot into root/.tmp-*, linking unchanged files; fsync; rename to v<version>
    pause     drain "abort" only: POST /pause_generation {"mode": "abort"}
    reload    POST /update_weights_from_disk (model_path, load_format, flush_cache=true,
              weight_version=str(version)); timeouts and 5xx are retried (the same path twice
              is harmless)
    confirm   GET /get_weight_version: the reply alone is not trusted. The new version: served.
              The previous one: failed, raise. Anything else: reload the previous snapshot,
              confirm again, and raise (served_version() is None if even that fails)
    continue  drain "abort" only: POST /continue_generation, also after a failure
    point     `current` -> the new snapshot; prune older snapshots. Until the reload succeeds the
              previous snapshot stays on disk: SGLang re-reads it when a load fails.

`swap_delta` (in place, O(delta)): on a server started with weightsync's loader
(`--custom-weight-loader`, `custom_weight_loader = true`), a delta the agent captured goes to the
workers as one small file through `update_weights_from_tensor` with that loader, patched into the
live parameters under the pause and read back; the old bits are kept for `undo` (parity refuse).
Anything else, a refusal or a worker's error included, goes in whole by the states above.

It keeps no reference to the tensors it is handed (`zero_copy` is False). Not here: verifying
versions (the agent), loading weights (SGLang), the in-place path's RPCs (`sglang_delta.py`) and
worker side (`sglang_loader.py`, `delta_apply.py`), the generic reload hook (`safetensors_dir.py`).
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from weightsync.agents.engines.base import (
    EngineState,
    Layout,
    PromptLogprobs,
    SwapReport,
    check_fits,
    check_layout,
    check_swap_args,
    layout_of,
)
from weightsync.agents.engines.safetensors_dir import as_config_source, config_json
from weightsync.agents.engines.sglang_delta import FullPath as SGLangFullPath
from weightsync.agents.engines.sglang_delta import SGLangDeltas
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
from weightsync.checkpoint_io import INDEX_NAME, SAFETENSORS_DTYPES, plan_shards
from weightsync.errors import WeightsyncError
from weightsync.format.hashing import xxh3_hex
from weightsync.format.tensors import raw_bytes
from weightsync.retry import Backoff, GaveUp, retry_call
from weightsync.transport.json_http import HttpClient, HttpError

logger = logging.getLogger(__name__)

DRAINS = ("wait", "abort")
_SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


class SGLangError(WeightsyncError, RuntimeError):
    """The SGLang server refused, failed or could not be reached for a step of a swap."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGLangEngineConfig:
    """Where the SGLang server is, where snapshots go and how swaps drain requests.

    The snapshot's config.json comes from `template_dir` (the HF directory the server was started
    with: SGLang reads config.json from every path it loads) or, failing that, from `model`.
    """

    url: str
    """Base URL of the SGLang server, e.g. "http://127.0.0.1:30000"."""
    root: str
    """Directory for the snapshots and the `current` symlink (created if missing). The server
    must read it under the same path (same machine or the same mount)."""
    template_dir: str | None = None
    """An HF model directory whose non-weight files (config.json, tokenizer, generation config)
    are copied into every snapshot."""
    model: Any = None
    """An HF config.json dict, a `weightsync.models.ModelConfig` or a dict of its fields: written
    as config.json when the template has none."""
    drain: str = "wait"
    """"wait": in-flight requests finish on the old weights, new ones wait for the reload
    (SGLang's update lock). "abort": in-flight requests are aborted (clients get finish_reason
    abort) so the reload does not wait for long generations."""
    load_format: str | None = None
    """Sent as the reload's load_format; None leaves the server's own (--load-format)."""
    shard_bytes: int = 512 * 2**20
    """Target size of one safetensors file (a tensor larger than this gets a file of its own).
    Smaller files let more of a snapshot be hard-linked when only some tensors change."""
    keep_snapshots: int = 1
    """Snapshots kept after a successful swap, newest first (at least the served one)."""
    api_key: str | None = None
    """The server's --api-key, sent as "Authorization: Bearer ..."."""
    reload_timeout_s: float = 600.0
    """Per reload attempt: loading a large model, and in drain "wait" the longest request in flight."""
    request_timeout_s: float = 30.0
    """Every other call (probe, version, pause, continue)."""
    reload_retries: int = 1
    """Further reload attempts after a connection error, timeout or 5xx reply."""
    retry_backoff_s: float = 1.0
    """Sleep before retry n is retry_backoff_s * 2**(n-1)."""
    custom_weight_loader: bool = False
    """The server was started with `--custom-weight-loader
    weightsync.agents.engines.sglang_loader.load_delta`: delta versions are patched in place (only
    the changed elements travel, `sglang_delta.py`); False: every version goes in whole."""
    tp_size: int = 1
    """The server's --tp-size (the loader's request is sent once per tensor-parallel rank)."""
    handoff_dir: str | None = None
    """A tmpfs directory the server's workers can read, for delta files (default /dev/shm)."""
    delta_max_changed_fraction: float = 0.25
    """A version that changes more than this fraction of the elements goes in whole."""
    native_reload: tuple[str, ...] = ()
    """fnmatch patterns of layers (checkpoint module names) delta swaps always load whole."""

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not re.fullmatch(r"https?://[^/\s]+/?", self.url):
            raise ValueError(f"url must be the server's base URL like http://HOST:PORT, got {self.url!r}")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if not isinstance(self.root, (str, os.PathLike)) or not str(self.root):
            raise ValueError("root must be a directory path for the snapshots")
        object.__setattr__(self, "root", str(self.root))
        object.__setattr__(self, "model", as_config_source(self.model))
        if self.model is None and self.template_dir is None:
            raise ValueError(
                "give template_dir (the HF directory the server was started with) and/or model, "
                "so snapshots get a config.json"
            )
        if self.drain not in DRAINS:
            raise ValueError(
                f"drain must be one of {DRAINS}, got {self.drain!r} (SGLang's in_place and retract "
                "pauses let paused requests continue on the new weights)"
            )
        if self.load_format is not None and not isinstance(self.load_format, str):
            raise ValueError(f"load_format must be a string or None, got {self.load_format!r}")
        if not self.reload_timeout_s > 0 or not self.request_timeout_s > 0 or self.retry_backoff_s < 0:
            raise ValueError("reload_timeout_s and request_timeout_s must be > 0 and retry_backoff_s >= 0 seconds")
        if not isinstance(self.custom_weight_loader, bool):
            raise ValueError(f"custom_weight_loader must be true or false, got {self.custom_weight_loader!r}")
        fraction = self.delta_max_changed_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ValueError(f"delta_max_changed_fraction must be a number in 0..1, got {fraction!r}")
        if isinstance(self.native_reload, str) or not all(isinstance(p, str) and p for p in self.native_reload):
            raise ValueError(f"native_reload must be a list of layer name patterns, got {self.native_reload!r}")
        object.__setattr__(self, "native_reload", tuple(self.native_reload))
        if self.handoff_dir is not None and not Path(self.handoff_dir).is_dir():
            raise ValueError(f"handoff_dir {self.handoff_dir} is not a directory")
        for name, least in (("reload_retries", 0), ("keep_snapshots", 1), ("shard_bytes", 1), ("tp_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")

    def open(self) -> SGLangEngine:
        """The engine this config describes (the registry's "sglang" engine); probes the server."""
        return SGLangEngine(self)


class _NoAnswer(WeightsyncError):
    """A reload that got no answer or a 5xx: tried again."""

    def __init__(self, reply: _Reply) -> None:
        super().__init__(_describe(reply))
        self.reply = reply


@dataclasses.dataclass(frozen=True)
class _Reply:
    """One HTTP exchange: status None when no reply came (refused, reset, timed out)."""

    status: int | None
    text: str
    problem: str = ""

    def doc(self) -> dict[str, Any]:
        try:
            doc = json.loads(self.text)
        except ValueError:
            return {}
        return doc if isinstance(doc, dict) else {}


class SGLangEngine:
    """A copying `Engine` (name "sglang"): snapshot directories loaded by a running SGLang server."""

    name = "sglang"
    zero_copy = False
    swap_policies = (SwapPolicy.DRAIN, SwapPolicy.ABORT)  # IN_FLIGHT: see the module docstring
    weights_kinds = ("model",)

    def __init__(self, config: SGLangEngineConfig) -> None:
        self.config = config
        self.url: str | None = config.url  # where clients reach the served model
        self._http = HttpClient(config.url, api_key=config.api_key, timeout_s=config.request_timeout_s)
        self._template_files = find_template_files(config.template_dir, need_config=config.model is None)
        self._probe()  # before touching the disk: a wrong URL fails fast and leaves nothing behind
        self.dir = SnapshotDir(config.root)
        self.root = self.dir.root
        self._lock = threading.Lock()
        self._closed = False
        self.dir.remove_leftovers()
        # The server may serve anything before our first swap (its --model-path, or a snapshot of
        # an earlier run): nothing counts as served until a swap is confirmed.
        self._served: int | None = None
        self._server_version = self.weight_version()
        # Grouping of tensors into files and their layout, fixed by the first snapshot.
        self._plan: list[tuple[str, list[str]]] | None = None
        self._layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None
        self._base = self.current_dir()  # the snapshot new ones link against
        if self._base is not None and self._base.is_dir():
            self._plan, self._layout = _read_plan(self._base)
        else:
            self._base = None
        self._deltas = SGLangDeltas(self)
        self.delta_swaps = config.custom_weight_loader

    # ------------------------------------------------------------------ Engine protocol

    def swap(
        self, version: int, weights: Mapping[str, torch.Tensor], *, digest: str, policy: SwapPolicy = SwapPolicy.DRAIN
    ) -> SwapReport:
        """Writes snapshot `version` (linking unchanged files), has SGLang load it, confirms.
        `policy` ABORT pauses with mode abort whatever `drain` says; IN_FLIGHT is refused
        (module docstring)."""
        started = time.perf_counter()
        check_swap_args(version, digest, policy, self.swap_policies)
        abort = policy is SwapPolicy.ABORT or self.config.drain == "abort"
        with self._lock:
            if self._closed:
                raise WeightsyncError(f"the sglang engine on {self.root} is closed")
            check_layout(self._layout, weights)  # the first snapshot fixes the layout
            target = self.root / snapshot_name(version)
            previous = self.current_dir()
            created = False
            plan = self._plan if self._plan is not None else _plan_files(weights, self.config.shard_bytes)
            if target.exists() and read_meta(target).get("digest") == digest:
                logger.info("snapshot %s already holds version %d (digest %s); reusing it", target, version, digest)
                plan = _read_plan(target)[0] or plan  # its files, should it become the base
            else:
                if target.exists():
                    if previous is not None and previous.name == target.name:
                        raise WeightsyncError(
                            f"{target} is current and holds another digest than {digest}; "
                            "a version number must not be reused for other weights"
                        )
                    self.dir.discard(target)
                self._write_snapshot(target, version, weights, digest, plan)
                created = True
            try:
                pause_s = self._load(target, version, previous, abort=abort)
            except BaseException:
                if created:
                    self.dir.discard(target)  # a late load of it fails, and SGLang keeps the previous one
                if self._deltas.patched:  # SGLang fell back to `current`, older than what was patched in
                    self._served = None
                    logger.error("sglang %s: a failed reload after delta swaps leaves unknown weights", self.config.url)
                raise
            self.dir.point_current(target.name)
            self._served, self._server_version = version, str(version)
            self._base = target
            self._plan, self._layout = plan, layout_of(weights)
            self.dir.prune(self.config.keep_snapshots, {target.name})
            self._deltas.after_full_load(version, digest, weights)
        total_s = time.perf_counter() - started
        logger.info("sglang serves version %d from %s; reload %.2fs, swap %.2fs", version, target, pause_s, total_s)
        return SwapReport(version=version, pause_s=pause_s, total_s=total_s)

    def swap_delta(
        self,
        version: int,
        delta: Any,
        *,
        weights: Mapping[str, torch.Tensor],
        digest: str,
        policy: SwapPolicy = SwapPolicy.DRAIN,
    ) -> SwapReport:
        """The optional in-place path (`base.DeltaEngine`, `sglang_delta.py`) through weightsync's
        custom weight loader; a version that must go in whole is swapped like `swap`, and the
        report says why."""
        started = time.perf_counter()
        check_swap_args(version, digest, policy, self.swap_policies)
        with self._lock:
            if self._closed:
                raise WeightsyncError(f"the sglang engine on {self.root} is closed")
            reason = self._deltas.refusal(delta)
            if not reason:
                check_layout(self._layout, weights)
                try:
                    report = self._deltas.swap(version, delta, weights, digest, policy, started)
                    self._served, self._server_version = version, str(version)
                    return report
                except SGLangFullPath as e:
                    reason = str(e)
        logger.info("sglang %s: v%d goes in whole: %s", self.config.url, version, reason)
        return dataclasses.replace(self.swap(version, weights, digest=digest, policy=policy), path_reason=reason)

    def undo(self, version: int, *, policy: SwapPolicy = SwapPolicy.DRAIN) -> SwapReport | None:
        """The version before `version` back from the ranks' undo logs; None without one."""
        with self._lock:
            report = self._deltas.undo(version, policy)
            if report is not None:
                self._served, self._server_version = report.version, str(report.version)
            return report

    def served_version(self) -> int | None:
        return self._served

    def prompt_logprobs(
        self, prompts: Sequence[Sequence[int]], *, timeout_s: float = 60.0, top_k: int = 0
    ) -> PromptLogprobs:
        """The parity probe's question (`agents/parity.py`): per prompt, SGLang's log-prob of each
        prompt token after the first (POST /generate with input_ids, return_logprob and
        logprob_start_len 0: meta_info.input_token_logprobs), with the weight_version that
        answered. SGLang does not report its routing, its dtype or (here) top-k tokens: no expert
        choices, the probe's first record, no training/inference gap figure (`top_k` is ignored)."""
        logprobs, versions = [], set()
        for prompt in prompts:
            body = {
                "input_ids": [int(t) for t in prompt],
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_logprob": True,
                "logprob_start_len": 0,
            }
            reply = self._call("POST", "/generate", body, timeout_s)
            if reply.status != 200:
                raise SGLangError(f"POST {self.config.url}/generate for the parity probe: {_describe(reply)}")
            meta = reply.doc().get("meta_info") or {}
            entries = meta.get("input_token_logprobs")
            if not isinstance(entries, list) or len(entries) != len(prompt):
                raise SGLangError(f"SGLang answered no input_token_logprobs for a {len(prompt)}-token probe prompt")
            logprobs.append(torch.tensor([float(e[0]) for e in entries[1:]], dtype=torch.float32))
            versions.add(str(meta.get("weight_version")))
        served = versions.pop() if len(versions) == 1 else None
        return PromptLogprobs(version=int(served) if served is not None and served.isdigit() else -1, logprobs=logprobs)

    def wait_unused(self, version: int, timeout_s: float) -> bool:
        return True  # swap wrote the tensors to disk; nothing here refers to the agent's memory

    def check_fit(self, layout: Layout) -> None:
        check_fits(self._layout, layout)  # the first snapshot fixes the layout

    def state(self) -> EngineState:
        """What the server says it serves (GET /get_weight_version) against the last confirmed swap."""
        try:
            now = self.weight_version()
        except SGLangError as e:
            return EngineState(state="unreachable", reason=str(e))
        if self._served is None:
            return EngineState(
                state="empty", reason=f"no swap confirmed yet; the server reports weight_version {now!r}"
            )
        if now != str(self._served):
            return EngineState(
                state="unknown",
                reason=f"the server reports weight_version {now!r}, the last swap confirmed {self._served}",
            )
        return EngineState(state="serving", version=self._served)

    def verify_held(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """None: SGLang has no route that reports a digest of the weights it holds."""
        return None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.dir.close()

    # ------------------------------------------------------------------ inspection

    def weight_version(self) -> str | None:
        """The server's weight_version (GET /get_weight_version); SGLangError if it cannot be read."""
        reply = self._call("GET", "/get_weight_version", None, self.config.request_timeout_s)
        if reply.status != 200 or "weight_version" not in reply.doc():
            raise SGLangError(f"GET {self.config.url}/get_weight_version: {_describe(reply)}")
        value = reply.doc()["weight_version"]
        return None if value is None else str(value)

    def current_dir(self) -> Path | None:
        """The snapshot `current` names (the last one the server loaded), or None."""
        return self.dir.current()

    def snapshots(self) -> list[int]:
        """Versions with a snapshot on disk, ascending."""
        return self.dir.versions()

    # ------------------------------------------------------------------ steps

    def _probe(self) -> None:
        """Refuses a server that lacks a route a swap needs, naming every missing one."""
        missing = []
        info = self._call("GET", "/get_model_info", None, self.config.request_timeout_s)
        if info.status is None:
            raise SGLangError(f"no SGLang server answers at {self.config.url}: {info.problem}")
        if info.status != 200 or "weight_version" not in info.doc():
            missing.append("GET /get_model_info with weight_version")
        version = self._call("GET", "/get_weight_version", None, self.config.request_timeout_s)
        if version.status != 200 or "weight_version" not in version.doc():
            missing.append("GET /get_weight_version")
        # POST-only routes answer a GET with 405 when they exist and 404 when not: a probe with no
        # side effect (a POST to /continue_generation would un-pause someone else's pause).
        routes = ["/update_weights_from_disk"] + (
            ["/pause_generation", "/continue_generation"] if self.config.drain == "abort" else []
        )
        for route in routes:
            reply = self._call("GET", route, None, self.config.request_timeout_s)
            if reply.status == 404 or reply.status is None:
                missing.append(f"POST {route}")
        if missing:
            raise SGLangError(
                f"the server at {self.config.url} lacks {', '.join(missing)}; weightsync needs SGLang "
                f"with weight versions (>= 0.5) and drain {self.config.drain!r} (docs/sglang.md)"
            )
        logger.info(
            "sglang server at %s: model_path %s, weight_version %s",
            self.config.url,
            info.doc().get("model_path"),
            info.doc().get("weight_version"),
        )

    def _write_snapshot(
        self,
        target: Path,
        version: int,
        weights: Mapping[str, torch.Tensor],
        digest: str,
        plan: list[tuple[str, list[str]]],
    ) -> None:
        base_files = read_meta(self._base).get("files", {}) if self._base is not None else {}
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        free = shutil.disk_usage(self.root).free
        if nbytes > free:  # fail before writing rather than on ENOSPC halfway through
            raise WeightsyncError(
                f"version {version} needs up to {nbytes / 2**30:.2f} GiB, {self.root} has "
                f"{free / 2**30:.2f} GiB free; free space or lower keep_snapshots"
            )
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=self.root))
        try:
            fingerprints, linked = {}, 0
            for file, names in plan:
                tensors = {n: weights[n].detach().to("cpu").contiguous() for n in names}
                fingerprints[file] = _fingerprint(tensors)
                if base_files.get(file) == fingerprints[file] and _link(self._base / file, tmp / file):
                    linked += 1
                    continue
                # No per-version metadata in the file: its bytes depend on its tensors alone, so the
                # next snapshot can link it.
                save_file(tensors, str(tmp / file), metadata={"format": "pt"})
                fsync(tmp / file)
            weight_map = {n: file for file, names in plan for n in names}
            (tmp / INDEX_NAME).write_text(
                json.dumps(
                    {"metadata": {"total_size": nbytes}, "weight_map": dict(sorted(weight_map.items()))}, indent=2
                )
            )
            for src in self._template_files:
                shutil.copyfile(src, tmp / src.name)
            if not (tmp / CONFIG_NAME).exists():
                (tmp / CONFIG_NAME).write_text(json.dumps(config_json(self.config.model), indent=2, sort_keys=True))
            (tmp / SNAPSHOT_META).write_text(json.dumps({"version": version, "digest": digest, "files": fingerprints}))
            for path in tmp.iterdir():
                if not path.name.endswith(".safetensors"):
                    fsync(path)
            fsync(tmp)
            os.rename(tmp, target)
            fsync(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info(
            "snapshot %s: %d of %d files hard-linked from %s",
            target.name,
            linked,
            len(plan),
            self._base.name if self._base is not None else None,
        )

    def _load(self, target: Path, version: int, previous: Path | None, *, abort: bool) -> float:
        """Has the server load `target` and confirms it; the seconds requests were held back.

        Raises SGLangError when the server does not serve `version` afterwards."""
        config = self.config
        started = time.perf_counter()
        if abort:
            reply = self._call("POST", "/pause_generation", {"mode": "abort"}, config.request_timeout_s)
            if reply.status != 200:
                raise SGLangError(f"pause before version {version} failed: {_describe(reply)}; nothing changed")
        try:
            reply = self._reload(target, str(version))
            problem = self._confirm(version, reply, previous)
        finally:
            if abort:
                resumed = self._call("POST", "/continue_generation", {}, config.request_timeout_s)
                if resumed.status != 200:
                    # Loud: the server holds every new request until someone continues it.
                    logger.error(
                        "POST %s/continue_generation failed: %s; the server stays paused",
                        config.url,
                        _describe(resumed),
                    )
                    raise SGLangError(
                        f"continue after version {version} failed, the server stays paused: {_describe(resumed)}"
                    )
        if problem:
            raise SGLangError(problem)
        return time.perf_counter() - started

    def _reload(self, path: Path, weight_version: str) -> _Reply:
        body = {
            "model_path": str(path),
            "flush_cache": True,
            "weight_version": weight_version,
            "abort_all_requests": False,
        }
        if self.config.load_format is not None:
            body["load_format"] = self.config.load_format

        def attempt() -> _Reply:
            reply = self._call("POST", "/update_weights_from_disk", body, self.config.reload_timeout_s)
            if reply.status is None or reply.status >= 500:
                raise _NoAnswer(reply)
            return reply  # an answer: success, or a refusal that a retry would only repeat

        retries, backoff_s = self.config.reload_retries, self.config.retry_backoff_s
        try:
            return retry_call(
                f"reload {path.name}",
                attempt,
                attempts=retries + 1,
                backoff=Backoff(first_s=backoff_s, max_s=backoff_s * 2**retries),
                retry_on=(_NoAnswer,),
                log=logger,
            )
        except GaveUp as e:
            return e.last.reply

    def _confirm(self, version: int, reply: _Reply, previous: Path | None) -> str:
        """'' when the server serves `version`; else what went wrong, after making sure the server
        serves a known version (the previous one) where it can."""
        said = _describe(reply)
        try:
            now = self.weight_version()
        except SGLangError as e:
            now, said = None, f"{said}; then {e}"
        if now == str(version):
            if not (reply.status == 200 and reply.doc().get("success") is True):
                logger.warning("reload of version %d: %s, yet the server reports weight_version %s", version, said, now)
            return ""
        expected = self._server_version
        if now is not None and now == expected:
            return f"reload of version {version} failed, the server still serves weight_version {now}: {said}"
        # Neither: the reply was lost and the server's state is not the one we left it in.
        served_before, self._served = self._served, None
        # Restored only when `previous` is what this engine had the server load: after a restart,
        # `current` may be older than what the server was started on.
        if served_before is None or previous is None or not previous.is_dir():
            return (
                f"reload of version {version} failed and the server reports weight_version {now!r}, "
                f"not {expected!r}; no snapshot to restore: {said}"
            )
        logger.error(
            "reload of version %d: %s; server reports weight_version %r; restoring %s",
            version,
            said,
            now,
            previous.name,
        )
        restored = self._reload(previous, expected)
        try:
            now = self.weight_version()
        except SGLangError:
            now = None
        if now == expected:
            self._served = served_before
            return f"reload of version {version} failed; restored weight_version {expected}: {said}"
        return (
            f"reload of version {version} failed and restoring {previous.name} failed too "
            f"({_describe(restored)}); the server reports weight_version {now!r}: {said}"
        )

    def _call(self, method: str, route: str, body: Any, timeout_s: float) -> _Reply:
        """One exchange; an error reply or no reply is a _Reply too (the callers decide what it means)."""
        try:
            reply = self._http.request(method, route, body, timeout_s=timeout_s)
        except HttpError as e:
            if e.status is not None and e.status < 300:  # a reply over the size cap: none usable
                return _Reply(None, "", e.detail)
            return _Reply(e.status, e.body, "" if e.status is not None else e.detail)
        return _Reply(reply.status, reply.text)


def _plan_files(weights: Mapping[str, torch.Tensor], shard_bytes: int) -> list[tuple[str, list[str]]]:
    """Tensors, in the order given, cut into named files of about `shard_bytes` (`plan_shards`)."""
    groups = plan_shards(weights, shard_bytes)
    return [(f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors", names) for i, names in enumerate(groups)]


def _read_plan(snapshot: Path) -> tuple[list[tuple[str, list[str]]] | None, dict | None]:
    """The file plan and layout of a snapshot this engine wrote; (None, None) if it is not one."""
    try:
        weight_map = json.loads((snapshot / INDEX_NAME).read_text())["weight_map"]
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        if not all(_SHARD.fullmatch(f) for f in files):
            return None, None
        plan, layout = [], {}
        for file in sorted(files):
            with safe_open(str(snapshot / file), framework="pt") as f:
                names = list(f.keys())  # the file's own order, as written
                for name in names:
                    sl = f.get_slice(name)
                    layout[name] = (SAFETENSORS_DTYPES[sl.get_dtype()], tuple(sl.get_shape()))
            plan.append((file, names))
        return plan, layout
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("cannot reuse the file plan of %s (%s); the next snapshot starts a new one", snapshot, e)
        return None, None


def _fingerprint(tensors: Mapping[str, torch.Tensor]) -> str:
    """xxh3-128 over names, dtypes, shapes and bytes: equal fingerprints, equal file contents."""
    parts = []
    for name, t in sorted(tensors.items()):
        parts.append(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        if t.numel():
            parts.append(memoryview(raw_bytes(t)))
    return xxh3_hex(*parts)


def _link(src: Path, dst: Path) -> bool:
    """Hard-links src to dst; False (caller writes the file) where links are not possible."""
    try:
        os.link(src, dst)
        return True
    except OSError as e:  # the file went missing, or a filesystem without hard links
        logger.warning("cannot hard-link %s (%s); writing a copy", src, e)
        return False


def _describe(reply: _Reply) -> str:
    if reply.status is None:
        return f"no reply ({reply.problem})"
    doc = reply.doc()
    text = doc.get("message") if isinstance(doc.get("message"), str) else reply.text
    return f"HTTP {reply.status}: {text.strip()[:500]}"
