"""sglang_contract_server: a *contract server* for the SGLang routes the sglang engine uses. It is
not SGLang: it reproduces, in plain `http.server`, the documented routes and the failure
behaviour read from SGLang's source (`entrypoints/http_server.py`, `managers/tokenizer_manager.py`),
so the engine's tests run on a CPU machine where SGLang cannot be installed.

What it keeps of SGLang:
- `POST /generate` holds the reader side of the model-update lock for the whole request, and its
  meta_info reports `weight_version` at the end (SGLang's field). New requests wait while paused.
- `POST /update_weights_from_disk` {model_path, load_format, flush_cache, weight_version,
  abort_all_requests}: takes the writer side of the lock unless paused (so it waits for in-flight
  requests and holds new ones); really loads config.json + safetensors of model_path (names and
  shapes checked against the architecture); on failure re-reads the previous model_path from disk
  and answers 400 {"success": false, "message": ..., "num_paused_requests": 0}; on success sets
  weight_version (if given) and, with flush_cache, flushes the cache.
- `POST /pause_generation` {"mode": "abort" | "in_place" | "retract"}: abort aborts in-flight
  requests and waits until none holds the lock; the other two only stop them, so a reload while
  paused skips the lock and the paused requests continue on the new weights (as in SGLang).
  `POST /continue_generation`.
- `GET|POST /flush_cache` is refused (400) while requests are running or waiting.
- `GET /get_model_info`, `GET /get_weight_version`, `GET /health`; an unknown route is 404, a
  known route with the wrong method 405 (FastAPI's answers).
- `POST /update_weights_from_tensor` {serialized_named_tensors (one base64 pickle per TP rank),
  load_format, flush_cache, weight_version, abort_all_requests}: the payload is unpickled with a
  torch/builtins allowlist and checked to be (name, tensor) pairs (SGLang's
  `_validate_update_weights_from_tensor_payload`); a `load_format` listed in the server's
  `--custom-weight-loader` (`custom_weight_loader`) is imported and called as
  `loader(model, named_tensors)` on the served model, under the model-update lock as a reload;
  another is refused (400, "Unknown load_format"). `model` is an nn.Module whose parameters are
  the served tensors, with a `load_weights(named_tensors)` as SGLang models have.
- `POST /update_weight_version` {new_version, abort_all_requests}: relabels what is served.

- `POST /generate` with `"return_logprob": true` and `logprob_start_len` 0 answers meta_info
  `input_token_logprobs`, [[logprob, token id, null], ...] with null for the first token, as
  SGLang does; computed by weightsync.models' decoder on the loaded weights in float32.

What it adds for tests (not in SGLang): meta_info "weight_versions_used" (every version a
request's steps ran on), `hold` (a request with `"hold": true` in sampling_params stops after its
first step until `release()`), `fail_next_loads`, `lose_next_replies` (the load happens, the
connection closes without a reply), `missing_routes`, and `calls` (route log).
Not here: tokenizers, sampling, batching, KV caches (the cache is a counter).
"""

from __future__ import annotations

import base64
import importlib
import io
import json
import pickle
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from weightsync.models import load_pretrained, skeleton
from weightsync.models.probe import run_probe

_ROUTES = {
    "/generate": ("POST", "PUT"),
    "/update_weights_from_disk": ("POST",),
    "/update_weights_from_tensor": ("POST",),
    "/update_weight_version": ("POST",),
    "/pause_generation": ("POST",),
    "/continue_generation": ("POST",),
    "/flush_cache": ("GET", "POST"),
    "/get_model_info": ("GET",),
    "/get_weight_version": ("GET",),
    "/health": ("GET",),
}


