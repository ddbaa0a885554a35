"""cli.jobs: the long-running jobs: train (the FSDP2 trainer), demo (the whole loop on this
machine) and serve-training (the Tinker-compatible training API).

Not here: what they run (weightsync.trainer, weightsync.app.demo, weightsync.app.training).
"""

from __future__ import annotations

import argparse
from typing import Any

from weightsync.agents.engines.swap_policy import SwapPolicy
from weightsync.app.cli.common import Failed, add_common_flags, add_log_format_flag
from weightsync.app.demo.run import DEMO_ENGINES
from weightsync.stores import store_uri_forms


def demo_config(args: argparse.Namespace):
    """The DemoConfig that `weightsync demo` with these arguments runs."""
    from weightsync.app.demo import DemoConfig

    overrides = {
        k: getattr(args, k)
        for k in (
            "store",
            "out_dir",
            "warmup_steps",
            "rl_steps",
            "max_operand",
            "seed",
            "engine",
            "vllm_python",
            "regions",
            "agents_per_region",
            "swap_policy",
            "rollout_tokens",
        )
        if getattr(args, k) is not None
    }
    if args.inject_parity_fault:
        overrides["inject_parity_fault"] = True
    if args.moe:
        from weightsync.app.demo.run import MOE_ARCHITECTURE

        overrides["architecture"] = dict(MOE_ARCHITECTURE)
    if args.quick:  # what the CI test runs: enough SFT that some samples are right (else no group teaches
        # anything and the trainer waits for rollouts: after 30 steps, reward ~0.03, it sampled ~13
        # groups per group it used; after 60, reward ~0.07, ~3.5), then two GRPO steps
        overrides = {"warmup_steps": 60, "rl_steps": 2, "group_size": 4, "groups_per_step": 2, **overrides}
    return DemoConfig(**overrides)


def _cmd_demo(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.app.demo import run_demo

    summary = run_demo(demo_config(args), echo=(lambda _: None) if args.json else print)
    if not summary["all_bit_exact"]:
        raise Failed(summary, "some agents do not serve the last version bit for bit")
    return summary


def _cmd_train(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.trainer.launch import run_train_args

    code = run_train_args(args)
    row = {"config": args.config, "exit_code": code}
    if code != 0:
        raise Failed(row, f"training exited with code {code}")
    return row


def _cmd_serve_training(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.app.training.serve import launch, require_training_extra, to_argv

    require_training_extra()  # before any rank starts

    code = launch(to_argv(args), args.nproc)
    row = {"exit_code": code}
    if code != 0:
        raise Failed(row, f"the training server exited with code {code}")
    return row


def _add_demo(sub) -> None:
    from weightsync.app.demo.run import DemoConfig  # no torch: --help stays instant

    default = DemoConfig()  # the help states the code's defaults, not a copy of them
    p = sub.add_parser(
        "demo",
        help="run the end-to-end demo on embedded defaults",
        description="Run the asynchronous RL loop on this machine: an FSDP2 trainer (2 ranks) doing an "
        "SFT warm start then GRPO, 2 regions x 2 sync agents with reference inference "
        "servers, and rollout workers; then a table per version, summary.json and "
        "summary.png. Stops everything it started, also on Ctrl-C.",
    )
    add_common_flags(p, store=False, model=False)
    p.add_argument("--store", help=f"store URI (default: file://OUT_DIR/store); any of {store_uri_forms()}")
    p.add_argument(
        "--out-dir",
        help=f"working directory (default {default.out_dir}): made if missing, cleared if a previous demo made it, "
        "refused if it holds anything else",
    )
    p.add_argument("--warmup-steps", type=int, help=f"SFT warm-start steps (default {default.warmup_steps})")
    p.add_argument("--rl-steps", type=int, help=f"GRPO steps (default {default.rl_steps})")
    p.add_argument(
        "--max-operand", type=int, help=f"the task's operands are drawn from [0, N] (default {default.max_operand})"
    )
    p.add_argument("--seed", type=int, help=f"seed of the model, data and sampling (default {default.seed})")
    p.add_argument(
        "--engine",
        choices=DEMO_ENGINES,
        help="inference engine beside each agent: the embedded reference server (default) or a real vLLM "
        "server per agent (needs vLLM: bash scripts/setup_vllm.sh; docs/vllm.md)",
    )
    p.add_argument(
        "--vllm-python",
        help="--engine vllm: interpreter with vLLM and weightsync (default "
        "$WEIGHTSYNC_VLLM_PYTHON, else .venv-vllm/bin/python)",
    )
    p.add_argument("--regions", type=int, help=f"regions (default {default.regions})")
    p.add_argument(
        "--agents-per-region",
        type=int,
        help=f"agents per region (default {default.agents_per_region}; each runs its own engine)",
    )
    p.add_argument(
        "--swap-policy",
        choices=SwapPolicy.names(),
        help=f"every agent's swap policy (default {default.swap_policy}; docs/agents.md); summary.json reports the "
        "staleness of what the trainer learned from",
    )
    p.add_argument(
        "--rollout-tokens",
        type=int,
        help=f"tokens each completion generates (default {default.rollout_tokens}); more: long rollouts that swaps meet",
    )
    p.add_argument(
        "--moe",
        action="store_true",
        help="train and serve a tiny Qwen3-MoE (8 experts, top-2; the default model's active size) "
        "instead of the dense Qwen3",
    )
    p.add_argument(
        "--inject-parity-fault",
        action="store_true",
        help="one agent's engine serves two layers swapped for three GRPO versions (every byte verifies): "
        "its parity probe catches it and, under action refuse, it keeps the newest version that passed "
        "(docs/agents.md, 'Parity probe')",
    )
    p.add_argument("--quick", action="store_true", help="a few steps of each phase (what CI runs)")
    p.set_defaults(handler=_cmd_demo)


def _add_train(sub) -> None:
    from weightsync.trainer.launch import add_train_arguments

    p = sub.add_parser(
        "train",
        help="run the FSDP2 trainer (publishing in its loop)",
        description="Run the FSDP2 trainer from a TOML config; --nproc N starts N ranks with torchrun on this machine.",
    )
    add_common_flags(p, store=False, model=False)
    add_train_arguments(p)
    add_log_format_flag(p)
    p.set_defaults(handler=_cmd_train)


def _add_serve_training(sub) -> None:
    from weightsync.app.training.serve import add_arguments

    p = sub.add_parser(
        "serve-training",
        help="serve the Tinker training API on the FSDP2 trainer",
        description="A training server that the unmodified tinker SDK (0.38) talks to: "
        "tinker.ServiceClient(base_url=URL, api_key=KEY); see docs/training-api.md. "
        "--nproc N starts N ranks with torchrun (default: the profile's ranks, else 1).",
    )
    p.add_argument("--nproc", type=int, default=None, metavar="N", help="ranks on this machine (torchrun)")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout when the server exits")
    p.add_argument("-v", "--verbose", action="store_true")
    add_arguments(p)
    add_log_format_flag(p)
    p.set_defaults(handler=_cmd_serve_training)


def add_parsers(sub) -> None:
    for add in (_add_train, _add_demo, _add_serve_training):
        add(sub)
