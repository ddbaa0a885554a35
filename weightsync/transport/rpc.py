"""rpc: the gRPC pieces both ends share — limits, credentials, auth, the error table, the client.

The wire contract is proto/weightsync/transport/v1/sync.proto (generated code in weightsync/transport/v1/). One
message is hand-encoded: `ObjectFrame`, whose payload is a chunk object of up to ~68 MiB.
protobuf's Python runtime copies such a payload on every parse and serialize, which halves
loopback throughput; `encode_object_frame`/`decode_object_frame` write and read the same
protobuf wire format (any other protobuf implementation interoperates) with one copy on send
and none on receive.

Security: TLS from PEM files (mTLS when the server names a client CA), and a bearer token in
the `authorization` metadata checked by `TokenAuthInterceptor` in constant time. Errors cross
the wire as status codes from one table, `STATUS_BY_ERROR`, and come back as the same
weightsync exception types on the client side (`error_from_rpc`).

Not here: what an agent does with a call (agents/server.py delegates to the agent), pushing
(`push.py`).
"""

from __future__ import annotations

import dataclasses
import hmac
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from weightsync import errors
from weightsync.format.chunk import MAX_CHUNK_BYTES, max_object_bytes
from weightsync.format.manifest import MAX_MANIFEST_BYTES, ChunkPlacement
from weightsync.transport.v1 import sync_pb2

SERVICE = "weightsync.transport.v1.SyncAgent"
OFFER = f"/{SERVICE}/Offer"
PUSH_OBJECTS = f"/{SERVICE}/PushObjects"
GET_STATUS = f"/{SERVICE}/GetStatus"

# Explicit limits: the largest message is an object frame (one chunk object) or an offer (one
# manifest); a little over the larger of the two, never gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = max(max_object_bytes(MAX_CHUNK_BYTES), MAX_MANIFEST_BYTES) + 64 * 1024
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Keepalive pings notice a dead peer on an idle connection (a partitioned region) in ~30 s.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)
SERVER_OPTIONS = CHANNEL_OPTIONS + (
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.so_reuseport", 0),
)
OFFER_DEADLINE_S = 30.0
STATUS_DEADLINE_S = 10.0
PUSH_STREAM_DEADLINE_S = 600.0  # a push stream is reopened (and resumed) after this long

# ------------------------------------------------------------------------------ errors

STATUS_BY_ERROR: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    # Most specific first: the first matching row wins.
    (errors.AccessDenied, grpc.StatusCode.UNAUTHENTICATED),
    (errors.SignatureError, grpc.StatusCode.PERMISSION_DENIED),
    (errors.StaleVersion, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.LayoutError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.VersionNotFound, grpc.StatusCode.NOT_FOUND),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.FormatError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.IntegrityError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.StoreError, grpc.StatusCode.UNAVAILABLE),
    (errors.WeightsyncError, grpc.StatusCode.INTERNAL),
)
_ERROR_BY_STATUS = {
    grpc.StatusCode.UNAUTHENTICATED: errors.AccessDenied,
    grpc.StatusCode.PERMISSION_DENIED: errors.SignatureError,
    grpc.StatusCode.FAILED_PRECONDITION: errors.StaleVersion,
    grpc.StatusCode.NOT_FOUND: errors.VersionNotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.INVALID_ARGUMENT: errors.FormatError,
}


def status_for(error: BaseException) -> grpc.StatusCode:
    for error_type, code in STATUS_BY_ERROR:
        if isinstance(error, error_type):
            return code
    return grpc.StatusCode.INTERNAL


