"""base: the one small interface between a sync agent and the inference engine beside it.

The agent verifies a whole version, then hands its tensors to `Engine.swap`; the engine makes
them the served weights atomically (no request ever runs on a mix of two versions) and reports
how long requests were held back. Engines are found by their `type` in the registry
(`engines/__init__.py`); `check_engine` checks that one keeps the shape below.

Two kinds of engine, told apart by `zero_copy`:
- zero-copy (the in-process reference server): serves the very tensors it is handed. The agent
  must not modify them while any request still runs on them; it asks `wait_unused(version)`
  before it reuses that memory for a later version (double buffering).
- copying (a safetensors directory + reload hook, a remote vLLM/SGLang): copies or persists the
  tensors inside `swap` and keeps no reference, so the agent may reuse them as soon as `swap`
  returns.

Every engine checks a swap's arguments with the shared `check_swap_args` and `check_layout`
below, so that all refuse the same things with the same errors.

Besides swapping, an engine answers three questions the agent's signals rest on: `check_fit`
(would `swap` refuse weights of this layout? asked before the agent rewrites the buffer a copying
engine is handed, so that a refused version never touches it), `state` (what it serves now, or why
it serves nothing: `EngineState`) and `verify_held` (does what it holds hash to the agent's verified
copy of a version? `status --verify`; None from an engine that cannot report what it holds).

Optional members:
- `prompt_logprobs(prompts, timeout_s=..., top_k=0)` (a `PromptLogprobs`), what the agent's parity
  probe asks after each swap (`agents/parity.py`): the log-prob of each prompt token, the dtype the
  engine computes in, and with top_k each position's most likely next tokens. An engine without it
  is never probed.
- `withdraw(reason)`: stop serving (new requests are refused, `state()` says "paused" with the
  reason) until the next `swap`; what the agent's refuse rule asks when no version passed the
  parity probe (`swap.py`). An engine without it keeps serving, and the agent reports that it
  serves nothing (not healthy).
- In-place delta swaps (`DeltaEngine`): `swap_delta` and `undo`, for an engine whose workers patch
  the changed elements into what they serve. An engine without them gets every version whole.

Not here: verifying, staging or fetching versions (the agent does that), the registry
(`engines/__init__.py`), the swap policies themselves (`swap_policy.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from weightsync.agents.engines.swap_policy import SwapPolicy
from weightsync.errors import LayoutError
from weightsync.format.hashing import xxh3_hex
from weightsync.format.layout import MAX_VERSION
from weightsync.format.manifest import WEIGHTS_KINDS
from weightsync.format.tensors import describe_layout_change, layout_of, raw_bytes

Layout = Mapping[str, tuple[torch.dtype | None, tuple[int, ...]]]
"""Tensor name -> (dtype, shape) a swap must match; a dtype of None accepts any dtype."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwapReport:
    """What one swap cost."""

    version: int
    pause_s: float
    """Time during which new requests were held back (the pause clients see). For engines that
    reload on their own (a remote server), the reload call's duration as the engine reports it."""
    total_s: float
    """The whole `swap` call: for copying engines this includes writing and the reload call."""
    path: str = "full"
    """How the version went in: "delta" (the changed elements patched in place, `swap_delta`) or
    "full" (the whole version handed over)."""
    path_reason: str = ""
    """Why a swap that could have gone in as a delta went in whole (a full version, a restarted
    server, a version gap over the budget, a worker whose state diverged...)."""
    native_layers: tuple[str, ...] = ()
    """Layers a delta swap reloaded through the engine's own loader (not plain copies), with why."""
    delta_bytes: int = 0
    """Bytes handed to the workers for a delta swap (the delta file)."""


