"""reference_server: the HTTP/JSON front end of the reference engine, and the "reference" engine type.

`ReferenceServer` is a `ReferenceEngine` (`reference.py`: the zero-copy `Engine`, generation)
that also serves it over HTTP: POST /v1/generate, GET /v1/version, /health and /metrics. The
handler validates each request (`parse_generate_request`) and delegates; it holds no logic of its
own. `ReferenceServerConfig` is what the registry knows as "reference": `open()` builds and starts
a server, and `python -m weightsync.agents.engines.reference_server --model-dir DIR` serves a
directory.

Not here: swapping, generation and what requests see during a swap (`reference.py`), TLS or auth
(bind to loopback or put a proxy in front).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

import prometheus_client as prom

from weightsync.agents.engines.reference import (
    COMPUTE_DTYPES,
    TOKENIZER,
    Completion,
    Generation,
    NotReady,
    ReferenceEngine,
    ReferenceEngineConfig,
    Served,
)
from weightsync.errors import WeightsyncError
from weightsync.models import ModelConfig
from weightsync.transport.json_http import BodyError, JsonHandler, JsonHttpServer

__all__ = [
    "BadRequest",
    "Completion",
    "Generation",
    "NotReady",
    "ReferenceServer",
    "ReferenceServerConfig",
    "Served",
    "parse_generate_request",
    "serve",
]

logger = logging.getLogger(__name__)

_GENERATE_FIELDS = {"prompts", "prompt_ids", "max_new_tokens", "temperature", "top_k", "seed", "stop"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReferenceServerConfig(ReferenceEngineConfig):
    """How to run the reference server: the engine's settings (give exactly one of `model` and
    `model_dir`), where to listen, and the limits every request is checked against."""

    host: str = "127.0.0.1"
    """Interface to bind. The API has no auth: keep loopback unless a proxy guards it."""
    port: int = 0
    """TCP port; 0 picks a free one (read it back from `ReferenceServer.url`)."""
    max_body_bytes: int = 1 << 20
    """Largest request body read; larger ones get 413 without being read."""
    max_batch_size: int = 64
    """Most prompts in one request."""
    max_prompt_tokens: int = 4096
    """Most tokens in one prompt (prompt + new tokens must also fit max_position_embeddings)."""
    max_new_tokens_limit: int = 1024
    """Largest `max_new_tokens` a request may ask for."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an int in 0..65535 (0 picks a free one), got {self.port!r}")
        for name in ("max_body_bytes", "max_batch_size", "max_prompt_tokens", "max_new_tokens_limit"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    def open(self) -> ReferenceServer:
        """The server this config describes, started (the registry's "reference" engine)."""
        return ReferenceServer(self).start()


class BadRequest(WeightsyncError, ValueError):
    """A generate request that does not follow the API (the message says what to fix)."""


class ReferenceServer(ReferenceEngine):
    """The reference engine behind an HTTP server; it is itself an `Engine` (name "reference")."""

    config: ReferenceServerConfig

    def __init__(self, config: ReferenceServerConfig) -> None:
        super().__init__(config)
        self._http: JsonHttpServer | None = None
        self._thread: threading.Thread | None = None

    def close(self) -> None:
        """Stops the HTTP server (running generations finish on their own threads); idempotent."""
        if not self._close_engine():
            return
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._thread.join(timeout=10)
            logger.info("reference server on %s stopped", self.url)

    def start(self) -> ReferenceServer:
        """Binds host:port and serves HTTP on a background thread; returns self."""
        if self._closed:
            raise WeightsyncError("the reference server is closed; build a new one")
        if self._http is not None:
            return self
        self._http = JsonHttpServer(
            (self.config.host, self.config.port), _Handler, max_body_bytes=self.config.max_body_bytes
        )
        self._http.engine = self  # type: ignore[attr-defined]
        self._thread = self._http.serve_in_thread("reference-server")
        logger.info("reference server listening on %s (compute %s)", self.url, self.config.compute_dtype)
        return self

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:PORT (after `start`)."""
        if self._http is None:
            raise WeightsyncError("the reference server is not started; call start()")
        return self._http.url

    def __enter__(self) -> ReferenceServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def version_info(self) -> dict[str, Any]:
        """The /v1/version document."""
        record = self._current
        served = record.served if record is not None else Served(None, None, {})
        return {
            "weight_version": served.version,
            "weight_digest": served.digest,
            "swapped_at": record and record.swapped_at,
            "last_swap_pause_s": self._last_pause_s,
            "compute_dtype": self.config.compute_dtype,
        }

    def handle_generate(self, body: bytes) -> dict[str, Any]:
        """The /v1/generate answer for a request body; BadRequest or NotReady on failure.

        `weight_version` (and `weight_digest`) name the version the response started on, the
        oldest of `weight_versions`, every version that produced one of its tokens; each
        completion's `versions` lists [{version, start, stop}] token ranges (docs/agents.md)."""
        args = parse_generate_request(body, self.model_config, self.config, default_stop=self.default_stop)
        generation = self.generate(**args)
        completions = []
        for c in generation.completions:
            doc = c._asdict()
            doc["versions"] = [r._asdict() for r in c.versions]
            completions.append(doc)
        return {
            "weight_version": generation.served.version,
            "weight_digest": generation.served.digest,
            "weight_versions": generation.versions(),
            "restarts": generation.restarts,
            "completions": completions,
        }


def parse_generate_request(
    body: bytes, model: ModelConfig, limits: ReferenceServerConfig, *, default_stop: int | None = None
) -> dict[str, Any]:
    """Keyword arguments for `ReferenceServer.generate` from a JSON body; BadRequest on anything off.
    `default_stop`: the stop token of a request that sends no "stop" (the engine's `default_stop`)."""
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
        if vocab < TOKENIZER.vocab_size:
            raise BadRequest(f"this model's vocabulary ({vocab}) is not the byte tokenizer's; send prompt_ids")
        prompt_ids = []
        for i, text in enumerate(prompts):
            if not isinstance(text, str):
                raise BadRequest(f"prompts[{i}] must be a string, got {type(text).__name__}")
            prompt_ids.append(TOKENIZER.encode(text))
    else:
        prompt_ids = []
        for i, ids in enumerate(_list(doc["prompt_ids"], "prompt_ids", limits.max_batch_size)):
            ids = _list(ids, f"prompt_ids[{i}]", limits.max_prompt_tokens)
            prompt_ids.append([_int(t, f"prompt_ids[{i}][{j}]", 0, vocab - 1) for j, t in enumerate(ids)])
    for i, ids in enumerate(prompt_ids):
        if len(ids) > limits.max_prompt_tokens:
            raise BadRequest(f"prompt {i} has {len(ids)} tokens; the limit is {limits.max_prompt_tokens}")
        if len(ids) + max_new > model.max_position_embeddings:
            raise BadRequest(
                f"prompt {i} ({len(ids)} tokens) + max_new_tokens ({max_new}) exceeds the model's "
                f"max_position_embeddings ({model.max_position_embeddings})"
            )
    temperature = doc.get("temperature", 0.0)
    # A tiny positive temperature scales logits to inf (NaN probabilities); greedy is spelled 0.
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not (temperature == 0 or 0.01 <= temperature <= 100)
    ):
        raise BadRequest(f"temperature must be 0 (greedy) or a number in [0.01, 100], got {temperature!r}")
    stop = doc.get("stop", default_stop)
    return {
        "prompt_ids": prompt_ids,
        "max_new_tokens": max_new,
        "temperature": float(temperature),
        "top_k": _int(doc.get("top_k", 0), "top_k", 0, vocab),
        "seed": None if doc.get("seed") is None else _int(doc["seed"], "seed", 0, 2**63 - 1),
        "stop": None if stop is None else _int(stop, "stop", 0, vocab - 1),
    }


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


