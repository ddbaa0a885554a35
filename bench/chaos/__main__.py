"""The chaos command line: `python -m bench.chaos --rounds N [--seed S] [--store local|s3|both]`
prints one JSON record (the machine, each store's summary) and exits 1 on any violation;
`python -m bench.chaos publisher --spec FILE` is the publisher process a run starts.

Not here: the run itself (run.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from bench.chaos import __doc__ as CHAOS_DOC
from bench.chaos.config import REPO, SWAP_POLICIES, ChaosConfig
from harness.machine import describe_machine


def _machine() -> dict:
    """The machine (harness.describe_machine), its load, and which code ran (checkout and changes)."""
    import weightsync

    def git(*args: str) -> str:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            return subprocess.run(
                ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30, check=False
            ).stdout.strip()
        return ""

    return {
        **describe_machine(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        # Where the code came from, without this machine's paths: git_head names the checkout.
        "code": "checkout" if (Path(weightsync.__file__).resolve().parent.parent / ".git").exists() else "installed",
        "git_head": git("rev-parse", "--short", "HEAD"),
        "git_modified": git("status", "--short", "--untracked-files=no").splitlines(),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["publisher"]:
        from bench.chaos.publisher import publisher_main

        parser = argparse.ArgumentParser(prog="python -m bench.chaos publisher")
        parser.add_argument("--spec", required=True)
        return publisher_main(parser.parse_args(argv[1:]).spec)
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=CHAOS_DOC.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--store", choices=["local", "s3", "both"], default="local")
    parser.add_argument("--versions-per-round", type=int, default=3)
    parser.add_argument("--convergence-bound-s", type=float, default=60.0)
    parser.add_argument("--fault-scale", type=float, default=1.0, help="multiplies every fault's probability")
    parser.add_argument(
        "--swap-policy",
        choices=[*SWAP_POLICIES, "mixed"],
        default="drain",
        help="every agent's swap policy (docs/agents.md); mixed: all three in one cluster, one "
        "per agent (bench/chaos/config.py, MIXED_POLICIES)",
    )
    parser.add_argument("--workdir", help="where processes keep caches and logs (default: a temp dir)")
    parser.add_argument("--keep-workdir", action="store_true", help="keep logs and caches (kept anyway on violations)")
    args = parser.parse_args(argv)

    def stop(signum, frame):  # SIGTERM (and SIGINT, which background shells ignore): clean up, then exit
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    from bench.chaos.run import run_chaos

    machine = _machine()
    results = {}
    for store in ["local", "s3"] if args.store == "both" else [args.store]:
        config = ChaosConfig(
            rounds=args.rounds,
            seed=args.seed,
            store=store,
            versions_per_round=args.versions_per_round,
            convergence_bound_s=args.convergence_bound_s,
            fault_scale=args.fault_scale,
            keep_workdir=args.keep_workdir,
            swap_policy=args.swap_policy,
            workdir=None if args.workdir is None else str(Path(args.workdir) / store),
        )
        results[store] = run_chaos(config)
    machine["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    record = {
        "bench": "chaos",
        "command": "python -m bench.chaos " + " ".join(argv),
        "machine": machine,
        "violations": sum(r["violations"] for r in results.values()),
        "results": results,
    }
    print(json.dumps(record, indent=1))
    return 1 if record["violations"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
