"""launch: what `weightsync train --config FILE [--nproc N]` runs.

With --nproc N > 1 (and not already under torchrun) it starts `torchrun --standalone
--nproc-per-node N -m weightsync.trainer.train ...` as a child job (`run_torchrun`: a SIGTERM or
Ctrl-C reaches every rank, and no rank outlives the command) and returns its exit code; otherwise it runs the trainer in this process (a world of one, or this rank of a job
that torchrun started). Multi-node jobs call torchrun directly with their rendezvous flags.

The config is checked before any rank starts: a setting to fix is one ConfigError line and exit
code 2, as for every command. Imports nothing heavy at module level, so `weightsync train --help`
stays instant.

Not here: the trainer itself (`train.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

STOP_TIMEOUT_S = 60.0


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The `weightsync train` arguments, for the CLI's subparser."""
    parser.add_argument("--config", required=True, help="trainer TOML file (see trainer/configs/sft_tiny.toml)")
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="ranks on this machine: spawns torchrun --standalone with N processes (default: run in this process)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value in TOML syntax, e.g. --set train.steps=10 (repeatable)",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level of every rank (default INFO)")


def run_train(
    config: str | os.PathLike, *, nproc: int | None = None, overrides: Sequence[str] = (), log_level: str = "INFO"
) -> int:
    """Runs a training job; returns its exit code (0 only if every rank finished). The config is
    read and checked here first: a setting to fix is a ConfigError before any rank starts (exit 2),
    not a traceback from each of N ranks."""
    from weightsync.errors import ConfigError
    from weightsync.trainer.config import load_job_config

    if nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    load_job_config(config, overrides)
    argv = ["--config", os.fspath(config), "--log-level", log_level]
    for override in overrides:
        argv += ["--set", override]
    if nproc is None or nproc == 1 or "LOCAL_RANK" in os.environ:
        from weightsync.trainer.train import main

        return main(argv)
    return run_torchrun(nproc, "weightsync.trainer.train", argv)


def run_torchrun(nproc: int, module: str, argv: Sequence[str], *, stop_timeout_s: float = STOP_TIMEOUT_S) -> int:
    """`torchrun --standalone --nproc-per-node N -m MODULE ARGV` as a child job; returns its exit code.

    The job runs in a process group of its own, and a SIGTERM or SIGINT to this process is passed
    on to torchrun (which passes it on to the ranks and waits for them). If the job has not ended
    `stop_timeout_s` after that, its whole group is killed: the ranks never outlive this process.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", module, *argv]  # fmt: skip
    job = subprocess.Popen(command, start_new_session=True)
    stopping = threading.Event()

    def forward(signum, _frame) -> None:
        stopping.set()
        with contextlib.suppress(ProcessLookupError):
            os.kill(job.pid, signum)

    handlers = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            try:
                return job.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                if stopping.is_set():
                    break
        try:
            return job.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            return -signal.SIGKILL  # killed below
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if job.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def run_train_args(args: argparse.Namespace) -> int:
    """`run_train` from the namespace `add_train_arguments` parsed."""
    return run_train(args.config, nproc=args.nproc, overrides=args.overrides, log_level=args.log_level)
