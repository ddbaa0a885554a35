"""rollouts: a rollout worker — samples groups from the inference servers, scores them, queues them.

The inference side of the RL loop. In a loop, it draws a prompt of the task, asks one of the
reference servers (round robin over every region's agents) for `group_size` completions at
temperature 1, scores each exactly, and turns the group into GRPO examples: advantage =
(reward - group mean) / group std; a group whose rewards are all equal teaches nothing and is
not queued (its rewards still count in the statistics). Every completion carries the weight
version that produced it (the server reports it with each response) and that version's trainer
step (from its manifest), so the trainer can bound staleness. It never waits for the trainer:
it samples with whatever weights the servers serve now.

Runs as a process: `python -m weightsync.app.demo.rollouts CONFIG_JSON` (what `weightsync demo`
starts), until SIGTERM. Not here: the queue format (`rollout_queue.py`), training.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import signal
import statistics
import sys
import threading
import time

from weightsync.app.demo.rollout_queue import Rollout, RolloutQueue
from weightsync.app.demo.task import AdditionTask
from weightsync.models import ByteTokenizer
from weightsync.transport.json_http import HttpClient, HttpError

log = logging.getLogger(__name__)

ANSWER_TOKENS = 8  # the answer's budget: what is scored and trained on


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    servers: tuple[str, ...]
    """Base URLs of the reference inference servers to sample from."""
    queue_dir: str
    store: str
    """Store URI, to read each version's trainer step from its manifest."""
    model: str
    worker: str = "w0"
    group_size: int = 8
    max_new_tokens: int = 8
    """Tokens each completion generates. Above ANSWER_TOKENS the server goes on past the answer's
    EOS (a long rollout); what is scored and trained on is the answer part."""
    temperature: float = 1.0
    """1.0: the servers' log-probs are then exactly the sampling distribution's."""
    max_operand: int = 99
    seed: int = 0
    stats_path: str | None = None
    """JSON lines, one per group: time, server, version, step, mean reward."""
    engine: str = "reference"
    """What the servers are: "reference" (POST /v1/generate) or "vllm" (OpenAI /v1/completions)."""
    request_timeout_s: float = 600.0
    """Per request: long rollouts on a loaded machine take minutes."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "servers", tuple(self.servers))
        if not self.servers or self.group_size < 2:
            raise ValueError("need at least one server and group_size >= 2")


class RolloutWorker:
    def __init__(self, config: RolloutConfig) -> None:
        from weightsync.stores import open_store

        self.config = config
        self.queue = RolloutQueue(config.queue_dir)
        self.task = AdditionTask(max_operand=config.max_operand)
        self.tokenizer = ByteTokenizer()
        self.store = open_store(config.store)
        self.rng = random.Random(f"rollouts/{config.seed}/{config.worker}")
        self._steps: dict[int, int] = {}
        self._next_server = self.rng.randrange(len(config.servers))
        self.last_version: dict[str, int] = {}

    def step_of(self, version: int) -> int:
        """The trainer step that produced `version` (its manifest's step), cached."""
        from weightsync.versions import read_manifest

        if version not in self._steps:
            self._steps[version] = read_manifest(self.store, self.config.model, version).step or 0
        return self._steps[version]

    def sample_group(self) -> dict | None:
        """One prompt, `group_size` completions from one server; queued if it has a signal."""
        server = self.config.servers[self._next_server]
        self._next_server = (self._next_server + 1) % len(self.config.servers)
        prompt, answer = self.task.sample(self.rng)
        sample = self._sample_vllm if self.config.engine == "vllm" else self._sample_reference
        doc = sample(server, prompt)
        if doc is None:
            return None
        version = int(doc["weight_version"])
        if version < self.last_version.get(server, 0):
            raise AssertionError(f"{server} went back from v{self.last_version[server]} to v{version}")
        self.last_version[server] = version
        completions = [_answer_part(c) for c in doc["completions"]]
        rewards = [self.task.reward(self.tokenizer.decode(c["token_ids"]), answer) for c in completions]
        # Staleness counts from the oldest version that produced a token the trainer learns from.
        version = min(r["version"] for c in completions for r in c["versions"])
        step = self.step_of(version) if version > 0 else 0
        mean = statistics.fmean(rewards)
        std = statistics.pstdev(rewards)
        if std > 0:
            prompt_ids = self.tokenizer.encode(prompt)
            group = [
                Rollout(
                    tokens=prompt_ids + c["token_ids"],
                    loss_weights=[0.0] * len(prompt_ids) + [1.0] * len(c["token_ids"]),
                    sampler_logprobs=[0.0] * len(prompt_ids) + c["logprobs"],
                    advantage=(r - mean) / std,
                    reward=r,
                    weight_version=version,
                    sampler_step=step,
                    weight_versions=c["versions"],
                )
                for c, r in zip(completions, rewards, strict=True)
            ]
            self.queue.put(group, worker=self.config.worker)
        return {
            "t": time.time(),
            "server": server,
            "version": version,
            "step": step,
            "reward": mean,
            "queued": std > 0,
            "worker": self.config.worker,
            "versions": doc.get("weight_versions", [version]),
            "restarts": doc.get("restarts", 0),
        }

    def _sample_reference(self, server: str, prompt: str) -> dict | None:
        body = {
            "prompts": [prompt] * self.config.group_size,
            "max_new_tokens": self.config.max_new_tokens,
            "temperature": self.config.temperature,
            "seed": self.rng.randrange(2**31),
        }
        if self.config.max_new_tokens > ANSWER_TOKENS:
            body["stop"] = None  # a long rollout: generate all of them
        try:
            return HttpClient(server, timeout_s=self.config.request_timeout_s).post_json("/v1/generate", body)
        except HttpError as e:
            if e.status == 503:  # no weights yet, or busy: come back later
                return None
            raise

    def _sample_vllm(self, server: str, prompt: str) -> dict | None:
        """A group from vLLM, in the reference server's shape. vLLM reports no version per response
        and, without a tokenizer, no sampling logprobs: the group is sampled, then scored (prompt
        logprobs of prompt + completion, which at temperature 1 are the sampling distribution's),
        and kept only if the server's weight version was the same before and after both calls —
        with the drain swap policy both then ran on that one version."""
        client = HttpClient(server, timeout_s=60.0)
        before = client.get_json("/weight_info").get("weight_version")
        if before in (None, "", "None"):
            return None  # no version swapped in yet
        ids = self.tokenizer.encode(prompt)
        sampled = client.post_json(
            "/v1/completions",
            {
                "model": "m",
                "prompt": ids,
                "n": self.config.group_size,
                "max_tokens": self.config.max_new_tokens,
                "temperature": self.config.temperature,
                "seed": self.rng.randrange(2**31),
                "return_token_ids": True,
                "stop_token_ids": [self.tokenizer.EOS],
            },
        )
        completions = [list(c["token_ids"]) for c in sampled["choices"]]
        scored = client.post_json(
            "/v1/completions",
            {
                "model": "m",
                "prompt": [ids + c for c in completions],
                "max_tokens": 1,
                "temperature": 0.0,
                "prompt_logprobs": 1,
            },
        )
        if client.get_json("/weight_info").get("weight_version") != before:
            return None  # a swap came between the calls: sample again
        out = []
        for tokens, choice in zip(completions, scored["choices"], strict=True):
            positions = choice["prompt_logprobs"][len(ids) :]
            logprobs = [float(entry[str(token)]["logprob"]) for token, entry in zip(tokens, positions, strict=False)]
            out.append(
                {
                    "text": self.tokenizer.decode(tokens),
                    "token_ids": tokens,
                    "logprobs": logprobs,
                    "versions": [{"version": int(before), "start": 0, "stop": len(tokens)}],
                }
            )
        return {"weight_version": int(before), "completions": out}

    def run(self, stop: threading.Event) -> None:
        stats = open(self.config.stats_path, "a") if self.config.stats_path else None
        try:
            while not stop.is_set():
                try:
                    row = self.sample_group()
                except (HttpError, OSError, ValueError, KeyError) as e:  # a server restarting: try the next one
                    log.warning("%s: sampling failed: %s", self.config.worker, e)
                    stop.wait(0.5)
                    continue
                if row is None:
                    stop.wait(0.2)
                elif stats is not None:
                    stats.write(json.dumps(row) + "\n")
                    stats.flush()
        finally:
            if stats is not None:
                stats.close()


def _answer_part(completion: dict) -> dict:
    """The part of a completion that is scored and trained on: up to its first EOS, at most
    ANSWER_TOKENS tokens, with the version ranges that produced it."""
    tokens = completion["token_ids"]
    end = tokens.index(ByteTokenizer.EOS) + 1 if ByteTokenizer.EOS in tokens else len(tokens)
    end = min(end, ANSWER_TOKENS)
    versions = [{**r, "stop": min(r["stop"], end)} for r in completion["versions"] if r["start"] < end]
    return {"token_ids": tokens[:end], "logprobs": completion["logprobs"][:end], "versions": versions}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s [rollouts] %(name)s %(levelname)s: %(message)s"
    )
    config = RolloutConfig(**json.loads(argv[0]))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    RolloutWorker(config).run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
