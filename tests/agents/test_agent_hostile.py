"""Hostile inputs at a sync agent, over real gRPC (port 0): every case of tests/hostile/agent/ is
refused with the status code and message its expected.json names, and leaves the agent and its
store exactly as they were: same served version, digest and bytes (torch.equal), same store
listing, nothing left pending; afterwards the agent still takes a good version.

Also here: the parser corpus (tests/hostile/) replayed through an agent (every hostile manifest
offered, every hostile chunk delivered inside an otherwise valid version), inputs too big for
files (oversized manifests and object frames, frames over the message limit), clock skew in
manifests (must not matter), a compromised bucket, and regression tests for the agent bugs this
corpus and bench/chaos found.

Each case starts a fresh agent from a copy of a warmed cache (it serves v2 before its first
call), so what one case leaves behind cannot change what the next one sees.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import shutil
import time
from pathlib import Path

import grpc
import pytest
import torch

from harness.bits import bits_equal
from weightsync import errors
from weightsync.agents.config import AgentConfig
from weightsync.agents.server import AgentServer
from weightsync.errors import WeightsyncError
from weightsync.format.chunk import MAX_CHUNK_BYTES, max_object_bytes, object_hash
from weightsync.format.codecs import CODEC_NAMES
from weightsync.format.hashing import xxh3_hex
from weightsync.format.layout import chunk_key, manifest_key, model_prefix, signature_key
from weightsync.format.manifest import MAX_MANIFEST_BYTES, ChunkRef, compute_digest, parse_manifest
from weightsync.reader import Reader
from weightsync.stores import LocalStore
from weightsync.transport.rpc import (
    GET_STATUS,
    MAX_MESSAGE_BYTES,
    OFFER,
    PUSH_OBJECTS,
    AgentClient,
    ObjectFrame,
    encode_object_frame,
    open_channel,
    status_for,
)
from weightsync.transport.v1 import sync_pb2
from weightsync.versions import read_manifest

HOSTILE = Path(__file__).parents[1] / "hostile"
CORPUS = HOSTILE / "agent"
EXPECTED = json.loads((CORPUS / "expected.json").read_text())
MODEL = EXPECTED["model"]
CASES = EXPECTED["cases"]
PARSER_EXPECTED = json.loads((HOSTILE / "expected.json").read_text())
WAIT_S = 60
SERVED = 2  # what every agent serves before a case


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen():
    """The corpus generator (tests/hostile/agent is not a package)."""
    return _load(CORPUS / "make_agent_hostile.py", "make_agent_hostile")


# ------------------------------------------------------------------------------ agents


def _config(kind: str, root: Path) -> AgentConfig:
    settings = dict(EXPECTED["agents"][kind])
    if "trusted_keys" in settings:
        settings["trusted_keys"] = tuple(str(CORPUS / k) for k in settings["trusted_keys"])
    return AgentConfig(
        model=MODEL,
        cache_dir=str(root / "cache"),
        name=f"hostile-{kind}",
        store=LocalStore(root / "store").uri,
        workers=1,
        poll_interval_s=0.5,
        push_wait_s=0.5,
        engine={"type": "reference", "model": EXPECTED["arch"], "port": 0, "torch_threads": 1},
        **settings,
    )


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """Per kind of agent: a copy of the corpus store and a cache from which an agent serves v2."""
    roots = {}
    for kind in EXPECTED["agents"]:
        root = tmp_path_factory.mktemp(f"warm-{kind}")
        shutil.copytree(CORPUS / "store", root / "store")
        server = AgentServer(_config(kind, root)).start()
        try:
            assert server.agent.wait_for_version(SERVED, WAIT_S), f"{kind} never served v{SERVED} of the corpus store"
        finally:
            server.stop(0)
        roots[kind] = root
    return roots


@pytest.fixture
def start_agent(warm, tmp_path):
    """start_agent(kind) -> (server, store directory): a fresh agent serving v2 from its cache."""
    started = []

    def start(kind: str) -> tuple[AgentServer, Path]:
        root = tmp_path / kind
        shutil.copytree(warm[kind], root)
        server = AgentServer(_config(kind, root)).start()
        started.append(server)
        assert server.agent.served_version == SERVED, "the agent did not restore v2 from its cache"
        return server, root / "store"

    yield start
    for server in started:
        server.stop(0)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    version: int
    digest: str
    weights: dict[str, torch.Tensor]
    store: list[tuple[str, str]]


def _store_listing(directory: Path) -> list[tuple[str, str]]:
    return sorted(
        (str(p.relative_to(directory)), hashlib.sha256(p.read_bytes()).hexdigest())
        for p in directory.rglob("*")
        if p.is_file()
    )


def _snapshot(server: AgentServer, store_dir: Path) -> Snapshot:
    served = server.engine.served()
    return Snapshot(
        served.version, served.digest, {k: v.clone() for k, v in served.weights.items()}, _store_listing(store_dir)
    )


def _assert_unchanged(server: AgentServer, store_dir: Path, before: Snapshot, *, nothing_pending: bool) -> None:
    served = server.engine.served()
    assert (served.version, served.digest) == (before.version, before.digest), "the served version changed"
    assert sorted(served.weights) == sorted(before.weights)
    for name, tensor in before.weights.items():
        assert bits_equal(served.weights[name], tensor), f"served {name} changed"
    status = AgentClient(server.address, token=EXPECTED["agents"][_kind(server)].get("token")).status(verify=True)
    assert (status.current_version, status.current_digest) == (before.version, before.digest)
    assert status.served_digest == before.digest, "the served bytes no longer hash to the version's digest"
    if nothing_pending:  # a refused call leaves nothing behind that the agent would go on to sync
        assert status.target_version == before.version, f"a refused call left v{status.target_version} pending"
    assert _store_listing(store_dir) == before.store, "the store changed"


def _kind(server: AgentServer) -> str:
    return server.config.name.removeprefix("hostile-")


def _assert_still_takes_a_good_version(server: AgentServer, store_dir: Path) -> None:
    """Commits the corpus's next/ (good v3 and a full v6) and waits for the agent to serve v6."""
    shutil.copytree(CORPUS / "next", store_dir, dirs_exist_ok=True)
    want = Reader(LocalStore(store_dir), model=MODEL).read(6)
    assert server.agent.wait_for_version(6, WAIT_S), (
        f"after the case the agent never served v6: {server.agent.status()['last_error']}"
    )
    served = server.engine.served()
    assert served.version == 6 and served.digest == want.manifest.digest
    for name, tensor in want.state_dict().items():
        assert bits_equal(served.weights[name], tensor), name


