"""probe: a version's numerical-parity probe, as the manifest carries it.

A digest proves the bytes arrived; it does not prove that an engine computes with them what the
trainer computes (a dtype it casts to, a fused layout loaded in the wrong order, a config value
read differently, for MoE a router that picks other experts). So a publisher may put a small
probe into each version, for two questions that are kept apart (agents/parity.py asks them):

- records: does the engine compute what the trainer computes at the engine's precision? Per
  compute dtype the engines may serve in (bf16 first), the log-prob of each prompt token given
  the tokens before it, computed from the weights exactly as published, and for MoE models the
  experts each sparse layer's router chose per token. An engine is held to the record of its own
  compute dtype: the reference engine then matches to the last bit, and vLLM differs only by its
  kernels.
- training: how far apart are training and inference as RL sees it? The trainer's training
  forward (its weights as they train, in its compute precision) gives, at each prompt position,
  the top-k next tokens with their log-probs: the tokens the policy would sample there.

Where: the manifest's `producer["probe"]`, so that the version's signature covers it, it travels
with every push, relay and catch-up, and readers that predate it ignore it (producer is
free-form): no new object kind, no format bump. The manifest's JSON forbids floats, so arrays are
base64 of little-endian bytes; a probe also names the xxh3 of its own canonical form, so a
damaged one is refused rather than read as a parity failure.

    producer["probe"] = {
        "format": 2,
        "prompts": [[token ids], ...],          # each at least 2 tokens
        "records": [{                           # one per compute dtype, at most one each
            "compute_dtype": "bfloat16",
            "logprobs": base64(float32[...]),   # per prompt, tokens 1..n-1, prompts concatenated
            "experts": base64(uint16[...]),     # MoE: [expert_positions, layers, top_k] sorted ids
        }, ...],
        "expert_layers": L, "expert_top_k": K, "expert_positions": P,   # MoE only
        "training": {                           # optional
            "compute_dtype": "float32", "k": 8,
            "ids": base64(uint32[...]),         # [predicted positions, k], best first
            "logprobs": base64(float32[...]),   # the same shape
        },
        "xxh3": "...",                          # of the canonical JSON of every other key
    }

Format 1 (issue 34: one record at the top level, `compute_dtype`, `logprobs`, `experts` with
`top_k`) stays readable: it reads as a probe of one record and no training figure.

Size: a probe must fit the manifest's free-form bound with room to spare (MAX_PROBE_BYTES). Expert
choices of a large MoE (48 layers x top-8) are the big part: only the first `expert_positions`
positions keep them, as many as fit (`expert_positions_that_fit`).

Not here: choosing prompts and computing a probe (`weightsync.models.probe`, run by the trainer
and the reference engine), comparing one with an engine (`weightsync.agents.parity`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from weightsync.errors import FormatError
from weightsync.format.hashing import xxh3_hex
from weightsync.format.manifest import canonical_json

PROBE_FORMAT = 2
"""1: one record (issue 34). 2: a record per compute dtype and the training forward's top-k."""
READABLE_FORMATS = (1, 2)
MAX_PROBE_BYTES = 48 * 1024
"""Bound on a probe's canonical JSON: the manifest's producer object holds at most 64 KiB."""
MAX_PROBE_PROMPTS = 64
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
_KEYS = {"format", "prompts", "records", "xxh3"}
_EXPERT_KEYS = {"expert_layers", "expert_top_k", "expert_positions"}
_V1_KEYS = {"format", "prompts", "logprobs", "compute_dtype", "xxh3"}
_V1_EXPERT_KEYS = {"experts", "expert_layers", "top_k", "expert_positions"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbeRecord:
    """What the published weights compute for the probe's prompts in one compute dtype."""

    compute_dtype: str
    logprobs: np.ndarray
    """float32, one per predicted position: for each prompt its tokens 1..n-1, prompts in order."""
    experts: np.ndarray | None = None
    """uint16 [expert_positions, layers, top_k]: the sorted expert ids the router chose at each
    position (prompts' tokens in order, every token, the first included), or None (dense model)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "logprobs", np.ascontiguousarray(self.logprobs, dtype=np.float32).reshape(-1))
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise FormatError(f"probe compute_dtype must be one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}")
        if not np.isfinite(self.logprobs).all() or (self.logprobs > 0).any():
            raise FormatError(f"probe log-probs ({self.compute_dtype}) must be finite and <= 0")
        if self.experts is not None:
            experts = np.ascontiguousarray(self.experts)
            if experts.ndim != 3 or experts.size and (experts.min() < 0 or experts.max() > 0xFFFF):
                raise FormatError(
                    f"probe experts must be [positions, layers, top_k] ids in 0..65535, got {experts.shape}"
                )
            object.__setattr__(self, "experts", experts.astype(np.uint16))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingTopK:
    """The trainer's training forward at each predicted position: its k most likely next tokens."""

    compute_dtype: str
    ids: np.ndarray
    """int64 [predicted positions, k], most likely first."""
    logprobs: np.ndarray
    """float32 [predicted positions, k], the log-probs of `ids`."""

    def __post_init__(self) -> None:
        ids = np.ascontiguousarray(self.ids).astype(np.int64)
        logprobs = np.ascontiguousarray(self.logprobs, dtype=np.float32)
        if ids.ndim != 2 or ids.shape != logprobs.shape or ids.shape[1] < 1:
            raise FormatError(
                f"probe training top-k needs ids and log-probs of one [positions, k] shape, got "
                f"{ids.shape} and {logprobs.shape}"
            )
        if ids.size and (ids.min() < 0 or ids.max() > 0xFFFFFFFF):
            raise FormatError("probe training token ids must be in 0..2^32-1")
        if not np.isfinite(logprobs).all() or (logprobs > 0).any():
            raise FormatError("probe training log-probs must be finite and <= 0")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise FormatError(
                f"probe training compute_dtype must be one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}"
            )
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "logprobs", logprobs)

    @property
    def k(self) -> int:
        return int(self.ids.shape[1])


