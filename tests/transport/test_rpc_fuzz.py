"""Fuzzing the agent's gRPC handlers: random and mutated Offer, PushObjects and GetStatus requests
against a live agent that requires a token and signatures (the corpus agent of tests/hostile/agent,
serving v2).

Two ways in: straight into the handlers the server registers (`agent_service_handler` over the
servicer, request bytes in, as grpc would call them; thousands of examples a minute), and through a
real gRPC channel with a token (fewer, slower). Inputs: raw bytes; OfferRequests whose manifest is a
mutation of a real one (bytes flipped, cut, inserted; JSON fields changed) or random, with real,
foreign, mutated or random signatures, random versions, hops and object lists; object frames with
real or random payloads under right, wrong or malformed addresses, for this or another model.

Properties: every call ends in OK or a status code from weightsync's error table, never INTERNAL or
UNKNOWN (an unexpected exception) and never a request grpc fails to parse; afterwards the agent is
healthy and serves exactly what it served before (nothing the fuzzer sends is signed by the trusted
key, apart from replays of v1 and v2), bit for bit, with its store untouched.

WEIGHTSYNC_FUZZ_EXAMPLES sets the examples per test (default 300; the channel test runs a third of
them); each test prints how many calls it made.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.agents.config import AgentConfig
from weightsync.agents.server import AgentServer, _Servicer  # the servicer itself: the fast way in
from weightsync.format.chunk import object_hash
from weightsync.stores import LocalStore
from weightsync.transport.rpc import (
    GET_STATUS,
    OFFER,
    PUSH_OBJECTS,
    SERVICE,
    ObjectFrame,
    agent_service_handler,
    encode_object_frame,
    open_channel,
)
from weightsync.transport.v1 import sync_pb2

EXAMPLES = int(os.environ.get("WEIGHTSYNC_FUZZ_EXAMPLES", "300"))
# Hypothesis's own default: a fresh random search on a developer's machine, a fixed one where CI is
# set (so a submission never fails on a bug it did not bring). Long searches: docs/security.md.
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
FUZZ_CHANNEL = settings(FUZZ, max_examples=max(10, EXAMPLES // 3))
CORPUS = Path(__file__).parents[1] / "hostile" / "agent"
EXPECTED = json.loads((CORPUS / "expected.json").read_text())
MODEL = EXPECTED["model"]
SETTINGS = EXPECTED["agents"]["guarded"]
TOKEN = SETTINGS["token"]
# Codes from weightsync.transport.rpc.STATUS_BY_ERROR (and grpc's own for oversized messages): a refusal with a reason.
ALLOWED = {
    "OK",
    "INVALID_ARGUMENT",
    "FAILED_PRECONDITION",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "UNAUTHENTICATED",
    "NOT_FOUND",
    "UNAVAILABLE",
}
CALLS: collections.Counter[str] = collections.Counter()


def _material() -> dict:
    """Real bytes to mutate: manifests and signatures of the corpus store and of v3 (whose valid
    signature is never used: nothing the fuzzer sends may be a new version the agent should take)."""
    store, following = LocalStore(CORPUS / "store"), LocalStore(CORPUS / "next")
    manifests, signatures, objects = [], [], []
    for source in (store, following):
        for info in source.list():
            data = source.get(info.key)
            if "/versions/" in info.key:
                manifests.append(data)
            elif "/signatures/" in info.key and "000000000003" not in info.key and "000000000006" not in info.key:
                signatures.append(data)
            elif "/chunks/" in info.key:
                objects.append(data)
    signatures.append((CORPUS / "offer_v3_signed_by_an_untrusted_key.sig").read_bytes())
    return {"manifests": manifests, "signatures": signatures, "objects": objects[:20]}


MATERIAL = _material()


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzzed-agent")
    shutil.copytree(CORPUS / "store", root / "store")
    config = AgentConfig(
        model=MODEL,
        cache_dir=str(root / "cache"),
        name="fuzzed",
        store=LocalStore(root / "store").uri,
        token=TOKEN,
        trusted_keys=(str(CORPUS / "trusted.pub"),),
        require_signatures=True,
        max_pending_bytes=SETTINGS["max_pending_bytes"],
        workers=1,
        poll_interval_s=0.5,
        engine={"type": "reference", "model": EXPECTED["arch"], "port": 0, "torch_threads": 1},
    )
    server = AgentServer(config).start()
    assert server.agent.wait_for_version(2, 60)
    before = _state(server, root / "store")
    yield server
    after = _state(server, root / "store")
    server.stop(0)
    assert after == before, "the fuzzed agent changed what it serves, or its store changed"
    print(f"\nrpc fuzz calls by path and outcome: {dict(sorted(CALLS.items()))}")


def _state(server: AgentServer, store_dir: Path) -> tuple:
    served = server.engine.served()
    weights = {
        n: hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, t in served.weights.items()
    }
    store = sorted(
        (str(p.relative_to(store_dir)), hashlib.sha256(p.read_bytes()).hexdigest())
        for p in store_dir.rglob("*")
        if p.is_file()
    )
    status = server.agent.status(verify=True)
    assert status["served_digest"] == served.digest, "the served bytes no longer hash to their digest"
    return served.version, served.digest, weights, store, status["current_version"], status["target_version"]


# ------------------------------------------------------------------------------ strategies


@st.composite
def mutated(draw, pool: list[bytes]) -> bytes:
    data = bytearray(draw(st.sampled_from(pool)))
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "digit", "truncate", "json"]))
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[at : at + draw(st.integers(1, 64))]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "digit":
            digits = [i for i, b in enumerate(data) if 48 <= b <= 57]
            if digits:
                data[draw(st.sampled_from(digits))] = draw(st.integers(48, 57))
        elif op == "truncate":
            data = data[:at]
        else:
            try:
                doc = json.loads(bytes(data))
            except ValueError:
                continue
            if isinstance(doc, dict) and doc:
                key = draw(st.sampled_from(sorted(doc)))
                doc[key] = draw(
                    st.none()
                    | st.booleans()
                    | st.integers(-(2**70), 2**70)
                    | st.text(max_size=12)
                    | st.just(doc[key])
                    | st.lists(st.integers(), max_size=3)
                )
                data = bytearray(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    return bytes(data)


hex32 = st.text("0123456789abcdef", min_size=32, max_size=32)
names = st.sampled_from([MODEL] * 6 + ["other-model", "", "../" + MODEL]) | st.text(max_size=12)
real_manifests = st.sampled_from(MATERIAL["manifests"])
manifests = st.just(b"") | real_manifests | real_manifests | mutated(MATERIAL["manifests"]) | st.binary(max_size=300)
signatures = (
    st.just(b"") | st.sampled_from(MATERIAL["signatures"]) | mutated(MATERIAL["signatures"]) | st.binary(max_size=200)
)


@st.composite
def offers(draw) -> sync_pb2.OfferRequest:
    manifest = draw(manifests)
    try:  # mostly the version the manifest says, so that offers get past that check to the signature
        claimed = json.loads(manifest)["version"]
        # bool is an int to Python but not to protobuf: a mutated manifest may claim "version": true
        usable = isinstance(claimed, int) and not isinstance(claimed, bool) and 0 <= claimed < 2**64
        version = claimed if usable and draw(st.integers(0, 3)) else None
    except (ValueError, KeyError, TypeError):
        version = None
    return sync_pb2.OfferRequest(
        model=draw(names),
        version=draw(st.integers(0, 2**64 - 1) | st.integers(0, 8)) if version is None else version,
        manifest=manifest,
        signature=draw(signatures),
        objects=draw(st.lists(hex32 | st.text(max_size=40), max_size=4)),
        origin=draw(st.text(max_size=20)),
        hops=draw(st.integers(0, 2**32 - 1) | st.integers(0, 20)),
    )


@st.composite
def frames(draw) -> bytes:
    data = draw(st.sampled_from(MATERIAL["objects"]) | mutated(MATERIAL["objects"]) | st.binary(max_size=2000))
    address = draw(
        st.just(object_hash(data))
        | hex32
        | st.text(max_size=40)
        | st.sampled_from([object_hash(o) for o in MATERIAL["objects"]])
    )
    version = draw(st.integers(0, 2**64 - 1) | st.integers(0, 8))
    frame = encode_object_frame(ObjectFrame(draw(names), version, address, data))
    if draw(st.booleans()):
        return frame
    return draw(mutated([frame]))  # a frame the codec must refuse (or read as something else)


raw_requests = st.binary(max_size=400)


# ------------------------------------------------------------------------------ straight into the handlers


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code, self.details = code, details


class _Context:
    """Stands in for grpc.ServicerContext: abort raises, as the real one does."""

    def abort(self, code, details):
        raise _Aborted(code, details)

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def time_remaining(self) -> float | None:
        return None  # a call without a deadline


class _Details:
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture(scope="module")
def handlers(agent):
    """The method handlers the agent's server registers, over a servicer of the running agent."""
    servicer = _Servicer(agent.agent)
    generic = agent_service_handler(servicer.offer, servicer.push_objects, servicer.get_status)
    return {name: generic.service(_Details(f"/{SERVICE}/{name}")) for name in ("Offer", "PushObjects", "GetStatus")}


