"""trainer benchmark: what publishing every step costs the FSDP2 training loop, and what
optimizer-state offload saves in memory.

Timing: one torchrun job (--ranks N, gloo on CPU or NCCL on GPUs) trains a Qwen3-style model and
alternates blocks of steps with publishing every step and without, in ABBA order after a warm-up
block, in the same process group on the same model. The ratio of mean step times (publishing /
not) is the loop's overhead; the target is <= 1.05. The first step of each block is left out:
it is a transition (after a publishing block it still overlaps the last version's encoding,
the first publishing step overlaps none), so both sides are compared in steady state. On a
shared machine other tenants' load swings step times by more than the effect measured: read the
ratio with the load averages the record carries, and repeat runs. For a load-independent view the
record also carries, over the publishing steps, the CPU seconds of rank 0's training thread and
of its publisher threads (snapshot excluded: it runs on the training thread): their quotient is
what publishing costs a rank whose cores training keeps busy.

Memory: two more launches run the same job a few steps without publishing, with and without
`parallel.cpu_offload`, and report each rank's peak RSS (and peak CUDA memory on GPUs). On a
CPU-only machine parameters, gradients and optimizer state live in host memory either way, so
RSS barely moves there; the difference that matters is on the accelerator.

Prints one JSON record (config, versions, hardware, machine load before and after, results);
--save also writes it to bench/results/. Run from the repository root:

    python -m bench.trainer [--ranks 2] [--hidden 512] [--layers 4] [--save]

Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.machine import describe_machine

ROOT = Path(__file__).resolve().parent.parent


def job_doc(args: argparse.Namespace, *, steps: int, store: str | None, offload: bool) -> dict:
    heads = max(1, args.hidden // 64)
    train = {
        "steps": steps,
        "seed": 0,
        "log_every": 1_000_000,  # the bench prints its own record
        "model": {
            "model_type": "qwen3",
            "vocab_size": 259,
            "hidden_size": args.hidden,
            "intermediate_size": 3 * args.hidden,
            "num_hidden_layers": args.layers,
            "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2),
        },
        "optimizer": {"lr": args.lr, "max_grad_norm": 1.0},
        "data": {
            "source": "reverse",
            "global_batch_size": args.global_batch,
            "micro_batch_size": args.global_batch // int(os.environ.get("WORLD_SIZE", args.ranks)),
            "max_seq_len": 64,
        },
        "guard": {"enabled": False},
    }
    if store is not None:
        train["publish"] = {
            "store": store,
            "model": "bench",
            "every_steps": 1,
            "publisher": {"workers": args.publish_workers, "max_in_flight": 2},
        }
    parallel = {"cpu_offload": offload, "mixed_precision": args.mixed_precision}
    return {"parallel": parallel, "train": train}


# ----------------------------------------------------------------------------------- workers


def worker_timing(args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    from weightsync.trainer.config import parse_job_config
    from weightsync.trainer.train import Trainer

    warmup, block = args.warmup_steps, args.block_steps
    pattern = ("ABBA" * args.blocks)[: args.blocks]  # A = publishing every step, B = not publishing
    steps = warmup + block * len(pattern)

    def mode_of(step: int) -> str:  # "warmup", "publish" or "plain"
        if step <= warmup:
            return "warmup"
        return "publish" if pattern[(step - warmup - 1) // block] == "A" else "plain"

    def is_transition(step: int) -> bool:
        # The first step of a block is not steady state: after a publishing block it still
        # carries the encoding of the last version; the first publishing step carries none.
        return step > warmup and (step - warmup - 1) % block == 0

    class BenchTrainer(Trainer):
        cpu_marks = (time.thread_time(), _publisher_cpu_s())

        def publish(self):
            return super().publish() if mode_of(self.step) == "publish" else {}

        def log_metrics(self, metrics, verdict, t0):
            # CPU seconds of this step's training thread and of the publisher's threads: unlike
            # wall time, they hardly move with other tenants' load.
            marks = (time.thread_time(), _publisher_cpu_s())
            metrics["bench/train_cpu_s"] = marks[0] - self.cpu_marks[0]
            metrics["bench/publisher_cpu_s"] = marks[1] - self.cpu_marks[1]
            self.cpu_marks = marks
            super().log_metrics(metrics, verdict, t0)

    store = Path(args.store_dir) / "store"
    trainer = BenchTrainer(parse_job_config(job_doc(args, steps=steps, store=str(store), offload=False)))
    try:
        history = trainer.train()
        versions = trainer.publisher.last_version
        failures = trainer.publisher.failures
    finally:
        trainer.close()
    rss = _gather_peak_rss(dist)
    by_mode: dict[str, list[dict]] = {}
    for m in history:
        by_mode.setdefault("transition" if is_transition(m["step"]) else mode_of(m["step"]), []).append(m)
    publish_s = [m["step_s"] for m in by_mode["publish"]]
    plain_s = [m["step_s"] for m in by_mode["plain"]]
    return {
        "steps": steps,
        "pattern": pattern,
        "warmup_steps": warmup,
        "block_steps": block,
        "step_s_publishing": {"mean": statistics.mean(publish_s), "median": statistics.median(publish_s)},
        "step_s_plain": {"mean": statistics.mean(plain_s), "median": statistics.median(plain_s)},
        "ratio_mean": statistics.mean(publish_s) / statistics.mean(plain_s),
        "ratio_median": statistics.median(publish_s) / statistics.median(plain_s),
        "train_thread_cpu_s_per_step": statistics.mean(m["bench/train_cpu_s"] for m in by_mode["publish"]),
        "publisher_cpu_s_per_step": statistics.mean(m["bench/publisher_cpu_s"] for m in by_mode["publish"]),
        "publisher_cpu_fraction": sum(m["bench/publisher_cpu_s"] for m in by_mode["publish"])
        / sum(m["bench/train_cpu_s"] for m in by_mode["publish"]),
        "publish_wait_s_mean": statistics.mean(m.get("publish/wait_s", 0.0) for m in by_mode["publish"]),
        "publish_latency_s_mean": _mean(m.get("publish/latency_s") for m in by_mode["publish"]),
        "publish_ratio_mean": _mean(m.get("publish/ratio") for m in by_mode["publish"]),
        "tokens_per_step": statistics.mean(m["tokens"] for m in history),
        "versions": versions,
        "publish_failures": failures,
        "final_loss": history[-1]["loss"],
        "peak_rss_MiB_per_rank": rss,
        "step_s_all": [
            [m["step"], "transition" if is_transition(m["step"]) else mode_of(m["step"]), round(m["step_s"], 4)]
            for m in history
        ],
    }


def worker_memory(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    from weightsync.trainer.config import parse_job_config
    from weightsync.trainer.train import Trainer

    trainer = Trainer(parse_job_config(job_doc(args, steps=args.memory_steps, store=None, offload=bool(args.offload))))
    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(trainer.device)
    try:
        history = trainer.train()
        peak_cuda = torch.cuda.max_memory_allocated(trainer.device) / 2**20 if cuda else None
    finally:
        trainer.close()
    return {
        "offload": bool(args.offload),
        "peak_rss_MiB_per_rank": _gather_peak_rss(dist),
        "peak_cuda_MiB_rank0": peak_cuda,
        "step_s_mean": statistics.mean(m["step_s"] for m in history[1:] or history),
    }


def _publisher_cpu_s() -> float:
    """User + system CPU seconds of this process's publisher threads (named ws-*), from /proc."""
    import threading

    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for thread in threading.enumerate():
        if thread.name.startswith("ws-") and thread.native_id is not None:
            try:
                fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # the thread just ended
                continue
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _gather_peak_rss(dist) -> list[float]:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, _peak_rss_mib())
    return values


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


