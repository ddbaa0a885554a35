"""http: the Tinker SDK's HTTP routes (`/api/v1/...`) on a threaded HTTP/1.1 server.

A thin layer: it checks the API key (`X-API-Key`), caps the body size, decodes JSON or the
forward_backward protobuf (zstd-compressed when the client says so), calls the service and
encodes what it returns. Errors map to status codes in one place (`_status_of`): user errors
400, bad key 401, unknown things and unimplemented features 404 (with a message naming the
feature), oversized bodies 413, anything else 500. Failed *futures* are not HTTP errors: the
SDK reads `{"error", "category"}` from a 200 answer to retrieve_future.

Not here: what the routes do (service.py), the body schema (wire.py).
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable
from typing import Any

from weightsync.app.training.errors import AuthError, NotSupported, TrainingError, UserInputError
from weightsync.app.training.futures import Outcome
from weightsync.app.training.service import TrainingService
from weightsync.app.training.wire import decode_forward_backward
from weightsync.transport.json_http import BodyError, JsonHandler, JsonHttpServer

log = logging.getLogger(__name__)

PROTO = "application/x-protobuf"

# Feature flags the SDK fetches once per client (`ClientConfigResponse`): what this server supports.
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "parallel_fwdbwd_chunks": True,
    "proto_compress_fwdbwd": False,
    "use_pyqwest_transport": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
    "sample_no_retries": False,
}
DYNAMIC_CONFIG = {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


class TrainingHTTPServer(JsonHttpServer):
    def __init__(
        self,
        address: tuple[str, int],
        service: TrainingService,
        *,
        api_key: str,
        max_body_bytes: int = 64 * 1024 * 1024,
        fwdbwd_max_chunk_len: int = 1024,
    ) -> None:
        self.service, self.api_key = service, api_key
        client_config = {**CLIENT_CONFIG, "fwdbwd_max_chunk_len": fwdbwd_max_chunk_len}
        self.routes = _routes(service, client_config)
        super().__init__(address, _Handler, max_body_bytes=max_body_bytes, body_hint="send fewer datums per request")


def _routes(service: TrainingService, client_config: dict[str, Any]) -> dict[tuple[str, str], Callable[[bytes], Any]]:
    def json_route(fn: Callable[[dict], Any]) -> Callable[[bytes], Any]:
        return lambda body: fn(_json(body))

    return {
        ("GET", "/api/v1/healthz"): lambda *_: service.health(),
        ("GET", "/api/v1/get_server_capabilities"): lambda *_: service.capabilities(),
        ("POST", "/api/v1/client/config"): lambda *_: client_config,
        ("POST", "/api/v1/client/dynamic_config"): lambda *_: DYNAMIC_CONFIG,
        ("POST", "/api/v1/telemetry"): lambda *_: {"status": "accepted"},
        ("POST", "/api/v1/create_session"): json_route(service.create_session),
        ("POST", "/api/v1/session_heartbeat"): json_route(service.heartbeat),
        ("POST", "/api/v1/create_model"): json_route(service.create_model),
        ("POST", "/api/v1/get_info"): json_route(service.get_info),
        ("POST", "/api/v1/forward_backward"): lambda body: service.forward_backward(decode_forward_backward(body)),
        ("POST", "/api/v1/optim_step"): json_route(service.optim_step),
        ("POST", "/api/v1/save_weights"): json_route(service.save_state),
        ("POST", "/api/v1/load_weights"): json_route(service.load_state),
        ("POST", "/api/v1/retrieve_future"): json_route(service.retrieve),
        ("POST", "/api/v1/save_weights_for_sampler"): json_route(service.save_weights_for_sampler),
        ("POST", "/api/v1/create_sampling_session"): json_route(service.create_sampling_session),
        ("POST", "/api/v1/asample"): json_route(service.sample),
    }


class _Handler(JsonHandler):
    server: TrainingHTTPServer

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        try:
            body = self._read_body()
            self._check_key()
            route = self.server.routes.get((method, path))
            if route is not None:
                result = route(body)
            elif method == "GET" and path.startswith("/api/v1/training_runs/") and path.endswith("/checkpoints"):
                result = self.server.service.list_checkpoints(
                    path[len("/api/v1/training_runs/") : -len("/checkpoints")]
                )
            elif method == "POST" and path.startswith("/api/v1/sessions/") and path.endswith("/finish"):
                result = self.server.service.finish_session(
                    path[len("/api/v1/sessions/") : -len("/finish")], _json(body)
                )
            elif method == "GET" and path.startswith("/api/v1/samplers/"):
                result = self.server.service.get_sampler(path[len("/api/v1/samplers/") :])
            else:
                raise NotSupported(
                    f"{method} {path} is not implemented by the weightsync training server "
                    f"(feature {path.rsplit('/', 1)[-1]!r}); see docs/training-api.md for the "
                    "routes it serves"
                )
        except Exception as e:  # noqa: BLE001 (one table maps every error to a status; the body names it)
            self._send_error(e)
            return
        if isinstance(result, Outcome):
            extra = [] if result.weight_version is None else [("X-Weight-Version", str(result.weight_version))]
            if result.proto is not None:
                self.send_bytes(200, result.proto, PROTO, extra)
            elif result.error is not None:
                self.send_json(200, {"error": result.error, "category": result.category})
            else:
                self.send_json(200, result.json)
        else:
            self.send_json(200, result)

    def _read_body(self) -> bytes:
        body = self.read_body(required=False)
        if self.headers.get("Content-Encoding", "").lower() == "zstd":
            import zstandard

            try:
                body = zstandard.ZstdDecompressor().decompress(body, max_output_size=self.server.max_body_bytes)
            except zstandard.ZstdError as e:
                raise UserInputError(f"request body is not valid zstd (or over the size limit): {e}") from e
        return body

    def _check_key(self) -> None:
        given = self.headers.get("X-API-Key") or ""
        if not hmac.compare_digest(given.encode(), self.server.api_key.encode()):
            raise AuthError("missing or wrong API key (X-API-Key); use the key the server was started with")

    def _send_error(self, error: Exception) -> None:
        status, category = _status_of(error)
        if status >= 500:
            log.exception("%s %s failed", self.command, self.path, exc_info=error)
        message = str(error) or type(error).__name__
        self.send_json(status, {"error": message, "detail": message, "category": category})


def _status_of(error: Exception) -> tuple[int, str]:
    if isinstance(error, TrainingError):
        return error.http_status, error.category
    if isinstance(error, BodyError):
        return error.status, UserInputError.category
    return 500, "server"


def _json(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body or b"{}")
    except ValueError as e:
        raise UserInputError(f"request body is not JSON: {e}") from e
    if not isinstance(doc, dict):
        raise UserInputError("request body must be a JSON object")
    return doc