def error_from_rpc(e: grpc.RpcError, what: str, *, deadline_s: float | None = None) -> errors.WeightsyncError:
    """A client-side weightsync error for a failed call (transport failures: RpcUnavailable). A
    call past its deadline (`deadline_s`) says what that can mean: gRPC's own word is only
    "Deadline Exceeded"."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    detail = e.details() if hasattr(e, "details") else str(e)
    error_type = _ERROR_BY_STATUS.get(code, errors.RpcUnavailable)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and deadline_s is not None:
        detail = (
            f"{detail}: no answer within {deadline_s:g} s. The agent may be busy (a status with --verify waits for "
            "a sync under way) or starting; or the address is not a weightsync agent (a port that accepts "
            "connections and never answers), or TLS is expected where plaintext was sent: check the address, "
            "and retry with a longer deadline (weightsync status --timeout-s)"
        )
    return error_type(f"{what}: {code.name if code else 'UNKNOWN'}: {detail}")


# ------------------------------------------------------------------------------ frames


@dataclasses.dataclass(frozen=True)
class ObjectFrame:
    model: str
    version: int
    object: str  # xxh3-128 hex of data
    data: memoryview | bytes
    placement: ChunkPlacement | None = None  # where it goes (fields 5-8), when the sender knows


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def encode_object_frame(frame: ObjectFrame) -> bytes:
    """`ObjectFrame` in protobuf wire format: fields 1-3, the placement (5-8), then field 4
    (data) last."""
    model, obj = frame.model.encode(), frame.object.encode()
    head = b"\x0a" + _varint(len(model)) + model + b"\x10" + _varint(frame.version) + b"\x1a" + _varint(len(obj)) + obj
    where = frame.placement
    if where is not None:
        tensor = where.tensor.encode()
        head += (
            b"\x2a"
            + _varint(len(tensor))
            + tensor
            + b"\x30"
            + _varint(where.start)
            + b"\x38"
            + _varint(where.stop)
            + b"\x40"
            + _varint(where.parent)
        )
    return head + b"\x22" + _varint(len(frame.data)) + frame.data


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(view) or shift > 63:
            raise errors.FormatError("malformed object frame (varint)")
        byte = view[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7


# ObjectFrame's fields by number: 0 = varint, 2 = length-delimited (model, version, object, data,
# tensor, start, stop, parent).
_FRAME_WIRE_TYPES = {1: 2, 2: 0, 3: 2, 4: 2, 5: 2, 6: 0, 7: 0, 8: 0}


def decode_object_frame(data: bytes) -> ObjectFrame:
    """Parses an `ObjectFrame` in any field order (skipping unknown fields, as protobuf does);
    the payload is a view into `data`, not a copy."""
    view = memoryview(data)
    fields: dict[int, object] = {}
    pos = 0
    while pos < len(view):
        key, pos = _read_varint(view, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(view, pos)
        elif wire == 2:
            length, pos = _read_varint(view, pos)
            if pos + length > len(view):
                raise errors.FormatError("malformed object frame (truncated field)")
            value, pos = view[pos : pos + length], pos + length
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if pos + width > len(view):
                raise errors.FormatError("malformed object frame (truncated field)")
            value, pos = view[pos : pos + width], pos + width
        else:
            raise errors.FormatError(f"malformed object frame (wire type {wire})")
        # A known field with the wrong wire type would be read as the wrong Python type: a varint
        # where bytes belong makes bytes(n) allocate n bytes, so a 10-byte frame could ask for GBs.
        if _FRAME_WIRE_TYPES.get(number, wire) != wire:
            raise errors.FormatError(f"malformed object frame (field {number} has wire type {wire})")
        fields[number] = value
    try:
        model = bytes(fields.get(1, b"")).decode()
        obj = bytes(fields.get(3, b"")).decode()
        tensor = bytes(fields.get(5, b"")).decode()
    except UnicodeDecodeError:
        raise errors.FormatError("malformed object frame (model, object or tensor is not UTF-8)") from None
    version, start, stop, parent = (fields.get(n, 0) for n in (2, 6, 7, 8))
    if not all(isinstance(v, int) for v in (version, start, stop, parent)):
        raise errors.FormatError("malformed object frame (version or placement)")
    placement = ChunkPlacement(tensor, start, stop, parent) if tensor else None
    return ObjectFrame(model, version, obj, fields.get(4, memoryview(b"")), placement)


# ------------------------------------------------------------------------------ security


@dataclasses.dataclass(frozen=True, kw_only=True)
class TlsConfig:
    """TLS material (PEM files). Server: cert + key, and client_ca to require client
    certificates (mTLS). Client: ca to verify the server, cert + key for mTLS."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    """The CA that signed the peer's certificate (clients: the server's; servers: for mTLS)."""
    require_client_cert: bool = False
    server_name: str | None = None
    """Client only: the name to check the server's certificate against (default: the host)."""

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("TLS needs both cert and key (or neither)")
        if self.require_client_cert and not self.ca:
            raise ValueError("require_client_cert needs ca: the CA that signs client certificates")

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise errors.StoreError(f"cannot read TLS file {path}: {e}") from None


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    if not (tls.cert and tls.key):
        raise ValueError("a TLS server needs cert and key")
    return grpc.ssl_server_credentials(
        [(_read(tls.key), _read(tls.cert))],
        root_certificates=_read(tls.ca),
        require_client_auth=tls.require_client_cert,
    )


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca), private_key=_read(tls.key), certificate_chain=_read(tls.cert)
    )


def read_token(token: str | None = None, token_file: str | None = None) -> str | None:
    """The bearer token from a value, a file, or $WEIGHTSYNC_TOKEN (in that order)."""
    if token:
        return token
    if token_file:
        try:
            return Path(token_file).read_text().strip() or None
        except OSError as e:
            raise errors.AccessDenied(f"cannot read token file {token_file}: {e}") from None
    return os.environ.get("WEIGHTSYNC_TOKEN") or None


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without `authorization: Bearer <token>` (the health service stays open)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        self._deny = deny

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith("/grpc.health.v1.Health/"):
            return continuation(handler_call_details)
        presented = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(presented.encode(), self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(lambda it, ctx: self._deny(None, ctx))
        return grpc.unary_unary_rpc_method_handler(self._deny)


def open_channel(target: str, tls: TlsConfig | None = None) -> grpc.Channel:
    """A channel with explicit message limits and keepalive; TLS when configured."""
    if tls is not None and tls.enabled:
        options = CHANNEL_OPTIONS
        if tls.server_name:
            options += (("grpc.ssl_target_name_override", tls.server_name),)
        return grpc.secure_channel(target, channel_credentials(tls), options=options)
    return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)


