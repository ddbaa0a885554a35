"""reference: the reference inference engine, weightsync's embedded default.

Runs a `weightsync.models.CausalLM` in-process and implements the `Engine` protocol
(agents/engines/base.py). It is zero-copy: `swap` makes the agent's very tensors the served weights by
flipping one reference to an immutable (version, digest, weights, policy) record. Each request
takes the record when it starts and holds it (the model runs on per-call weights via
`functional_call`); requests in flight are counted per version so that `wait_unused` can tell the
agent when a replaced version's memory is free again. Nothing is copied or converted while new
requests are held back.

What a running request does when a swap lands is the swap's policy (`SwapPolicy`),
applied between token steps, never inside a forward pass:
    drain      it keeps its version to the end: a response comes from one version
    in_flight  at its next token step it takes the new record; its KV cache is recomputed from
               the prefix with the new weights (CausalLM.generate's `next_weights`), and each
               completion lists which versions made which token ranges
    abort      at its next token step it is cut and run again from the start on the new record
               (same seed); the response says how often (`restarts`)
Under in_flight and abort a replaced version is left within one token step of each running
request, so the agent's double buffer is free again at once: no third buffer is needed.

Which compute_dtype: "bfloat16" (default) serves the published bf16 tensors as they are: no copy,
no extra memory, the pause is a reference flip; use it on CPUs with bf16 instructions
(AVX512-BF16, AMX), where it is also the faster one. "float32" converts each version to fp32
before the flip (outside the pause) and generates in fp32: use it on CPUs without bf16
instructions, where bf16 matmuls are emulated and slow, if 2x the memory and a conversion per swap
are affordable. It keeps no reference to the agent's tensors (`zero_copy` is False). "float16"
converts likewise, for engines that serve fp16 (the parity probe holds an engine to the trainer's
record of its own compute dtype: train.publish.probe_dtypes must list it).
`python -m bench.swap` measures bfloat16 and float32 on the machine at hand.

Not here: the HTTP/JSON front end, request validation and the "reference" engine type
(`reference_server.py`), verifying or fetching versions (the agent), continuous batching across
requests (each request is its own batch, prompts grouped by length), GPUs, tokenizers beyond
`ByteTokenizer`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import prometheus_client as prom
import torch

from weightsync.agents.engines.base import (
    EngineState,
    HeldReport,
    Layout,
    PromptLogprobs,
    SwapReport,
    check_fits,
    check_layout,
    check_swap_args,
    compare_tensors,
    layout_of,
)
from weightsync.agents.engines.swap_policy import SwapPolicy
from weightsync.errors import ConfigError, LayoutError, WeightsyncError
from weightsync.models import (
    ByteTokenizer,
    CausalLM,
    ModelConfig,
    as_model_config,
    load_pretrained,
    rope_inv_freq,
    skeleton,
)
from weightsync.models.probe import run_probe

logger = logging.getLogger(__name__)

COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MODEL_STOP = "model"
"""`generate(stop=MODEL_STOP)`: stop at the model's own EOS (`ReferenceEngine.default_stop`)."""
TOKENIZER = ByteTokenizer()
_PAUSE_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReferenceEngineConfig:
    """How to run the reference engine. Give exactly one of `model` and `model_dir`."""

    model: ModelConfig | Mapping[str, Any] | None = None
    """The architecture (a ModelConfig or a dict of its fields); no weights until the first swap."""
    model_dir: str | None = None
    """An HF-style directory (config.json + safetensors): its weights are served as version 0."""
    compute_dtype: str = "bfloat16"
    """"bfloat16": serve the swapped-in tensors as they are (zero-copy). "float32": convert each
    version before the flip; faster on CPUs without bf16 instructions, 2x memory, not zero-copy.
    "float16": convert likewise (what an fp16 engine computes)."""
    torch_threads: int | None = None
    """torch.set_num_threads for this process (a process-wide setting); None leaves torch's default."""
    max_concurrent_requests: int = 4
    """Generations running at once; later requests wait up to `queue_timeout_s`, then get NotReady."""
    queue_timeout_s: float = 30.0
    eos_token_id: int | None = None
    """The token a generation stops at when a request sends no `stop` ("stop": null turns it off).
    None: the model's own, eos_token_id from model_dir's generation_config.json, else from its
    config.json (the first one where they list several); failing those, the byte tokenizer's EOS
    (257) for a model whose vocabulary is the byte tokenizer's (259 tokens, as the demo's and
    the trainer's small models); else no default stop: generations run to max_new_tokens."""

    def __post_init__(self) -> None:
        if (self.model is None) == (self.model_dir is None):
            raise ValueError(
                "give exactly one of model (the architecture: a table of ModelConfig fields) and model_dir "
                "(an HF directory, config.json + safetensors: --model-dir) for the reference engine; got "
                f"{'both' if self.model is not None else 'neither'}"
            )
        object.__setattr__(self, "model", as_model_config(self.model))
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {sorted(COMPUTE_DTYPES)}, got {self.compute_dtype!r}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError("torch_threads must be >= 1, or None for torch's default")
        value = self.max_concurrent_requests
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"max_concurrent_requests must be a positive int, got {value!r}")
        if not self.queue_timeout_s > 0:
            raise ValueError("queue_timeout_s must be > 0 seconds")
        eos = self.eos_token_id
        if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int) or eos < 0):
            raise ValueError(f"eos_token_id must be a token id (an int >= 0) or None, got {eos!r}")

    @classmethod
    def options_from_store(cls, table: Mapping[str, Any], *, store: str, model: str, where: str) -> dict[str, Any]:
        """With neither `model` nor `model_dir` in `table`: the architecture (and stop token) of the
        config.json that `model`'s latest version carries in `store` (weightsync.model_files), so that
        an agent given a store needs nothing else (engines.complete_from_store). ConfigError when the
        store cannot tell: no versions of the model (naming the models it holds), or versions
        published without a config.json."""
        if "model" in table or "model_dir" in table:
            return {}
        from weightsync.model_files import get_model_files
        from weightsync.stores import open_store
        from weightsync.versions import latest_version, list_models, read_manifest

        give = "give the engine its architecture: --model-dir DIR (an HF directory), or [agent.engine] model = {...}"
        try:
            opened = open_store(store)
            latest = latest_version(opened, model)
            if latest is None:
                models = list_models(opened)
                holds = f"it holds {', '.join(models[:10])}" if models else "it holds no models yet"
                raise ConfigError(
                    f"{where}: the reference engine reads its architecture from the store, and {opened.uri} has no "
                    f"versions of {model!r}; {holds}. Name one of them (model), wait for the trainer's first "
                    f"version, or {give}"
                )
            files = get_model_files(opened, model, read_manifest(opened, model, latest))
        except ConfigError:
            raise
        except WeightsyncError as e:
            raise ConfigError(f"{where}: cannot read the architecture of {model!r} from {store}: {e}; {give}") from None
        if "config.json" not in files:
            raise ConfigError(
                f"{where}: {model} v{latest} in {opened.uri} was published without a config.json, so the reference "
                f"engine cannot know its architecture; {give} (`weightsync train`, and `weightsync publish` of an "
                "HF directory, publish one)"
            )
        what = f"{model} v{latest}"
        try:
            architecture = ModelConfig.from_hf(json.loads(files["config.json"]))
            eos = None
            for name in ("generation_config.json", "config.json"):  # as default_stop_token reads a model_dir
                eos = eos_token_in(files[name], what=f"{name} of {what}") if name in files else None
                if eos is not None:
                    break
        except (ValueError, TypeError) as e:  # LayoutError is a ValueError
            raise ConfigError(f"{where}: the config.json of {what} is not one the reference engine runs: {e}") from None
        return {"model": architecture} | ({"eos_token_id": eos} if eos is not None else {})


