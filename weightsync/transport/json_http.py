"""json_http: JSON over HTTP, both ends, written once.

The client (`HttpClient`) is what weightsync talks to inference servers' admin and generate routes,
reload hooks and the reference server with; the server base (`JsonHttpServer`, `JsonHandler`) is
what the reference server and the training API stand on.

Client. Every request has a timeout. A reply is read up to `max_reply_bytes`: a longer one is an error,
never a silent truncation that would surface later as garbled JSON. A request that fails is an
HttpError naming the method, the URL, the status (None: no answer: refused, reset, timed out, a
garbled reply) and the server's own message (`error_text`: the "error", "detail" or "message" of a
JSON error body, as vLLM, SGLang and FastAPI write them), and it says whether trying again may help
(`transient`: no answer, 408, 429 or 5xx).

Server. Threaded (a slow client costs its own thread), HTTP/1.1 keep-alive, a socket timeout so an
idle or trickling client cannot hold a thread forever, and one careful body reader: a body needs
a Content-Length (chunked bodies are refused with 411), one over the server's `max_body_bytes` is
refused with 413 (before it is sent when the client asks with Expect: 100-continue; read and
dropped when it is not too large, DRAIN_MAX_BYTES, so the client gets the 413 rather than a reset), and a
connection whose body was not read is closed.

Not here: retrying (`weightsync.retry`), gRPC (`rpc.py`), what a server's routes mean (each engine).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from weightsync.errors import WeightsyncError

log = logging.getLogger(__name__)

MAX_REPLY_BYTES = 64 * 1024 * 1024
"""The largest reply read by default: sampled tokens with log-probs of a large batch fit."""
ERROR_BODY_BYTES = 64 * 1024
"""How much of an error reply is read: enough to quote the server's message."""
DRAIN_MAX_BYTES = 16 * 1024 * 1024
"""The largest oversized request body a server reads and drops before its 413 (larger: the
connection closes unread)."""


def error_text(detail: str, limit: int = 2000) -> str:
    """The message a server put in an error body: its JSON "error" / "detail" / "message" (nested
    {"message": ...} included), else the body itself, cut to `limit` characters."""
    try:
        doc = json.loads(detail)
    except ValueError:
        return detail[:limit]
    if isinstance(doc, dict):
        for key in ("error", "detail", "message"):
            if key in doc:
                value = doc[key]
                return str(value.get("message") if isinstance(value, dict) else value)[:limit]
    return detail[:limit]


class HttpError(WeightsyncError):
    """A request that got no answer or an answer outside 2xx (see the module docstring)."""

    def __init__(self, method: str, url: str, status: int | None, detail: str, body: str = "") -> None:
        answered = f"answered {status}" if status is not None else "got no answer"
        super().__init__(f"{method} {url} {answered}: {detail}")
        self.method, self.url, self.status, self.detail = method, url, status, detail
        self.body = body
        """The error reply as the server sent it (its first ERROR_BODY_BYTES), for callers that read it."""

    def __reduce__(self):  # picklable like every weightsync error
        return (HttpError, (self.method, self.url, self.status, self.detail, self.body))

    @property
    def transient(self) -> bool:
        """No answer, a timeout (408), too many requests (429) or a server error (5xx): a later
        attempt may get through. Any other answer means the server understood and refused."""
        return self.status is None or self.status >= 500 or self.status in (408, 429)


@dataclasses.dataclass(frozen=True)
class Reply:
    status: int
    text: str

    def json(self) -> Any:
        """The reply's JSON ({} for an empty reply); ValueError for a body that is not JSON."""
        return json.loads(self.text) if self.text else {}