def _call_handler(handler, payload, streaming: bool) -> str:
    """What grpc would answer: a deserializer that raises is INTERNAL, so is any unexpected exception."""
    try:
        if handler.request_deserializer is not None:
            try:
                payload = (
                    [handler.request_deserializer(p) for p in payload]
                    if streaming
                    else handler.request_deserializer(payload)
                )
            except Exception as e:  # noqa: BLE001 - grpc answers INTERNAL to any of these
                return f"INTERNAL (deserializer: {type(e).__name__}: {e})"
        if streaming:
            handler.stream_unary(iter(payload), _Context())
        else:
            handler.unary_unary(payload, _Context())
        return "OK"
    except _Aborted as e:
        return e.code.name
    except Exception as e:  # noqa: BLE001 - an unexpected exception is what the fuzzer looks for
        return f"INTERNAL ({type(e).__name__}: {e})"


def _record(path: str, outcome: str) -> None:
    CALLS[f"{path} {outcome.split(' ')[0]}"] += 1
    assert outcome in ALLOWED, f"{path}: {outcome}"


@FUZZ
@given(offer=offers())
def test_offer_handler_answers_only_with_weightsync_codes(handlers, offer):
    _record("direct offer", _call_handler(handlers["Offer"], offer.SerializeToString(), streaming=False))