# ------------------------------------------------------------------------------ calls


class Wire:
    """grpc callables on one channel, so tests see the codes and details exactly as the agent sent them."""

    def __init__(self, address: str) -> None:
        self.channel = open_channel(address)
        raw = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
        self.offer = self.channel.unary_unary(
            OFFER,
            request_serializer=sync_pb2.OfferRequest.SerializeToString,
            response_deserializer=sync_pb2.OfferReply.FromString,
        )
        self.push = self.channel.stream_unary(
            PUSH_OBJECTS, request_serializer=encode_object_frame, response_deserializer=sync_pb2.PushReply.FromString
        )
        self.status = self.channel.unary_unary(
            GET_STATUS,
            request_serializer=sync_pb2.StatusRequest.SerializeToString,
            response_deserializer=sync_pb2.StatusReply.FromString,
        )
        self.raw_offer = self.channel.unary_unary(OFFER, **raw)
        self.raw_push = self.channel.stream_unary(PUSH_OBJECTS, **raw)

    def call(self, method, request, token: str | None) -> tuple[str, str, object]:
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        try:
            return "OK", "", method(request, timeout=WAIT_S, metadata=metadata)
        except grpc.RpcError as e:
            return e.code().name, e.details() or "", None

    def close(self) -> None:
        self.channel.close()