@dataclasses.dataclass(frozen=True, kw_only=True)
class Probe:
    """Fixed prompts and what the trainer computed for them (see the module docstring)."""

    prompts: tuple[tuple[int, ...], ...]
    records: tuple[ProbeRecord, ...]
    """At most one per compute dtype; the first is the one engines that do not say theirs are held to."""
    training: TrainingTopK | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompts", tuple(tuple(int(t) for t in p) for p in self.prompts))
        object.__setattr__(self, "records", tuple(self.records))
        if not 1 <= len(self.prompts) <= MAX_PROBE_PROMPTS:
            raise FormatError(f"a probe has 1..{MAX_PROBE_PROMPTS} prompts, got {len(self.prompts)}")
        if any(len(p) < 2 for p in self.prompts):
            raise FormatError("every probe prompt needs at least 2 tokens (the first predicts the second)")
        if any(t < 0 for p in self.prompts for t in p):
            raise FormatError("probe token ids must be non-negative")
        if not self.records:
            raise FormatError("a probe needs at least one record (compute dtype and log-probs)")
        dtypes = [r.compute_dtype for r in self.records]
        if len(set(dtypes)) != len(dtypes):
            raise FormatError(f"a probe holds at most one record per compute dtype, got {dtypes}")
        for record in self.records:
            if record.logprobs.size != self.predicted:
                raise FormatError(
                    f"a probe of these prompts has {self.predicted} log-probs, the {record.compute_dtype} record "
                    f"{record.logprobs.size}"
                )
            if record.experts is not None and record.experts.shape[0] > self.positions:
                raise FormatError(f"probe experts cover {record.experts.shape[0]} positions of {self.positions}")
        shapes = {None if r.experts is None else r.experts.shape for r in self.records}
        if len(shapes) != 1:
            raise FormatError(f"every record of a probe has experts of one shape, or none: got {shapes}")
        if self.training is not None and self.training.ids.shape[0] != self.predicted:
            raise FormatError(
                f"the probe's training top-k covers {self.training.ids.shape[0]} positions of {self.predicted}"
            )

    @property
    def predicted(self) -> int:
        """Positions with a log-prob: every prompt token but each prompt's first."""
        return sum(len(p) - 1 for p in self.prompts)

    @property
    def positions(self) -> int:
        """Every prompt token (the positions a router sees)."""
        return sum(len(p) for p in self.prompts)

    @property
    def compute_dtypes(self) -> tuple[str, ...]:
        return tuple(r.compute_dtype for r in self.records)

    def record(self, compute_dtype: str) -> ProbeRecord | None:
        """The record of `compute_dtype`, None when the trainer recorded none in it."""
        return next((r for r in self.records if r.compute_dtype == compute_dtype), None)

    def split(self, values: np.ndarray) -> list[np.ndarray]:
        """Per-predicted-position `values` (first axis) cut per prompt."""
        return np.split(values, np.cumsum([len(p) - 1 for p in self.prompts])[:-1])

    def to_json(self) -> dict[str, Any]:
        records = []
        for r in self.records:
            record: dict[str, Any] = {"compute_dtype": r.compute_dtype, "logprobs": _b64(r.logprobs.astype("<f4"))}
            if r.experts is not None:
                record["experts"] = _b64(r.experts.astype("<u2"))
            records.append(record)
        doc: dict[str, Any] = {"format": PROBE_FORMAT, "prompts": [list(p) for p in self.prompts], "records": records}
        experts = self.records[0].experts
        if experts is not None:
            doc.update(
                expert_positions=int(experts.shape[0]),
                expert_layers=int(experts.shape[1]),
                expert_top_k=int(experts.shape[2]),
            )
        if self.training is not None:
            t = self.training
            doc["training"] = {
                "compute_dtype": t.compute_dtype,
                "k": t.k,
                "ids": _b64(t.ids.astype("<u4")),
                "logprobs": _b64(t.logprobs.astype("<f4")),
            }
        doc["xxh3"] = _self_hash(doc)
        size = len(canonical_json(doc))
        if size > MAX_PROBE_BYTES:
            raise FormatError(
                f"a probe of {size} bytes exceeds the {MAX_PROBE_BYTES}-byte bound: use fewer or shorter prompts, "
                "fewer compute dtypes or a smaller training k, or record experts for fewer positions "
                "(expert_positions_that_fit)"
            )
        return doc