class Served(NamedTuple):
    """One version as served: what `served()` returns and what a request runs on."""

    version: int
    digest: str | None
    """The version digest the agent verified; None for weights loaded from `model_dir` at start."""
    weights: Mapping[str, torch.Tensor]
    """Read-only mapping of HF names to the served tensors."""


@dataclasses.dataclass(frozen=True)
class _Record:
    served: Served
    swapped_at: float  # unix seconds
    policy: SwapPolicy = SwapPolicy.DRAIN  # how requests running on the version it replaced meet it


class VersionRange(NamedTuple):
    """Tokens [start, stop) of a completion were produced by weight `version`."""

    version: int
    start: int
    stop: int


class Completion(NamedTuple):
    token_ids: list[int]
    """New tokens, up to and including the stop token if one was produced."""
    logprobs: list[float]
    """log p(token) under the model at temperature 1 (what a policy-gradient loss needs)."""
    text: str | None
    """Byte-tokenizer decoding (up to EOS); None when the vocabulary is not the byte tokenizer's."""
    finish_reason: str
    """"stop" (the stop token was produced) or "length" (max_new_tokens reached)."""
    versions: list[VersionRange]
    """Which weight versions produced which tokens, in order (one range unless an in_flight swap
    came during the generation)."""


class Generation(NamedTuple):
    """What `generate` returns."""

    served: Served
    """The version the request started on (after its last restart): the oldest one any of its
    tokens came from."""
    completions: list[Completion]
    restarts: int
    """How often an abort swap cut the request and it ran again from the start."""

    def versions(self) -> list[int]:
        """Every version that produced a token of this response, ascending."""
        return sorted({r.version for c in self.completions for r in c.versions} | {self.served.version})