def _read(name: str | None) -> bytes:
    return (CORPUS / name).read_bytes() if name else b""


def _run_step(server: AgentServer, wire: Wire, step: dict) -> None:
    token = step["token"] if "token" in step else EXPECTED["agents"][_kind(server)].get("token")
    rpc = step["rpc"]
    if rpc == "wait_failure":
        _wait_failure(server, step["version"], step["error"], step["match"])
        return
    if rpc == "offer":
        request = sync_pb2.OfferRequest(
            model=step.get("model", MODEL),
            version=step["version"],
            manifest=_read(step["manifest"]),
            signature=_read(step["signature"]),
            objects=step.get("objects", []),
            hops=step.get("hops", 0),
            origin="hostile",
        )
        code, details, reply = wire.call(wire.offer, request, token)
    elif rpc == "push":
        frames = [
            ObjectFrame(f.get("model", MODEL), f["version"], f["object"], _read(f["data"])) for f in step["frames"]
        ]
        code, details, reply = wire.call(wire.push, iter(frames), token)
    elif rpc == "status":
        code, details, reply = wire.call(wire.status, sync_pb2.StatusRequest(), token)
    elif rpc == "raw_offer":
        code, details, reply = wire.call(wire.raw_offer, _read(step["raw"]), token)
    elif rpc == "raw_push":
        code, details, reply = wire.call(wire.raw_push, iter([_read(r) for r in step["raw"]]), token)
    else:
        raise AssertionError(f"unknown step {rpc!r}")
    assert (code, step["match"] in details) == (step["code"], True), (
        f"{rpc}: got {code} {details!r}, want {step['code']} with {step['match']!r}"
    )
    if "decision" in step:
        assert sync_pb2.OfferReply.Decision.Name(reply.decision) == step["decision"]
    if "kept" in step:
        assert (reply.objects, reply.duplicates) == (step["kept"], step["duplicates"])


def _wait_failure(server: AgentServer, version: int, error: str, match: str) -> None:
    """Waits until the agent's ledger records `version` as failed with this error."""
    deadline = time.monotonic() + WAIT_S
    seen = ""
    while time.monotonic() < deadline:
        for entry in server.agent.status()["ledger"]:
            if entry["version"] == version and entry["outcome"] == "failed":
                seen = entry["error"]
                if seen.startswith(f"{error}: ") and match in seen:
                    return
        time.sleep(0.05)
    raise AssertionError(f"v{version} was never refused with {error}: ...{match}...; last error {seen!r}")


# ------------------------------------------------------------------------------ the corpus


