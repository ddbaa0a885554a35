"""engine: the one small interface between a sync agent and the inference engine beside it.

The agent verifies a whole version, then hands its tensors to `Engine.swap`; the engine makes
them the served weights atomically (no request ever runs on a mix of two versions) and reports
how long requests were held back. Engines are chosen by a `type` field and built by
`open_engine`, which raises on an unknown type.

Two kinds of engine, told apart by `zero_copy`:
- zero-copy (the in-process reference server): serves the very tensors it is handed. The agent
  must not modify them while any request still runs on them; it asks `wait_unused(version)`
  before it reuses that memory for a later version (double buffering).
- copying (a safetensors directory + reload hook, a remote vLLM/SGLang): copies or persists the
  tensors inside `swap` and keeps no reference, so the agent may reuse them as soon as `swap`
  returns.

Native vLLM/SGLang adapters (update weights over NCCL or from tensors) implement the same
protocol. Every engine checks a swap's arguments with the shared `check_swap_args` and
`check_layout` below, so that all refuse the same things with the same errors.

Not here: verifying, staging or fetching versions (the agent does that).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from weightsync.errors import LayoutError
from weightsync.format.layout import MAX_VERSION

SWAP_POLICIES = ("drain", "in_flight", "abort")
"""How requests running at a swap meet the new version (docs/agents.md, "Swap policies"):
- "drain": each request runs on the version it started on to its end, so a response comes from
  one version; the agent can rebuild that version's memory (zero-copy engines) only once the
  last such request ends, so sync latency is bounded by the longest request.
- "in_flight": running requests continue on the new version from their next token on; their KV
  cache is recomputed with the new weights, so the tokens after the switch are what the new
  version generates from that prefix. Responses say which versions made which tokens.
- "abort": running requests are cut at their next token and retried from the start on the new
  version (the reference engine retries them itself; vLLM returns them as aborted)."""

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


@runtime_checkable
class Engine(Protocol):
    """The contract every engine adapter keeps (tests/agents/engines/test_engines.py runs it over each).

    - `swap(version, weights, digest=..., policy=...)` makes `weights` (HF tensor names ->
      tensors, every tensor of the model) the served weights, atomically: no forward pass ever
      runs on a mix of two versions, and new requests get `version`. It returns once they do.
      Requests already running meet it as `policy` (one of `swap_policies`, see SWAP_POLICIES)
      says; the switch is always between token steps. On failure it raises and the previous
      version stays served.
    - `swap_policies` lists the policies the engine implements (the agent refuses to start with
      another).
    - `served_version()` is the version new requests get (None before the first swap).
    - `wait_unused(version, timeout_s)` returns True once no request runs on `version`'s
      tensors any more (immediately for copying engines); False on timeout.
    - `close()` stops whatever the engine started; idempotent.
    - `weights_kinds` (optional, default ("model",)): "model" for whole weights, "adapter" for
      LoRA adapter tensors only; the agent refuses to start with a weights_kind not listed.
    """

    name: str
    zero_copy: bool
    swap_policies: tuple[str, ...]

    def swap(
        self, version: int, weights: Mapping[str, torch.Tensor], *, digest: str, policy: str = "drain"
    ) -> SwapReport: ...

    def served_version(self) -> int | None: ...

    def wait_unused(self, version: int, timeout_s: float) -> bool: ...

    def close(self) -> None: ...


def check_swap_args(
    version: int, digest: str, policy: str = "drain", supported: tuple[str, ...] = SWAP_POLICIES
) -> None:
    """The arguments every `swap` takes besides the weights: ValueError / TypeError if off."""
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise ValueError(f"version must be an int in 0..{MAX_VERSION}, got {version!r}")
    if not isinstance(digest, str):
        raise TypeError(f"digest must be the version digest string, got {type(digest).__name__}")
    check_swap_policy(policy, supported)


def check_swap_policy(policy: str, supported: tuple[str, ...] = SWAP_POLICIES, *, engine: str = "this engine") -> None:
    """ValueError unless `policy` is one of SWAP_POLICIES that `supported` lists."""
    if policy not in SWAP_POLICIES:
        raise ValueError(f"swap policy must be one of {list(SWAP_POLICIES)}, got {policy!r}")
    if policy not in supported:
        raise ValueError(f"{engine} does not implement swap policy {policy!r}; it implements {list(supported)}")


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
    if expected is None:
        return
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise LayoutError(
            f"weights do not fit {what}: {len(missing)} missing {missing[:5]}, "
            f"{len(unexpected)} unexpected {unexpected[:5]}"
        )
    for name, (dtype, shape) in expected.items():
        tensor = weights[name]
        if tuple(tensor.shape) != tuple(shape):
            raise LayoutError(f"{name} has shape {tuple(tensor.shape)}, {what} needs {tuple(shape)}")
        if dtype is not None and tensor.dtype != dtype:
            raise LayoutError(f"{name} is {tensor.dtype}, {what} needs {dtype}")


def layout_of(weights: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The layout `weights` have (what later swaps are checked against)."""
    return {name: (t.dtype, tuple(t.shape)) for name, t in weights.items()}


_FACTORIES: dict[str, Callable[[dict[str, Any]], Engine]] = {}


def register_engine(type_name: str, factory: Callable[[dict[str, Any]], Engine]) -> None:
    """Makes `open_engine({"type": type_name, ...})` call `factory(options)`."""
    _FACTORIES[type_name] = factory


def open_engine(config: Mapping[str, Any]) -> Engine:
    """The engine a config names by its `type`; every other key is that engine's option.

    Raises ValueError on an unknown type, listing the known ones.
    """
    _load_builtin_engines()
    options = dict(config)
    type_name = options.pop("type", None)
    factory = _FACTORIES.get(type_name)
    if factory is None:
        raise ValueError(f"unknown engine type {type_name!r}; known: {sorted(_FACTORIES)}")
    return factory(options)


def engine_types() -> list[str]:
    """The engine types `open_engine` knows (what a config's `type` may say), sorted."""
    _load_builtin_engines()
    return sorted(_FACTORIES)


def _load_builtin_engines() -> None:
    # Imported for their register_engine calls; lazily, so `import engine` stays light.
    import weightsync.agents.reference_server  # noqa: F401
    import weightsync.agents.safetensors_engine  # noqa: F401
    import weightsync.agents.sglang_engine  # noqa: F401
    import weightsync.agents.vllm_engine  # noqa: F401