class NotReady(WeightsyncError, RuntimeError):
    """No weights are served yet, or all generation slots stayed busy past the queue timeout."""


class _Aborted(Exception):
    """An abort swap came while the request ran: it starts again on the new version."""


class _Metrics:
    """Prometheus metrics of one server, in its own registry (several servers may share a process)."""

    def __init__(self) -> None:
        self.registry = prom.CollectorRegistry()
        kw = {"registry": self.registry}
        self.requests = prom.Counter("weightsync_engine_requests", "Generate requests by outcome", ["outcome"], **kw)
        self.prompt_tokens = prom.Counter("weightsync_engine_prompt_tokens", "Prompt tokens processed", **kw)
        self.generated_tokens = prom.Counter("weightsync_engine_generated_tokens", "Tokens generated", **kw)
        self.request_seconds = prom.Histogram("weightsync_engine_request_seconds", "Generate request duration", **kw)
        self.in_flight = prom.Gauge("weightsync_engine_requests_in_flight", "Generations running", **kw)
        self.swaps = prom.Counter("weightsync_engine_swaps", "Swaps by outcome", ["outcome"], **kw)
        self.swap_pause = prom.Histogram(
            "weightsync_engine_swap_pause_seconds",
            "Time new requests were held back by a swap",
            buckets=_PAUSE_BUCKETS_S,
            **kw,
        )
        self.swap_total = prom.Histogram(
            "weightsync_engine_swap_seconds", "Whole swap call (validation, conversion, flip)", **kw
        )
        self.version = prom.Gauge("weightsync_engine_weight_version", "Version new requests get (-1: none)", **kw)
        self.version.set(-1)