def test_corpus_is_complete_and_regenerates(gen, tmp_path):
    named = {"make_agent_hostile.py", "expected.json", "trusted.pub"}
    for case in CASES.values():
        for step in case["steps"]:
            named.update(n for n in (step.get("manifest"), step.get("signature")) if n)
            named.update(f["data"] for f in step.get("frames", ()))
            raw = step.get("raw")
            named.update([raw] if isinstance(raw, str) else raw or ())
    files = {str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    top = {f for f in files if not f.startswith(("store/", "next/"))}
    assert top == named, f"unreferenced: {sorted(top - named)[:5]}, missing: {sorted(named - top)[:5]}"
    assert len(CASES) >= 40
    for name, case in CASES.items():
        for step in case["steps"]:
            assert step["rpc"] == "wait_failure" or step["code"] == "OK" or step["match"] or "xfail" in case, name
            if step.get("error"):
                assert issubclass(getattr(errors, step["error"]), errors.WeightsyncError), name
    # Regenerated, the corpus has the same files and cases (object bytes embed zstd frames, so
    # only their names are compared, not their bytes).
    gen.write(tmp_path)
    again = json.loads((tmp_path / "expected.json").read_text())
    assert {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()} == files - {
        "make_agent_hostile.py"
    }
    assert again == EXPECTED


def test_corpus_store_holds_what_the_cases_assume(gen):
    store = LocalStore(CORPUS / "store")
    reader = Reader(store, model=MODEL)
    v2 = reader.read(2)
    assert v2.manifest.kind == "delta" and v2.manifest.parent == 1
    assert v2.buffers[gen.EMBED].tobytes() == gen.parser_corpus_parent(0).tobytes()
    make_hostile = _load(HOSTILE / "make_hostile.py", "make_hostile")
    assert v2.buffers[gen.EMBED].tobytes() == make_hostile.parent(0).tobytes()
    for name, tensor in gen.weights(2).items():
        assert bits_equal(v2.state_dict()[name], tensor), name


# The fast tier (scripts/test.sh --fast) runs a few cases of each kind; every case is marked
# slow otherwise (each starts an agent: ~1.5 s, ~75 s in all on 2 cores), and CI runs them all.
FAST_CASES = {
    "offer_v3_tampered_after_signing",
    "offer_without_a_token",
    "open_delta_on_the_wrong_parent",
    "open_full_with_a_zstd_bomb",
    "push_object_corrupted_in_flight",
    "raw_push_frame_with_a_bad_varint",
    "signed_delta_on_the_wrong_parent",
}


def test_fast_cases_are_cases():
    assert FAST_CASES <= set(CASES), "a renamed case would silently leave the fast tier"


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=([pytest.mark.xfail(strict=True, reason=case["xfail"])] if "xfail" in case else [])
            + ([] if name in FAST_CASES else [pytest.mark.slow]),
        )
        for name, case in sorted(CASES.items())
    ],
)
def test_hostile_conversation_is_refused_and_changes_nothing(name, start_agent):
    case = CASES[name]
    server, store_dir = start_agent(case["agent"])
    before = _snapshot(server, store_dir)
    wire = Wire(server.address)
    try:
        for step in case["steps"]:
            _run_step(server, wire, step)
    finally:
        wire.close()
    _assert_unchanged(
        server, store_dir, before, nothing_pending=not any(s["rpc"] == "wait_failure" for s in case["steps"])
    )
    _assert_still_takes_a_good_version(server, store_dir)


# ------------------------------------------------------------------------------ built at test time


def test_inputs_too_big_for_files_are_refused(start_agent):
    server, store_dir = start_agent("open")
    before = _snapshot(server, store_dir)
    wire = Wire(server.address)
    manifest = (CORPUS / "open_offer_v1_older_than_served.json").read_bytes()
    huge_manifest = manifest + b" " * (MAX_MANIFEST_BYTES + 1 - len(manifest))
    over_format = b"\0" * (max_object_bytes(MAX_CHUNK_BYTES) + 1)
    over_message = b"\0" * (MAX_MESSAGE_BYTES + 1)
    cases = [
        (
            wire.offer,
            sync_pb2.OfferRequest(model=MODEL, version=3, manifest=huge_manifest),
            "INVALID_ARGUMENT",
            f"manifest of {MAX_MANIFEST_BYTES + 1} bytes exceeds",
        ),
        (
            wire.push,
            iter([ObjectFrame(MODEL, 3, object_hash(over_format), over_format)]),
            "INVALID_ARGUMENT",
            "over the format's limit",
        ),
        (wire.push, iter([ObjectFrame(MODEL, 3, "0" * 32, over_message)]), "RESOURCE_EXHAUSTED", ""),
    ]
    try:
        for method, request, code, match in cases:
            got, details, _ = wire.call(method, request, None)
            assert (got, match in details) == (code, True), (got, details)
    finally:
        wire.close()
    _assert_unchanged(server, store_dir, before, nothing_pending=True)
    _assert_still_takes_a_good_version(server, store_dir)


