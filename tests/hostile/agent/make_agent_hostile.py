"""Writes the agent-level hostile corpus next to this file: what a sync agent must refuse over gRPC.

tests/hostile/ holds inputs for the parsers; this folder holds whole *conversations* with an
agent that serves a known version: offers (manifest + signature + request fields), pushed object
frames, raw wire bytes, each with the status code and message fragment the agent must answer,
and cases that an agent accepts at the offer but must refuse to serve (layout changes, deltas on
the wrong parent, zstd bombs behind a valid manifest). tests/agents/test_agent_hostile.py runs every
case against a real agent over gRPC and checks it changed nothing: same served version, digest
and bytes, same store.

What is here:
  store/        the upstream store the agents start from: v1 (full) and v2 (delta), signed by
                the trusted key. Agents serve v2 before any case runs.
  next/         good v3 (a delta on v2) and v6 (a full version), signed: after each case the
                liveness check commits them and the agent must serve v6 (newer than any version a
                case offers, so what a case left behind cannot stand in its way).
  objects/      object payloads the cases push, named by content address; `bad-*.bin` files
                are payloads that do not hash to the address they are pushed under.
  <case>*.json  manifests the cases offer; <case>*.sig signature documents; <case>*.raw raw
                request bytes.
  trusted.pub   the public key agents trust.
  expected.json the agents' settings ("agents") and the cases ("cases"), each a list of steps:
                  offer / push / status    a call, with the status code it must get ("OK" or a
                                           grpc.StatusCode name) and a fragment of the message
                  raw_offer / raw_push     the same with bytes that are not a valid message
                  wait_failure             the agent must record this version as failed with
                                           this error class and message
                `error` names the server-side exception class (documentation: the client only
                sees the code); `xfail` marks a case that shows a known bug (the test expects it
                to fail until the bug is fixed).

The keys are test keys derived from fixed public seeds (Ed25519 signatures are deterministic):
anyone can recompute the private keys from this file, which is the point. Never trust them.

Deterministic: `python tests/hostile/agent/make_agent_hostile.py` rewrites everything. Object
bytes embed zstd frames, so a zstandard upgrade may change them (and the manifests naming them);
tests/agents/test_agent_hostile.py checks the corpus is self-consistent, not byte-stable.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import zstandard
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from weightsync.format.chunk import encode_chunk, object_hash, pack_chunk
from weightsync.format.codecs import CODEC_FULL, CODEC_NAMES, CODEC_SPARSE
from weightsync.format.codecs.choice import CodecChoice
from weightsync.format.dtypes import dtype_by_name
from weightsync.format.hashing import xxh3_digest, xxh3_hex
from weightsync.format.layout import chunk_key, manifest_key, model_prefix, signature_key
from weightsync.format.manifest import CODEC_SAME, ChunkRef, Manifest, TensorEntry, compute_digest
from weightsync.format.tensors import dtype_of, raw_bytes
from weightsync.models import ModelConfig, build_model
from weightsync.transport.rpc import ObjectFrame, encode_object_frame
from weightsync.transport.signing import Signer
from weightsync.transport.v1 import sync_pb2

HERE = Path(__file__).resolve().parent
MODEL = "hostile-agent"
OTHER_MODEL = "other-model"
# A tiny architecture the reference engine serves, with every kind of tensor it has. The embedding
# holds 4096 elements: the size of every chunk in the parser corpus (tests/hostile/make_hostile.py).
ARCH = ModelConfig(
    vocab_size=256,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)
CHUNK_ELEMENTS = 256  # several chunks per tensor, so deltas mix changed and unchanged chunks
EMBED = "model.embed_tokens.weight"
EMBED_CHUNK_ELEMENTS = 4096  # one chunk: a parser-corpus chunk can stand in for it
PARSER_CORPUS_COUNT = 4096
CREATED_UNIX_MS = 1764000000000
ZSTD_LEVEL = 3
PREDATES_CTX = CodecChoice(highest_codec=CODEC_SPARSE)
"""The corpus predates codec ctx: its deltas stay sparse/xor (objects that must stay readable),
and regenerating it reproduces the committed files. Agents meet ctx objects in test_agents."""
TOKEN = "hostile-token"
PENDING_QUOTA_BYTES = 64 * 1024
TRUSTED = Signer(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"weightsync hostile trusted test key").digest()))
UNTRUSTED = Signer(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"weightsync hostile rogue test key").digest()))
AGENTS = {
    # What production runs on an untrusted network: a token and signatures by a trusted key.
    "guarded": {
        "token": TOKEN,
        "trusted_keys": ["trusted.pub"],
        "require_signatures": True,
        "max_pending_bytes": PENDING_QUOTA_BYTES,
    },
    # No token, no signatures (a trusted network): everything rests on hashes and layout checks.
    "open": {},
}


# ------------------------------------------------------------------------------- weights


def parser_corpus_parent(seed: int = 0) -> np.ndarray:
    """The bytes the parser corpus's chunks are made against: make_hostile.parent(seed), repeated
    here because tests/hostile is not a package (tests/agents/test_agent_hostile.py checks they agree)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2**16, PARSER_CORPUS_COUNT, dtype=np.uint16).view(np.uint8).copy()


