"""data: training examples, the sources that yield them, and their collation into tensors.

Two kinds of example, one per front end: the TOML loop's `Example` (below) and the Training
API's `Datum` (model input tokens and its loss's named per-token inputs, as the Tinker SDK sends
them; `collate_datums` pads a rank's datums into one batch).

An `Example` is token ids with a loss weight per token (0 = prompt, 1 = response; any weight
>= 0 is allowed), plus, for policy-gradient losses, the sequence's advantage, the sampler's
log-prob of each token and the trainer step of the weights that sampled it. `collate` turns a micro-batch of
examples into right-padded next-token tensors (one example per row; the causal mask means
padding after an example never changes what it sees, and padded positions weigh 0).

Sources implement the `ExampleSource` protocol: `take(count)` returns this rank's next
examples, `state_dict()`/`load_state_dict()` make the position checkpointable. The built-in
sources number examples globally and hand data-parallel rank r the r-th slice of each draw,
so a global batch holds the same examples whatever the number of ranks or micro-batches.
The RL loop plugs in its own rollout source.

Not here: the model, losses, anything distributed (sources get their rank and rank count),
decoding or checking the Training API's requests (`weightsync.app.training.wire`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from weightsync.models import ByteTokenizer
from weightsync.trainer.config import DataConfig

PAD_ID = 0
"""Input id of padded positions: any id the vocabulary has; they are never attended to by
real tokens (causal mask, right padding) and weigh 0 in every loss."""


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Example:
    """One sequence. Per-token fields are aligned with `tokens`; position 0 has nothing that
    predicts it, so its weight and sampler log-prob are ignored."""

    tokens: torch.Tensor
    """Token ids, int64, 1-D (a sequence or list is converted)."""
    loss_weights: torch.Tensor
    """Per-token weight of predicting that token, float32, >= 0 (0 = prompt, 1 = response)."""
    advantage: float | None = None
    """GRPO: the sequence's advantage (e.g. reward minus the group mean, over the group std)."""
    sampler_logprobs: torch.Tensor | None = None
    """GRPO: log-prob of each token under the weights that sampled it (0 where not sampled)."""
    sampler_step: int | None = None
    """The trainer step of the published weights that sampled it (the `step` in that version's
    manifest); the trainer reports staleness = its current step - this."""

    def __post_init__(self) -> None:
        tokens = torch.as_tensor(self.tokens, dtype=torch.int64)
        weights = torch.as_tensor(self.loss_weights, dtype=torch.float32)
        if tokens.ndim != 1 or tokens.numel() < 2:
            raise ValueError(f"an example needs a 1-D sequence of at least 2 tokens, got shape {tuple(tokens.shape)}")
        if weights.shape != tokens.shape:
            raise ValueError(f"loss_weights has {weights.numel()} entries for {tokens.numel()} tokens")
        if bool((tokens < 0).any()):
            raise ValueError("token ids must be >= 0")
        if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
            raise ValueError("loss_weights must be finite and >= 0")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "loss_weights", weights)
        if self.sampler_logprobs is not None:
            logprobs = torch.as_tensor(self.sampler_logprobs, dtype=torch.float32)
            if logprobs.shape != tokens.shape:
                raise ValueError(f"sampler_logprobs has {logprobs.numel()} entries for {tokens.numel()} tokens")
            object.__setattr__(self, "sampler_logprobs", logprobs)

    def __len__(self) -> int:
        return self.tokens.numel()


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """Next-token tensors of a micro-batch: row i predicts targets[i, j] from input_ids[i, :j+1]."""

    input_ids: torch.Tensor  # (batch, tokens) int64
    targets: torch.Tensor  # (batch, tokens) int64
    loss_weights: torch.Tensor  # (batch, tokens) float32, 0 on padding and prompts
    advantages: torch.Tensor | None  # (batch,) float32
    sampler_logprobs: torch.Tensor | None  # (batch, tokens) float32
    sampler_steps: torch.Tensor  # (batch,) int64, -1 where unknown
    token_mask: torch.Tensor | None = None  # (batch, tokens) bool, False on padding (MoE aux loss)

    @property
    def num_tokens(self) -> int:
        """Token positions computed, padding included (what tokens/s counts)."""
        return self.input_ids.numel()

    def to(self, device: torch.device) -> MicroBatch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return MicroBatch(*(move(getattr(self, f.name)) for f in dataclasses.fields(self)))