def test_every_parser_corpus_manifest_offered_to_an_agent_is_refused(start_agent):
    server, store_dir = start_agent("open")
    before = _snapshot(server, store_dir)
    wire = Wire(server.address)
    # An empty manifest field is not a hostile manifest on the wire: it is an objects-only offer.
    names = sorted(
        n for n, spec in PARSER_EXPECTED.items() if spec["kind"] == "manifest" and n != "manifest_empty.json"
    )
    assert len(names) >= 60
    try:
        for name in names:
            spec = PARSER_EXPECTED[name]
            code = status_for(getattr(errors, spec["error"])(spec["match"])).name
            request = sync_pb2.OfferRequest(model=MODEL, version=3, manifest=(HOSTILE / name).read_bytes())
            got, details, _ = wire.call(wire.offer, request, None)
            assert (got, spec["match"] in details) == (code, True), f"{name}: {got} {details!r}"
    finally:
        wire.close()
    _assert_unchanged(server, store_dir, before, nothing_pending=True)
    _assert_still_takes_a_good_version(server, store_dir)


@pytest.mark.slow
def test_every_parser_corpus_chunk_delivered_in_a_version_is_refused(gen, start_agent):
    """Each hostile chunk, pushed as the one changed chunk of a delta on v2 (v2's embedding holds
    exactly the bytes the chunk was built against), fails the way tests/format/test_hostile.py says it
    fails, inside a real agent; the agent keeps serving v2."""
    server, store_dir = start_agent("open")
    before = _snapshot(server, store_dir)
    v2 = Reader(LocalStore(store_dir), model=MODEL).read(2).manifest
    # Left out, because in this setting they would be valid: chunk_applied_to_wrong_parent is built
    # against another parent, chunk_wrong_dtype is refused only for a float16 tensor.
    names = sorted(
        n
        for n, spec in PARSER_EXPECTED.items()
        if spec["kind"] == "chunk" and spec["parent_seed"] == 0 and spec["dtype"] == "bfloat16"
    )
    assert len(names) >= 35
    wire = Wire(server.address)
    refused_at_offer = 0
    try:
        for version, name in enumerate(names, start=3):
            spec = PARSER_EXPECTED[name]
            obj = (HOSTILE / name).read_bytes()
            address = object_hash(obj)
            tensors = []
            for t in v2.tensors:
                chunks = tuple(ChunkRef(start=c.start, stop=c.stop, codec="same", raw=c.raw) for c in t.chunks)
                if t.name == gen.EMBED:
                    chunks = (
                        ChunkRef(
                            start=0,
                            stop=spec["count"],
                            codec=CODEC_NAMES[spec["codec"]],
                            raw=spec["raw"],
                            object=address,
                            key=chunk_key(address),
                            size=len(obj),
                        ),
                    )
                tensors.append(dataclasses.replace(t, chunks=chunks))
            manifest = dataclasses.replace(
                v2, version=version, parent=2, base=1, tensors=tuple(tensors), digest=compute_digest(tensors)
            ).to_bytes()
            try:
                parse_manifest(manifest)
            except WeightsyncError as e:  # e.g. an oversized object: the manifest naming it is refused
                got, details, _ = wire.call(
                    wire.offer, sync_pb2.OfferRequest(model=MODEL, version=version, manifest=manifest), None
                )
                assert (got, str(e) in details) == (status_for(e).name, True), f"{name}: {got} {details!r}"
                refused_at_offer += 1
                continue
            # Offer first, then push: a push wakes the sync thread, which would spend the wake-up on
            # retrying the previous failed version and then sleep out its backoff.
            got, details, reply = wire.call(
                wire.offer, sync_pb2.OfferRequest(model=MODEL, version=version, manifest=manifest), None
            )
            assert got == "OK" and reply.decision == sync_pb2.OfferReply.WANTED, f"{name}: {got} {details}"
            got, details, _ = wire.call(wire.push, iter([ObjectFrame(MODEL, version, address, obj)]), None)
            assert got == "OK", f"{name}: {got} {details}"
            _wait_failure(server, version, spec["error"], spec["match"])
    finally:
        wire.close()
    assert refused_at_offer < len(names) // 4, "most hostile chunks must reach the decoder, not stop at the manifest"
    _assert_unchanged(server, store_dir, before, nothing_pending=False)
    # A good version numbered above every hostile one, so that the check does not depend on how the
    # agent treats the hostile versions it still knows (test_a_bogus_unsigned_offer_... covers that).
    version = len(names) + 3
    manifest, objects = gen.encode_version(gen.weights(6), None, version=version, step=6)
    store = LocalStore(store_dir)
    for key, data in _signed_store_files(gen, manifest, objects).items():
        store.put(key, data)
    assert server.agent.wait_for_version(version, WAIT_S), server.agent.status()["last_error"]
    served = server.engine.served()
    assert (served.version, served.digest) == (version, manifest.digest)
    assert all(bits_equal(served.weights[n], t) for n, t in gen.weights(6).items())


