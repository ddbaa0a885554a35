"""rollout_queue: rollouts from inference-side workers to the trainer, through a directory.

Workers `put` one JSON file per group of samples (the completions of one prompt, with their
rewards, advantages, sampler log-probs and the weight version that produced them), written to
a temporary name and renamed, so a reader never sees half a file. The trainer's rank 0 `claim`s
files in arrival order by renaming them into `claimed/` (a file is consumed once, whatever
crashes) and drops those sampled by weights older than its staleness bound into `dropped/`.
Nothing here waits on the other side: workers never block on the trainer, and `claim` returns
what is there.

Not here: sampling (`rollouts.py`), training on rollouts (`weightsync.app.demo.rl`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One sampled completion, ready to train on."""

    tokens: list[int]
    """Prompt and completion token ids."""
    loss_weights: list[float]
    """0 on the prompt, 1 on the completion."""
    sampler_logprobs: list[float]
    """Log-prob of each token under the sampling weights (0 on the prompt)."""
    advantage: float
    reward: float
    weight_version: int
    """The published version that sampled it."""
    sampler_step: int
    """The trainer step of that version (staleness is counted in steps)."""
    weight_versions: list[dict] = dataclasses.field(default_factory=list)
    """Which versions produced which completion tokens: [{version, start, stop}] (more than one
    when an in_flight swap came during the generation; `weight_version` is the oldest)."""


class RolloutQueue:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.pending, self.claimed, self.dropped = (self.root / d for d in ("pending", "claimed", "dropped"))
        for d in (self.pending, self.claimed, self.dropped):
            d.mkdir(parents=True, exist_ok=True)

    def put(self, group: list[Rollout], *, worker: str) -> Path:
        """Adds one group atomically; returns its file."""
        name = f"{time.time_ns():020d}-{worker}-{uuid.uuid4().hex[:8]}.json"
        tmp = self.pending / f".tmp-{name}"
        tmp.write_text(json.dumps([dataclasses.asdict(r) for r in group]))
        os.replace(tmp, self.pending / name)
        return self.pending / name

    def claim(self, count: int, *, min_sampler_step: int) -> tuple[list[Rollout], int]:
        """Up to `count` rollouts, oldest files first, whole groups only (so the last group may
        overshoot); groups sampled before `min_sampler_step` are dropped. Returns (rollouts,
        groups dropped)."""
        taken: list[Rollout] = []
        dropped = 0
        for path in sorted(p for p in self.pending.iterdir() if not p.name.startswith(".tmp-")):
            if len(taken) >= count:
                break
            try:
                group = [Rollout(**r) for r in json.loads(path.read_text())]
            except (OSError, ValueError, TypeError):
                continue  # half-visible on an odd filesystem, or not ours: leave it
            if group and min(r.sampler_step for r in group) < min_sampler_step:
                os.replace(path, self.dropped / path.name)
                dropped += 1
                continue
            os.replace(path, self.claimed / path.name)
            taken.extend(group)
        return taken, dropped

    def counts(self) -> dict[str, int]:
        return {
            d.name: sum(1 for p in d.iterdir() if not p.name.startswith(".tmp-"))
            for d in (self.pending, self.claimed, self.dropped)
        }

    def claimed_groups(self) -> list[list[Rollout]]:
        """Every group the trainer took, in claim order (for the demo's report)."""
        paths = sorted(self.claimed.iterdir())
        return [[Rollout(**r) for r in json.loads(p.read_text())] for p in paths]