ENGINE_STATES = ("serving", "empty", "paused", "unreachable", "unknown")
"""What `Engine.state()` may say: "serving" (new requests get `version`), "empty" (no weights
swapped in yet), "paused" (a failed swap left the server paused: it serves nothing until the next
good swap), "unreachable" (the server does not answer), "unknown" (the server answers but does not
say it serves the version last swapped in)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineState:
    """What an engine serves now, as it reports it (`Engine.state`)."""

    state: str
    """One of ENGINE_STATES."""
    version: int | None = None
    """The version new requests get; set only when `state` is "serving"."""
    reason: str = ""
    """Why it is not serving (the error of the swap that paused it, the unanswered request)."""

    def __post_init__(self) -> None:
        if self.state not in ENGINE_STATES:
            raise ValueError(f"engine state must be one of {ENGINE_STATES}, got {self.state!r}")
        if (self.state == "serving") != (self.version is not None):
            raise ValueError(f"an engine state has a version exactly when it is serving, got {self}")

    @property
    def serving(self) -> bool:
        return self.state == "serving"


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeldReport:
    """What `Engine.verify_held` found: the engine's digest of what it holds, against the agent's copy."""

    ok: bool
    """True iff the engine holds exactly the bytes it was compared with."""
    hashed: str
    """What was hashed, for an operator: e.g. "what the vllm engine's 1 worker holds"."""
    error: str = ""
    """The first difference (or why nothing could be compared) when not `ok`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptLogprobs:
    """An engine's answer to a parity probe (`prompt_logprobs`): what it computes for prompts."""

    version: int | None
    """The version that computed it, where the engine can say (None: the one served around the call)."""
    logprobs: list[torch.Tensor]
    """Per prompt: float log p(token i | tokens < i), i = 1..n-1."""
    experts: list[torch.Tensor] | None = None
    """MoE, where the engine exposes routing: per prompt [tokens, sparse layers, top_k] expert ids."""
    compute_dtype: str | None = None
    """The dtype the engine computes in ("bfloat16", "float16", "float32"), where it can say."""
    top_ids: list[torch.Tensor] | None = None
    """Asked with top_k, where the engine can: per prompt [n-1, top_k], each position's most likely
    next tokens, best first."""
    top_logprobs: list[torch.Tensor] | None = None
    """Their log-probs, the same shape."""


@runtime_checkable
class Engine(Protocol):
    """The contract every engine keeps (tests/agents/engines/test_engines.py runs it over each
    registered engine). Every member is required; the agent reads them all.

    - `swap(version, weights, digest=..., policy=...)` makes `weights` (HF tensor names ->
      tensors, every tensor of the model) the served weights, atomically: no forward pass ever
      runs on a mix of two versions, and new requests get `version`. It returns once they do.
      Requests already running meet it as `policy` (one of `swap_policies`) says; the switch is
      always between token steps. On failure it raises and the previous version stays served.
    - `served_version()` is the version new requests get (None before the first swap).
    - `wait_unused(version, timeout_s)` returns True once no request runs on `version`'s
      tensors any more (immediately for copying engines); False on timeout.
    - `check_fit(layout)` raises LayoutError where `swap` would refuse weights of `layout` for
      their names, dtypes or shapes (`Layout`), and does nothing otherwise; it touches nothing.
    - `state()` says what the engine serves now (`EngineState`); it may ask the server (a short
      request), never waits for a swap.
    - `verify_held(version, weights)` has the engine digest what it holds now (re-hash its own
      tensors, or ask its workers) and compares that with `weights`, the agent's verified copy of
      `version`: a `HeldReport`, or None from an engine that cannot report what it holds (one
      that hands weights to a server it cannot ask). Called between swaps.
    - `close()` stops whatever the engine started; idempotent.
    """

    name: str
    """The engine's type, as the registry knows it (shown in status, logs and errors)."""
    zero_copy: bool
    """True: serves the very tensors `swap` is handed (see the module docstring)."""
    swap_policies: tuple[SwapPolicy, ...]
    """The swap policies the engine implements; the agent refuses to start with another."""
    weights_kinds: tuple[str, ...]
    """What it serves, of WEIGHTS_KINDS; the agent refuses to start with a weights_kind not listed."""
    url: str | None
    """Where inference clients reach the served model (the agent's ready line and status), or
    None for an engine with no endpoint of its own (a directory that a server reloads from)."""

    def swap(
        self, version: int, weights: Mapping[str, torch.Tensor], *, digest: str, policy: SwapPolicy = SwapPolicy.DRAIN
    ) -> SwapReport: ...

    def served_version(self) -> int | None: ...

    def wait_unused(self, version: int, timeout_s: float) -> bool: ...

    def check_fit(self, layout: Layout) -> None: ...

    def state(self) -> EngineState: ...

    def verify_held(self, version: int, weights: Mapping[str, torch.Tensor]) -> HeldReport | None: ...

    def close(self) -> None: ...