class ReferenceEngine:
    """The reference inference engine, in-process (name "reference"); `ReferenceServer` adds HTTP."""

    name = "reference"
    swap_policies = tuple(SwapPolicy)
    weights_kinds = ("model",)
    url: str | None = None
    """In-process: no endpoint of its own (`ReferenceServer.url` is its HTTP one)."""

    def __init__(self, config: ReferenceEngineConfig) -> None:
        self.config = config
        self.zero_copy = config.compute_dtype == "bfloat16"
        self._dtype = COMPUTE_DTYPES[config.compute_dtype]
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        initial = None
        if config.model_dir is not None:
            model_config, initial = load_pretrained(config.model_dir)
        else:
            model_config = config.model
        self.model_config: ModelConfig = model_config
        self.default_stop = default_stop_token(config, model_config)
        """The stop token of a request that names none (ReferenceEngineConfig.eos_token_id)."""
        # Any float dtype fits the architecture; _check_layout adds what this engine needs.
        self._layout = {name: (None, tuple(t.shape)) for name, t in _replica(model_config).state_dict().items()}
        # functional_call swaps the weights into the module for the duration of a call, so a
        # module runs one request at a time: each running request borrows its own replica.
        # Replicas live on the meta device (no memory) apart from the RoPE frequencies.
        self._replicas: queue.SimpleQueue[CausalLM] = queue.SimpleQueue()
        for _ in range(config.max_concurrent_requests):
            self._replicas.put(_replica(model_config))
        self._cond = threading.Condition()
        self._current: _Record | None = None
        self._withdrawn = ""  # why `withdraw` stopped serving ("" when it did not)
        self._last_pause_s: float | None = None
        self._in_flight: collections.Counter[int] = collections.Counter()
        self._swap_lock = threading.Lock()
        self.metrics = _Metrics()
        self._closed = False
        if initial is not None:
            self._check_layout(initial, strict_dtype=False)
            tensors = {n: t.to(self._dtype) if t.is_floating_point() else t for n, t in initial.items()}
            self._current = _Record(Served(0, None, MappingProxyType(tensors)), time.time())
            self.metrics.version.set(0)
            logger.info("serving version 0 from %s", config.model_dir)

    # ------------------------------------------------------------------ Engine protocol

    def swap(
        self, version: int, weights: Mapping[str, torch.Tensor], *, digest: str, policy: SwapPolicy = SwapPolicy.DRAIN
    ) -> SwapReport:
        """Makes `weights` the served weights atomically; running requests meet them as `policy`
        says (module docstring). Raises LayoutError (and keeps serving the previous version)
        when they do not fit the architecture."""
        started = time.perf_counter()
        check_swap_args(version, digest, policy, self.swap_policies)
        with self._swap_lock:
            if self._closed:
                raise WeightsyncError("the reference engine is closed")
            try:
                self._check_layout(weights, strict_dtype=self.zero_copy)
            except LayoutError:
                self.metrics.swaps.labels("refused").inc()
                raise
            tensors = dict(weights)
            if not self.zero_copy:  # converted before the flip: the pause never includes it
                tensors = {n: t.to(self._dtype) if t.is_floating_point() else t for n, t in tensors.items()}
            served = Served(version, digest, MappingProxyType(tensors))
            flip = time.perf_counter()
            with self._cond:
                self._current, self._withdrawn = _Record(served, time.time(), policy), ""
                self._cond.notify_all()
            pause_s = self._last_pause_s = time.perf_counter() - flip
            total_s = time.perf_counter() - started
        self.metrics.swaps.labels("ok").inc()
        self.metrics.swap_pause.observe(pause_s)
        self.metrics.swap_total.observe(total_s)
        self.metrics.version.set(version)
        logger.info("swapped to version %d (pause %.1f us, swap %.1f ms)", version, pause_s * 1e6, total_s * 1e3)
        return SwapReport(version=version, pause_s=pause_s, total_s=total_s)

    def served_version(self) -> int | None:
        record = self._current
        return None if record is None else record.served.version

    def wait_unused(self, version: int, timeout_s: float) -> bool:
        """True once no request runs on `version` and new requests get another version. A
        float32 server converted the agent's tensors, so it never holds them: True at once."""
        if not self.zero_copy:
            return True

        def unused() -> bool:
            current = self._current
            return (current is None or current.served.version != version) and not self._in_flight[version]

        with self._cond:
            return self._cond.wait_for(unused, timeout=max(0.0, timeout_s))

    def check_fit(self, layout: Layout) -> None:
        """LayoutError where `swap` would refuse weights of `layout` (the architecture's names and
        shapes, floating point, and under compute_dtype bfloat16 that dtype)."""
        check_fits(self._layout, layout, what="the architecture")
        self._check_dtypes(layout, strict_dtype=self.zero_copy)

    def state(self) -> EngineState:
        """In-process: serving whatever was swapped in last (or loaded from model_dir as version 0)."""
        version = self.served_version()
        if version is None and self._withdrawn:
            return EngineState(state="paused", reason=self._withdrawn)
        if version is None:
            return EngineState(state="empty", reason="no weights yet: the agent has not swapped in a version")
        return EngineState(state="serving", version=version)

    def verify_held(self, version: int, weights: Mapping[str, torch.Tensor]) -> HeldReport:
        """The served tensors against `weights`: the same memory under compute_dtype bfloat16
        (zero-copy: the agent's re-hash of its buffers covers them), re-hashed in float32."""
        record = self._current
        what = f"the {len(record.served.weights) if record else 0} tensors the reference engine serves" + (
            " (the agent's own buffers: zero-copy)" if self.zero_copy else f" ({self.config.compute_dtype})"
        )
        if record is None or record.served.version != version:
            served = "nothing" if record is None else f"v{record.served.version}"
            return HeldReport(ok=False, hashed=what, error=f"the engine serves {served}, not v{version}")
        error = compare_tensors(record.served.weights, weights)
        return HeldReport(ok=not error, hashed=what, error=error)

    def close(self) -> None:
        """Refuses further swaps (running generations finish on their own threads); idempotent."""
        self._close_engine()

    def _close_engine(self) -> bool:
        """Marks the engine closed; whether this call did (False when it already was)."""
        with self._swap_lock:
            if self._closed:
                return False
            self._closed = True
            return True

    # ------------------------------------------------------------------ in-process API

    def requests_in_flight(self) -> int:
        """Generations running now, over all versions."""
        with self._cond:
            return sum(self._in_flight.values())

    def served(self) -> Served:
        """What new requests get now: (version, digest, weights). Raises NotReady before any weights."""
        record = self._current
        if record is None:
            raise NotReady(self._withdrawn or "no weights yet: the agent has not swapped in a version")
        return record.served

    @contextlib.contextmanager
    def lease(self) -> Iterator[Served]:
        """Holds the current version for the duration of the block, as a drain-policy request
        does: its tensors stay served to the holder, and `wait_unused(version)` waits for the
        block to end."""
        with self._cond:
            record = self._hold()
        try:
            yield record.served
        finally:
            self._release(record)

    def _hold(self) -> _Record:
        """The current record, counted as in use (call under `_cond`)."""
        record = self._current
        if record is None:
            raise NotReady(self._withdrawn or "no weights yet: the agent has not swapped in a version")
        self._in_flight[record.served.version] += 1
        return record

    def _release(self, record: _Record) -> None:
        with self._cond:
            self._in_flight[record.served.version] -= 1
            if not self._in_flight[record.served.version]:
                del self._in_flight[record.served.version]
                self._cond.notify_all()

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: int | None | str = MODEL_STOP,
    ) -> Generation:
        """Continuations of `prompt_ids` (any lengths), with the versions that produced them.

        `stop`: the token that ends a completion (None: none, MODEL_STOP: the model's, `default_stop`).

        Prompts are grouped by length and each group decoded as one batch. A swap during the
        generation is met as its policy says (module docstring). Inputs are trusted (the HTTP
        layer validates them). Raises NotReady without weights or when every generation slot
        stays busy for `queue_timeout_s`.
        """
        if stop == MODEL_STOP:
            stop = self.default_stop
        try:
            replica = self._replicas.get(timeout=self.config.queue_timeout_s)
        except queue.Empty:
            raise NotReady(
                f"all {self.config.max_concurrent_requests} generation slots stayed busy for "
                f"{self.config.queue_timeout_s}s; retry later"
            ) from None
        self.metrics.in_flight.inc()
        restarts = 0
        try:
            with self._cond:
                request = self._running(self._hold())
            try:
                while True:
                    started = request.record
                    try:
                        completions = self._generate_on(
                            replica,
                            request,
                            prompt_ids,
                            max_new_tokens=max_new_tokens,
                            temperature=temperature,
                            top_k=top_k,
                            seed=seed,
                            stop=stop,
                        )
                        break
                    except _Aborted:
                        restarts += 1
                        logger.info(
                            "a request on version %d was cut by an abort swap; it runs again on version %d",
                            started.served.version,
                            request.record.served.version,
                        )
            finally:
                self._release(request.record)
        finally:
            self.metrics.in_flight.dec()
            self._replicas.put(replica)
        self.metrics.prompt_tokens.inc(sum(map(len, prompt_ids)))
        self.metrics.generated_tokens.inc(sum(len(c.token_ids) for c in completions))
        return Generation(started.served, completions, restarts)

    def prompt_logprobs(
        self, prompts: Sequence[Sequence[int]], *, timeout_s: float = 60.0, top_k: int = 0
    ) -> PromptLogprobs:
        """The parity probe's question (`agents/parity.py`): per prompt, the log-prob of each token
        after the first, with `top_k` each position's most likely next tokens, and for MoE models
        the experts each sparse layer chose per token, on the served version (held for the call,
        like a drain-policy request), in the compute dtype. Computed by
        `weightsync.models.probe.run_probe`, the very code the trainer's probe runs."""
        try:
            replica = self._replicas.get(timeout=min(timeout_s, self.config.queue_timeout_s))
        except queue.Empty:
            raise NotReady("every generation slot stayed busy; the parity probe waits for the next version") from None
        try:  # a generation slot bounds the probe's memory and CPU like a request's
            with self.lease() as served:
                weights = served.weights
                run = run_probe(self.model_config, prompts, weights.__getitem__, dtypes=[self._dtype], top_k=top_k)
        finally:
            self._replicas.put(replica)
        run = run[self._dtype]
        return PromptLogprobs(
            version=served.version,
            logprobs=run.logprobs,
            experts=run.experts,
            compute_dtype=self.config.compute_dtype,
            top_ids=run.top_ids,
            top_logprobs=run.top_logprobs,
        )

    def withdraw(self, reason: str) -> None:
        """Stops serving until the next swap: new requests are refused (NotReady with `reason`),
        running ones finish on their version; `state()` says "paused"."""
        with self._cond:
            self._current, self._withdrawn = None, reason
            self._cond.notify_all()
        self.metrics.version.set(-1)
        logger.warning("serving nothing: %s", reason)

    def _running(self, record: _Record) -> _Running:
        """The state of one request starting on `record` (tests gate its steps by subclassing)."""
        return _Running(self, record)

    def _generate_on(
        self,
        replica: CausalLM,
        request: _Running,
        prompt_ids: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        top_k: int,
        seed: int | None,
        stop: int | None,
    ) -> list[Completion]:
        """One attempt at the whole request, starting on `request.record`; _Aborted if an abort
        swap cuts it."""
        generator = torch.Generator()
        if seed is None:
            generator.seed()  # a default Generator has a fixed seed: every request would sample alike
        else:
            generator.manual_seed(seed)
        by_length: dict[int, list[int]] = collections.defaultdict(list)
        for i, ids in enumerate(prompt_ids):
            by_length[len(ids)].append(i)
        completions: list[Completion | None] = [None] * len(prompt_ids)
        for group, length in enumerate(sorted(by_length)):
            if group:  # between two batches is a step boundary too
                request.between_steps(0)
            switches = [(request.record.served.version, 0)]

            def next_weights(i: int, switches: list = switches) -> Mapping[str, torch.Tensor] | None:
                record = request.between_steps(i)
                if record is None:
                    return None
                switches.append((record.served.version, i))
                return record.served.weights

            rows = by_length[length]
            batch = torch.tensor([list(prompt_ids[i]) for i in rows], dtype=torch.long)
            tokens, logprobs = replica.generate(
                batch,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                stop_token=stop,
                generator=generator,
                weights=request.record.served.weights,
                next_weights=next_weights,
            )
            for row, i in enumerate(rows):
                completions[i] = self._completion(tokens[row].tolist(), logprobs[row].tolist(), stop, switches)
        return completions

    def _completion(
        self, tokens: list[int], logprobs: list[float], stop: int | None, switches: list[tuple[int, int]]
    ) -> Completion:
        finish = "length"
        if stop is not None and stop in tokens:  # rows that stopped keep emitting the stop token
            end = tokens.index(stop) + 1
            tokens, logprobs, finish = tokens[:end], logprobs[:end], "stop"
        text = TOKENIZER.decode(tokens) if self.model_config.vocab_size >= TOKENIZER.vocab_size else None
        # A switch at or after the row's end made none of its tokens (the batch went on for other rows).
        starts = [(version, start) for version, start in switches if start < len(tokens)] or switches[:1]
        ranges = [
            VersionRange(version, start, stop_at)
            for (version, start), (_, stop_at) in zip(starts, starts[1:] + [(None, len(tokens))], strict=True)
        ]
        return Completion(tokens, logprobs, text, finish, ranges)

    def _check_layout(self, weights: Mapping[str, torch.Tensor], *, strict_dtype: bool) -> None:
        check_layout(self._layout, weights, what="the architecture")
        for name, tensor in weights.items():
            if tensor.device.type != "cpu":
                raise LayoutError(f"{name} is on {tensor.device}; the reference server computes on the CPU")
        self._check_dtypes(layout_of(weights), strict_dtype=strict_dtype)

    def _check_dtypes(self, layout: Layout, *, strict_dtype: bool) -> None:
        for name, (dtype, _) in layout.items():
            if not dtype.is_floating_point:
                raise LayoutError(f"{name} is {dtype}; the model's weights are floating point")
            if strict_dtype and dtype != self._dtype:
                raise LayoutError(
                    f"{name} is {dtype}; compute_dtype {self.config.compute_dtype} serves "
                    f"{self._dtype} tensors as they are (use compute_dtype float32 to convert)"
                )