# ---------------------------------------------------------------------------------- launcher


def launch(args: argparse.Namespace, worker: str, extra: list[str], out_dir: Path) -> dict:
    result = out_dir / f"{worker}-{len(list(out_dir.iterdir()))}.json"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // args.ranks))),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.ranks}",
        "-m",
        "bench.trainer",
        "--worker",
        worker,
        "--result",
        str(result),
        *_forwarded(args),
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
        raise SystemExit(f"bench worker {worker} failed with exit code {proc.returncode}")
    return json.loads(result.read_text())


def _forwarded(args: argparse.Namespace) -> list[str]:
    names = (
        "hidden",
        "layers",
        "global_batch",
        "lr",
        "warmup_steps",
        "block_steps",
        "blocks",
        "memory_steps",
        "publish_workers",
        "mixed_precision",
    )
    return [item for name in names for item in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def run(args: argparse.Namespace) -> dict:
    import torch

    from weightsync import __version__
    from weightsync.models import ModelConfig, num_parameters

    load_before = _load()
    with tempfile.TemporaryDirectory(prefix="bench-trainer-", dir=args.store_parent) as tmp:
        out = Path(tmp) / "results"
        out.mkdir()
        timing = launch(args, "timing", ["--store-dir", tmp], out)
        memory = [launch(args, "memory", ["--offload", flag], out) for flag in ("0", "1")]
    heads = max(1, args.hidden // 64)
    params = num_parameters(
        ModelConfig(
            vocab_size=259,
            hidden_size=args.hidden,
            intermediate_size=3 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
        )
    )
    return {
        "bench": "trainer",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {
            **{k: v for k, v in vars(args).items() if k not in ("worker", "result", "save")},
            "parameters": params,
            "bf16_MB": 2 * params / 1e6,
        },
        "versions": {"weightsync": __version__, "torch": torch.__version__, "python": platform.python_version()},
        "hardware": describe_machine(),
        "load_before": load_before,
        "load_after": _load(),
        "timing": timing,
        "memory": {"without_offload": memory[0], "with_offload": memory[1]},
    }


def _load() -> dict:
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"loadavg": os.getloadavg(), "uptime": uptime}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trainer", description=__doc__.split("\n")[0])
    # Not --nproc: torchrun's parser would take it for an abbreviation of its --nproc-per-node.
    parser.add_argument("--ranks", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--hidden", type=int, default=512, help="model width (default 512: ~13M parameters)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=64, help="examples per step over all ranks")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first (allocations, caches)")
    parser.add_argument(
        "--block-steps", type=int, default=6, help="steps per publishing / plain block; the first of each is not timed"
    )
    parser.add_argument("--blocks", type=int, default=8, help="blocks, in ABBA... order (A = publishing)")
    parser.add_argument("--memory-steps", type=int, default=3, help="steps of each memory run")
    parser.add_argument("--publish-workers", type=int, default=1, help="publisher encode threads per rank")
    parser.add_argument("--mixed-precision", default="none", choices=("none", "bf16"))
    parser.add_argument("--store-parent", default=None, help="where the temporary store goes (default: $TMPDIR)")
    parser.add_argument("--save", action="store_true", help="also write the record to bench/results/")
    parser.add_argument("--worker", choices=("timing", "memory"), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--store-dir", help=argparse.SUPPRESS)
    parser.add_argument("--offload", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        import logging

        from weightsync.trainer.config import ParallelConfig
        from weightsync.trainer.parallel import close_runtime, init_runtime

        logging.basicConfig(level=logging.WARNING)
        # The worker owns the process group, so it outlives the Trainer (peak RSS is gathered after).
        runtime = init_runtime(ParallelConfig(cpu_offload=bool(args.offload)))
        try:
            record = worker_timing(args) if args.worker == "timing" else worker_memory(args)
            if runtime.rank == 0:
                Path(args.result).write_text(json.dumps(record))
        finally:
            close_runtime(runtime)
        return 0
    record = run(args)
    print(json.dumps(record))
    if args.save:
        name = f"trainer-{record['hardware']['cores']}cpu-{platform.machine()}-{record['date'][:10]}.json"
        (ROOT / "bench" / "results" / name).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