# ------------------------------------------------------------------------------ client


def _replied(reply, call: str, target: str):
    """grpc-python hands back None (status OK, no message) when a corrupting link lost the
    reply's DATA frame: that is a transport failure, not an answer."""
    if reply is None:
        raise errors.RpcUnavailable(f"{call} to {target}: the reply was lost on the link")
    return reply


class AgentClient:
    """Calls one agent's SyncAgent service; every call has a deadline and carries the token."""

    def __init__(self, target: str, *, tls: TlsConfig | None = None, token: str | None = None) -> None:
        self.target = target
        self.channel = open_channel(target, tls)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._offer = self.channel.unary_unary(
            OFFER,
            request_serializer=sync_pb2.OfferRequest.SerializeToString,
            response_deserializer=sync_pb2.OfferReply.FromString,
        )
        self._push = self.channel.stream_unary(
            PUSH_OBJECTS, request_serializer=encode_object_frame, response_deserializer=sync_pb2.PushReply.FromString
        )
        self._status = self.channel.unary_unary(
            GET_STATUS,
            request_serializer=sync_pb2.StatusRequest.SerializeToString,
            response_deserializer=sync_pb2.StatusReply.FromString,
        )

    def offer(self, request: sync_pb2.OfferRequest, timeout_s: float = OFFER_DEADLINE_S) -> sync_pb2.OfferReply:
        try:
            return _replied(self._offer(request, timeout=timeout_s, metadata=self._metadata), "offer", self.target)
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"offer of v{request.version} to {self.target}") from None

    def push(self, frames: Iterator[ObjectFrame], timeout_s: float = PUSH_STREAM_DEADLINE_S) -> sync_pb2.PushReply:
        try:
            return _replied(self._push(frames, timeout=timeout_s, metadata=self._metadata), "push", self.target)
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"push to {self.target}") from None

    def push_future(self, frames: Iterator[ObjectFrame], timeout_s: float = PUSH_STREAM_DEADLINE_S) -> grpc.Future:
        """The push as a future (the caller feeds `frames` from a queue while it runs)."""
        return self._push.future(frames, timeout=timeout_s, metadata=self._metadata)

    def status(self, timeout_s: float = STATUS_DEADLINE_S, *, verify: bool = False) -> sync_pb2.StatusReply:
        """The agent's status; with verify, also the digest of the bytes it serves (one hash pass)."""
        try:
            reply = self._status(sync_pb2.StatusRequest(verify=verify), timeout=timeout_s, metadata=self._metadata)
            return _replied(reply, "status", self.target)
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"status of {self.target}", deadline_s=timeout_s) from None

    def close(self) -> None:
        self.channel.close()


def agent_service_handler(
    offer: Callable[[sync_pb2.OfferRequest, grpc.ServicerContext], sync_pb2.OfferReply],
    push_objects: Callable[[Iterator[ObjectFrame], grpc.ServicerContext], sync_pb2.PushReply],
    get_status: Callable[[sync_pb2.StatusRequest, grpc.ServicerContext], sync_pb2.StatusReply],
) -> grpc.GenericRpcHandler:
    """The SyncAgent service with the fast ObjectFrame codec (instead of the generated
    add_SyncAgentServicer_to_server, which would parse payloads with protobuf).

    Requests arrive as bytes and are parsed here, in the handler, not by grpc's deserializer: a
    request grpc fails to parse is answered INTERNAL ("Exception deserializing request!"),
    while a malformed request is the client's fault and must get INVALID_ARGUMENT with a reason.
    Push frames are parsed lazily as the stream is read; their FormatError reaches the servicer.
    """

    def parsed(parse, handler):
        def call(raw: bytes, context: grpc.ServicerContext):
            try:
                request = parse(raw)
            except (DecodeError, errors.FormatError) as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {e}")
            return handler(request, context)

        return call

    def push(raw_frames: Iterator[bytes], context: grpc.ServicerContext) -> sync_pb2.PushReply:
        return push_objects((decode_object_frame(raw) for raw in raw_frames), context)

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Offer": grpc.unary_unary_rpc_method_handler(
                parsed(sync_pb2.OfferRequest.FromString, offer),
                response_serializer=sync_pb2.OfferReply.SerializeToString,
            ),
            "PushObjects": grpc.stream_unary_rpc_method_handler(
                push, response_serializer=sync_pb2.PushReply.SerializeToString
            ),
            "GetStatus": grpc.unary_unary_rpc_method_handler(
                parsed(sync_pb2.StatusRequest.FromString, get_status),
                response_serializer=sync_pb2.StatusReply.SerializeToString,
            ),
        },
    )