def collate(examples: Sequence[Example], *, max_seq_len: int, pad_multiple: int = 8) -> MicroBatch:
    """Pads examples to the longest (rounded up to pad_multiple, capped at max_seq_len - 1
    next-token positions) and shifts them into next-token form.

    Raises ValueError for an example longer than max_seq_len: cutting a response would train
    on a truncated answer, so sources must keep examples short enough.
    """
    if not examples:
        raise ValueError("cannot collate an empty micro-batch")
    longest = max(len(e) for e in examples)
    if longest > max_seq_len:
        raise ValueError(
            f"an example has {longest} tokens, over train.data.max_seq_len = {max_seq_len}; "
            "raise max_seq_len or shorten the source's examples"
        )
    width = min(-(-(longest - 1) // pad_multiple) * pad_multiple, max_seq_len - 1)
    rows = len(examples)
    input_ids = torch.full((rows, width), PAD_ID, dtype=torch.int64)
    targets = torch.zeros((rows, width), dtype=torch.int64)
    weights = torch.zeros((rows, width), dtype=torch.float32)
    policy = [e.advantage is not None for e in examples]
    if any(policy) and not all(policy):
        raise ValueError("a micro-batch mixes examples with and without advantages")
    logprobs = torch.zeros((rows, width), dtype=torch.float32) if all(policy) else None
    for i, e in enumerate(examples):
        n = len(e) - 1
        input_ids[i, :n] = e.tokens[:-1]
        targets[i, :n] = e.tokens[1:]
        weights[i, :n] = e.loss_weights[1:]
        if logprobs is not None:
            if e.sampler_logprobs is None:
                raise ValueError("a policy-gradient example (with an advantage) needs sampler_logprobs")
            logprobs[i, :n] = e.sampler_logprobs[1:]
    advantages = torch.tensor([e.advantage for e in examples], dtype=torch.float32) if all(policy) else None
    sampler_steps = torch.tensor([-1 if e.sampler_step is None else e.sampler_step for e in examples])
    token_mask = torch.arange(width) < torch.tensor([len(e) - 1 for e in examples])[:, None]
    return MicroBatch(input_ids, targets, weights, advantages, logprobs, sampler_steps, token_mask)


@dataclasses.dataclass(frozen=True, eq=False)
class Datum:
    """One Training API example: the model input tokens and the loss inputs (name -> array of
    the same length: `target_tokens`, `weights`, `logprobs`, `advantages`)."""

    tokens: np.ndarray  # (T,) int64
    inputs: dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True, eq=False)
class DatumBatch:
    """Datums as right-padded rows on a device: row i predicts targets[i, j] from input_ids[i, :j+1]."""

    input_ids: torch.Tensor  # (rows, tokens) int64
    targets: torch.Tensor  # (rows, tokens) int64
    lengths: tuple[int, ...]  # each datum's token count (no entry for a padding-only row)
    inputs: tuple[dict[str, torch.Tensor], ...]  # each datum's float inputs, target_tokens aside

    @property
    def token_mask(self) -> torch.Tensor:
        """(rows, tokens) bool: True on the datums' tokens, False on padding (MoE aux loss)."""
        lengths = list(self.lengths) + [0] * (self.input_ids.shape[0] - len(self.lengths))
        lengths_t = torch.tensor(lengths, device=self.input_ids.device)
        return torch.arange(self.input_ids.shape[1], device=self.input_ids.device) < lengths_t[:, None]


def collate_datums(data: Sequence[Datum], device: torch.device) -> DatumBatch:
    """One padded batch of `data`. Without data it is one row of one padding token: a rank that
    got no datum still runs forward and backward, which FSDP's collectives need of every rank."""
    width = max([len(d.tokens) for d in data], default=1)
    input_ids = torch.full((max(len(data), 1), width), PAD_ID, dtype=torch.int64)
    targets = torch.zeros_like(input_ids)
    for row, datum in enumerate(data):
        n = len(datum.tokens)
        input_ids[row, :n] = torch.from_numpy(datum.tokens)
        targets[row, :n] = torch.from_numpy(datum.inputs["target_tokens"].astype(np.int64))
    inputs = tuple(
        {k: torch.from_numpy(v.astype(np.float32)).to(device) for k, v in d.inputs.items() if k != "target_tokens"}
        for d in data
    )
    return DatumBatch(input_ids.to(device), targets.to(device), tuple(len(d.tokens) for d in data), inputs)


@runtime_checkable
class ExampleSource(Protocol):
    """Yields this rank's examples; its position is checkpointable.

    - `take(count)` returns exactly `count` examples (a source that runs dry raises
      StopIteration); every data-parallel rank calls it with the same count at the same time.
    - `state_dict()` is a small dict of plain Python values (ints, strings, lists); loading it
      into a fresh source makes it yield exactly what the saved one would have yielded next.
    """

    def take(self, count: int) -> list[Example]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class _IndexedSource:
    """Examples numbered 0, 1, 2, ... globally; rank r of n takes the r-th slice of each draw."""

    kind = "indexed"

    def __init__(self, *, dp_rank: int, dp_size: int, seed: int) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_size})")
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.next_index = 0

    def take(self, count: int) -> list[Example]:
        start = self.next_index + self.dp_rank * count
        self.next_index += count * self.dp_size
        return [self.example(i) for i in range(start, start + count)]

    def example(self, index: int) -> Example:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"kind": self.kind, "seed": self.seed, "next_index": self.next_index}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != self.kind or state.get("seed") != self.seed:
            raise ValueError(
                f"data position of a {state.get('kind')!r} source with seed {state.get('seed')} cannot "
                f"resume a {self.kind!r} source with seed {self.seed}"
            )
        self.next_index = int(state["next_index"])