class SGLangContractServer:
    """Serves one model directory on 127.0.0.1 (port 0) with SGLang's weight-update routes."""

    def __init__(
        self, model_path: str | Path, *, weight_version: str = "default", custom_weight_loader: tuple[str, ...] = ()
    ) -> None:
        self.model_path = str(model_path)
        self.custom_weight_loader = tuple(custom_weight_loader)
        self.architecture, self.weights = load_pretrained(self.model_path)
        self.model = _served_module(self.architecture, self.weights)
        self.weight_version = weight_version
        self.calls: list[tuple[str, str, dict]] = []  # (method, route, body)
        self.fail_next_loads: list[str] = []  # messages: the next loads fail with them
        self.lose_next_replies = 0  # the next reloads happen, but their connection closes unanswered
        self.missing_routes: set[str] = set()
        self.loads = 0  # successful loads of a new model_path
        self.cache_flushes = 0
        self.writer_waiting = threading.Event()  # set when a reload waits for in-flight requests
        self.holding = threading.Event()  # set when a held request has run its first step
        self._cond = threading.Condition()
        self._readers = 0  # requests holding the model-update lock
        self._waiting_writers = 0
        self._writer = False
        self._paused: str | None = None  # None or the pause mode
        self._abort_generation = 0  # bumped by every abort: requests started before it stop
        self._released = False
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self._thread = threading.Thread(target=self.http.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.release()
        self.http.shutdown()
        self.http.server_close()

    def release(self) -> None:
        """Lets held requests go on."""
        with self._cond:
            self._released = True
            self._cond.notify_all()

    # ------------------------------------------------------------------ the model-update lock

    def _acquire_reader(self) -> None:
        with self._cond:
            # Waits while paused, then like SGLang's RWLock: writers first.
            self._cond.wait_for(lambda: self._paused is None and not self._writer and not self._waiting_writers)
            self._readers += 1

    def _release_reader(self) -> None:
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    def _acquire_writer(self) -> None:
        with self._cond:
            self._waiting_writers += 1
            if self._readers or self._writer:
                self.writer_waiting.set()
            self._cond.wait_for(lambda: not self._readers and not self._writer)
            self._waiting_writers -= 1
            self._writer = True

    def _release_writer(self) -> None:
        with self._cond:
            self._writer = False
            self.writer_waiting.clear()
            self._cond.notify_all()

    # ------------------------------------------------------------------ routes

    def generate(self, body: dict) -> dict:
        params = body.get("sampling_params") or {}
        steps = int(params.get("max_new_tokens", 4))
        input_ids = list(body.get("input_ids") or [0])
        used, output_ids = [], []
        finish = {"type": "length", "length": steps}
        self._acquire_reader()
        try:
            with self._cond:
                started_at = self._abort_generation
            for step in range(steps):
                with self._cond:
                    # in_place/retract pauses stop running requests between steps.
                    self._cond.wait_for(lambda: self._paused is None or self._abort_generation != started_at)
                    if self._abort_generation != started_at:
                        finish = {"type": "abort", "message": "Abort in running batch."}
                        break
                    weights, version = self.weights, self.weight_version
                if version not in used:
                    used.append(version)
                output_ids.append(_next_token(weights, input_ids + output_ids))
                if step == 0 and params.get("hold"):
                    self.holding.set()
                    with self._cond:
                        self._cond.wait_for(lambda: self._released or self._abort_generation != started_at)
        finally:
            self._release_reader()
        with self._cond:
            version = self.weight_version
            weights = self.weights
        meta = {}
        if body.get("return_logprob"):
            if int(body.get("logprob_start_len", -1)) != 0:
                raise ValueError("the contract server answers input logprobs from logprob_start_len 0 only")
            meta["input_token_logprobs"] = _input_logprobs(self.architecture, weights, input_ids)
        return {
            "text": "",
            "output_ids": output_ids,
            "meta_info": {
                "id": body.get("rid", ""),
                "finish_reason": finish,
                "weight_version": version,
                "prompt_tokens": len(input_ids),
                "completion_tokens": len(output_ids),
                "weight_versions_used": used,
                **meta,
            },
        }

    def update_weights_from_disk(self, body: dict) -> tuple[int, dict]:
        if not isinstance(body.get("model_path"), str):
            return 400, {"object": "error", "message": "model_path: Field required", "code": 400}
        if body.get("abort_all_requests"):
            self._abort_all()
        with self._cond:
            paused = self._paused is not None
        if not paused:  # paused: SGLang updates at once, without the lock
            self._acquire_writer()
        try:
            try:
                if self.fail_next_loads:
                    raise ValueError(self.fail_next_loads.pop(0))
                _, weights = load_pretrained(body["model_path"])
            except Exception as e:  # SGLang: any load error rolls back to the previous model_path
                _, weights = load_pretrained(self.model_path)
                with self._cond:
                    self.weights = weights
                return 400, {
                    "success": False,
                    "num_paused_requests": 0,
                    "message": f"Failed to update weights: {e}.\nRolling back to original weights.",
                }
            with self._cond:
                self.weights, self.model_path = weights, body["model_path"]
                self.model = _served_module(self.architecture, weights)
                self.loads += 1
            message = "Succeeded to update model weights."
            if body.get("flush_cache", True) and not self._flush():
                return 400, {
                    "success": False,
                    "num_paused_requests": 0,
                    "message": "Cache flush failed after updating weights",
                }
            if body.get("weight_version") is not None:
                with self._cond:
                    self.weight_version = str(body["weight_version"])
                message += f" Weight version updated to {body['weight_version']}."
            return 200, {"success": True, "message": message, "num_paused_requests": 0}
        finally:
            if not paused:
                self._release_writer()

    def update_weights_from_tensor(self, body: dict) -> tuple[int, dict]:
        payload, load_format = body.get("serialized_named_tensors"), body.get("load_format")
        if not isinstance(payload, list) or not payload or not all(isinstance(p, str) for p in payload):
            return 400, {
                "object": "error",
                "message": "serialized_named_tensors: a list of str per TP rank",
                "code": 400,
            }
        if load_format not in self.custom_weight_loader:
            return 400, {"success": False, "message": f"Unknown load_format={load_format}", "num_paused_requests": 0}
        try:
            named_tensors = _AllowlistUnpickler(io.BytesIO(base64.b64decode(payload[0], validate=True))).load()
        except (ValueError, pickle.UnpicklingError) as e:
            return 400, {"success": False, "message": f"Invalid update_weights_from_tensor payload: {e}"}
        if not isinstance(named_tensors, list) or not all(
            isinstance(item, tuple)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
            for item in named_tensors
        ):
            return 400, {
                "success": False,
                "message": "Invalid update_weights_from_tensor payload: not (name, tensor) pairs",
            }
        if body.get("abort_all_requests"):
            self._abort_all()
        with self._cond:
            paused = self._paused is not None
        if not paused:
            self._acquire_writer()
        try:
            module_name, _, attr = load_format.rpartition(".")
            try:
                getattr(importlib.import_module(module_name), attr)(self.model, named_tensors)
            except Exception as e:  # SGLang answers the failure; the weights are what the loader left
                return 400, {"success": False, "message": f"Failed to update weights: {e}", "num_paused_requests": 0}
            if body.get("flush_cache", True):
                self._flush()
            if body.get("weight_version") is not None:
                with self._cond:
                    self.weight_version = str(body["weight_version"])
            return 200, {"success": True, "message": "Success", "num_paused_requests": 0}
        finally:
            if not paused:
                self._release_writer()

    def update_weight_version(self, body: dict) -> tuple[int, dict]:
        if not isinstance(body.get("new_version"), str):
            return 400, {"object": "error", "message": "new_version: Field required", "code": 400}
        if body.get("abort_all_requests"):
            self._abort_all()
        with self._cond:
            self.weight_version = body["new_version"]
        return 200, {"success": True, "message": "Weight version updated", "new_version": body["new_version"]}

    def pause_generation(self, body: dict) -> tuple[int, dict]:
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return 400, {"object": "error", "message": f"Invalid mode: {mode!r}", "code": 400}
        with self._cond:
            self._paused = mode
        if mode == "abort":
            self._abort_all()
            with self._cond:
                self._cond.wait_for(lambda: not self._readers)
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self) -> tuple[int, dict]:
        with self._cond:
            self._paused = None
            self._cond.notify_all()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _abort_all(self) -> None:
        with self._cond:
            self._abort_generation += 1
            self._cond.notify_all()

    def _flush(self) -> bool:
        with self._cond:
            if self._readers:  # running or waiting requests: SGLang does not flush
                return False
            self.cache_flushes += 1
            return True

    # ------------------------------------------------------------------ HTTP

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._route("GET")

            def do_POST(self) -> None:
                self._route("POST")

            def do_PUT(self) -> None:
                self._route("PUT")

            def _route(self, method: str) -> None:
                route = self.path.split("?", 1)[0]
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else {}
                except ValueError:
                    return self._answer(400, {"object": "error", "message": "invalid JSON", "code": 400})
                if route not in _ROUTES or route in server.missing_routes:
                    return self._answer(404, {"detail": "Not Found"})
                if method not in _ROUTES[route]:
                    return self._answer(405, {"detail": "Method Not Allowed"})
                server.calls.append((method, route, body))
                if route == "/generate":
                    return self._answer(200, server.generate(body))
                if route == "/update_weights_from_disk":
                    status, doc = server.update_weights_from_disk(body)
                    if server.lose_next_replies:
                        server.lose_next_replies -= 1
                        self.close_connection = True
                        return  # the load happened; the reply is lost
                    return self._answer(status, doc)
                if route == "/update_weights_from_tensor":
                    return self._answer(*server.update_weights_from_tensor(body))
                if route == "/update_weight_version":
                    return self._answer(*server.update_weight_version(body))
                if route == "/pause_generation":
                    return self._answer(*server.pause_generation(body))
                if route == "/continue_generation":
                    return self._answer(*server.continue_generation())
                if route == "/flush_cache":
                    flushed = server._flush()
                    return self._answer(
                        200 if flushed else 400,
                        "Cache flushed.\nPlease check backend logs for "
                        "more details. (When there are running or waiting requests, the operation "
                        "will not be performed.)\n",
                    )
                if route == "/get_model_info":
                    return self._answer(
                        200,
                        {
                            "model_path": server.model_path,
                            "tokenizer_path": None,
                            "is_generation": True,
                            "weight_version": server.weight_version,
                        },
                    )
                if route == "/get_weight_version":
                    return self._answer(200, {"weight_version": server.weight_version})
                return self._answer(200, "")  # /health

            def _answer(self, status: int, doc: dict | str) -> None:
                data = (doc if isinstance(doc, str) else json.dumps(doc)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if isinstance(doc, str) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler


class _AllowlistUnpickler(pickle.Unpickler):
    """SGLang unpickles weight payloads with a module allowlist: torch, collections, builtins."""

    def find_class(self, module: str, name: str):
        if module.partition(".")[0] in ("torch", "collections", "builtins"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"blocked unpickle of {module}.{name}: not in the weight-payload allowlist")


def _served_module(architecture, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """An nn.Module whose parameters are the served tensors themselves (HF names), with the
    `load_weights(named_tensors)` SGLang models have: what a custom weight loader is handed."""
    model = skeleton(architecture)
    model.load_state_dict(weights, assign=True, strict=False)
    params = dict(model.named_parameters())

    def load_weights(named_tensors) -> None:
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor)

    model.load_weights = load_weights
    return model


def _input_logprobs(architecture, weights: dict[str, torch.Tensor], ids: list[int]) -> list[list]:
    """SGLang's input_token_logprobs: [logprob, id, text] per prompt token, None for the first."""
    run = run_probe(architecture, [ids], weights.__getitem__, dtypes=[torch.float32])[torch.float32]
    return [[None, ids[0], None]] + [
        [float(lp), t, None] for lp, t in zip(run.logprobs[0].tolist(), ids[1:], strict=True)
    ]


def _next_token(weights: dict[str, torch.Tensor], ids: list[int]) -> int:
    """A token that depends on the weights: the argmax of one embedding row against lm_head."""
    embed = weights["model.embed_tokens.weight"]
    head = weights.get("lm_head.weight", embed)
    row = embed[ids[-1] % embed.shape[0]].float()
    return int(torch.argmax(head.float() @ row))
