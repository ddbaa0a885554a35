"""training-API benchmark: the step time of the Tinker-compatible training server against the
TOML trainer's own loop, same model, same batch, measured in one run.

Both sides run the same work per step: forward and backward of the same batch (cross-entropy
over the same weighted tokens) and an AdamW step, one rank, fp32, on the same HF-style model
directory. The trainer side is `weightsync.trainer.train.Trainer` in this process
(forward_backward + clip_gradients + apply_verdict, what its `train()` loop does per step minus
data loading); the API side is the unmodified `tinker` SDK against `weightsync serve-training`
in a child process (forward_backward + optim_step, waiting for the optimizer step's result).
Both compute on one thread (the server child runs with OMP_NUM_THREADS=1, the trainer with
torch.set_num_threads(1)): on a loaded 2-core machine, thread counts alone move step times more
than the effect measured.
Blocks alternate A B A B after a warm-up block of each, so drift in the machine's load hits both
sides alike; the first step of each block is left out. The ratio of mean step times (API /
trainer) is the API's overhead; the target is <= 1.15.

Prints one JSON record (config, versions, hardware, load before and after, results); --save also
writes it to bench/results/. Run from the repository root:

    python -m bench.training_api [--hidden 256] [--layers 4] [--batch 16] [--seq 256] [--steps 6] [--save]

Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

from harness.machine import describe_machine
from harness.training_server import API_KEY, TrainingServer

ROOT = Path(__file__).resolve().parent.parent


def make_model(directory: Path, hidden: int, layers: int, vocab: int) -> str:
    from weightsync.models import ModelConfig, build_model, save_pretrained

    config = ModelConfig(
        model_type="qwen3",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=4096,
    )
    save_pretrained(directory, config, build_model(config, seed=0).state_dict(), dtype=None)
    return str(directory)


def make_batch(batch: int, seq: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(seq)] for _ in range(batch)]


class TrainerSide:
    def __init__(self, model_dir: str, sequences: list[list[int]], lr: float) -> None:
        from weightsync.trainer.config import parse_job_config
        from weightsync.trainer.data import Example, collate
        from weightsync.trainer.train import Trainer

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        seq = max(len(s) for s in sequences)
        job = parse_job_config(
            {
                "parallel": {"device": "cpu"},
                "train": {
                    "steps": 10**6,
                    "model": {"init_dir": model_dir},
                    "optimizer": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "max_grad_norm": 0.0},
                    "schedule": {"warmup_steps": 0, "decay": "constant"},
                    "data": {
                        "global_batch_size": len(sequences),
                        "micro_batch_size": len(sequences),
                        "max_seq_len": seq,
                        "pad_multiple": 1,
                    },
                },
            }
        )
        self.trainer = Trainer(job)
        examples = [Example(tokens=s, loss_weights=[0.0] + [1.0] * (len(s) - 1)) for s in sequences]
        self.batch = collate(examples, max_seq_len=seq, pad_multiple=1)

    def step(self) -> float:
        t0 = time.perf_counter()
        metrics = self.trainer.forward_backward([self.batch])
        metrics.update(self.trainer.clip_gradients())
        self.trainer.apply_verdict(metrics)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.trainer.close()


class ApiSide:
    def __init__(self, server: TrainingServer, model_dir: str, sequences: list[list[int]], lr: float) -> None:
        import tinker
        from tinker import types

        self.types = types
        service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
        self.client = service.create_lora_training_client(base_model=model_dir, rank=0).result()
        tokens = sum(len(s) - 1 for s in sequences)
        self.data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(s[:-1]),
                loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0 / tokens] * (len(s) - 1)},
            )
            for s in sequences
        ]
        self.adam = types.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-8)

    def step(self) -> float:
        t0 = time.perf_counter()
        self.client.forward_backward(self.data, "cross_entropy")
        self.client.optim_step(self.adam).result()
        return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6, help="steps per block (the first of each is left out)")
    parser.add_argument("--blocks", type=int, default=2, help="A B pairs after the warm-up")
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import torch

    # The server runs with OMP_NUM_THREADS=1 (harness/training_server.py): give the trainer the same.
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "model", args.hidden, args.layers, args.vocab)
        sequences = make_batch(args.batch, args.seq, args.vocab)
        trainer = TrainerSide(model_dir, sequences, lr=1e-4)
        with TrainingServer(Path(tmp) / "state", extra_args=("--long-poll-s", "5")) as server:
            api = ApiSide(server, model_dir, sequences, lr=1e-4)
            times: dict[str, list[float]] = {"trainer": [], "api": []}
            for block in range(args.blocks + 1):
                for name, side in (("trainer", trainer), ("api", api)):
                    block_times = [side.step() for _ in range(args.steps)]
                    if block > 0:  # block 0 is the warm-up
                        times[name].extend(block_times[1:])
        trainer.close()
    means = {name: statistics.mean(values) for name, values in times.items()}
    record = {
        "benchmark": "training_api",
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "config": vars(args),
        "machine": describe_machine(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "results": {
            "trainer_step_s": means["trainer"],
            "api_step_s": means["api"],
            "ratio_api_over_trainer": means["api"] / means["trainer"],
            "target_ratio": 1.15,
            "trainer_steps_s": times["trainer"],
            "api_steps_s": times["api"],
        },
    }
    print(json.dumps(record))
    if args.save:
        out = ROOT / "bench" / "results" / f"training_api-{record['time'][:19].replace(':', '')}.json"
        out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
