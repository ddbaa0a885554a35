"""probe: a version's numerical-parity probe, as the manifest carries it.

A digest proves the bytes arrived; it does not prove that an engine computes with them what the
trainer computes (a dtype it casts to, a fused layout loaded in the wrong order, another
reduction order, for MoE a router that picks other experts). So a publisher may put a small probe
into each version: a few fixed prompts (token ids), the trainer's own log-prob of each prompt
token given the tokens before it, and for MoE models the experts its router chose for each token
in each sparse layer. An agent asks its engine for the same after every swap and compares
(agents/parity.py).

Where: the manifest's `producer["probe"]`, so that the version's signature covers it, it travels
with every push, relay and catch-up, and readers that predate it ignore it (producer is
free-form): no new object kind, no format bump. The manifest's JSON forbids floats, so the
arrays are base64 of little-endian bytes; a probe also names the xxh3 of its own canonical form,
so a damaged one is refused rather than read as a parity failure.

    producer["probe"] = {
        "format": 1,
        "prompts": [[token ids], ...],         # each at least 2 tokens
        "logprobs": base64(float32[...]),       # per prompt, tokens 1..n-1, prompts concatenated
        "compute_dtype": "float32",             # what the trainer's forward computed in
        "experts": base64(uint16[...]),         # MoE: per position, layer, top-k (sorted ids); optional
        "expert_layers": L, "top_k": K, "expert_positions": P,   # P: positions covered, in order
        "xxh3": "...",                          # of the canonical JSON of every other key
    }

Size: a probe must fit the manifest's free-form bound with room to spare (MAX_PROBE_BYTES). Expert
choices of a large MoE (48 layers x top-8) are the big part: only the first `expert_positions`
positions keep them, as many as fit (`expert_positions_that_fit`).

Not here: computing a probe (`weightsync.models.probe`, run by the trainer and the reference
engine), comparing one with an engine (`weightsync.agents.parity`).
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

PROBE_FORMAT = 1
MAX_PROBE_BYTES = 48 * 1024
"""Bound on a probe's canonical JSON: the manifest's producer object holds at most 64 KiB."""
MAX_PROBE_PROMPTS = 64
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
_KEYS = {"format", "prompts", "logprobs", "compute_dtype", "xxh3"}
_EXPERT_KEYS = {"experts", "expert_layers", "top_k", "expert_positions"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Probe:
    """Fixed prompts and what the trainer computed for them (see the module docstring)."""

    prompts: tuple[tuple[int, ...], ...]
    logprobs: np.ndarray
    """float32, one per predicted position: for each prompt its tokens 1..n-1, prompts in order."""
    compute_dtype: str = "float32"
    experts: np.ndarray | None = None
    """uint16 [expert_positions, layers, top_k]: the sorted expert ids the router chose at each
    position (prompts' tokens in order, every token, the first included), or None (dense model,
    or none recorded)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompts", tuple(tuple(int(t) for t in p) for p in self.prompts))
        object.__setattr__(self, "logprobs", np.ascontiguousarray(self.logprobs, dtype=np.float32).reshape(-1))
        if self.experts is not None:
            experts = np.ascontiguousarray(self.experts)
            if experts.ndim != 3 or experts.size and (experts.min() < 0 or experts.max() > 0xFFFF):
                raise FormatError(
                    f"probe experts must be [positions, layers, top_k] ids in 0..65535, got {experts.shape}"
                )
            object.__setattr__(self, "experts", experts.astype(np.uint16))
        if not 1 <= len(self.prompts) <= MAX_PROBE_PROMPTS:
            raise FormatError(f"a probe has 1..{MAX_PROBE_PROMPTS} prompts, got {len(self.prompts)}")
        if any(len(p) < 2 for p in self.prompts):
            raise FormatError("every probe prompt needs at least 2 tokens (the first predicts the second)")
        if any(t < 0 for p in self.prompts for t in p):
            raise FormatError("probe token ids must be non-negative")
        if self.logprobs.size != self.predicted:
            raise FormatError(f"a probe of these prompts has {self.predicted} log-probs, got {self.logprobs.size}")
        if not np.isfinite(self.logprobs).all() or (self.logprobs > 0).any():
            raise FormatError("probe log-probs must be finite and <= 0")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise FormatError(f"probe compute_dtype must be one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}")
        if self.experts is not None and self.experts.shape[0] > self.positions:
            raise FormatError(f"probe experts cover {self.experts.shape[0]} positions of {self.positions}")

    @property
    def predicted(self) -> int:
        """Positions with a log-prob: every prompt token but each prompt's first."""
        return sum(len(p) - 1 for p in self.prompts)

    @property
    def positions(self) -> int:
        """Every prompt token (the positions a router sees)."""
        return sum(len(p) for p in self.prompts)

    def split_logprobs(self) -> list[np.ndarray]:
        """`logprobs` cut per prompt."""
        cuts = np.cumsum([len(p) - 1 for p in self.prompts])[:-1]
        return np.split(self.logprobs, cuts)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "format": PROBE_FORMAT,
            "prompts": [list(p) for p in self.prompts],
            "logprobs": _b64(self.logprobs.astype("<f4")),
            "compute_dtype": self.compute_dtype,
        }
        if self.experts is not None:
            doc.update(
                experts=_b64(self.experts.astype("<u2")),
                expert_layers=int(self.experts.shape[1]),
                top_k=int(self.experts.shape[2]),
                expert_positions=int(self.experts.shape[0]),
            )
        doc["xxh3"] = _self_hash(doc)
        size = len(canonical_json(doc))
        if size > MAX_PROBE_BYTES:
            raise FormatError(
                f"a probe of {size} bytes exceeds the {MAX_PROBE_BYTES}-byte bound: use fewer or shorter "
                "prompts, or record experts for fewer positions (expert_positions_that_fit)"
            )
        return doc