def weights(step: int) -> dict[str, torch.Tensor]:
    """The bf16 weights of trainer step `step`: a seeded init, then per step ~10 % of the elements
    moved by one ULP (bit pattern +-1), as RL steps do. Step 2's embedding is replaced by the
    parser corpus's parent bytes, so that any hostile chunk of that corpus, named by a v3 that
    is a delta on v2, meets exactly the bytes it was built against."""
    out = {n: t.detach().to(torch.bfloat16) for n, t in build_model(ARCH, seed=0).state_dict().items()}
    for s in range(1, step + 1):
        g = torch.Generator().manual_seed(1000 + s)
        for name in sorted(out):
            bits = out[name].view(torch.int16).clone().reshape(-1)
            where = torch.rand(bits.numel(), generator=g) < 0.1
            bits[where] += torch.randint(0, 2, (int(where.sum()),), generator=g, dtype=torch.int16) * 2 - 1
            out[name] = bits.view(torch.bfloat16).reshape(out[name].shape)
    if step == 2:
        embed = torch.from_numpy(parser_corpus_parent(0).view(np.int16).copy())
        out[EMBED] = embed.view(torch.bfloat16).reshape(out[EMBED].shape)
    return out


def chunk_elements(name: str) -> int:
    return EMBED_CHUNK_ELEMENTS if name == EMBED else CHUNK_ELEMENTS


def encode_version(
    tensors: dict[str, torch.Tensor],
    parent: dict[str, torch.Tensor] | None,
    *,
    version: int,
    parent_version: int | None = None,
    base: int | None = None,
    step: int | None = None,
    model: str = MODEL,
    created_unix_ms: int = CREATED_UNIX_MS,
    choice: CodecChoice | None = None,
) -> tuple[Manifest, dict[str, bytes]]:
    """A manifest and its objects, encoded the way the publisher does (full, or deltas against
    `parent` in the codecs `choice` allows, chunks of `chunk_elements(name)` elements). Nothing
    checks that parent and `parent_version` agree: that is what some cases get wrong on purpose."""
    entries, objects = [], {}
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        dtype = dtype_of(tensor)
        new = raw_bytes(tensor)
        old = None if parent is None else raw_bytes(parent[name].contiguous())
        refs = []
        size = dtype.itemsize
        for start in range(0, tensor.numel(), chunk_elements(name)):
            stop = min(start + chunk_elements(name), tensor.numel())
            codec_id, raw, obj, _ = encode_chunk(
                new[start * size : stop * size],
                None if old is None else old[start * size : stop * size],
                dtype,
                ZSTD_LEVEL,
                choice=choice,
            )
            if obj is None:
                refs.append(ChunkRef(start=start, stop=stop, codec=CODEC_SAME, raw=raw))
                continue
            address = object_hash(obj)
            objects[address] = obj
            refs.append(
                ChunkRef(
                    start=start,
                    stop=stop,
                    codec=CODEC_NAMES[codec_id],
                    raw=raw,
                    object=address,
                    key=chunk_key(address),
                    size=len(obj),
                )
            )
        entries.append(TensorEntry(name=name, dtype=dtype.name, shape=tuple(tensor.shape), chunks=tuple(refs)))
    full = parent is None
    manifest = Manifest(
        model=model,
        version=version,
        parent=parent_version,
        base=version if full else base,
        kind="full" if full else "delta",
        step=step,
        created_unix_ms=created_unix_ms,
        tensors=tuple(entries),
        digest=compute_digest(entries),
        producer={"name": "make_agent_hostile"},
        stats={},
    )
    return manifest, objects