class HttpClient:
    """Requests to one server (`base_url`, no trailing slash; routes start with "/")."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 30.0,
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_s = timeout_s
        self.max_reply_bytes = max_reply_bytes

    def request(self, method: str, route: str = "", body: Any = None, *, timeout_s: float | None = None) -> Reply:
        """One request (`body`, if any, sent as JSON); its reply, or HttpError."""
        url = self.base_url + route
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, headers=self.headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as answer:
                raw = answer.read(self.max_reply_bytes + 1)
                status = answer.status
        except urllib.error.HTTPError as e:
            try:
                text = e.read(ERROR_BODY_BYTES).decode("utf-8", "replace")
            except (OSError, http.client.HTTPException):  # reset while the error body was read
                text = ""
            raise HttpError(method, url, e.code, error_text(text), text) from None
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out, garbled reply
            raise HttpError(method, url, None, f"{type(e).__name__}: {e}") from None
        if len(raw) > self.max_reply_bytes:
            raise HttpError(method, url, status, f"reply over {self.max_reply_bytes} bytes")
        return Reply(status, raw.decode("utf-8", "replace"))

    def get_json(self, route: str = "", *, timeout_s: float | None = None) -> Any:
        return self._json("GET", route, None, timeout_s)

    def post_json(self, route: str = "", body: Any = None, *, timeout_s: float | None = None) -> Any:
        return self._json("POST", route, body, timeout_s)

    def _json(self, method: str, route: str, body: Any, timeout_s: float | None) -> Any:
        reply = self.request(method, route, body, timeout_s=timeout_s)
        try:
            return reply.json()
        except ValueError:
            raise HttpError(method, self.base_url + route, reply.status, f"not JSON: {reply.text[:500]}") from None


# ----------------------------------------------------------------------------------- server


class BodyError(WeightsyncError):
    """A request body that cannot be read; `status` is the HTTP answer (400, 411 or 413)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self):  # picklable like every weightsync error
        return (BodyError, (self.status, str(self)))


class JsonHttpServer(ThreadingHTTPServer):
    """A threaded HTTP server for a `JsonHandler` subclass; `max_body_bytes` bounds request bodies."""

    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], handler: type[JsonHandler], *, max_body_bytes: int, body_hint: str = ""
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self.body_hint = body_hint
        """Said after the 413's message: how the client can send less."""
        super().__init__(address, handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def serve_in_thread(self, name: str) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, args=(0.1,), name=name, daemon=True)
        thread.start()
        return thread


class JsonHandler(BaseHTTPRequestHandler):
    """The request-handling base of a `JsonHttpServer`: reading bodies, sending answers."""

    protocol_version = "HTTP/1.1"
    timeout = 120  # socket timeout: an idle or trickling client cannot hold a thread forever
    server: JsonHttpServer

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), fmt % args)

    def handle_expect_100(self) -> bool:
        # A client that asks before sending (Expect: 100-continue) learns of an oversized body
        # without sending it.
        length = self.headers.get("Content-Length", "")
        if length.isdigit() and int(length) > self.server.max_body_bytes:
            self.close_connection = True
            self.send_json(413, {"error": self._too_large(int(length))})
            return False
        return super().handle_expect_100()

    def read_body(self, *, required: bool = True) -> bytes:
        """The request body; BodyError (the connection then closes) for one that cannot be read.
        Not `required`: a request without a Content-Length has an empty body."""
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding") or (length is None and required):
            self.close_connection = True
            raise BodyError(411, "send the JSON body with a Content-Length (chunked bodies are not supported)")
        if length is None:
            return b""
        if not length.isdigit():
            self.close_connection = True
            raise BodyError(400, f"bad Content-Length {length!r}")
        size, limit = int(length), self.server.max_body_bytes
        if size > limit:
            if size <= min(8 * limit, DRAIN_MAX_BYTES):  # read and dropped: the client gets the 413, not a reset
                remaining = size
                while remaining > 0 and (chunk := self.rfile.read(min(1 << 16, remaining))):
                    remaining -= len(chunk)
            self.close_connection = True
            raise BodyError(413, self._too_large(size))
        return self.rfile.read(size)

    def _too_large(self, size: int) -> str:
        hint = f"; {self.server.body_hint}" if self.server.body_hint else ""
        return f"request body of {size} bytes is over this server's limit of {self.server.max_body_bytes} bytes{hint}"

    def send_json(self, status: int, doc: Any, headers: Sequence[tuple[str, str]] = ()) -> None:
        # NaN and Infinity as Python's json writes them: a training metric (a grad norm) or a log-prob
        # can be one, and Python clients (the tinker SDK's) read them back.
        self.send_bytes(status, json.dumps(doc).encode(), "application/json", headers)

    def send_bytes(self, status: int, body: bytes, content_type: str, headers: Sequence[tuple[str, str]] = ()) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers:
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)