@runtime_checkable
class DeltaEngine(Protocol):
    """The optional members of an engine that applies delta versions in place. The agent uses them
    when an engine has both (`accepts_deltas`).

    - `swap_delta(version, delta, weights=..., digest=..., policy=...)`: like `swap`, for a version
      whose `delta` (a `weightsync.delta_capture.VersionDelta`: every element that differs from
      `delta.parent`, old and new bits) the agent captured while applying it. `delta.parent` must be
      the version the engine serves. `weights` is the whole new version: the engine may take the
      full path instead (a restarted server, a gap over its budget, workers whose old bits do not
      sum to the agent's), and says so in the report (`path`, `path_reason`). Same guarantees as
      `swap`: atomic for requests, verified, and on failure it raises with the previous version
      still served.
    - `undo(version, policy=...)`: the version served before `version` goes back, from the undo log
      the delta swap that made `version` served kept (O(changed elements)); a `SwapReport`, or None
      when there is no such log (the agent then swaps the previous version in whole).
    - `delta_swaps` (optional, default True): False while the engine is configured to take whole
      versions only; the agent then captures nothing.
    """

    def swap_delta(
        self,
        version: int,
        delta: Any,
        *,
        weights: Mapping[str, torch.Tensor],
        digest: str,
        policy: SwapPolicy = SwapPolicy.DRAIN,
    ) -> SwapReport: ...

    def undo(self, version: int, *, policy: SwapPolicy = SwapPolicy.DRAIN) -> SwapReport | None: ...


def accepts_deltas(engine: object) -> bool:
    """True when `engine` has the optional in-place delta members (`DeltaEngine`) and its
    `delta_swaps` (where it has one) is on: only then does the agent capture what a version changes."""
    members = callable(getattr(engine, "swap_delta", None)) and callable(getattr(engine, "undo", None))
    return members and bool(getattr(engine, "delta_swaps", True))


def check_engine(engine: object) -> None:
    """TypeError unless `engine` has every member of `Engine`, each of the documented kind: what
    the registry checks of each engine it opens, and the contract suite of each registered one."""
    problems = []
    for member in ("swap", "served_version", "wait_unused", "check_fit", "state", "verify_held", "close"):
        if not callable(getattr(engine, member, None)):
            problems.append(f"{member}() is missing")
    name, url = getattr(engine, "name", None), getattr(engine, "url", None)
    if not isinstance(name, str) or not name:
        problems.append(f"name must be a non-empty str, not {name!r}")
    if not isinstance(getattr(engine, "zero_copy", None), bool):
        problems.append("zero_copy must be a bool")
    policies = getattr(engine, "swap_policies", None)
    if not isinstance(policies, tuple) or not policies or not all(isinstance(p, SwapPolicy) for p in policies):
        problems.append(f"swap_policies must be a non-empty tuple of SwapPolicy, not {policies!r}")
    kinds = getattr(engine, "weights_kinds", None)
    if not isinstance(kinds, tuple) or not kinds or not set(kinds) <= set(WEIGHTS_KINDS):
        problems.append(f"weights_kinds must be a non-empty tuple of {WEIGHTS_KINDS}, not {kinds!r}")
    if url is not None and not isinstance(url, str):
        problems.append(f"url must be a str or None, not {url!r}")
    if problems:
        raise TypeError(f"{type(engine).__name__} is not an Engine: " + "; ".join(problems))


def check_swap_args(version: int, digest: str, policy: SwapPolicy, supported: tuple[SwapPolicy, ...]) -> None:
    """The arguments every `swap` takes besides the weights: ValueError / TypeError if off."""
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise ValueError(f"version must be an int in 0..{MAX_VERSION}, got {version!r}")
    if not isinstance(digest, str):
        raise TypeError(f"digest must be the version digest string, got {type(digest).__name__}")
    check_swap_policy(policy, supported)


