"""vllm: a copying engine that hot-swaps verified versions into a running vLLM server.

The server is vLLM's OpenAI-compatible one, started with weightsync's worker extension and the
dev routes (docs/vllm.md has the full command):

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \
        --worker-extension-cls weightsync.agents.engines.vllm_worker.WeightsyncWorkerExtension

A swap, in order (a failure at any step is handled as the last column says):

    layout   names against what the workers load, shapes and dtypes    -> nothing changed: raise
             against the last version served (vLLM's loader would find
             another shape only once the server is paused)
    handoff  the version's tensors go to a safetensors file on tmpfs       -> nothing changed: raise
             (`handoff_dir`, /dev/shm); each worker maps it, so no tensor
             crosses the network
    check    POST /collective_rpc weightsync_check: each worker hashes the -> damaged: nothing
             file against the agent's per-tensor hashes (still serving)       changed, raise
    pause    POST /pause?mode=M, M from the swap policy: DRAIN -> wait      -> nothing changed: raise
             (running requests finish on the old version, new ones wait),
             IN_FLIGHT -> keep (they are frozen), ABORT -> abort (cut)
    load     POST /collective_rpc weightsync_load: each worker reloads    -> unknown weights: stay
             through vLLM's own load path (fusing, tensor parallelism)        paused, unhealthy, raise
    verify   each worker's digest of what it now holds (HF names, its     -> unknown weights: stay
             tensor-parallel slices) equals the same slices of the            paused, unhealthy,
             published tensors                                                raise; the next swap
                                                                               reloads everything
    commit   POST /reset_prefix_cache?reset_running_requests=true (no KV  -> stay paused, raise
             of the old weights is reused: requests frozen by keep are
             preempted, so their prompt and the tokens so far are computed
             again with the new weights), POST /update_weight_version,
             POST /resume

Delta versions go in place instead (`swap_delta`, the optional `base.DeltaEngine` members; the
steps are in `vllm_delta.py`): only the changed elements travel, the workers patch them through
their placement plans, the pause covers the scatter, and `undo` writes the workers' undo log back.
A version that cannot (no plan after a server restart, a gap over `delta_max_changed_fraction`,
workers whose old bits diverged) takes the steps above, and the report says why.

LoRA adapter-only versions (engine `lora_name`, agent weights_kind "adapter"; `vllm_lora.py`):
the handoff is a PEFT directory, the server also needs --enable-lora and
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, and "load" puts the adapter under `lora_name` (the first
swap through POST /v1/load_lora_adapter, later ones in place under the same id); "verify" compares
each worker's adapter tensors (lora_B with vLLM's alpha / rank folded in) with the published ones.
The base model stays the one vLLM was started with.

The server therefore serves either a verified version or nothing. Under in_flight a response can
span versions: vLLM labels each step's output with the weight version set by
/update_weight_version, and its token-in/token-out route (`POST /inference/v1/generate`, on a
server started with --enable-scale-out) reports `weight_versions` spans [start, end) per choice.
The OpenAI routes report no versions; /weight_info gives the version served now. A restarted agent finds the
server as the last one left it (maybe paused mid-load) and swaps its cached version in again.

Memory in the agent: the agent's one buffer (the engine keeps no reference to it); the handoff
file lives on tmpfs only for the duration of the swap. The copy vLLM serves is the engine's copy.
Not here: fetching or verifying versions (the agent), the worker side (`vllm_worker.py`), adapters
(`vllm_lora.py`), in-place delta swaps and the audit (`vllm_delta.py`).
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

from weightsync.agents.engines import vllm_lora
from weightsync.agents.engines.base import (
    EngineState,
    HeldReport,
    Layout,
    PromptLogprobs,
    SwapReport,
    check_fits,
    check_layout,
    check_swap_args,
    check_swap_policy,
    layout_of,
    tensor_hash,
)
from weightsync.agents.engines.delta_handoff import tag
from weightsync.agents.engines.swap_policy import SwapPolicy
from weightsync.agents.engines.vllm_delta import FullPath, VllmDeltas
from weightsync.agents.engines.vllm_worker import PROTOCOL, WeightsyncWorkerExtension
from weightsync.checkpoint_io import SAFETENSORS_DTYPES, write_safetensors_file
from weightsync.errors import IntegrityError, LayoutError, WeightsyncError
from weightsync.transport.json_http import HttpClient

logger = logging.getLogger(__name__)

EXTENSION = f"{WeightsyncWorkerExtension.__module__}.{WeightsyncWorkerExtension.__qualname__}"
"""What vLLM's --worker-extension-cls must name."""
PAUSE_MODES = ("wait", "abort", "keep")
_PAUSE_MODE = {SwapPolicy.DRAIN: "wait", SwapPolicy.IN_FLIGHT: "keep", SwapPolicy.ABORT: "abort"}  # -> /pause mode
# route -> how to get it, for the refusal message when a server lacks it
REQUIRED_ROUTES = {
    "/collective_rpc": "start vLLM with VLLM_SERVER_DEV_MODE=1",
    "/pause": "start vLLM with VLLM_SERVER_DEV_MODE=1 (vLLM >= 0.11 has /pause and /resume)",
    "/resume": "start vLLM with VLLM_SERVER_DEV_MODE=1",
    "/reset_prefix_cache": "start vLLM with VLLM_SERVER_DEV_MODE=1",
}
OPTIONAL_ROUTES = ("/update_weight_version", "/is_paused", "/weight_info")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VllmEngineConfig:
    """How to reach the vLLM server and how swaps behave."""

    url: str
    """Base URL of the vLLM OpenAI-compatible server, e.g. "http://127.0.0.1:8000"."""
    api_key: str | None = None
    """Sent as "Authorization: Bearer ..." (a server started with --api-key); or $VLLM_API_KEY."""
    pause_mode: str = "wait"
    """Deprecated: the agent's `swap_policy` decides (drain -> wait, in_flight -> keep, abort ->
    abort). A value other than "wait" here is used for agents left on the default drain policy,
    as it was before swap policies existed."""
    handoff_dir: str | None = None
    """A directory on tmpfs that the vLLM workers can read (the same host or pod); default
    /dev/shm when it exists, else the system temp dir."""
    request_timeout_s: float = 30.0
    """Per HTTP call for the quick routes (pause waits up to drain_timeout_s instead)."""
    drain_timeout_s: float = 600.0
    """How long /pause?mode=wait may take for running requests to finish."""
    load_timeout_s: float = 600.0
    """How long the workers may take to check, load and digest one version."""
    start_timeout_s: float = 0.0
    """Wait this long for the server to answer /health at start (0: it must be up already)."""
    lora_name: str | None = None
    """Serve LoRA adapter-only versions (the agent's weights_kind = "adapter") as the adapter of
    this name, which requests ask for as their `model`; None: whole-model versions. The server
    needs --enable-lora, --max-lora-rank >= the adapter's rank and
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (docs/vllm.md, "Serving LoRA adapters")."""
    lora_alpha: float = 32.0
    """The adapters' alpha (vLLM scales them by alpha / rank); weightsync's trainer uses 32."""
    delta_swaps: bool = True
    """Apply delta versions in place: only the changed elements travel to the workers, which patch
    them into what they serve (`vllm_delta.py`); False: every version is handed over whole."""
    delta_max_changed_fraction: float = 0.25
    """A version that changes more than this fraction of the elements goes in whole."""
    native_reload: tuple[str, ...] = ()
    """fnmatch patterns of layers (checkpoint module names, e.g. "model.layers.*.mlp.experts") that
    delta swaps always reload through vLLM's own loader, as they do layers that are not plain
    copies of the checkpoint (quantized, repacked, derived)."""
    audit_interval_s: float = 300.0
    """Seconds between background audits of what the workers hold (0: none; `status --verify`
    still audits)."""
    audit_elements_per_s: float = 20e6
    """The background audit reads at most this many elements per second (its CPU or GPU share)."""
    audit_step_elements: int = 4_000_000
    """Elements per audit RPC: each holds the worker's loop for that long."""

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not re.match(r"https?://[^/]+", self.url):
            raise ValueError(f"url must be the vLLM server's http:// or https:// base URL, got {self.url!r}")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {self.pause_mode!r}")
        for name in ("request_timeout_s", "drain_timeout_s", "load_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if (
            isinstance(self.start_timeout_s, bool)
            or not isinstance(self.start_timeout_s, (int, float))
            or self.start_timeout_s < 0
        ):
            raise ValueError(f"start_timeout_s must be >= 0 seconds, got {self.start_timeout_s!r}")
        if self.handoff_dir is not None and not Path(self.handoff_dir).is_dir():
            raise ValueError(f"handoff_dir {self.handoff_dir} is not a directory")
        if self.lora_name is not None and (
            not isinstance(self.lora_name, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", self.lora_name)
        ):
            raise ValueError(f"lora_name must be 1-128 letters, digits, '.', '_' or '-', got {self.lora_name!r}")
        if (
            isinstance(self.lora_alpha, bool)
            or not isinstance(self.lora_alpha, (int, float))
            or not self.lora_alpha > 0
        ):
            raise ValueError(f"lora_alpha must be a positive number, got {self.lora_alpha!r}")
        if not isinstance(self.delta_swaps, bool):
            raise ValueError(f"delta_swaps must be true or false, got {self.delta_swaps!r}")
        fraction = self.delta_max_changed_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ValueError(f"delta_max_changed_fraction must be a number in 0..1, got {fraction!r}")
        if isinstance(self.native_reload, str) or not all(isinstance(p, str) and p for p in self.native_reload):
            raise ValueError(f"native_reload must be a list of layer name patterns, got {self.native_reload!r}")
        object.__setattr__(self, "native_reload", tuple(self.native_reload))
        for name in ("audit_interval_s", "audit_elements_per_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if (
            isinstance(self.audit_step_elements, bool)
            or not isinstance(self.audit_step_elements, int)
            or self.audit_step_elements < 1
        ):
            raise ValueError(f"audit_step_elements must be an int >= 1, got {self.audit_step_elements!r}")

    def open(self) -> VllmEngine:
        """The engine this config describes (the registry's "vllm" engine); probes the server."""
        return VllmEngine(self)


class VllmEngine:
    """A copying `Engine` (name "vllm") driving a vLLM server through its dev routes and
    weightsync's worker extension."""

    name = "vllm"
    zero_copy = False
    swap_policies = tuple(SwapPolicy)

    def __init__(self, config: VllmEngineConfig) -> None:
        self.config = config
        self.url: str | None = config.url  # where clients reach the served model
        api_key = config.api_key or os.environ.get("VLLM_API_KEY")
        self._http = HttpClient(config.url, api_key=api_key, timeout_s=config.request_timeout_s)
        self._lock = threading.Lock()
        self._closed = False
        self._served: int | None = None
        self._served_digest = ""
        self._pause_split: dict[str, float] = {}
        self._model_name: str | None = None  # --served-model-name, read on the first parity probe
        self._swaps_begun = self._swaps_ended = 0  # a probe's answer counts only if no swap overlapped it
        self._healthy = True
        self._last_error: str | None = None
        self._slices: dict[int, dict[str, tuple]] = {}  # per worker: what it held at the last swap
        self._layout: Layout | None = None  # names, dtypes and shapes of the last version served
        self._handoff_dir = Path(
            config.handoff_dir or ("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())
        )
        self.weights_kinds = ("adapter",) if config.lora_name else ("model",)
        self._lora_id: int | None = None  # vLLM's id for lora_name, once this engine registered it
        self._remove_stale_handoffs()
        self._wait_until_up()
        self.routes = self._probe_routes()
        self.workers = self._probe_extension()
        self.lora_info = self._probe_lora() if config.lora_name else None
        self.delta_swaps = config.delta_swaps and config.lora_name is None
        self._deltas = VllmDeltas(self)

    # ------------------------------------------------------------------ Engine protocol

    def swap(
        self, version: int, weights: Mapping[str, torch.Tensor], *, digest: str, policy: SwapPolicy = SwapPolicy.DRAIN
    ) -> SwapReport:
        """Hands `weights` to the workers, has them load and digest them, and serves `version`
        only once every worker holds exactly those bytes; running requests meet it as `policy`
        says (module docstring)."""
        started = time.perf_counter()
        check_swap_args(version, digest, policy, self.swap_policies)
        with self._lock:
            return self._swap_whole(version, weights, digest, policy, started)

    def swap_delta(
        self,
        version: int,
        delta: Any,
        *,
        weights: Mapping[str, torch.Tensor],
        digest: str,
        policy: SwapPolicy = SwapPolicy.DRAIN,
    ) -> SwapReport:
        """The optional in-place path (`base.DeltaEngine`, `vllm_delta.py`): only the elements
        `delta` changes go to the workers; a version that must go in whole (see
        `VllmDeltas.refusal`, or workers whose old bits diverged) is swapped like `swap`, and the
        report says why."""
        started = time.perf_counter()
        check_swap_args(version, digest, policy, self.swap_policies)
        with self._lock:
            self._check_open()
            reason = "adapter versions go in whole" if self.config.lora_name else self._deltas.refusal(delta)
            if not reason:
                check_layout(self._layout, weights, what=f"the model vLLM serves (v{self._served})")
                try:
                    return self._deltas.swap(version, delta, weights, digest, policy, started)
                except FullPath as e:
                    reason = str(e)
            logger.info("vllm %s: v%d goes in whole: %s", self.config.url, version, reason)
            report = self._swap_whole(version, weights, digest, policy, started)
        return dataclasses.replace(report, path_reason=reason)

    def undo(self, version: int, *, policy: SwapPolicy = SwapPolicy.DRAIN) -> SwapReport | None:
        """The version served before `version` back from the workers' undo log (O(changed
        elements)); None when the last swap was not the delta swap that made `version` served."""
        check_swap_policy(policy, self.swap_policies)
        with self._lock:
            self._check_open()
            return self._deltas.undo(version, policy)

    def _swap_whole(
        self, version: int, weights: Mapping[str, torch.Tensor], digest: str, policy: SwapPolicy, started: float
    ) -> SwapReport:
        mode = self._pause_mode(policy)
        adapter = self.config.lora_name is not None
        self._check_open()
        if adapter:
            rank = vllm_lora.adapter_rank(version, weights, self.lora_info)
        else:
            check_layout(None, weights)  # tensors; their shapes: against the last version served, below
            self._check_names(version, weights)
            # vLLM's loader would refuse another shape only after the pause, leaving the
            # server paused on half-loaded weights: refused here, while it still serves.
            check_layout(self._layout, weights, what=f"the model vLLM serves (v{self._served})")
        path = self._handoff_dir / f"weightsync-v{version}-{os.getpid()}-{time.monotonic_ns()}"
        try:
            if adapter:
                scale = self.config.lora_alpha / rank
                hashes = vllm_lora.write_peft_dir(path, weights, rank, self.config.lora_alpha, self._write_handoff)
                self._check_handoff(path / vllm_lora.WEIGHTS_FILE, hashes)  # while still serving
                dtype = self.workers[0]["dtype"]
                expected = {
                    (name, dtype): vllm_lora.held_hash(t, name, _TORCH_DTYPES[dtype], scale)
                    for name, t in weights.items()
                }
            else:
                path = path.with_suffix(".safetensors")
                hashes = self._write_handoff(path, weights)
                self._check_handoff(path, hashes)  # while still serving: nothing is touched yet
                expected = self._expected_digests(weights)  # likewise, for the slices the workers held last
            t_pause = time.perf_counter()
            self._swaps_begun += 1  # from here until _swaps_ended catches up, weights may change
            self._post(f"/pause?mode={mode}", timeout_s=self.config.drain_timeout_s)
            paused = time.perf_counter()
            try:
                reports = self._load_adapter(path) if adapter else self._load(path, tag(version, digest))
            except BaseException as e:
                self._mark_unhealthy(f"v{version} failed while loading: {e}")
                raise
            try:
                if adapter:
                    vllm_lora.verify(version, weights, reports, scale, expected, _TORCH_DTYPES)
                else:
                    self._verify(version, weights, reports, expected)
                self._post("/reset_prefix_cache?reset_running_requests=true")
                if "/update_weight_version" in self.routes:
                    self._post("/update_weight_version", {"new_version": str(version)})
                self._post("/resume")
            except BaseException as e:
                self._mark_unhealthy(f"v{version}: {e}")
                raise
            resumed = time.perf_counter()
        finally:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            self._swaps_ended = self._swaps_begun
        self._served, self._served_digest, self._healthy, self._last_error = version, digest, True, None
        self._pause_split = {"wait_s": paused - t_pause, "hold_s": resumed - paused}
        self._layout = None if adapter else layout_of(weights)
        if not adapter:
            self._deltas.after_full_load(weights)  # served already: its plans and D(v) are for the audit
        timings = reports[0].get("timings_s", {})
        logger.info(
            "vllm %s serves v%d: pause %.1f ms (drain %.1f ms, load %.1f ms), swap %.2f s",
            self.config.url,
            version,
            1000 * (resumed - t_pause),
            1000 * (paused - t_pause),
            1000 * timings.get("load", 0.0),
            time.perf_counter() - started,
        )
        return SwapReport(version=version, pause_s=resumed - t_pause, total_s=time.perf_counter() - started)

    def prompt_logprobs(
        self, prompts: Sequence[Sequence[int]], *, timeout_s: float = 60.0, top_k: int = 0
    ) -> PromptLogprobs:
        """The parity probe's question (`agents/parity.py`): per prompt, vLLM's log-prob of each
        prompt token after the first and, with `top_k`, each position's `top_k` most likely next
        tokens (POST /v1/completions with the token ids, prompt_logprobs = top_k, one generated
        token), on whatever the server serves, with the dtype its workers hold the model in.
        vLLM does not expose its routing: no expert choices. The version is the one served around
        the calls; an answer during which a swap began or ran may mix versions, and is reported as
        version -1 (the agent drops it)."""
        if self.weights_kinds == ("adapter",):
            raise WeightsyncError(
                "an adapter-serving vLLM engine answers no parity probe (versions of adapters carry none)"
            )
        before = (self._served, self._swaps_begun, self._swaps_ended)
        model = self._served_model_name()
        logprobs, top_ids, top_logprobs = [], [], []
        for prompt in prompts:
            body = {"model": model, "prompt": [int(t) for t in prompt], "max_tokens": 1, "temperature": 0.0}
            reply = self._post("/v1/completions", body | {"prompt_logprobs": top_k}, timeout_s=timeout_s)
            entries = ((reply.get("choices") or [{}])[0]).get("prompt_logprobs")
            if not isinstance(entries, list) or len(entries) != len(prompt):
                raise WeightsyncError(f"vLLM answered no prompt logprobs for a {len(prompt)}-token probe prompt")
            values, ids, tops = [], [], []
            for i, entry in enumerate(entries[1:], start=1):
                candidate = (entry or {}).get(str(prompt[i]))
                if candidate is None:
                    raise WeightsyncError(f"vLLM's prompt logprobs lack probe token {i}")
                values.append(float(candidate["logprob"]))
                # Each entry holds the prompt token and the top_k by rank (1 = most likely).
                ranked = sorted(
                    (c["rank"], int(t), float(c["logprob"])) for t, c in entry.items() if c["rank"] <= top_k
                )
                if top_k and len(ranked) != top_k:
                    raise WeightsyncError(f"vLLM gave {len(ranked)} of {top_k} top log-probs at probe token {i}")
                ids.append([t for _, t, _ in ranked])
                tops.append([lp for _, _, lp in ranked])
            logprobs.append(torch.tensor(values, dtype=torch.float32))
            top_ids.append(torch.tensor(ids, dtype=torch.long).reshape(len(values), top_k))
            top_logprobs.append(torch.tensor(tops, dtype=torch.float32).reshape(len(values), top_k))
        settled = before[1] == before[2] and (self._served, self._swaps_begun, self._swaps_ended) == before
        version = before[0] if settled and before[0] is not None else -1
        return PromptLogprobs(
            version=version,
            logprobs=logprobs,
            compute_dtype=self.workers[0].get("dtype"),
            top_ids=top_ids if top_k else None,
            top_logprobs=top_logprobs if top_k else None,
        )

    def withdraw(self, reason: str) -> None:
        """Stops serving until the next swap: the server is paused (running requests aborted) and
        the engine reports itself paused and unhealthy with `reason`."""
        with self._lock:
            self._post("/pause?mode=abort", timeout_s=self.config.drain_timeout_s)
            self._mark_unhealthy(reason)

    def _served_model_name(self) -> str:
        """The model name requests must give (the first of GET /v1/models: --served-model-name),
        asked once: a server keeps its name for its life."""
        if self._model_name is None:
            cards = self._get("/v1/models").get("data") or []
            bases = [c.get("id") for c in cards if not c.get("parent")]
            if not bases:
                raise WeightsyncError(f"vLLM at {self.config.url} lists no model in /v1/models")
            self._model_name = bases[0]
        return self._model_name

    def served_version(self) -> int | None:
        return self._served if self._healthy else None

    def wait_unused(self, version: int, timeout_s: float) -> bool:
        return True  # the workers copied the tensors; nothing here refers to the agent's memory

    def check_fit(self, layout: Layout) -> None:
        """The names the workers load and the shapes of the last version served (whole-model
        versions); an adapter's rank and modules are checked on its tensors, in swap."""
        if self.config.lora_name is None:
            self._check_names(None, layout)
            check_fits(self._layout, layout, what=f"the model vLLM serves (v{self._served})")

    def state(self) -> EngineState:
        """Paused after a swap that failed mid-load (until the next good one), else what GET /health says."""
        if not self._healthy:
            return EngineState(state="paused", reason=f"kept paused after a failed swap: {self._last_error}")
        try:
            self._request("GET", "/health", None, min(5.0, self.config.request_timeout_s))
        except WeightsyncError as e:
            return EngineState(state="unreachable", reason=str(e))
        if self._served is None:
            return EngineState(state="empty", reason="no version swapped in since the agent started")
        return EngineState(state="serving", version=self._served)

    def verify_held(self, version: int, weights: Mapping[str, torch.Tensor]) -> HeldReport:
        """Every worker digests what it holds now (`weightsync_digest`, or the adapter's
        `weightsync_lora_digest`) and the digests are compared with the same slices of `weights`."""
        adapter = self.config.lora_name is not None
        what = f"what the vllm engine's {len(self.workers)} worker(s) hold" + (
            f" of adapter {self.config.lora_name!r}"
            if adapter
            else " (MoE experts read back from the CPU kernel's packed layout; other parameters the CPU "
            "kernels repack: as hashed when loaded)"
        )
        with self._lock:
            if not self._healthy or self._served != version:
                served = f"v{self._served}" if self._healthy else f"nothing (paused: {self._last_error})"
                return HeldReport(ok=False, hashed=what, error=f"the engine serves {served}, not v{version}")
            try:
                if adapter:
                    if self._lora_id is None:
                        return HeldReport(ok=False, hashed=what, error="the adapter is not registered with vLLM")
                    reports = self.rpc(
                        "weightsync_lora_digest", str(self._lora_id), timeout_s=self.config.load_timeout_s
                    )
                    rank = vllm_lora.adapter_rank(version, weights, self.lora_info)
                    scale = self.config.lora_alpha / rank
                    vllm_lora.verify(version, weights, reports, scale, {}, _TORCH_DTYPES)
                else:
                    reports = self.rpc("weightsync_digest", timeout_s=self.config.load_timeout_s)
                    self._compare(version, weights, reports)
                    audit = self._deltas.audit(rate_elements_per_s=None, locked=True)
                    if audit["ok"] is False:
                        return HeldReport(ok=False, hashed=what, error=self._last_error or "the audit failed")
            except WeightsyncError as e:
                return HeldReport(ok=False, hashed=what, error=str(e))
        return HeldReport(ok=True, hashed=what)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._deltas.close()
        if self.config.lora_name:  # the adapter's fixed directory: tmpfs memory until the host reboots
            shutil.rmtree(self._handoff_dir / f"weightsync-lora-{self.config.lora_name}", ignore_errors=True)

    # ------------------------------------------------------------------ inspection

    def health(self) -> dict[str, Any]:
        """{"healthy", "served_version", "last_error", "last_audit"}: unhealthy means the server is
        kept paused."""
        return {
            "healthy": self._healthy,
            "served_version": self.served_version(),
            "last_error": self._last_error,
            "last_audit": self._deltas.last_audit,
        }

    def pause_split(self) -> dict[str, float]:
        """The last swap's pause in two: "wait_s", until the server acknowledged /pause (under
        in_flight: the engine step under way finishing), and "hold_s", from then to /resume
        answered (what the swap itself holds requests for)."""
        return dict(self._pause_split)

    def delta_stats(self) -> dict[str, Any]:
        """Figures of the last in-place delta swap (`VllmDeltas.last_swap`): what a benchmark reads."""
        return dict(self._deltas.last_swap)

    def served_weight_version(self) -> str | None:
        """The weight version vLLM itself reports (GET /weight_info), where it has the route."""
        if "/weight_info" not in self.routes:
            return None
        return self._get("/weight_info").get("weight_version")

    def rpc(self, method: str, *args: str, timeout_s: float | None = None) -> list[Any]:
        """One collective RPC on every worker; their results in rank order."""
        timeout_s = timeout_s or self.config.request_timeout_s
        reply = self._post(
            "/collective_rpc", {"method": method, "args": list(args), "timeout": timeout_s}, timeout_s=timeout_s + 30
        )
        results = reply.get("results") if isinstance(reply, dict) else None
        if not isinstance(results, list) or not results:
            raise WeightsyncError(f"{self.config.url}/collective_rpc {method}: no results in {str(reply)[:200]}")
        return results

    # ------------------------------------------------------------------ steps

    def _write_handoff(self, path: Path, weights: Mapping[str, torch.Tensor]) -> dict[str, str]:
        """Writes the handoff file (`write_safetensors_file`: tensor by tensor, no second copy of the
        model in memory) and returns {name: xxh3 of its bytes}."""
        size = sum(t.numel() * t.element_size() for t in weights.values())
        free = os.statvfs(path.parent)
        if size > free.f_bavail * free.f_frsize:
            raise WeightsyncError(
                f"handoff of {size / 2**30:.2f} GiB does not fit in {path.parent}; "
                "give handoff_dir a tmpfs with room for one model"
            )
        return write_safetensors_file(path, weights)

    def _check_handoff(self, path: Path, hashes: dict[str, str]) -> None:
        """Every worker hashes the handoff file against the agent's hashes."""
        try:
            self.rpc("weightsync_check", str(path), json.dumps(hashes), timeout_s=self.config.load_timeout_s)
        except WeightsyncError as e:
            if "damaged between the agent and this worker" in str(e) or "does not hold the announced" in str(e):
                raise IntegrityError(f"in-engine check of the handoff failed: {e}") from e
            raise

    def _expected_digests(self, weights: Mapping[str, torch.Tensor]) -> dict[tuple[int, str, tuple], str]:
        """Hashes of the slices each worker reported holding at the last swap, computed before the
        pause so that verifying after the load is a comparison of strings."""
        return {
            (rank, name, tuple(spec)): _slice_hash(weights[name], *spec)
            for rank, slices in self._slices.items()
            for name, spec in slices.items()
            if name in weights
        }

    def _load(self, path: Path, held: str = "") -> list[dict[str, Any]]:
        results = self.rpc(
            "weightsync_load",
            str(path),
            held,
            json.dumps(list(self.config.native_reload)),
            timeout_s=self.config.load_timeout_s,
        )
        for result in results:
            if not isinstance(result, dict) or "tensors" not in result:
                raise WeightsyncError(f"a worker answered weightsync_load with {str(result)[:300]}")
        return results

    def _verify(
        self,
        version: int,
        weights: Mapping[str, torch.Tensor],
        reports: list[dict[str, Any]],
        expected: Mapping[tuple[int, str, tuple], str] | None = None,
    ) -> None:
        """Each worker's digest against the same slices of the published tensors (`expected`:
        hashes computed beforehand, by rank, name and slice; the rest are computed here); the
        slices they hold are remembered for the next swap's `expected`."""
        self._compare(version, weights, reports, expected)
        self._slices = {
            rank: {name: tuple(entry[:4]) for name, entry in report["tensors"].items()}
            for rank, report in enumerate(reports)
        }

    def _compare(
        self,
        version: int,
        weights: Mapping[str, torch.Tensor],
        reports: list[dict[str, Any]],
        expected: Mapping[tuple[int, str, tuple], str] | None = None,
    ) -> None:
        """IntegrityError (LayoutError) at the first worker slice that differs from `weights`
        (is not among them); what `_verify` checks after a load and `verify_held` at any time."""
        expected = expected or {}
        covered: set[str] = set()
        for rank, report in enumerate(reports):
            if report.get("unverifiable"):
                raise IntegrityError(f"worker {rank} holds parameters no digest covers: {report['unverifiable'][:5]}")
            for name, (dim, start, length, dtype, actual) in report["tensors"].items():
                tensor = weights.get(name)
                if tensor is None:
                    raise LayoutError(
                        f"worker {rank} holds {name}, which v{version} does not publish; the "
                        "served model's architecture does not match the published one"
                    )
                spec = (dim, start, length, dtype)
                want = expected.get((rank, name, spec)) or _slice_hash(tensor, *spec)
                if want != actual:
                    raise IntegrityError(
                        f"worker {rank} holds {name} with digest {actual}, v{version} has "
                        f"{want}: the engine does not serve what was published"
                    )
                covered.add(name)
        missing = sorted(set(weights) - covered)
        if missing:
            raise LayoutError(
                f"v{version} publishes {len(missing)} tensors no worker loaded, e.g. {missing[:5]}; "
                "the served model's architecture does not match the published one"
            )

    def _load_adapter(self, staged: Path) -> list[dict[str, Any]]:
        """Moves the staged PEFT directory's files into this adapter's fixed directory (the path
        vLLM keeps for the name, and reads again should it ever evict the adapter from its cache,
        so it always holds the served version), then has every worker load them: the first time
        through POST /v1/load_lora_adapter (which names the adapter), then in place under the same
        id (the route's own load_inplace would make vLLM reload from disk at every step)."""
        fixed = self._handoff_dir / f"weightsync-lora-{self.config.lora_name}"
        fixed.mkdir(exist_ok=True)
        for name in (vllm_lora.WEIGHTS_FILE, vllm_lora.CONFIG_FILE):
            os.replace(staged / name, fixed / name)
        if self._lora_id is None:
            self._lora_id = self._register_adapter(fixed)
            results = self.rpc("weightsync_lora_digest", str(self._lora_id), timeout_s=self.config.load_timeout_s)
        else:
            results = self.rpc(
                "weightsync_lora_load", str(self._lora_id), str(fixed), timeout_s=self.config.load_timeout_s
            )
        return results

    def _register_adapter(self, directory: Path) -> int:
        """Loads `directory` as lora_name (unloading an earlier registration, e.g. by this agent
        before a restart) and returns the id vLLM gave it: the one id the workers gained."""
        name = self.config.lora_name
        cards = self._get("/v1/models").get("data") or []
        if any(isinstance(card, dict) and card.get("id") == name for card in cards):
            self._post("/v1/unload_lora_adapter", {"lora_name": name})
        before = self._lora_ids()
        self._post(
            "/v1/load_lora_adapter",
            {"lora_name": name, "lora_path": str(directory)},
            timeout_s=self.config.load_timeout_s,
        )
        gained = self._lora_ids() - before
        if len(gained) != 1:
            raise WeightsyncError(
                f"loading adapter {name!r} gave the workers adapter ids {sorted(gained)}, not one: "
                "was another adapter loaded at the same time?"
            )
        return gained.pop()

    def _lora_ids(self) -> set[int]:
        return set(self.rpc("weightsync_lora_info")[0]["ids"])

    def _check_names(self, version: int | None, names: Mapping[str, Any]) -> None:
        """Refuses, before the server is touched, a version whose tensor names are not the ones
        the served model loads (another architecture, a renamed checkpoint)."""
        expected = set(self.workers[0].get("hf_names") or ())
        missing, unexpected = sorted(expected - set(names)), sorted(set(names) - expected)
        if missing or unexpected:
            which = "the version" if version is None else f"v{version}"
            raise LayoutError(
                f"{which} does not fit the model vLLM serves ({self.workers[0].get('model_class')}): "
                f"{len(missing)} tensors missing {missing[:5]}, {len(unexpected)} unexpected "
                f"{unexpected[:5]}; the published model's architecture does not match"
            )

    def _remove_stale_handoffs(self) -> None:
        """Deletes handoffs (files, and staged adapter directories) that an agent killed mid-swap
        left on the tmpfs: each would hold up to a model's bytes of memory until the host reboots.
        Only those whose writer (the pid in the name) is no longer running are touched."""
        for path in self._handoff_dir.glob("weightsync-v*-*-*"):
            parts = path.name.split("-")
            if len(parts) < 4 or not parts[2].isdigit() or _pid_alive(int(parts[2])):
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            logger.info("removed %s, a handoff left by a process that is gone", path)

    def _check_open(self) -> None:
        if self._closed:
            raise WeightsyncError(f"the vllm engine for {self.config.url} is closed")

    def _pause_mode(self, policy: SwapPolicy) -> str:
        """The /pause mode of a swap policy (module docstring)."""
        return _PAUSE_MODE[policy] if policy is not SwapPolicy.DRAIN else self.config.pause_mode

    def _mark_unhealthy(self, reason: str) -> None:
        self._healthy, self._last_error = False, reason
        self._lora_id = None  # the next swap registers the adapter afresh
        logger.error("vllm %s is kept paused and unhealthy: %s", self.config.url, reason)

    # ------------------------------------------------------------------ start

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while True:
            try:
                self._request("GET", "/health", None, self.config.request_timeout_s)
                return
            except WeightsyncError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(1.0)

    def _probe_routes(self) -> set[str]:
        spec = self._get("/openapi.json")
        routes = set(spec.get("paths", {})) if isinstance(spec, dict) else set()
        missing = [route for route in REQUIRED_ROUTES if route not in routes]
        if missing:
            how = "; ".join(f"{route}: {REQUIRED_ROUTES[route]}" for route in missing)
            raise WeightsyncError(
                f"the vLLM server at {self.config.url} lacks {missing} ({how}), and "
                f"pass --worker-extension-cls {EXTENSION}"
            )
        return routes

    def _probe_extension(self) -> list[dict[str, Any]]:
        try:
            workers = self.rpc("weightsync_info")
        except WeightsyncError as e:
            raise WeightsyncError(
                f"the vLLM server at {self.config.url} has no weightsync worker extension "
                f"({e}); start it with --worker-extension-cls {EXTENSION}"
            ) from None
        for worker in workers:
            if not isinstance(worker, dict) or worker.get("protocol") != PROTOCOL:
                raise WeightsyncError(
                    f"the vLLM workers run another weightsync worker extension ({worker}); "
                    f"install the same weightsync version beside vLLM as the agent's"
                )
        return workers

    def _probe_lora(self) -> dict[str, Any]:
        """Refuses a server that cannot take adapters at runtime; returns what its workers take."""
        missing = [r for r in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") if r not in self.routes]
        if missing:
            raise WeightsyncError(
                f"the vLLM server at {self.config.url} lacks {missing}: start it with "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True to serve adapter-only versions (lora_name)"
            )
        try:
            infos = self.rpc("weightsync_lora_info")
        except WeightsyncError as e:
            raise WeightsyncError(
                f"the vLLM workers' weightsync extension cannot serve adapters ({e}); install "
                "the same weightsync version beside vLLM as the agent's"
            ) from None
        if not all(isinstance(info, dict) and info.get("enabled") for info in infos):
            raise WeightsyncError(
                f"the vLLM server at {self.config.url} runs without LoRA: start it with "
                "--enable-lora --max-lora-rank R (R >= the run's LoRA rank)"
            )
        return infos[0]

    # ------------------------------------------------------------------ HTTP

    def _get(self, route: str) -> Any:
        return self._request("GET", route, None, self.config.request_timeout_s)

    def _post(self, route: str, body: Any = None, *, timeout_s: float | None = None) -> Any:
        return self._request("POST", route, body, timeout_s or self.config.request_timeout_s)

    def _request(self, method: str, route: str, body: Any, timeout_s: float) -> Any:
        """The route's JSON reply ({} when empty; {"text": ...} for one that is not JSON); an
        HttpError (a WeightsyncError) that names the route and vLLM's message when it fails."""
        reply = self._http.request(method, route, body, timeout_s=timeout_s)
        try:
            return reply.json()
        except ValueError:
            return {"text": reply.text[:500]}


_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in SAFETENSORS_DTYPES.values() if d is not None}
"""torch's dtype names (what workers report they hold tensors in) -> torch dtypes."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _slice_hash(tensor: torch.Tensor, dim: int, start: int, length: int, dtype: str) -> str:
    """xxh3 of the slice a worker reports it holds, in the dtype it holds it in."""
    piece = tensor if dim < 0 else tensor.narrow(dim, start, length)
    target = _TORCH_DTYPES.get(dtype)
    if target is None:
        raise LayoutError(f"a worker holds a tensor in {dtype}, which weightsync cannot compare")
    return tensor_hash(piece.to(target))