def expert_positions_that_fit(prompts: Sequence[Sequence[int]], layers: int, top_k: int) -> int:
    """How many positions' expert choices fit the probe's bound beside these prompts (all of them
    when they fit): base64 costs 4/3, the ids 2 bytes each, the rest is kept a quarter of the bound."""
    positions = sum(len(p) for p in prompts)
    per_position = max(1, layers * top_k * 2 * 4 // 3 + 1)
    return max(0, min(positions, (MAX_PROBE_BYTES * 3 // 4) // per_position))


def probe_from_json(doc: Any) -> Probe:
    """The probe in a manifest's producer["probe"]; FormatError naming what is wrong."""
    if not isinstance(doc, dict):
        raise FormatError("producer.probe must be a JSON object")
    keys = set(doc)
    if not _KEYS <= keys or not keys <= _KEYS | _EXPERT_KEYS or (keys & _EXPERT_KEYS and not _EXPERT_KEYS <= keys):
        raise FormatError(
            f"producer.probe has fields {sorted(keys)}; it needs {sorted(_KEYS)} (+ all of {sorted(_EXPERT_KEYS)} or none)"
        )
    if doc["format"] != PROBE_FORMAT or isinstance(doc["format"], bool):
        raise FormatError(f"producer.probe format {doc['format']!r} is not supported; this build reads {PROBE_FORMAT}")
    if doc["xxh3"] != _self_hash({k: v for k, v in doc.items() if k != "xxh3"}):
        raise FormatError("producer.probe does not match its own xxh3: it was damaged")
    prompts = doc["prompts"]
    if not isinstance(prompts, list) or not all(
        isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompts
    ):
        raise FormatError("producer.probe prompts must be lists of token ids")
    experts = None
    if "experts" in doc:
        shape = tuple(doc[k] for k in ("expert_positions", "expert_layers", "top_k"))
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise FormatError("producer.probe expert_positions, expert_layers and top_k must be integers >= 0")
        raw = _unb64(doc["experts"], "experts")
        if len(raw) != 2 * shape[0] * shape[1] * shape[2]:
            raise FormatError(f"producer.probe experts hold {len(raw)} bytes, not those of {shape} uint16 ids")
        experts = np.frombuffer(raw, dtype="<u2").reshape(shape)
    raw = _unb64(doc["logprobs"], "logprobs")
    if len(raw) % 4:
        raise FormatError("producer.probe logprobs are not whole float32 values")
    return Probe(
        prompts=prompts,
        logprobs=np.frombuffer(raw, dtype="<f4").astype(np.float32),
        compute_dtype=doc["compute_dtype"],
        experts=experts,
    )


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