class _Running:
    """One running request: the record it holds (counted for `wait_unused`), moved on between
    token steps as the policy of the swap that replaced it says."""

    def __init__(self, engine: ReferenceEngine, record: _Record) -> None:
        self.engine = engine
        self.record = record

    def between_steps(self, step: int) -> _Record | None:
        """Called between two token steps, before new token `step`: the record to go on with when an in_flight swap
        replaced the one held (None: keep the one held); _Aborted after an abort swap, the
        request then holding the new record to start again on."""
        engine = self.engine
        current = engine._current
        # None: the version was withdrawn (the agent serves nothing); running requests finish on theirs.
        if current is None or current is self.record or current.policy is SwapPolicy.DRAIN:
            return None
        with engine._cond:
            current = engine._current
            if current is None:
                return None
            old, self.record = self.record, engine._hold()
        engine._release(old)
        if current.policy is SwapPolicy.ABORT:
            raise _Aborted
        return current


def default_stop_token(config: ReferenceEngineConfig, model: ModelConfig) -> int | None:
    """The stop token of a request that names none: `config.eos_token_id`, else the model
    directory's own (generation_config.json, then config.json), else the byte tokenizer's EOS for
    a model with its vocabulary, else None (ReferenceEngineConfig.eos_token_id says why)."""
    eos = config.eos_token_id
    if eos is None and config.model_dir is not None:
        for name in ("generation_config.json", "config.json"):
            eos = _eos_in(Path(config.model_dir) / name)
            if eos is not None:
                break
    if eos is None and model.vocab_size == ByteTokenizer.vocab_size:
        eos = ByteTokenizer.EOS
    if eos is not None and not 0 <= eos < model.vocab_size:
        raise LayoutError(f"eos_token_id {eos} is not a token of the model's vocabulary (0..{model.vocab_size - 1})")
    return eos


def _eos_in(path: Path) -> int | None:
    """The eos_token_id an HF config file names (the first of a list), or None."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise LayoutError(f"cannot read {path}: {e}") from None
    return eos_token_in(data, what=str(path))


def eos_token_in(data: bytes, *, what: str) -> int | None:
    """The eos_token_id an HF config file's bytes name (the first of a list), or None; `what` names
    the file in errors."""
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise LayoutError(f"cannot read {what}: {e}") from None
    eos = doc.get("eos_token_id") if isinstance(doc, dict) else None
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int)):
        raise LayoutError(f"{what}: eos_token_id must be a token id, got {eos!r}")
    return eos


def _replica(config: ModelConfig) -> CausalLM:
    module = skeleton(config)
    module.inv_freq = rope_inv_freq(config)  # the one real tensor a replica needs
    return module.eval()