class _Handler(JsonHandler):
    """HTTP/JSON front of a ReferenceServer (`self.server.engine`); holds no logic of its own."""

    server_version = "weightsync-reference/1"

    def do_GET(self) -> None:
        engine: ReferenceServer = self.server.engine  # type: ignore[attr-defined]
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self.send_json(
                200,
                {
                    "status": "ok",
                    "ready": engine.served_version() is not None,
                    "weight_version": engine.served_version(),
                },
            )
        elif path == "/v1/version":
            self.send_json(200, engine.version_info())
        elif path == "/metrics":
            self.send_bytes(200, prom.generate_latest(engine.metrics.registry), prom.CONTENT_TYPE_LATEST)
        elif path == "/v1/generate":
            self.send_json(405, {"error": "use POST for /v1/generate"}, [("Allow", "POST")])
        else:
            self.send_json(404, {"error": f"no such path {path!r}; see /v1/generate, /v1/version, /health, /metrics"})

    def do_POST(self) -> None:
        engine: ReferenceServer = self.server.engine  # type: ignore[attr-defined]
        if self.path.split("?", 1)[0] != "/v1/generate":
            self.close_connection = True  # the body was not read
            self.send_json(404, {"error": f"no such path {self.path!r}; POST /v1/generate"})
            return
        started = time.perf_counter()
        outcome, status, error, headers = "ok", 200, "", []  # an error's status and message, or the answer's body
        try:
            answer = engine.handle_generate(self.read_body())
            body = json.dumps(answer, allow_nan=False).encode()  # here: an answer that cannot be sent is a 500
            headers = [("X-Weight-Version", str(answer["weight_version"]))]
        except BodyError as e:
            outcome, status, error = "bad_request", e.status, str(e)
        except BadRequest as e:
            outcome, status, error = "bad_request", 400, str(e)
        except NotReady as e:
            outcome, status, error, headers = "unavailable", 503, str(e), [("Retry-After", "1")]
        except Exception as e:  # a bug must cost one request, never the server
            outcome, status, error = "error", 500, f"internal error: {type(e).__name__}: {e}"
            logger.exception("generate failed")
        if outcome != "ok":
            body = json.dumps({"error": error}).encode()
        # Counted before the answer leaves: a client that reads /metrics after its answer sees its
        # request there (counted after the send, a quick /metrics could miss it).
        engine.metrics.requests.labels(outcome).inc()
        engine.metrics.request_seconds.observe(time.perf_counter() - started)
        self.send_bytes(status, body, "application/json", headers)


def serve(argv: Sequence[str] | None = None) -> int:
    """Serves an HF-style directory until SIGINT/SIGTERM; prints {"url": ...} once listening."""
    parser = argparse.ArgumentParser(
        prog="python -m weightsync.agents.engines.reference_server",
        description="Serve an HF-style model directory with the reference server.",
    )
    parser.add_argument("--model-dir", required=True, help="config.json + safetensors, served as version 0")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--compute-dtype", choices=sorted(COMPUTE_DTYPES), default="bfloat16")
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--max-concurrent-requests", type=int, default=4)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ReferenceServerConfig(
        model_dir=args.model_dir,
        host=args.host,
        port=args.port,
        compute_dtype=args.compute_dtype,
        torch_threads=args.torch_threads,
        max_concurrent_requests=args.max_concurrent_requests,
    )
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
