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

Not here: verifying, staging or fetching versions (the agent does that), the registry
(`engines/__init__.py`), the swap policies themselves (`swap_policy.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch

from weightsync.agents.engines.swap_policy import SwapPolicy
from weightsync.errors import LayoutError
from weightsync.format.layout import MAX_VERSION

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


WEIGHTS_KINDS = ("model", "adapter")
"""What an engine may serve: "model" (whole weights) or "adapter" (LoRA adapter tensors only)."""


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

    def close(self) -> None: ...


def check_engine(engine: object) -> None:
    """TypeError unless `engine` has every member of `Engine`, each of the documented kind: what
    the registry checks of each engine it opens, and the contract suite of each registered one."""
    problems = []
    for member in ("swap", "served_version", "wait_unused", "close"):
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