@FUZZ
@given(stream=st.lists(frames(), min_size=1, max_size=4))
def test_push_handler_answers_only_with_weightsync_codes(handlers, stream):
    _record("direct push", _call_handler(handlers["PushObjects"], stream, streaming=True))


@FUZZ
@given(offer=raw_requests, stream=st.lists(raw_requests, min_size=1, max_size=3), status=raw_requests)
def test_handlers_refuse_bytes_that_are_not_messages_with_invalid_argument(handlers, offer, stream, status):
    _record("direct raw offer", _call_handler(handlers["Offer"], offer, streaming=False))
    _record("direct raw push", _call_handler(handlers["PushObjects"], stream, streaming=True))
    _record("direct raw status", _call_handler(handlers["GetStatus"], status, streaming=False))


# ------------------------------------------------------------------------------ through a real channel


@pytest.fixture(scope="module")
def wire(agent):
    channel = open_channel(agent.address)
    raw = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    calls = {
        "offer": channel.unary_unary(OFFER, **raw),
        "push": channel.stream_unary(PUSH_OBJECTS, **raw),
        "status": channel.unary_unary(GET_STATUS, **raw),
    }
    yield calls
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()


def _over_channel(call, payload, token: str | None) -> str:
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    try:
        call(payload, timeout=30, metadata=metadata)
        return "OK"
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
            return f"{e.code().name} ({e.details()})"
        return e.code().name


@FUZZ_CHANNEL
@given(
    offer=offers(),
    stream=st.lists(frames(), min_size=1, max_size=3),
    raw=raw_requests,
    token=st.sampled_from([TOKEN, TOKEN, TOKEN, "wrong", None]),
)
def test_rpcs_over_a_real_channel_answer_only_with_weightsync_codes(wire, offer, stream, raw, token):
    _record("channel offer", _over_channel(wire["offer"], offer.SerializeToString(), token))
    _record("channel push", _over_channel(wire["push"], iter(stream), token))
    _record("channel raw offer", _over_channel(wire["offer"], raw, token))
    _record("channel raw status", _over_channel(wire["status"], raw, token))
