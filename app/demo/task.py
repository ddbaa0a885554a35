"""task: the demo's verifiable task — two-number addition, "<a>+<b>=" -> "<a+b>".

Small enough that a few-million-parameter model learns it on a CPU in minutes, verifiable
exactly (the reward is 1 for the right sum, 0 otherwise), and with a difficulty knob
(`max_operand`) so that after a short SFT warm start the model is right only sometimes and
reinforcement learning has room to show. Trainer (SFT warm start) and rollout workers (prompts,
rewards) share it. Not here: tokens (`weightsync.models.ByteTokenizer`), sampling, training.
"""

from __future__ import annotations

import dataclasses
import random


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdditionTask:
    max_operand: int = 99
    """Operands are drawn from [0, max_operand]."""

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise ValueError("max_operand must be >= 1")

    def sample(self, rng: random.Random) -> tuple[str, str]:
        """A prompt and its answer."""
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return f"{a}+{b}=", str(a + b)

    @staticmethod
    def reward(completion: str, answer: str) -> float:
        """1.0 for exactly the answer (surrounding whitespace ignored), else 0.0."""
        return 1.0 if completion.strip() == answer else 0.0
