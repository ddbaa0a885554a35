"""fault_proxy: a threaded HTTP/1.1 proxy that breaks S3 traffic on purpose, for tests.

It sits between boto3 and an S3-compatible test server (moto) on 127.0.0.1, forwards every
request, and injects faults drawn from a seeded `FaultPlan`: S3 error responses (500
InternalError, 503 SlowDown, with proper XML bodies), connection resets before or after the
response headers, bodies cut short of their Content-Length, slow responses, single flipped bytes
in request or response bodies, and "lost responses" (the server did the work, the client is told
500). It counts what it injected, per kind, under a lock, and can be switched off at any time.

It speaks HTTP/1.1 with keep-alive to the client (one upstream connection per client
connection), accepts Content-Length and chunked request bodies (botocore sends both, and
`Expect: 100-continue`), and forwards bodies with a Content-Length.

Byte flips hit only object data: PUT request bodies (PutObject, UploadPart) and the bodies of
object GETs. That is the data S3 integrity checks cover; a flipped XML request or listing is
rejected by the server or fails to parse, which tests nothing about our integrity checks.

moto 5.x stores a PUT body without checking its Content-MD5 (AWS S3, MinIO and Ceph RGW reject
a mismatch with 400 BadDigest). With `check_content_md5` the proxy makes that check on the
server's behalf, after any flip, so the reject-and-retry path can be tested; without it a
flipped upload reaches moto's storage, as it would on a server that checks nothing.

Not a general proxy: one upstream, no TLS, no CONNECT. Not here: the S3 server (moto.py), faults on
raw TCP links (tcp_relay.py).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import http.client
import http.server
import logging
import random
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Mapping

log = logging.getLogger(__name__)

# Faults, in the order a request meets them.
ERROR_500 = "error_500"  # answered 500 InternalError without forwarding
SLOWDOWN_503 = "slowdown_503"  # answered 503 SlowDown without forwarding
RESET_BEFORE = "reset_before"  # request read, connection reset, nothing forwarded
DELAY = "delay"  # forwarded after `delay_s`
FLIP_REQUEST = "flip_request"  # one byte of a PUT body flipped before forwarding
LOST_RESPONSE = "lost_response"  # forwarded (the server acts), the client gets 500
RESET_AFTER_HEADERS = "reset_after_headers"  # status and headers sent, then a reset
TRUNCATE = "truncate"  # headers promise the whole body, half of it is sent, then the connection closes
FLIP_RESPONSE = "flip_response"  # one byte of an object GET's body flipped
FAULT_KINDS = (
    ERROR_500,
    SLOWDOWN_503,
    RESET_BEFORE,
    DELAY,
    FLIP_REQUEST,
    LOST_RESPONSE,
    RESET_AFTER_HEADERS,
    TRUNCATE,
    FLIP_RESPONSE,
)
BAD_DIGEST = "bad_digest"  # not a fault: a flipped upload refused by the Content-MD5 check

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "expect",
    "content-length",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultPlan:
    """Which faults to inject, and how often."""

    rates: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Probability of each kind in FAULT_KINDS per request it can apply to (flips: object data
    only; truncation: GET bodies); at most one fault per request."""
    seed: int = 0
    """Seeds the draws (the sequence is fixed; which request gets which draw depends on thread timing)."""
    max_faults: int | None = None
    """Stop injecting after this many faults in all (None: no limit); e.g. 1 to break only the first request."""
    delay_s: float = 0.5
    """How long DELAY holds a request."""
    check_content_md5: bool = True
    """Refuse a PUT whose body does not match its Content-MD5 with 400 BadDigest, as S3 does."""
    max_body_bytes: int = 256 * 1024 * 1024
    """Largest request body accepted; larger ones are refused with 400 (a test bug, not a fault)."""

    def __post_init__(self) -> None:
        unknown = set(self.rates) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS}")
        if any(not 0 <= r <= 1 for r in self.rates.values()) or sum(self.rates.values()) > 1:
            raise ValueError("fault rates must be in [0, 1] and add up to at most 1")
        if self.delay_s < 0 or (self.max_faults is not None and self.max_faults < 0):
            raise ValueError("delay_s and max_faults must be >= 0")