def _zstd_bomb_object() -> tuple[bytes, str]:
    """A `full` chunk object of CHUNK_ELEMENTS bf16 elements whose first stream's zstd frame
    declares 1 MiB: well formed, correctly hashed, refused before decompressing."""
    bf16 = dtype_by_name("bfloat16")
    bomb = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(b"\0" * (1 << 20))
    plane = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(b"\0" * CHUNK_ELEMENTS)
    table = b"".join(np.array([CHUNK_ELEMENTS, len(f)], "<u8").tobytes() for f in (bomb, plane))
    payload = bytes([2]) + table + bomb + plane
    raw = xxh3_digest(b"\0" * (2 * CHUNK_ELEMENTS))
    return pack_chunk(CODEC_FULL, ZSTD_LEVEL, bf16, CHUNK_ELEMENTS, raw, payload), raw.hex()


# ------------------------------------------------------------------------------- the corpus


class Corpus:
    """Collects files and cases, then writes them."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.cases: dict[str, dict] = {}

    def file(self, name: str, data: bytes) -> str:
        assert self.files.get(name, data) == data, f"two different {name}"
        self.files[name] = data
        return name

    def manifest(self, name: str, manifest: Manifest | bytes) -> str:
        return self.file(f"{name}.json", manifest if isinstance(manifest, bytes) else manifest.to_bytes())

    def objects(self, objects: dict[str, bytes]) -> list[str]:
        return [self.file(f"objects/{address}", obj) for address, obj in sorted(objects.items())]

    def case(self, name: str, agent: str, threat: str, *steps: dict, xfail: str | None = None) -> None:
        assert name not in self.cases, name
        self.cases[name] = {
            "agent": agent,
            "threat": threat,
            "steps": list(steps),
            **({"xfail": xfail} if xfail else {}),
        }


def _store_files(manifest: Manifest, objects: dict[str, bytes], signer: Signer | None) -> dict[str, str | bytes]:
    data = manifest.to_bytes()
    files = {manifest_key(manifest.model, manifest.version): data}
    prefix = model_prefix(manifest.model)
    files.update({prefix + chunk_key(a): o for a, o in objects.items()})
    if signer is not None:
        files[signature_key(manifest.model, manifest.version, xxh3_hex(data))] = signer.sign(data)
    return files


def offer(
    version: int, manifest: str | None, signature: str | None, code: str, match: str = "", *, error: str = "", **fields
) -> dict:
    return {
        "rpc": "offer",
        "version": version,
        "manifest": manifest,
        "signature": signature,
        **fields,
        "code": code,
        "error": error,
        "match": match,
    }


def push(frames: list[dict], code: str, match: str = "", *, error: str = "", **fields) -> dict:
    return {"rpc": "push", "frames": frames, **fields, "code": code, "error": error, "match": match}


def frames_of(version: int, names: list[str]) -> list[dict]:
    return [{"version": version, "object": Path(n).name, "data": n} for n in names]


def build() -> tuple[Corpus, dict[str, dict[str, bytes]]]:
    encode = functools.partial(encode_version, choice=PREDATES_CTX)
    c = Corpus()
    w1, w2, w3, w4, w6 = (weights(s) for s in (1, 2, 3, 4, 6))
    v1, o1 = encode(w1, None, version=1, step=1)
    v2, o2 = encode(w2, w1, version=2, parent_version=1, base=1, step=2)
    v3, o3 = encode(w3, w2, version=3, parent_version=2, base=1, step=3)
    v6, o6 = encode(w6, None, version=6, step=6)
    trees = {
        "store": {**_store_files(v1, o1, TRUSTED), **_store_files(v2, o2, TRUSTED)},
        "next": {**_store_files(v3, o3, TRUSTED), **_store_files(v6, o6, TRUSTED)},
    }
    c.file("trusted.pub", TRUSTED.public_pem())
    v3_bytes, v2_bytes = v3.to_bytes(), v2.to_bytes()

    def sig(name, data, signer=TRUSTED):
        return c.file(f"{name}.sig", signer.sign(data))

    # ---- guarded agent: signatures, token, replays, other models, limits
    name = "offer_v3_unsigned"
    c.case(
        name,
        "guarded",
        "a rogue client offers a version nobody trusted signed",
        offer(3, c.manifest(name, v3), None, "PERMISSION_DENIED", "not signed", error="SignatureError"),
    )
    name = "offer_v3_signed_by_an_untrusted_key"
    c.case(
        name,
        "guarded",
        "a rogue client signs its own version with its own key",
        offer(
            3,
            c.manifest(name, v3),
            sig(name, v3_bytes, UNTRUSTED),
            "PERMISSION_DENIED",
            "which is not trusted",
            error="SignatureError",
        ),
    )
    name = "offer_v3_tampered_after_signing"
    tampered = dataclasses.replace(v3, step=333, created_unix_ms=0)  # digest intact: only the signature sees it
    c.case(
        name,
        "guarded",
        "a man in the middle edits a signed manifest (fields the digest does not cover)",
        offer(
            3,
            c.manifest(name, tampered),
            sig(name, v3_bytes),
            "PERMISSION_DENIED",
            "does not match the manifest",
            error="SignatureError",
        ),
    )
    name = "offer_v3_with_the_signature_of_v2"
    c.case(
        name,
        "guarded",
        "a valid signature lifted from another version",
        offer(
            3,
            c.manifest(name, v3),
            sig(name, v2_bytes),
            "PERMISSION_DENIED",
            "does not match the manifest",
            error="SignatureError",
        ),
    )
    for name, document, match in [
        ("offer_v3_signature_not_json", b"\x00\xffnot json", "malformed signature document"),
        (
            "offer_v3_signature_bad_hex",
            json.dumps({"alg": "ed25519", "key_id": TRUSTED.key_id, "sig": "zz" * 64}, sort_keys=True).encode(),
            "malformed signature document",
        ),
        ("offer_v3_signature_missing_fields", b'{"alg":"ed25519"}', "malformed signature document"),
        (
            "offer_v3_signature_wrong_algorithm",
            json.dumps({"alg": "rsa-pss", "key_id": TRUSTED.key_id, "sig": "00" * 64}).encode(),
            "is not supported",
        ),
        ("offer_v3_signature_oversized", b" " * 2048, "is over 1024"),
    ]:
        c.case(
            name,
            "guarded",
            "a malformed signature document",
            offer(
                3,
                c.manifest(name, v3),
                c.file(f"{name}.sig", document),
                "PERMISSION_DENIED",
                match,
                error="SignatureError",
            ),
        )
    name = "offer_v2_replay_with_other_weights"
    other_v2, _ = encode(w4, w1, version=2, parent_version=1, base=1, step=2)
    c.case(
        name,
        "guarded",
        "a second, different v2 (a replayed version number), even signed by the trusted key",
        offer(
            2,
            c.manifest(name, other_v2),
            sig(name, other_v2.to_bytes()),
            "INVALID_ARGUMENT",
            "differs from the one served",
            error="IntegrityError",
        ),
    )
    name = "offer_v1_older_than_served"
    c.case(
        name,
        "guarded",
        "a replay of an old, genuinely signed version",
        offer(
            1,
            c.manifest(name, v1),
            sig(name, v1.to_bytes()),
            "FAILED_PRECONDITION",
            "older than the served",
            error="StaleVersion",
        ),
    )
    name = "offer_v2_replay_of_the_served_version"
    c.case(
        name,
        "guarded",
        "the served version offered again (a retry): harmless, not wanted",
        offer(2, c.manifest(name, v2), sig(name, v2_bytes), "OK", decision="NOT_NEEDED"),
    )
    name = "offer_request_for_another_model"
    c.case(
        name,
        "guarded",
        "an offer addressed to another model",
        offer(
            3,
            c.manifest(name, v3),
            sig(name, v3_bytes),
            "INVALID_ARGUMENT",
            f"serves '{MODEL}', not '{OTHER_MODEL}'",
            error="FormatError",
            model=OTHER_MODEL,
        ),
    )
    name = "offer_manifest_of_another_model"
    other_model, _ = encode(w3, w2, version=3, parent_version=2, base=1, step=3, model=OTHER_MODEL)
    c.case(
        name,
        "guarded",
        "a correctly signed manifest of another model, in an offer for this one",
        offer(
            3,
            c.manifest(name, other_model),
            sig(name, other_model.to_bytes()),
            "INVALID_ARGUMENT",
            f"serves '{MODEL}', not '{OTHER_MODEL}'",
            error="FormatError",
        ),
    )
    name = "offer_version_field_differs_from_manifest"
    c.case(
        name,
        "guarded",
        "an offer whose version field contradicts its (signed) manifest",
        offer(
            7,
            c.manifest(name, v3),
            sig(name, v3_bytes),
            "INVALID_ARGUMENT",
            "offer says v7 but its manifest is v3",
            error="FormatError",
        ),
    )
    name = "offer_relayed_too_often"
    c.case(
        name,
        "guarded",
        "a relay loop in the peer configuration",
        offer(
            3,
            c.manifest(name, v3),
            sig(name, v3_bytes),
            "INVALID_ARGUMENT",
            "relayed 17 times",
            hops=17,
            error="FormatError",
        ),
    )
    name = "offer_manifest_truncated"
    c.case(
        name,
        "guarded",
        "a manifest cut short",
        offer(
            3,
            c.manifest(name, v3_bytes[:-7]),
            sig(name, v3_bytes[:-7]),
            "INVALID_ARGUMENT",
            "manifest is not valid JSON",
            error="FormatError",
        ),
    )
    name = "offer_manifest_traversal_key_signed"
    doc = json.loads(v3_bytes)
    first = next(ch for t in doc["tensors"] for ch in t["chunks"] if "key" in ch)
    first["key"] = "chunks/../../../../etc/passwd"
    evil = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    c.case(
        name,
        "guarded",
        "a manifest whose object key walks out of the cache, even signed by the trusted key",
        offer(
            3,
            c.manifest(name, evil),
            sig(name, evil),
            "INVALID_ARGUMENT",
            "is not the content address",
            error="FormatError",
        ),
    )
    name = "offer_manifest_overlapping_ranges_signed"
    doc = json.loads(v3_bytes)
    doc["tensors"][0]["chunks"][1]["start"] -= 1
    overlap = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    c.case(
        name,
        "guarded",
        "chunk ranges that overlap (a write outside the chunk's range)",
        offer(3, c.manifest(name, overlap), sig(name, overlap), "INVALID_ARGUMENT", "contiguous", error="FormatError"),
    )
    name = "offer_objects_only_with_bad_addresses"
    c.case(
        name,
        "guarded",
        "an objects-only offer naming paths instead of content addresses",
        offer(
            3,
            None,
            None,
            "INVALID_ARGUMENT",
            "32-character lowercase hex",
            error="FormatError",
            objects=["../../../etc/passwd", "A" * 32],
        ),
    )
    for name, token in [("offer_with_a_wrong_token", "wrong"), ("offer_without_a_token", None)]:
        c.case(
            name,
            "guarded",
            "a client without the bearer token",
            offer(
                3,
                c.manifest(name, v3),
                sig(name, v3_bytes),
                "UNAUTHENTICATED",
                "bearer token",
                error="AccessDenied",
                token=token,
            ),
        )
    good = min(o3)
    v3_objects = c.objects({good: o3[good]})
    c.case(
        "push_with_a_wrong_token",
        "guarded",
        "a client without the bearer token pushes objects",
        push(frames_of(3, v3_objects), "UNAUTHENTICATED", "bearer token", error="AccessDenied", token="wrong"),
    )
    c.case(
        "status_without_a_token",
        "guarded",
        "a client without the bearer token asks for status",
        {"rpc": "status", "token": None, "code": "UNAUTHENTICATED", "error": "AccessDenied", "match": "bearer token"},
    )
    flipped = bytearray(o3[good])
    flipped[len(flipped) // 2] ^= 0x10
    bad = c.file("objects/bad-flipped.bin", bytes(flipped))
    c.case(
        "push_object_corrupted_in_flight",
        "guarded",
        "a byte flipped on the link",
        push(
            [{"version": 3, "object": good, "data": bad}],
            "INVALID_ARGUMENT",
            "does not match its content address",
            error="IntegrityError",
        ),
    )
    c.case(
        "push_object_under_a_path",
        "guarded",
        "an object address that walks out of the cache",
        push(
            [{"version": 3, "object": "../../../../tmp/owned", "data": v3_objects[0]}],
            "INVALID_ARGUMENT",
            "is not 32 lowercase hex",
            error="FormatError",
        ),
    )
    c.case(
        "push_object_uppercase_address",
        "guarded",
        "an address that is not canonical hex",
        push(
            [{"version": 3, "object": good.upper(), "data": v3_objects[0]}],
            "INVALID_ARGUMENT",
            "is not 32 lowercase hex",
            error="FormatError",
        ),
    )
    c.case(
        "push_object_for_another_model",
        "guarded",
        "objects for another model",
        push(
            [{"model": OTHER_MODEL, "version": 3, "object": good, "data": v3_objects[0]}],
            "INVALID_ARGUMENT",
            f"serves '{MODEL}', not '{OTHER_MODEL}'",
            error="FormatError",
        ),
    )
    c.case(
        "push_objects_for_an_old_version",
        "guarded",
        "objects of a version older than the served one",
        push(frames_of(1, c.objects({a: o1[a] for a in sorted(o1)[:2]})), "OK", kept=0, duplicates=2),
    )
    rng = np.random.default_rng(7)
    blobs = {}
    for _ in range(4):
        blob = rng.integers(0, 256, 20_000, dtype=np.uint8).tobytes()
        blobs[object_hash(blob)] = blob
    c.case(
        "push_past_the_pending_quota",
        "guarded",
        f"a sender filling the agent's disk: {len(blobs)} x 20 kB of valid objects, quota {PENDING_QUOTA_BYTES} B",
        push(
            frames_of(99, c.objects(blobs)), "RESOURCE_EXHAUSTED", "await a version; limit", error="ResourceExhausted"
        ),
    )
    wrong_parent, o_wp = encode(w3, w4, version=3, parent_version=2, base=1, step=3)
    name = "signed_delta_on_the_wrong_parent"
    c.case(
        name,
        "guarded",
        "a trusted publisher's delta whose XORs apply to another parent (a publisher bug): "
        "the signature is valid, the bytes still must verify",
        push(frames_of(3, c.objects(o_wp)), "OK"),
        offer(3, c.manifest(name, wrong_parent), sig(name, wrong_parent.to_bytes()), "OK", decision="WANTED"),
        {"rpc": "wait_failure", "version": 3, "error": "IntegrityError", "match": "differs from the published"},
    )
    request = sync_pb2.OfferRequest(model=MODEL, version=3, manifest=v3_bytes, signature=TRUSTED.sign(v3_bytes))
    wire = request.SerializeToString()
    c.case(
        "raw_offer_truncated_protobuf",
        "guarded",
        "offer bytes that are not a protobuf message",
        {
            "rpc": "raw_offer",
            "raw": c.file("raw_offer_truncated_protobuf.raw", wire[:40]),
            "code": "INVALID_ARGUMENT",
            "error": "FormatError",
            "match": "malformed request",
        },
    )
    frame = encode_object_frame(ObjectFrame(MODEL, 3, good, o3[good]))
    c.case(
        "raw_push_frame_with_a_bad_varint",
        "guarded",
        "object frame bytes that are not a protobuf message",
        {
            "rpc": "raw_push",
            "raw": [
                c.file(
                    "raw_push_frame_with_a_bad_varint.raw", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01" + frame
                )
            ],
            "code": "INVALID_ARGUMENT",
            "error": "FormatError",
            "match": "malformed object frame",
        },
    )

    # ---- open agent: no signatures, so the offer is accepted; serving must still be refused
    def accepted_then_failed(
        name: str, threat: str, manifest: Manifest | bytes, objects: dict[str, bytes], error: str, match: str
    ) -> None:
        data = manifest if isinstance(manifest, bytes) else manifest.to_bytes()
        version = json.loads(data)["version"]
        steps = [push(frames_of(version, c.objects(objects)), "OK")] if objects else []
        steps += [
            offer(version, c.manifest(name, data), None, "OK", decision="WANTED"),
            {"rpc": "wait_failure", "version": version, "error": error, "match": match},
        ]
        c.case(name, "open", threat, *steps)

    c.case(
        "open_offer_v2_replay_with_other_weights",
        "open",
        "a second, different v2",
        offer(
            2,
            c.manifest("open_offer_v2_replay_with_other_weights", other_v2),
            None,
            "INVALID_ARGUMENT",
            "differs from the one served",
            error="IntegrityError",
        ),
    )
    c.case(
        "open_offer_v1_older_than_served",
        "open",
        "a replay of an old version",
        offer(
            1,
            c.manifest("open_offer_v1_older_than_served", v1),
            None,
            "FAILED_PRECONDITION",
            "older than the served",
            error="StaleVersion",
        ),
    )
    accepted_then_failed(
        "open_delta_on_the_wrong_parent",
        "a delta whose XORs apply to weights the agent does not hold",
        wrong_parent,
        o_wp,
        "IntegrityError",
        "differs from the published",
    )
    orphan, o_orphan = encode(w4, w3, version=5, parent_version=4, base=1, step=5)
    accepted_then_failed(
        "open_delta_on_a_version_that_does_not_exist",
        "a delta whose parent was never committed",
        orphan,
        o_orphan,
        "IntegrityError",
        "neither cached nor in the store",
    )
    rebased = dataclasses.replace(v3, base=2)
    accepted_then_failed(
        "open_delta_with_a_base_its_parent_does_not_have",
        "a delta chain whose bases disagree (a spliced chain)",
        rebased,
        o3,
        "FormatError",
        "disagree on their base",
    )
    retyped_w3 = {n: (t.view(torch.float16) if n == "model.norm.weight" else t) for n, t in w3.items()}
    retyped_w2 = {n: (t.view(torch.float16) if n == "model.norm.weight" else t) for n, t in w2.items()}
    retyped, o_retyped = encode(retyped_w3, retyped_w2, version=3, parent_version=2, base=1, step=3)
    accepted_then_failed(
        "open_delta_that_changes_a_dtype",
        "a delta that changes a tensor's dtype without a rebase",
        retyped,
        o_retyped,
        "LayoutError",
        "changes tensor layout without a rebase",
    )
    reshaped_name = "model.layers.0.self_attn.q_proj.weight"
    for name, tensors, match in [
        (
            "open_full_with_a_wrong_shape",
            {n: (t.reshape(-1) if n == reshaped_name else t) for n, t in w3.items()},
            "has shape (256,), the architecture needs (16, 16)",
        ),
        ("open_full_with_float32_weights", {n: t.float() for n, t in w3.items()}, "is torch.float32"),
        ("open_full_missing_a_tensor", {n: t for n, t in w3.items() if n != "model.norm.weight"}, "1 missing"),
        (
            "open_full_with_an_extra_tensor",
            {**w3, "model.backdoor.weight": torch.zeros(4, dtype=torch.bfloat16)},
            "1 unexpected",
        ),
    ]:
        manifest, objects = encode(tensors, None, version=3, step=3)
        accepted_then_failed(
            name,
            "a complete, consistent version that does not fit the served architecture",
            manifest,
            objects,
            "LayoutError",
            match,
        )
    bomb, bomb_raw = _zstd_bomb_object()
    full3, o_full3 = encode(w3, None, version=3, step=3)
    target = full3.tensors[0]
    bomb_ref = ChunkRef(
        start=0,
        stop=CHUNK_ELEMENTS,
        codec="full",
        raw=bomb_raw,
        object=object_hash(bomb),
        key=chunk_key(object_hash(bomb)),
        size=len(bomb),
    )
    tensors = (dataclasses.replace(target, chunks=(bomb_ref, *target.chunks[1:])), *full3.tensors[1:])
    with_bomb = dataclasses.replace(full3, tensors=tensors, digest=compute_digest(tensors))
    objects = {r.object: o_full3.get(r.object, bomb) for t in tensors for r in t.chunks}
    accepted_then_failed(
        "open_full_with_a_zstd_bomb",
        "a chunk whose zstd frame claims 1 MiB for 512 bytes",
        with_bomb,
        objects,
        "FormatError",
        f"zstd frame claims 1048576 bytes, expected {CHUNK_ELEMENTS}",
    )
    ref = full3.tensors[0].chunks[0]
    tensors = (
        dataclasses.replace(
            full3.tensors[0], chunks=(dataclasses.replace(ref, size=ref.size + 1), *full3.tensors[0].chunks[1:])
        ),
        *full3.tensors[1:],
    )
    accepted_then_failed(
        "open_full_with_a_wrong_object_size",
        "a manifest that lies about an object's size",
        dataclasses.replace(full3, tensors=tensors),
        o_full3,
        "IntegrityError",
        "size or hash mismatch",
    )
    liar_raw = "0" * 32
    tensors = (
        dataclasses.replace(
            full3.tensors[0], chunks=(dataclasses.replace(ref, raw=liar_raw), *full3.tensors[0].chunks[1:])
        ),
        *full3.tensors[1:],
    )
    accepted_then_failed(
        "open_full_whose_manifest_raw_hash_lies",
        "a manifest whose raw hash disagrees with the object it names",
        dataclasses.replace(full3, tensors=tensors, digest=compute_digest(tensors)),
        o_full3,
        "IntegrityError",
        "raw hash differs from the manifest's",
    )
    missing, _ = encode(w3, None, version=3, step=3, created_unix_ms=1)
    accepted_then_failed(
        "open_full_whose_objects_exist_nowhere",
        "a version whose objects nobody has",
        missing,
        {},
        "IntegrityError",
        "is missing from",
    )
    return c, trees


def write(directory: Path = HERE) -> None:
    corpus, trees = build()
    for sub in ("store", "next", "objects"):
        shutil.rmtree(directory / sub, ignore_errors=True)
    for path in directory.iterdir():
        if path.suffix in (".json", ".sig", ".raw", ".pub"):
            path.unlink()
    for tree, files in trees.items():
        for key, data in files.items():
            path = directory / tree / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    for name, data in corpus.files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    expected = {"model": MODEL, "arch": dataclasses.asdict(ARCH), "agents": AGENTS, "cases": corpus.cases}
    (directory / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    write()
    print(f"wrote the agent hostile corpus to {HERE}")