def expert_positions_that_fit(
    prompts: Sequence[Sequence[int]], layers: int, top_k: int, *, records: int = 1, other_bytes: int = 0
) -> int:
    """How many positions' expert choices fit the probe's bound beside these prompts, `records`
    records' worth, and `other_bytes` of everything else (all positions when they fit): base64
    costs 4/3, the ids 2 bytes each; the prompts and the rest keep a quarter of the bound."""
    positions = sum(len(p) for p in prompts)
    per_position = max(1, records * (layers * top_k * 2 * 4 // 3 + 1))
    room = MAX_PROBE_BYTES * 3 // 4 - other_bytes
    return max(0, min(positions, room // per_position))


def probe_from_json(doc: Any) -> Probe:
    """The probe in a manifest's producer["probe"] (format 1 or 2); FormatError naming what is wrong."""
    if not isinstance(doc, dict):
        raise FormatError("producer.probe must be a JSON object")
    version = doc.get("format")
    if isinstance(version, bool) or version not in READABLE_FORMATS:
        raise FormatError(f"producer.probe format {version!r} is not supported; this build reads {READABLE_FORMATS}")
    required, optional = (_V1_KEYS, _V1_EXPERT_KEYS) if version == 1 else (_KEYS, _EXPERT_KEYS | {"training"})
    keys = set(doc)
    if not required <= keys or not keys <= required | optional:
        raise FormatError(
            f"producer.probe has fields {sorted(keys)}; format {version} has {sorted(required)} "
            f"and may have {sorted(optional)}"
        )
    if doc["xxh3"] != _self_hash(doc):
        raise FormatError("producer.probe does not match its own xxh3: it was damaged")
    prompts = doc["prompts"]
    if not isinstance(prompts, list) or not all(
        isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompts
    ):
        raise FormatError("producer.probe prompts must be lists of token ids")
    if version == 1:
        return _probe_v1(doc, keys)
    expert_keys = keys & _EXPERT_KEYS
    if expert_keys and expert_keys != _EXPERT_KEYS:
        raise FormatError(f"producer.probe needs all of {sorted(_EXPERT_KEYS)} or none, got {sorted(expert_keys)}")
    shape = _expert_shape(doc, ("expert_positions", "expert_layers", "expert_top_k")) if expert_keys else None
    if not isinstance(doc["records"], list):
        raise FormatError("producer.probe records must be a list")
    records = []
    for record in doc["records"]:
        if not isinstance(record, dict) or not {"compute_dtype", "logprobs"} <= set(record) <= {
            "compute_dtype",
            "logprobs",
            "experts",
        }:
            raise FormatError("each producer.probe record has compute_dtype, logprobs and (MoE) experts")
        if ("experts" in record) != (shape is not None):
            raise FormatError("producer.probe records carry experts exactly when the probe gives their shape")
        records.append(
            ProbeRecord(
                compute_dtype=record["compute_dtype"],
                logprobs=_floats(record["logprobs"], "logprobs"),
                experts=None if shape is None else _experts(record["experts"], shape),
            )
        )
    return Probe(prompts=prompts, records=records, training=_training(doc.get("training")))


def _probe_v1(doc: dict[str, Any], keys: set[str]) -> Probe:
    if keys & _V1_EXPERT_KEYS and not _V1_EXPERT_KEYS <= keys:
        raise FormatError(f"producer.probe needs all of {sorted(_V1_EXPERT_KEYS)} or none")
    experts = None
    if "experts" in doc:
        experts = _experts(doc["experts"], _expert_shape(doc, ("expert_positions", "expert_layers", "top_k")))
    record = ProbeRecord(
        compute_dtype=doc["compute_dtype"], logprobs=_floats(doc["logprobs"], "logprobs"), experts=experts
    )
    return Probe(prompts=doc["prompts"], records=[record])


def _training(doc: Any) -> TrainingTopK | None:
    if doc is None:
        return None
    if not isinstance(doc, dict) or set(doc) != {"compute_dtype", "k", "ids", "logprobs"}:
        raise FormatError("producer.probe training has exactly compute_dtype, k, ids and logprobs")
    k = doc["k"]
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise FormatError(f"producer.probe training k must be an integer >= 1, got {k!r}")
    raw = _unb64(doc["ids"], "training ids")
    logprobs = _floats(doc["logprobs"], "training logprobs")
    if len(raw) % (4 * k) or len(raw) // 4 != logprobs.size:
        raise FormatError("producer.probe training ids and logprobs are not both [positions, k]")
    ids = np.frombuffer(raw, dtype="<u4").astype(np.int64).reshape(-1, k)
    return TrainingTopK(compute_dtype=doc["compute_dtype"], ids=ids, logprobs=logprobs.reshape(-1, k))


def _expert_shape(doc: dict[str, Any], names: tuple[str, str, str]) -> tuple[int, int, int]:
    shape = tuple(doc[k] for k in names)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise FormatError(f"producer.probe {', '.join(names)} must be integers >= 0")
    return shape


def _experts(text: Any, shape: tuple[int, int, int]) -> np.ndarray:
    raw = _unb64(text, "experts")
    if len(raw) != 2 * shape[0] * shape[1] * shape[2]:
        raise FormatError(f"producer.probe experts hold {len(raw)} bytes, not those of {shape} uint16 ids")
    return np.frombuffer(raw, dtype="<u2").reshape(shape)


def _floats(text: Any, what: str) -> np.ndarray:
    raw = _unb64(text, what)
    if len(raw) % 4:
        raise FormatError(f"producer.probe {what} are not whole float32 values")
    return np.frombuffer(raw, dtype="<f4").astype(np.float32)


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode("ascii")


def _unb64(text: Any, what: str) -> bytes:
    if not isinstance(text, str):
        raise FormatError(f"producer.probe {what} must be a base64 string")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise FormatError(f"producer.probe {what} is not valid base64") from None


def _self_hash(doc: dict[str, Any]) -> str:
    return xxh3_hex(canonical_json({k: v for k, v in doc.items() if k != "xxh3"}))