def _sft_example(prompt: str, response: str) -> Example:
    tok = ByteTokenizer()
    prompt_ids = tok.encode(prompt)
    response_ids = tok.encode(response, bos=False) + [tok.EOS]
    return Example(tokens=prompt_ids + response_ids, loss_weights=[0.0] * len(prompt_ids) + [1.0] * len(response_ids))


class ArithmeticSource(_IndexedSource):
    """Synthetic SFT, verifiable: "<a>+<b>=" -> "<a+b>" with 1-4 digit operands (byte tokens)."""

    kind = "arithmetic"

    def example(self, index: int) -> Example:
        rng = random.Random(f"arithmetic/{self.seed}/{index}")
        a, b = (rng.randrange(10 ** rng.randint(1, 4)) for _ in range(2))
        return _sft_example(f"{a}+{b}=", str(a + b))


class ReverseSource(_IndexedSource):
    """Synthetic SFT, verifiable: "reverse <word>:" -> the word reversed (3-12 lowercase letters)."""

    kind = "reverse"

    def example(self, index: int) -> Example:
        rng = random.Random(f"reverse/{self.seed}/{index}")
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 12)))
        return _sft_example(f"reverse {word}:", word[::-1])


class JsonlSource(_IndexedSource):
    """Pre-tokenized examples, one JSON object per line:

        {"tokens": [ids], "loss_weights": [w], "advantage": a?, "sampler_logprobs": [lp]?,
         "sampler_step": s?}

    Endless: epoch e visits every line once, in a permutation seeded by (seed, e) when shuffle
    is on. Lines are located by byte offset, so the file is never held in memory whole.
    """

    kind = "jsonl"

    def __init__(self, path: str | os.PathLike, *, dp_rank: int, dp_size: int, seed: int, shuffle: bool) -> None:
        super().__init__(dp_rank=dp_rank, dp_size=dp_size, seed=seed)
        self.path, self.shuffle = Path(path), shuffle
        self._offsets = self._index_lines()
        if not self._offsets:
            raise ValueError(f"{self.path} holds no examples")
        self._order: tuple[int, list[int]] | None = None

    def _index_lines(self) -> list[int]:
        offsets, position = [], 0
        with open(self.path, "rb") as f:
            for line in f:
                if line.strip():
                    offsets.append(position)
                position += len(line)
        return offsets

    def _line_of(self, index: int) -> int:
        epoch, within = divmod(index, len(self._offsets))
        if not self.shuffle:
            return within
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self._offsets)))
            random.Random(f"jsonl/{self.seed}/{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1][within]

    def example(self, index: int) -> Example:
        line = self._line_of(index)
        with open(self.path, "rb") as f:
            f.seek(self._offsets[line])
            text = f.readline()
        try:
            doc = json.loads(text)
            return Example(
                tokens=doc["tokens"],
                loss_weights=doc["loss_weights"],
                advantage=doc.get("advantage"),
                sampler_logprobs=doc.get("sampler_logprobs"),
                sampler_step=doc.get("sampler_step"),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{self.path}: example on line {line + 1} is malformed: {e!r}") from e

    def state_dict(self) -> dict:
        return {**super().state_dict(), "lines": len(self._offsets), "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        if state.get("lines") != len(self._offsets) or state.get("shuffle") != self.shuffle:
            raise ValueError(
                f"{self.path} changed since the checkpoint (lines or shuffle differ); the saved data "
                "position would point at different examples"
            )
        super().load_state_dict(state)


def build_source(config: DataConfig, *, dp_rank: int, dp_size: int) -> ExampleSource:
    """The source `config.source` names, sharded for this data-parallel rank."""
    if config.source == "arithmetic":
        return ArithmeticSource(dp_rank=dp_rank, dp_size=dp_size, seed=config.seed)
    if config.source == "reverse":
        return ReverseSource(dp_rank=dp_rank, dp_size=dp_size, seed=config.seed)
    if config.source == "jsonl":
        return JsonlSource(config.path, dp_rank=dp_rank, dp_size=dp_size, seed=config.seed, shuffle=config.shuffle)
    if config.source == "rollouts":
        raise ValueError(
            'train.data.source = "rollouts" is fed by the RL job (python -m weightsync.app.demo.rl, '
            "what `weightsync demo` runs), not by the plain trainer"
        )
    raise ValueError(f"unknown train.data.source {config.source!r}")