def _signed_store_files(gen, manifest, objects) -> dict[str, bytes]:
    data = manifest.to_bytes()
    files = {
        manifest_key(MODEL, manifest.version): data,
        signature_key(MODEL, manifest.version, xxh3_hex(data)): gen.TRUSTED.sign(data),
    }
    files.update({model_prefix(MODEL) + chunk_key(a): o for a, o in objects.items()})
    return files


def test_clock_skew_in_manifests_does_not_matter(gen, start_agent):
    """Versions are ordered by number, never by created_unix_ms: a manifest stamped at the epoch,
    one from the far future, and one earlier than its parent are all served, in order."""
    server, store_dir = start_agent("guarded")
    store = LocalStore(store_dir)
    previous = gen.weights(2)
    for version, created in ((3, 0), (4, 2**62), (5, 1)):
        weights = gen.weights(version)
        manifest, objects = gen.encode_version(
            weights,
            previous,
            version=version,
            parent_version=version - 1,
            base=1,
            step=version,
            created_unix_ms=created,
        )
        for key, data in _signed_store_files(gen, manifest, objects).items():
            store.put(key, data)
        assert server.agent.wait_for_version(version, WAIT_S), server.agent.status()["last_error"]
        served = server.engine.served()
        assert (served.version, served.digest) == (version, manifest.digest)
        assert all(bits_equal(served.weights[n], t) for n, t in weights.items())
        previous = weights


# ------------------------------------------------------------------------------ known bugs


@pytest.mark.slow
def test_a_bogus_unsigned_offer_does_not_hide_the_stores_real_version(start_agent):
    server, store_dir = start_agent("open")
    wire = Wire(server.address)
    try:
        for step in CASES["open_delta_on_the_wrong_parent"]["steps"]:  # a v3 that can never verify
            _run_step(server, wire, step)
    finally:
        wire.close()
    next_store = LocalStore(CORPUS / "next")
    store = LocalStore(store_dir)
    for info in next_store.list():  # the publisher commits the real v3 (only v3)
        if "000000000006" not in info.key and info.key.split("/")[-1] not in _v6_objects(next_store):
            store.put(info.key, next_store.get(info.key))
    assert server.agent.wait_for_version(3, 15), f"the real v3 was never served: {server.agent.status()['last_error']}"


def _v6_objects(store: LocalStore) -> set[str]:
    """Objects of next/'s v6 that v3 does not share."""

    def names(v: int) -> set[str]:
        return {c.object for t in read_manifest(store, MODEL, v).tensors for c in t.chunks if c.object}

    return names(6) - names(3)


def test_a_flipped_byte_in_a_cached_manifest_does_not_wedge_the_agent(gen, start_agent):
    server, store_dir = start_agent("open")
    store = LocalStore(store_dir)
    next_store = LocalStore(CORPUS / "next")
    v6_only = _v6_objects(next_store)
    for info in next_store.list():  # v3, a delta on v2: now the agent double-buffers v2 (spare) and v3 (served)
        if "000000000006" not in info.key and info.key.split("/")[-1] not in v6_only:
            store.put(info.key, next_store.get(info.key))
    assert server.agent.wait_for_version(3, WAIT_S), server.agent.status()["last_error"]
    cached = Path(server.config.cache_dir) / "store" / manifest_key(MODEL, 2)
    data = bytearray(cached.read_bytes())
    data[data.index(b'"key":"chunks/') + 8] ^= 0x01  # "chunks" -> "chunk" + 'r': no longer parses
    cached.write_bytes(bytes(data))
    manifest, objects = gen.encode_version(gen.weights(4), gen.weights(3), version=4, parent_version=3, base=1, step=4)
    for key, value in _signed_store_files(gen, manifest, objects).items():
        store.put(key, value)
    assert server.agent.wait_for_version(4, 30), f"v4 was never served: {server.agent.status()['last_error']}"


