"""rl: the asynchronous RL job `weightsync demo` runs — an SFT warm start, then GRPO on rollouts.

Two phases in one torchrun job, on one process group:

    warm start -> SFT on the task (`weightsync.app.demo.task`) for `warmup_steps`, publishing every
                  step like any run; rank 0 then exports the weights as an HF directory
    grpo       -> a new Trainer starts from that directory and trains on the rollouts that the
                  inference-side workers queue (`RolloutSource`), still publishing every step

The trainer never waits for a version to reach the inference servers: it publishes and goes on.
It waits for rollouts only when the queue is empty, and it drops rollouts sampled by weights
more than `max_staleness_steps` steps older than its own (the importance ratio in the GRPO loss
corrects for the staleness it keeps).

    torchrun --standalone --nproc-per-node 2 -m weightsync.app.demo.rl --config FILE --rollouts DIR \
        --export-dir DIR --warmup-steps 40 --rl-steps 60

Not here: sampling and rewards (`weightsync.app.demo.rollouts`), the orchestration (`weightsync.app.demo`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from weightsync.app.demo.rollout_queue import Rollout, RolloutQueue
from weightsync.app.demo.task import AdditionTask
from weightsync.models import ByteTokenizer
from weightsync.trainer.config import LossConfig, ModelSpec, load_job_config
from weightsync.trainer.data import Example, _IndexedSource
from weightsync.trainer.parallel import broadcast_object, close_runtime, init_runtime
from weightsync.trainer.train import Trainer, configure_logging

log = logging.getLogger(__name__)


class TaskSource(_IndexedSource):
    """SFT examples of the demo task (prompt -> answer + EOS), numbered globally like the trainer's
    synthetic sources: rank r of n takes the r-th slice of each draw."""

    kind = "task-sft"

    def __init__(self, task: AdditionTask, *, dp_rank: int, dp_size: int, seed: int) -> None:
        super().__init__(dp_rank=dp_rank, dp_size=dp_size, seed=seed)
        self.task = task
        self.tokenizer = ByteTokenizer()

    def example(self, index: int) -> Example:
        prompt, answer = self.task.sample(random.Random(f"task-sft/{self.seed}/{index}"))
        prompt_ids = self.tokenizer.encode(prompt)
        answer_ids = self.tokenizer.encode(answer, bos=False) + [self.tokenizer.EOS]
        return Example(tokens=prompt_ids + answer_ids, loss_weights=[0.0] * len(prompt_ids) + [1.0] * len(answer_ids))


class RolloutSource:
    """GRPO examples from the rollout queue. Every rank calls `take` together: rank 0 claims
    enough fresh rollouts (waiting only while the queue is empty) and broadcasts them; rank r
    keeps the r-th slice. Rollouts are consumed: a resumed run does not replay them."""

    kind = "rollouts"

    def __init__(
        self,
        queue_dir: str,
        *,
        dp_rank: int,
        dp_size: int,
        current_step: Callable[[], int],
        max_staleness_steps: int,
        wait_timeout_s: float = 600.0,
    ) -> None:
        self.queue = RolloutQueue(queue_dir)
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.current_step = current_step
        self.max_staleness_steps = max_staleness_steps
        self.wait_timeout_s = wait_timeout_s
        self.buffer: list[Rollout] = []
        self.taken = 0
        self.dropped_groups = 0
        self.waited_s = 0.0

    def take(self, count: int) -> list[Example]:
        claimed = broadcast_object(self._claim(count * self.dp_size) if self.dp_rank == 0 else None)
        mine = claimed[self.dp_rank * count : (self.dp_rank + 1) * count]
        self.taken += len(claimed)
        return [
            Example(
                tokens=r["tokens"],
                loss_weights=r["loss_weights"],
                advantage=r["advantage"],
                sampler_logprobs=r["sampler_logprobs"],
                sampler_step=r["sampler_step"],
            )
            for r in mine
        ]

    def _claim(self, need: int) -> list[dict]:
        t0 = time.monotonic()
        delay = 0.01
        while True:
            oldest = self.current_step() - self.max_staleness_steps
            self.buffer = [r for r in self.buffer if r.sampler_step >= oldest]
            if len(self.buffer) >= need:
                break
            got, dropped = self.queue.claim(need - len(self.buffer), min_sampler_step=oldest)
            self.dropped_groups += dropped
            self.buffer.extend(got)
            if len(self.buffer) >= need:
                break
            if time.monotonic() - t0 > self.wait_timeout_s:
                raise TimeoutError(self._starved_reason(time.time() - self.wait_timeout_s))
            time.sleep(delay)
            delay = min(delay * 1.5, 0.2)
        self.waited_s += time.monotonic() - t0
        batch, self.buffer = self.buffer[:need], self.buffer[need:]
        return [dataclasses.asdict(r) for r in batch]

    def _starved_reason(self, since_unix: float) -> str:
        """Why no rollout came, from the workers' statistics beside the queue (`stats-w*.jsonl`):
        none sampled, or every group sampled scored the same (GRPO has no signal in such a group,
        so workers do not queue it; a model that fails every prompt stays there)."""
        groups = []
        for path in Path(self.queue.root).glob("stats-w*.jsonl"):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    row = json.loads(line)
                    if row["t"] >= since_unix:
                        groups.append(row)
        head = f"no rollouts for {self.wait_timeout_s:.0f} s: "
        if not groups:
            return head + "the rollout workers sampled nothing in that time: are they running? (their logs)"
        mean = sum(g["reward"] for g in groups) / len(groups)
        return (
            head + f"the rollout workers sampled {len(groups)} groups in that time, none with a reward "
            f"signal (every completion of a group scored the same; mean reward {mean:.2f}): the model "
            f"gives the same reward to every sample on the task. A longer warm start (--warmup-steps) or "
            f"a lower RL learning rate avoids it."
        )

    def state_dict(self) -> dict:
        return {"kind": self.kind, "taken": self.taken}

    def load_state_dict(self, state: dict) -> None:
        self.taken = int(state.get("taken", 0))


def run_warm_start(job, task: AdditionTask, *, steps: int, export_dir: str) -> None:
    """SFT on the task for `steps`; rank 0 writes the resulting fp32 weights as an HF directory."""
    sft = dataclasses.replace(
        job,
        train=dataclasses.replace(
            job.train,
            steps=steps,
            loss=LossConfig(kind="sft"),
            schedule=dataclasses.replace(job.train.schedule, warmup_steps=min(job.train.schedule.warmup_steps, steps)),
        ),
    )
    holder: dict[str, Trainer] = {}
    source = _LazySource(
        holder, lambda t: TaskSource(task, dp_rank=t.dp_rank, dp_size=t.dp_size, seed=job.train.data.seed)
    )
    trainer = holder["trainer"] = Trainer(sft, source=source)
    try:
        trainer.train()
        trainer.engine.export_pretrained(export_dir, dtype=torch.float32)
        if trainer.rank == 0:
            log.info("warm start done after %d steps; weights in %s", steps, export_dir)
    finally:
        trainer.close()


def run_grpo(
    job,
    *,
    export_dir: str | None,
    first_step: int,
    steps: int,
    queue_dir: str,
    max_staleness_steps: int,
    lr: float | None,
) -> None:
    """GRPO on queued rollouts for `steps` steps, numbered on from `first_step` (the warm start's
    steps), so that every published version has its own step and staleness is counted right."""
    optimizer = job.train.optimizer if lr is None else dataclasses.replace(job.train.optimizer, lr=lr)
    train = dataclasses.replace(
        job.train, steps=first_step + steps, optimizer=optimizer, loss=dataclasses.replace(job.train.loss, kind="grpo")
    )
    if export_dir is not None:
        train = dataclasses.replace(train, model=ModelSpec(init_dir=export_dir))
    holder: dict[str, Trainer] = {}
    source = _LazySource(
        holder,
        lambda t: RolloutSource(
            queue_dir,
            dp_rank=t.dp_rank,
            dp_size=t.dp_size,
            current_step=lambda: t.step,
            max_staleness_steps=max_staleness_steps,
        ),
    )
    trainer = holder["trainer"] = Trainer(dataclasses.replace(job, train=train), source=source)
    trainer.step = max(trainer.step, first_step)  # a fresh Trainer counts from 0; go on from the warm start
    try:
        trainer.train()
        rollouts = source.inner
        if trainer.rank == 0:
            log.info(
                "GRPO done: %d rollouts trained on, %d stale groups dropped, %.1f s waiting for rollouts",
                rollouts.taken,
                rollouts.dropped_groups,
                rollouts.waited_s,
            )
    finally:
        trainer.close()


class _LazySource:
    """An ExampleSource built on first use from the Trainer it feeds (`holder["trainer"]`): the
    Trainer takes its source before it builds the mesh that gives the data-parallel rank. A
    position restored before then is applied once the source exists."""

    def __init__(self, holder: dict, build: Callable[[Trainer], object]) -> None:
        self.holder, self.build = holder, build
        self.inner = None
        self._state: dict | None = None

    def _get(self):
        if self.inner is None:
            self.inner = self.build(self.holder["trainer"])
            if self._state is not None:
                self.inner.load_state_dict(self._state)
        return self.inner

    def take(self, count: int) -> list[Example]:
        return self._get().take(count)

    def state_dict(self) -> dict:
        return self._get().state_dict() if self.inner is not None or "trainer" in self.holder else (self._state or {})

    def load_state_dict(self, state: dict) -> None:
        if self.inner is None and "trainer" not in self.holder:
            self._state = state
        else:
            self._get().load_state_dict(state)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightsync.app.demo.rl", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="trainer TOML (parallel, model, optimizer, data, publish)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rollouts", required=True, help="rollout queue directory")
    parser.add_argument("--export-dir", required=True, help="where the warm-started weights go (HF directory)")
    parser.add_argument("--warmup-steps", type=int, default=40, help="SFT steps before GRPO (0: none)")
    parser.add_argument("--rl-steps", type=int, default=60, help="GRPO steps")
    parser.add_argument(
        "--max-staleness-steps", type=int, default=4, help="drop rollouts sampled by weights older than this many steps"
    )
    parser.add_argument("--max-operand", type=int, default=9)
    parser.add_argument("--rl-lr", type=float, help="GRPO learning rate (default: the config's optimizer lr)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    job = load_job_config(args.config, args.overrides)
    # One process group for both phases (each Trainer reuses it); the collective timeout is
    # torch's default, beyond the rollout wait, which may keep the other ranks in a broadcast.
    runtime = init_runtime(job.parallel, timeout_s=1800.0)
    try:
        task = AdditionTask(max_operand=args.max_operand)
        if args.warmup_steps:
            run_warm_start(job, task, steps=args.warmup_steps, export_dir=args.export_dir)
        run_grpo(
            job,
            export_dir=args.export_dir if args.warmup_steps else None,
            first_step=args.warmup_steps,
            steps=args.rl_steps,
            queue_dir=args.rollouts,
            max_staleness_steps=args.max_staleness_steps,
            lr=args.rl_lr,
        )
    finally:
        close_runtime(runtime)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"event": "done"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