class FaultProxy:
    """The proxy. Use as a context manager; `endpoint` is what boto3's endpoint_url should be."""

    def __init__(self, upstream: str, plan: FaultPlan | None = None) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(f"upstream must be http://HOST:PORT, got {upstream!r}")
        self.upstream = (parsed.hostname, parsed.port)
        self._lock = threading.Lock()
        self._plan = plan or FaultPlan()
        self._rng = random.Random(self._plan.seed)
        self._enabled = True
        self._counts: dict[str, int] = {}
        self._drawn = 0  # faults drawn under the current plan (max_faults counts these)
        self.requests = 0  # requests seen
        self.connections = 0  # client connections accepted (fewer than requests: keep-alive works)
        handler = type("_BoundHandler", (_Handler,), {"proxy": self})
        self._server = _Server(("127.0.0.1", 0), handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread: threading.Thread | None = None

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------------ the fault plan

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        """Off: every request passes through untouched (the plan and counts are kept)."""
        with self._lock:
            self._enabled = bool(on)

    @property
    def plan(self) -> FaultPlan:
        return self._plan

    def set_plan(self, plan: FaultPlan) -> None:
        with self._lock:
            self._plan = plan
            self._rng = random.Random(plan.seed)
            self._drawn = 0

    def counts(self) -> dict[str, int]:
        """Faults injected so far, per kind (kinds never injected are absent)."""
        with self._lock:
            return dict(self._counts)

    def _draw(self, applicable: frozenset[str]) -> str | None:
        """The fault for one request, among the kinds that can apply to it."""
        with self._lock:
            self.requests += 1
            if not self._enabled or (self._plan.max_faults is not None and self._drawn >= self._plan.max_faults):
                return None
            r = self._rng.random()
            for kind in FAULT_KINDS:
                if kind not in applicable:
                    continue
                r -= self._plan.rates.get(kind, 0.0)
                if r < 0:
                    self._drawn += 1
                    return kind
            return None

    def _count(self, kind: str) -> None:
        with self._lock:
            self._counts[kind] = self._counts.get(kind, 0) + 1

    def _flip_at(self, size: int) -> int:
        with self._lock:
            return self._rng.randrange(size)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        # A client that hung up, or an upstream that is gone (the test ended): not worth a traceback.
        log.debug("proxy: connection from %s ended with an error", client_address)


class _Handler(http.server.BaseHTTPRequestHandler):
    """One client connection: reads requests, forwards them upstream, answers (or breaks)."""

    proxy: FaultProxy
    protocol_version = "HTTP/1.1"  # keep-alive, and 100-continue handled by the base class

    def setup(self) -> None:
        super().setup()
        with self.proxy._lock:
            self.proxy.connections += 1

    def log_message(self, format: str, *args) -> None:  # the base class's signature
        log.debug("proxy: " + format, *args)

    def do_GET(self) -> None:  # http.server dispatches on do_<METHOD>
        self._proxy()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _proxy(self) -> None:
        proxy = self.proxy
        body = self._read_body()
        if body is None:
            return
        fault = proxy._draw(self._applicable(body))
        if fault == ERROR_500:
            proxy._count(fault)
            return self._send_error_xml(500, "InternalError", "We encountered an internal error. Please try again.")
        if fault == SLOWDOWN_503:
            proxy._count(fault)
            return self._send_error_xml(503, "SlowDown", "Please reduce your request rate.")
        if fault == RESET_BEFORE:
            proxy._count(fault)
            return self._reset()
        if fault == DELAY:
            proxy._count(fault)
            time.sleep(proxy.plan.delay_s)
        if fault == FLIP_REQUEST:
            proxy._count(fault)
            body = _flip(body, proxy._flip_at(len(body)))
        if proxy.plan.check_content_md5 and self.command == "PUT" and not self._md5_matches(body):
            proxy._count(BAD_DIGEST)
            return self._send_error_xml(400, "BadDigest", "The Content-MD5 you specified did not match the body.")

        try:
            status, reason, headers, response_body = self._forward(body)
        except OSError as e:  # upstream gone: what a client sees from a dead server
            log.warning("proxy: upstream failed: %s", e)
            return self._send_error_xml(502, "BadGateway", f"upstream failed: {e}")
        if fault == LOST_RESPONSE:
            proxy._count(fault)
            return self._send_error_xml(500, "InternalError", "We encountered an internal error. Please try again.")
        if fault == FLIP_RESPONSE and status in (200, 206) and response_body:
            proxy._count(fault)
            response_body = _flip(response_body, proxy._flip_at(len(response_body)))
        head_length = next((v for k, v in headers if k.lower() == "content-length"), None)
        self.send_response(status, reason)
        for name, value in headers:
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        length = head_length if self.command == "HEAD" and head_length is not None else str(len(response_body))
        self.send_header("Content-Length", length)
        if fault == RESET_AFTER_HEADERS:
            proxy._count(fault)
            self.end_headers()
            return self._reset()
        if fault == TRUNCATE and len(response_body) >= 2:
            proxy._count(fault)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(response_body[: len(response_body) // 2])
            self.close_connection = True
            return
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response_body)

    # ------------------------------------------------------------------------------ helpers

    def _read_body(self) -> bytes | None:
        """The request body (chunked or by Content-Length); None after refusing an oversized one."""
        limit = self.proxy.plan.max_body_bytes
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts, total = [], 0
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    break
                total += size
                if total > limit:
                    self._send_error_xml(400, "EntityTooLarge", "request body over the proxy's limit")
                    self.close_connection = True
                    return None
                parts.append(self.rfile.read(size))
                self.rfile.readline()  # CRLF after each chunk
            return b"".join(parts)
        length = int(self.headers.get("Content-Length") or 0)
        if length > limit:
            self._send_error_xml(400, "EntityTooLarge", "request body over the proxy's limit")
            self.close_connection = True
            return None
        return self.rfile.read(length) if length else b""

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """Sends the request upstream on this connection's upstream socket (re-opened if it closed)."""
        conn = getattr(self, "_upstream", None)
        for attempt in range(2):
            if conn is None:
                conn = http.client.HTTPConnection(*self.proxy.upstream, timeout=120)
                self._upstream = conn
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in _HOP_BY_HOP:
                        conn.putheader(name, value)
                if body or self.command in ("PUT", "POST"):
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body or None)
                response = conn.getresponse()
                data = response.read()
                return response.status, response.reason, response.getheaders(), data
            except (ConnectionError, http.client.HTTPException):
                # A kept-alive upstream socket the server closed meanwhile: retry once on a new one.
                conn.close()
                conn = self._upstream = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _md5_matches(self, body: bytes) -> bool:
        claimed = self.headers.get("Content-MD5")
        return claimed is None or base64.b64encode(hashlib.md5(body).digest()).decode() == claimed

    def _applicable(self, body: bytes) -> frozenset[str]:
        """Kinds that can break this request: flips only of object data, truncation only of GET bodies."""
        path, _, query = self.path.partition("?")
        object_get = self.command == "GET" and path.strip("/").count("/") >= 1 and "list-type" not in query
        kinds = set(FAULT_KINDS)
        if not (self.command == "PUT" and body):
            kinds.discard(FLIP_REQUEST)
        if not object_get:
            kinds.discard(FLIP_RESPONSE)
        if self.command != "GET":
            kinds.discard(TRUNCATE)
        return frozenset(kinds)

    def _send_error_xml(self, status: int, code: str, message: str) -> None:
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<Resource>{self.path.partition('?')[0]}</Resource><RequestId>fault-proxy</RequestId></Error>"
        ).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _reset(self) -> None:
        """Closes the client connection with a TCP RST (SO_LINGER 0), as a crashed peer would."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:  # the socket was reset on purpose
            pass
        conn = getattr(self, "_upstream", None)
        if conn is not None:
            conn.close()


def _flip(data: bytes, index: int) -> bytes:
    out = bytearray(data)
    out[index] ^= 0x01 << (index % 8)
    return bytes(out)