def _wait_last_error(server: AgentServer, match: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while match not in server.agent.status()["last_error"]:
        assert time.monotonic() < deadline, f"never refused ({match!r}): {server.agent.status()['last_error']!r}"
        time.sleep(0.05)


def test_a_compromised_bucket_cannot_make_a_signing_agent_serve_a_forgery(gen, start_agent):
    """Someone who can write the bucket but has no signing key commits a v3 of their own: unsigned,
    then signed by their own key, then with a genuine signature copied from another version. The
    agent, which polls the store, refuses each (SignatureError), serves v2 throughout, then takes
    the next genuinely signed version."""
    server, store_dir = start_agent("guarded")
    before = _snapshot(server, store_dir)
    store = LocalStore(store_dir)
    forged, objects = gen.encode_version(gen.weights(4), gen.weights(2), version=3, parent_version=2, base=1, step=3)
    data = forged.to_bytes()
    for address, obj in objects.items():
        store.put(model_prefix(MODEL) + chunk_key(address), obj)
    store.put(manifest_key(MODEL, 3), data)
    _wait_last_error(server, "not signed")
    signature = signature_key(MODEL, 3, xxh3_hex(data))
    for document, match in [
        (gen.UNTRUSTED.sign(data), "which is not trusted"),
        (
            store.get(signature_key(MODEL, 2, xxh3_hex(store.get(manifest_key(MODEL, 2))))),
            "does not match the manifest",
        ),
    ]:
        store.put(signature, document)
        _wait_last_error(server, match)
        served = server.engine.served()
        assert (served.version, served.digest) == (before.version, before.digest)
    store.delete(signature)
    store.delete(manifest_key(MODEL, 3))
    for address in objects:
        store.delete(model_prefix(MODEL) + chunk_key(address))
    _assert_unchanged(server, store_dir, before, nothing_pending=True)
    _assert_still_takes_a_good_version(server, store_dir)


@pytest.mark.slow
def test_a_damaged_old_cached_manifest_does_not_stop_cache_gc(gen, start_agent):
    server, store_dir = start_agent("open")
    store = LocalStore(store_dir)
    shutil.copytree(CORPUS / "next", store_dir, dirs_exist_ok=True)  # v3 (delta on v2) and v6 (full)
    assert server.agent.wait_for_version(6, WAIT_S), server.agent.status()["last_error"]
    cache = LocalStore(Path(server.config.cache_dir) / "store")
    cached = Path(server.config.cache_dir) / "store" / manifest_key(MODEL, 2)  # on no chain from v6 on
    if cached.exists():
        data = bytearray(cached.read_bytes())
        data[data.index(b'"stop":') + 1] ^= 0x10  # "stop" -> "ctop": no longer a manifest
        cached.write_bytes(bytes(data))
    for version in range(7, 12):  # full versions: each makes every older cached version collectable
        manifest, objects = gen.encode_version(gen.weights(version), None, version=version, step=version)
        for key, value in _signed_store_files(gen, manifest, objects).items():
            store.put(key, value)
        assert server.agent.wait_for_version(version, WAIT_S), server.agent.status()["last_error"]
    keep = server.config.cache_keep_versions
    cached_versions = sorted(
        int(i.key.rsplit("/", 1)[1].split(".")[0]) for i in cache.list(f"models/{MODEL}/versions/")
    )
    assert len(cached_versions) <= keep + 2, f"the cache keeps growing: {cached_versions}"