def check_swap_policy(policy: SwapPolicy, supported: tuple[SwapPolicy, ...], *, engine: str = "this engine") -> None:
    """The one check of a swap policy, wherever one meets an engine (the agent at start, each
    swap): TypeError unless it is a SwapPolicy (strings are parsed once, where a setting is read:
    `SwapPolicy.parse`), ValueError unless the engine implements it."""
    if not isinstance(policy, SwapPolicy):
        raise TypeError(
            f"swap policy must be a SwapPolicy ({', '.join(f'SwapPolicy.{p.name}' for p in SwapPolicy)}), "
            f"got {policy!r}; SwapPolicy.parse reads one from a setting"
        )
    if policy not in supported:
        raise ValueError(
            f"{engine} does not implement swap policy {policy.value!r}; it implements {[p.value for p in supported]}"
        )


def check_weights_kind(kind: str, served: tuple[str, ...], *, engine: str = "this engine") -> None:
    """ValueError unless the engine serves `kind` weights ("model" or "adapter", the agent's
    weights_kind): an agent must not fetch versions its engine cannot serve."""
    if kind not in served:
        how = (
            "vllm: set the engine's lora_name (the adapter name requests ask for)"
            if "adapter" == kind
            else "use an engine without lora_name"
        )
        raise ValueError(f"{engine} serves {list(served)} weights, not {kind!r} (the agent's weights_kind); {how}")


def check_layout(
    expected: Layout | None, weights: Mapping[str, torch.Tensor], *, what: str = "the served layout"
) -> None:
    """LayoutError unless every value is a tensor and, when `expected` is given, the names are
    exactly its names and each tensor has its shape (and its dtype, where one is given)."""
    for name, tensor in weights.items():
        if not isinstance(tensor, torch.Tensor):
            raise LayoutError(f"{name} is a {type(tensor).__name__}, not a torch.Tensor")
    check_fits(expected, layout_of(weights), what=what)


def check_fits(expected: Layout | None, layout: Layout, *, what: str = "the served layout") -> None:
    """`check_layout` on a layout (names -> (dtype, shape)) rather than tensors: what `check_fit`
    implementations share. Nothing to check when `expected` is None."""
    if expected is None:
        return
    change = describe_layout_change(expected, layout, expected_is=what)
    if change:
        raise LayoutError(f"weights do not fit {what}: {change}")


def tensor_hash(tensor: torch.Tensor) -> str:
    """xxh3-128 of a tensor's bytes (contiguous, on the CPU): what engines compare held tensors by."""
    return xxh3_hex(raw_bytes(tensor.detach().cpu().contiguous()))


def compare_tensors(held: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> str:
    """The first difference between the tensors an engine holds and `weights` (the agent's copy),
    each held tensor compared in its own dtype (a float32 engine holds exact conversions of bf16
    weights); "" when they are the same. Tensors that share memory with their counterpart are
    not hashed again (a zero-copy engine serves the agent's own buffers)."""
    missing, unexpected = sorted(set(weights) - set(held)), sorted(set(held) - set(weights))
    if missing or unexpected:
        return (
            f"the engine holds {len(missing)} tensors fewer {missing[:5]} and {len(unexpected)} more {unexpected[:5]}"
        )
    for name, tensor in held.items():
        want = weights[name]
        if tuple(tensor.shape) != tuple(want.shape):
            return f"the engine holds {name} with shape {tuple(tensor.shape)}, the version has {tuple(want.shape)}"
        if tensor.dtype == want.dtype and tensor.data_ptr() == want.data_ptr() and tensor.is_contiguous():
            continue  # the same bytes
        actual, expected = tensor_hash(tensor), tensor_hash(want.to(tensor.dtype))
        if actual != expected:
            return f"the engine holds {name} with digest {actual}, the version has {expected}"
    return ""


def manifest_layout(
    tensors: Iterable[tuple[str, str, tuple[int, ...]]],
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """A `Layout` from a manifest's (name, dtype name, shape) triples (`Manifest.layout`): what the
    agent asks `check_fit` about before it applies a version."""
    layout = {}
    for name, dtype, shape in tensors:
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise LayoutError(f"{name} is {dtype}, which this torch build has no dtype for")
        layout[name] = (torch_dtype, tuple(shape))
    return layout
