"""swap_policy: how requests running at a swap meet the new version — the one enum.

A string becomes a `SwapPolicy` once, where a setting is read (`SwapPolicy.parse`, from the
agent's config or the demo's); from there on only the enum travels: the agent hands it to
`Engine.swap`, each engine lists the ones it implements in `Engine.swap_policies`, and
`engines.base.check_swap_policy` is the one check that an engine implements a policy.

It imports nothing but the standard library, so that loading an agent config (and `--help`)
does not import torch.

Not here: what each engine does under each policy (the engines' modules), the check
(`engines/base.py`).
"""

from __future__ import annotations

import enum


class SwapPolicy(str, enum.Enum):
    """How requests running at a swap meet the new version (docs/agents.md, "Swap policies").

    A str subclass, so it prints, compares and serializes (JSON, TOML) as its value."""

    DRAIN = "drain"
    """Each request runs on the version it started on to its end, so a response comes from one
    version; a zero-copy engine's memory of that version is free again only once the last such
    request ends, so sync latency is bounded by the longest request."""
    IN_FLIGHT = "in_flight"
    """Running requests continue on the new version from their next token on; their KV cache is
    recomputed with the new weights, so the tokens after the switch are what the new version
    generates from that prefix. Responses say which versions made which tokens."""
    ABORT = "abort"
    """Running requests are cut at their next token and retried from the start on the new
    version (the reference engine retries them itself; vLLM returns them as aborted)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def names(cls) -> list[str]:
        """The spellings a setting may use, in declaration order (for help texts and errors)."""
        return [policy.value for policy in cls]

    @classmethod
    def parse(cls, value: object) -> SwapPolicy:
        """The policy a setting names; ValueError listing the choices for anything else."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for policy in cls:
                if policy.value == value:
                    return policy
        raise ValueError(f"swap policy must be one of {cls.names()}, got {value!r}")
