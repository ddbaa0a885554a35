"""reference_server: the reference inference server, weightsync's embedded default engine.

Serves a `weightsync.models.CausalLM` in-process over HTTP/JSON and implements the `Engine`
protocol (agents/engine.py) beside it. It is zero-copy: `swap` makes the agent's very tensors the
served weights by flipping one reference to an immutable (version, digest, weights) record. Each
request takes the record once when it starts and runs its whole generation on it (the model runs
on per-call weights via `functional_call`), so a request never sees two versions; requests in
flight are counted per version so that `wait_unused` can tell the agent when a replaced version's
memory is free again. Nothing is copied or converted while new requests are held back.

Which compute_dtype: "bfloat16" (default) serves the published bf16 tensors as they are: no copy,
no extra memory, the pause is a reference flip; use it on CPUs with bf16 instructions
(AVX512-BF16, AMX), where it is also the faster one. "float32" converts each version to fp32
before the flip (outside the pause) and generates in fp32: use it on CPUs without bf16
instructions, where bf16 matmuls are emulated and slow, if 2x the memory and a conversion per swap
are affordable. It keeps no reference to the agent's tensors (`zero_copy` is False).
`python -m bench.swap` measures both on the machine at hand.

Not here: verifying or fetching versions (the agent), continuous batching across requests (each
request is its own batch, prompts grouped by length), GPUs, tokenizers beyond `ByteTokenizer`,
TLS or auth (bind to loopback or put a proxy in front).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import logging
import queue
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import MappingProxyType
from typing import Any, NamedTuple

import prometheus_client as prom
import torch

from weightsync.agents.engine import SwapReport, check_layout, check_swap_args, register_engine
from weightsync.errors import LayoutError, WeightsyncError
from weightsync.models import (
    ByteTokenizer,
    CausalLM,
    ModelConfig,
    as_model_config,
    load_pretrained,
    rope_inv_freq,
)

logger = logging.getLogger(__name__)

COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_TOKENIZER = ByteTokenizer()
_GENERATE_FIELDS = {"prompts", "prompt_ids", "max_new_tokens", "temperature", "top_k", "seed", "stop"}
_PAUSE_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReferenceServerConfig:
    """How to run the reference server. Give exactly one of `model` and `model_dir`."""

    host: str = "127.0.0.1"
    """Interface to bind. The API has no auth: keep loopback unless a proxy guards it."""
    port: int = 0
    """TCP port; 0 picks a free one (read it back from `ReferenceServer.url`)."""
    model: ModelConfig | Mapping[str, Any] | None = None
    """The architecture (a ModelConfig or a dict of its fields); no weights until the first swap."""
    model_dir: str | None = None
    """An HF-style directory (config.json + safetensors): its weights are served as version 0."""
    compute_dtype: str = "bfloat16"
    """"bfloat16": serve the swapped-in tensors as they are (zero-copy). "float32": convert each
    version before the flip; faster on CPUs without bf16 instructions, 2x memory, not zero-copy."""
    torch_threads: int | None = None
    """torch.set_num_threads for this process (a process-wide setting); None leaves torch's default."""
    max_concurrent_requests: int = 4
    """Generations running at once; later requests wait up to `queue_timeout_s`, then get 503."""
    queue_timeout_s: float = 30.0
    max_body_bytes: int = 1 << 20
    """Largest request body read; larger ones get 413 without being read."""
    max_batch_size: int = 64
    """Most prompts in one request."""
    max_prompt_tokens: int = 4096
    """Most tokens in one prompt (prompt + new tokens must also fit max_position_embeddings)."""
    max_new_tokens_limit: int = 1024
    """Largest `max_new_tokens` a request may ask for."""

    def __post_init__(self) -> None:
        if (self.model is None) == (self.model_dir is None):
            raise ValueError("give exactly one of model (a ModelConfig or dict of its fields) and model_dir")
        object.__setattr__(self, "model", as_model_config(self.model))
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {sorted(COMPUTE_DTYPES)}, got {self.compute_dtype!r}")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an int in 0..65535 (0 picks a free one), got {self.port!r}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError("torch_threads must be >= 1, or None for torch's default")
        for name in ("max_concurrent_requests", "max_body_bytes", "max_batch_size", "max_prompt_tokens",
                     "max_new_tokens_limit"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not self.queue_timeout_s > 0:
            raise ValueError("queue_timeout_s must be > 0 seconds")


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


class Completion(NamedTuple):
    token_ids: list[int]
    """New tokens, up to and including the stop token if one was produced."""
    logprobs: list[float]
    """log p(token) under the model at temperature 1 (what a policy-gradient loss needs)."""
    text: str | None
    """Byte-tokenizer decoding (up to EOS); None when the vocabulary is not the byte tokenizer's."""
    finish_reason: str
    """"stop" (the stop token was produced) or "length" (max_new_tokens reached)."""


class NotReady(WeightsyncError, RuntimeError):
    """No weights are served yet, or all generation slots stayed busy past the queue timeout."""


class BadRequest(WeightsyncError, ValueError):
    """A generate request that does not follow the API (the message says what to fix)."""


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
        self.swap_pause = prom.Histogram("weightsync_engine_swap_pause_seconds", "Time new requests were held back"
                                         " by a swap", buckets=_PAUSE_BUCKETS_S, **kw)
        self.swap_total = prom.Histogram("weightsync_engine_swap_seconds", "Whole swap call (validation, "
                                         "conversion, flip)", **kw)
        self.version = prom.Gauge("weightsync_engine_weight_version", "Version new requests get (-1: none)", **kw)
        self.version.set(-1)


class ReferenceServer:
    """The reference inference server; it is itself an `Engine` (name "reference")."""

    name = "reference"

    def __init__(self, config: ReferenceServerConfig) -> None:
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
        self._last_pause_s: float | None = None
        self._in_flight: collections.Counter[int] = collections.Counter()
        self._swap_lock = threading.Lock()
        self.metrics = _Metrics()
        self._http: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        if initial is not None:
            self._check_layout(initial, strict_dtype=False)
            tensors = {n: t.to(self._dtype) if t.is_floating_point() else t for n, t in initial.items()}
            self._current = _Record(Served(0, None, MappingProxyType(tensors)), time.time())
            self.metrics.version.set(0)
            logger.info("serving version 0 from %s", config.model_dir)

    # ------------------------------------------------------------------ Engine protocol

    def swap(self, version: int, weights: Mapping[str, torch.Tensor], *, digest: str) -> SwapReport:
        """Makes `weights` the served weights atomically; raises LayoutError (and keeps serving
        the previous version) when they do not fit the architecture."""
        started = time.perf_counter()
        check_swap_args(version, digest)
        with self._swap_lock:
            if self._closed:
                raise WeightsyncError("the reference server is closed")
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
                self._current = _Record(served, time.time())
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

    def close(self) -> None:
        """Stops the HTTP server (running generations finish on their own threads); idempotent."""
        with self._swap_lock:
            if self._closed:
                return
            self._closed = True
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._thread.join(timeout=10)
            logger.info("reference server on %s stopped", self.url)

    # ------------------------------------------------------------------ in-process API

    def requests_in_flight(self) -> int:
        """Generations running now, over all versions."""
        with self._cond:
            return sum(self._in_flight.values())

    def served(self) -> Served:
        """What new requests get now: (version, digest, weights). Raises NotReady before any weights."""
        record = self._current
        if record is None:
            raise NotReady("no weights yet: the agent has not swapped in a version")
        return record.served

    @contextlib.contextmanager
    def lease(self) -> Iterator[Served]:
        """Holds the current version for the duration of the block, as a request does: its
        tensors stay served to the holder, and `wait_unused(version)` waits for the block to end."""
        with self._cond:
            record = self._current
            if record is None:
                raise NotReady("no weights yet: the agent has not swapped in a version")
            self._in_flight[record.served.version] += 1
        try:
            yield record.served
        finally:
            with self._cond:
                self._in_flight[record.served.version] -= 1
                if not self._in_flight[record.served.version]:
                    del self._in_flight[record.served.version]
                    self._cond.notify_all()

    def generate(self, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int = 0, seed: int | None = None, stop: int | None = ByteTokenizer.EOS,
                 ) -> tuple[Served, list[Completion]]:
        """Continuations of `prompt_ids` (any lengths), all from one version; returns that version.

        Prompts are grouped by length and each group decoded as one batch. Inputs are trusted
        (the HTTP layer validates them). Raises NotReady without weights or when every generation
        slot stays busy for `queue_timeout_s`.
        """
        try:
            replica = self._replicas.get(timeout=self.config.queue_timeout_s)
        except queue.Empty:
            raise NotReady(f"all {self.config.max_concurrent_requests} generation slots stayed busy for "
                           f"{self.config.queue_timeout_s}s; retry later") from None
        self.metrics.in_flight.inc()
        try:
            with self.lease() as served:
                generator = torch.Generator()
                if seed is None:
                    generator.seed()  # a default Generator has a fixed seed: every request would sample alike
                else:
                    generator.manual_seed(seed)
                by_length: dict[int, list[int]] = collections.defaultdict(list)
                for i, ids in enumerate(prompt_ids):
                    by_length[len(ids)].append(i)
                completions: list[Completion | None] = [None] * len(prompt_ids)
                for length in sorted(by_length):
                    rows = by_length[length]
                    batch = torch.tensor([list(prompt_ids[i]) for i in rows], dtype=torch.long)
                    tokens, logprobs = replica.generate(
                        batch, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                        stop_token=stop, generator=generator, weights=served.weights)
                    for row, i in enumerate(rows):
                        completions[i] = self._completion(tokens[row].tolist(), logprobs[row].tolist(), stop)
        finally:
            self.metrics.in_flight.dec()
            self._replicas.put(replica)
        self.metrics.prompt_tokens.inc(sum(map(len, prompt_ids)))
        self.metrics.generated_tokens.inc(sum(len(c.token_ids) for c in completions))
        return served, completions

    def _completion(self, tokens: list[int], logprobs: list[float], stop: int | None) -> Completion:
        finish = "length"
        if stop is not None and stop in tokens:  # rows that stopped keep emitting the stop token
            end = tokens.index(stop) + 1
            tokens, logprobs, finish = tokens[:end], logprobs[:end], "stop"
        text = _TOKENIZER.decode(tokens) if self.model_config.vocab_size >= _TOKENIZER.vocab_size else None
        return Completion(tokens, logprobs, text, finish)

    def _check_layout(self, weights: Mapping[str, torch.Tensor], *, strict_dtype: bool) -> None:
        check_layout(self._layout, weights, what="the architecture")
        for name, tensor in weights.items():
            if tensor.device.type != "cpu":
                raise LayoutError(f"{name} is on {tensor.device}; the reference server computes on the CPU")
            if not tensor.is_floating_point():
                raise LayoutError(f"{name} is {tensor.dtype}; the model's weights are floating point")
            if strict_dtype and tensor.dtype != self._dtype:
                raise LayoutError(f"{name} is {tensor.dtype}; compute_dtype {self.config.compute_dtype} serves "
                                  f"{self._dtype} tensors as they are (use compute_dtype float32 to convert)")

    # ------------------------------------------------------------------ HTTP

    def start(self) -> ReferenceServer:
        """Binds host:port and serves HTTP on a background thread; returns self."""
        if self._closed:
            raise WeightsyncError("the reference server is closed; build a new one")
        if self._http is not None:
            return self
        self._http = ThreadingHTTPServer((self.config.host, self.config.port), _Handler)
        self._http.daemon_threads = True
        self._http.engine = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._http.serve_forever, args=(0.1,), name="reference-server",
                                        daemon=True)
        self._thread.start()
        logger.info("reference server listening on %s (compute %s)", self.url, self.config.compute_dtype)
        return self

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:PORT (after `start`)."""
        if self._http is None:
            raise WeightsyncError("the reference server is not started; call start()")
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> ReferenceServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def version_info(self) -> dict[str, Any]:
        """The /v1/version document."""
        record = self._current
        served = record.served if record is not None else Served(None, None, {})
        return {"weight_version": served.version, "weight_digest": served.digest,
                "swapped_at": record and record.swapped_at, "last_swap_pause_s": self._last_pause_s,
                "compute_dtype": self.config.compute_dtype}

    def handle_generate(self, body: bytes) -> dict[str, Any]:
        """The /v1/generate answer for a request body; BadRequest or NotReady on failure."""
        args = parse_generate_request(body, self.model_config, self.config)
        served, completions = self.generate(**args)
        return {"weight_version": served.version, "weight_digest": served.digest,
                "completions": [c._asdict() for c in completions]}


def _replica(config: ModelConfig) -> CausalLM:
    with torch.device("meta"):
        module = CausalLM(config)
    module.inv_freq = rope_inv_freq(config)  # the one real tensor a replica needs
    return module.eval()


def parse_generate_request(body: bytes, model: ModelConfig, limits: ReferenceServerConfig) -> dict[str, Any]:
    """Keyword arguments for `ReferenceServer.generate` from a JSON body; BadRequest on anything off."""
    try:
        doc = json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"body is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise BadRequest("body must be a JSON object")
    unknown = sorted(set(doc) - _GENERATE_FIELDS)
    if unknown:
        raise BadRequest(f"unknown fields {unknown}; known: {sorted(_GENERATE_FIELDS)}")
    if ("prompts" in doc) == ("prompt_ids" in doc):
        raise BadRequest("give exactly one of prompts (list of strings) and prompt_ids (list of lists of ints)")
    max_new = _int(doc.get("max_new_tokens", 64), "max_new_tokens", 1, limits.max_new_tokens_limit)
    vocab = model.vocab_size
    if "prompts" in doc:
        prompts = _list(doc["prompts"], "prompts", limits.max_batch_size)
        if vocab < _TOKENIZER.vocab_size:
            raise BadRequest(f"this model's vocabulary ({vocab}) is not the byte tokenizer's; send prompt_ids")
        prompt_ids = []
        for i, text in enumerate(prompts):
            if not isinstance(text, str):
                raise BadRequest(f"prompts[{i}] must be a string, got {type(text).__name__}")
            prompt_ids.append(_TOKENIZER.encode(text))
    else:
        prompt_ids = []
        for i, ids in enumerate(_list(doc["prompt_ids"], "prompt_ids", limits.max_batch_size)):
            ids = _list(ids, f"prompt_ids[{i}]", limits.max_prompt_tokens)
            prompt_ids.append([_int(t, f"prompt_ids[{i}][{j}]", 0, vocab - 1) for j, t in enumerate(ids)])
    for i, ids in enumerate(prompt_ids):
        if len(ids) > limits.max_prompt_tokens:
            raise BadRequest(f"prompt {i} has {len(ids)} tokens; the limit is {limits.max_prompt_tokens}")
        if len(ids) + max_new > model.max_position_embeddings:
            raise BadRequest(f"prompt {i} ({len(ids)} tokens) + max_new_tokens ({max_new}) exceeds the model's "
                             f"max_position_embeddings ({model.max_position_embeddings})")
    temperature = doc.get("temperature", 0.0)
    # A tiny positive temperature scales logits to inf (NaN probabilities); greedy is spelled 0.
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            temperature == 0 or 0.01 <= temperature <= 100):
        raise BadRequest(f"temperature must be 0 (greedy) or a number in [0.01, 100], got {temperature!r}")
    stop = doc.get("stop", ByteTokenizer.EOS if vocab > ByteTokenizer.EOS else None)
    return {"prompt_ids": prompt_ids, "max_new_tokens": max_new, "temperature": float(temperature),
            "top_k": _int(doc.get("top_k", 0), "top_k", 0, vocab),
            "seed": None if doc.get("seed") is None else _int(doc["seed"], "seed", 0, 2**63 - 1),
            "stop": None if stop is None else _int(stop, "stop", 0, vocab - 1)}


def _refuse_constant(name: str) -> Any:
    raise BadRequest(f"{name} is not a JSON number")


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{what} must be an integer, got {json.dumps(value)[:40]}")
    if not lo <= value <= hi:
        raise BadRequest(f"{what} must be in {lo}..{hi}, got {value}")
    return value


def _list(value: Any, what: str, max_len: int) -> list:
    if not isinstance(value, list) or not value:
        raise BadRequest(f"{what} must be a non-empty list")
    if len(value) > max_len:
        raise BadRequest(f"{what} has {len(value)} entries; the limit is {max_len}")
    return value


class _Handler(BaseHTTPRequestHandler):
    """HTTP/JSON front of a ReferenceServer (`self.server.engine`); holds no logic of its own."""

    protocol_version = "HTTP/1.1"
    server_version = "weightsync-reference/1"
    timeout = 120  # socket timeout: an idle or trickling client cannot hold a thread forever

    def log_message(self, fmt: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), fmt % args)

    def do_GET(self) -> None:
        engine: ReferenceServer = self.server.engine  # type: ignore[attr-defined]
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._send(200, {"status": "ok", "ready": engine.served_version() is not None,
                             "weight_version": engine.served_version()})
        elif path == "/v1/version":
            self._send(200, engine.version_info())
        elif path == "/metrics":
            self._send_raw(200, prom.generate_latest(engine.metrics.registry), prom.CONTENT_TYPE_LATEST)
        elif path == "/v1/generate":
            self._send(405, {"error": "use POST for /v1/generate"}, [("Allow", "POST")])
        else:
            self._send(404, {"error": f"no such path {path!r}; see /v1/generate, /v1/version, /health, /metrics"})

    def do_POST(self) -> None:
        engine: ReferenceServer = self.server.engine  # type: ignore[attr-defined]
        if self.path.split("?", 1)[0] != "/v1/generate":
            self.close_connection = True  # the body was not read
            self._send(404, {"error": f"no such path {self.path!r}; POST /v1/generate"})
            return
        started = time.perf_counter()
        outcome = "ok"
        try:
            body = self._read_body(engine.config.max_body_bytes)
            if body is None:
                outcome = "bad_request"
                return
            answer = engine.handle_generate(body)
            self._send(200, answer, [("X-Weight-Version", str(answer["weight_version"]))])
        except BadRequest as e:
            outcome = "bad_request"
            self._send(400, {"error": str(e)})
        except NotReady as e:
            outcome = "unavailable"
            self._send(503, {"error": str(e)}, [("Retry-After", "1")])
        except Exception as e:  # a bug must cost one request, never the server
            outcome = "error"
            logger.exception("generate failed")
            self._send(500, {"error": f"internal error: {type(e).__name__}: {e}"})
        finally:
            engine.metrics.requests.labels(outcome).inc()
            engine.metrics.request_seconds.observe(time.perf_counter() - started)

    def handle_expect_100(self) -> bool:
        # A client that asks before sending (Expect: 100-continue) learns of an oversized body
        # without sending it.
        length = self.headers.get("Content-Length", "")
        limit = self.server.engine.config.max_body_bytes  # type: ignore[attr-defined]
        if length.isdigit() and int(length) > limit:
            self.close_connection = True
            self._send(413, {"error": f"body of {int(length)} bytes exceeds the limit of {limit} bytes"})
            return False
        return super().handle_expect_100()

    def _read_body(self, max_bytes: int) -> bytes | None:
        """The request body, or None after answering a request whose body cannot be read."""
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding") or length is None:
            self.close_connection = True
            self._send(411, {"error": "send the JSON body with a Content-Length (chunked bodies are not supported)"})
            return None
        if not length.isdigit():
            self.close_connection = True
            self._send(400, {"error": f"bad Content-Length {length!r}"})
            return None
        if int(length) > max_bytes:
            if int(length) <= 8 * max_bytes:  # read and dropped, so the client gets the 413, not a reset
                remaining = int(length)
                while remaining > 0 and (chunk := self.rfile.read(min(1 << 16, remaining))):
                    remaining -= len(chunk)
            self.close_connection = True
            self._send(413, {"error": f"body of {int(length)} bytes exceeds the limit of {max_bytes} bytes"})
            return None
        return self.rfile.read(int(length))

    def _send(self, status: int, doc: Any, headers: Sequence[tuple[str, str]] = ()) -> None:
        self._send_raw(status, json.dumps(doc, allow_nan=False).encode(), "application/json", headers)

    def _send_raw(self, status: int, body: bytes, content_type: str, headers: Sequence[tuple[str, str]] = ()) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers:
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)


def open_reference_server(options: Mapping[str, Any]) -> ReferenceServer:
    """The `open_engine({"type": "reference", ...})` factory: builds and starts the server."""
    names = sorted(f.name for f in dataclasses.fields(ReferenceServerConfig))
    try:
        config = ReferenceServerConfig(**options)
    except TypeError as e:
        raise ValueError(f"reference engine: {e}; options are {names}") from None
    return ReferenceServer(config).start()


register_engine("reference", open_reference_server)


def serve(argv: Sequence[str] | None = None) -> int:
    """Serves an HF-style directory until SIGINT/SIGTERM; prints {"url": ...} once listening."""
    parser = argparse.ArgumentParser(prog="python -m weightsync.agents.reference_server",
                                     description="Serve an HF-style model directory with the reference server.")
    parser.add_argument("--model-dir", required=True, help="config.json + safetensors, served as version 0")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--compute-dtype", choices=sorted(COMPUTE_DTYPES), default="bfloat16")
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--max-concurrent-requests", type=int, default=4)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ReferenceServerConfig(model_dir=args.model_dir, host=args.host, port=args.port,
                                   compute_dtype=args.compute_dtype, torch_threads=args.torch_threads,
                                   max_concurrent_requests=args.max_concurrent_requests)
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    with ReferenceServer(config) as server:
        print(json.dumps({"url": server.url, "weight_version": server.served_version()}), flush=True)
        while not stop.wait(1.0):
            pass
    return 0


def main() -> None:
    raise SystemExit(serve())


if __name__ == "__main__":
    main()
