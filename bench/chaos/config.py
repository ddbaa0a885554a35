"""config: what a chaos run is: the model, the regions, the fault kinds and their odds, ChaosConfig.

Not here: running it (run.py), the faults' actions (faults.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from weightsync.agents.engines.swap_policy import SwapPolicy

MODEL = "chaos-lm"
ARCH = {
    "vocab_size": 259,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
REGIONS = ("east", "west")
PROMPT = "weightsync chaos: "
GENERATION_PROMPT = [256, 99, 104, 97, 111, 115]
GENERATION_TOKENS = 96
"""The long generations kept running on every agent during the rounds (run.py, checks.py)."""
REPO = Path(__file__).resolve().parents[2]
SWAP_POLICIES = tuple(SwapPolicy.names())
MIXED_POLICIES = (SwapPolicy.DRAIN, SwapPolicy.IN_FLIGHT, SwapPolicy.ABORT, SwapPolicy.IN_FLIGHT)
"""Under swap_policy "mixed": east-1, east-2, west-1, west-2. in_flight twice: it is the policy whose
responses span versions, the one with the most to check per token range."""
FAULT_KINDS = (
    "kill_publisher",
    "kill_agent",
    "stall_agent",
    "partition_leader",
    "flip_in_flight",
    "flip_store_object",
    "flip_agent_cache",
    "stale_cache_restart",
    "s3_faults",
    "clock_skew",
    "gc_during_publish",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChaosConfig:
    rounds: int = 10
    seed: int = 0
    store: str = "local"
    """"local" (a directory) or "s3" (moto behind harness/fault_proxy.py)."""
    versions_per_round: int = 3
    convergence_bound_s: float = 60.0
    publish_deadline_s: float = 180.0
    """A publish (one attempt) that neither commits nor fails within this long is a hang."""
    start_deadline_s: float = 180.0
    chunk_bytes: int = 4096
    rebase_every: int = 3
    slow_s: float = 0.015
    """Pause per encoded object in the publisher, so that kills land mid-upload, not after it."""
    gc_keep: int = 3
    gc_grace_s: float = 60.0
    rss_growth_bound_mb: float = 160.0
    """Allowed RSS growth of a process over its first sample once it serves (leaks, chain blow-ups)."""
    fault_scale: float = 1.0
    """Multiplies every fault's per-round probability (capped at 1)."""
    swap_policy: str = "drain"
    """Every agent's swap policy (docs/agents.md), or "mixed": each agent its own, from
    MIXED_POLICIES, so one cluster runs all three. Long generations run during the faults and each
    token range of their responses is checked against the published weights of its version."""
    workdir: str | None = None
    keep_workdir: bool = False

    def policy_of(self, agent: str) -> str:
        """The swap policy of agent `agent` ("east-1" ...)."""
        if self.swap_policy != "mixed":
            return self.swap_policy
        region, index = agent.rsplit("-", 1)
        return MIXED_POLICIES[2 * REGIONS.index(region) + int(index) - 1]

    def __post_init__(self) -> None:
        if self.store not in ("local", "s3"):
            raise ValueError(f"store must be local or s3, got {self.store!r}")
        if self.swap_policy not in (*SWAP_POLICIES, "mixed"):
            raise ValueError(f"swap_policy must be drain, in_flight, abort or mixed, got {self.swap_policy!r}")
        if self.rounds < 1 or self.versions_per_round < 1:
            raise ValueError("rounds and versions_per_round must be >= 1")


FAULT_PROBABILITY = {
    "kill_publisher": 0.3,
    "kill_agent": 0.45,
    "stall_agent": 0.2,
    "partition_leader": 0.25,
    "flip_in_flight": 0.35,
    "flip_store_object": 0.25,
    "flip_agent_cache": 0.3,
    "stale_cache_restart": 0.2,
    "s3_faults": 0.7,
    "clock_skew": 0.4,
    "gc_during_publish": 0.3,
}
