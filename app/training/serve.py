"""serve: `weightsync serve-training`, the Tinker-compatible training server, on every rank.

    torchrun --nproc-per-node 2 -m weightsync.app.training.serve --state-dir DIR --port 8000
    weightsync serve-training --state-dir DIR --port 8000          (one rank, no torchrun)

Every rank builds the process group, the mesh and a Worker (the training engines of this rank,
`weightsync.trainer.commands`); rank 0 also serves HTTP and sends each request to all ranks as a
command; the others follow until rank 0 stops. When ready, rank
0 prints one JSON line `{"event": "ready", "url": ...}` on stdout (with `--port 0` it names the
port the OS chose). SIGTERM / SIGINT stop it cleanly.

The API key comes from `--api-key` or WEIGHTSYNC_TRAINING_API_KEY; the SDK only sends keys
that start with `tml-`.

Not here: the routes (http.py, service.py), the commands and the engine they run on
(`weightsync.trainer.commands`, `weightsync.trainer.engine`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence

log = logging.getLogger(__name__)

API_KEY_ENV = "WEIGHTSYNC_TRAINING_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from weightsync.stores import store_uri_forms

    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free port; the ready line names it)")
    parser.add_argument("--api-key", default=None, help=f"the key clients must send (default: ${API_KEY_ENV})")
    parser.add_argument("--state-dir", required=True, help="checkpoints and run descriptions (kept across restarts)")
    parser.add_argument(
        "--store",
        default=None,
        help=f"where save_weights_for_sampler publishes: {store_uri_forms()} (default file://<state-dir>/store)",
    )
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="DIR",
        help="any local HF model directory (config.json + safetensors; a tokenizer for sampling) to advertise "
        "in get_server_capabilities (repeatable); clients may pass any such directory as base_model",
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="NAME[@VERSION]",
        help="a training profile (app/training/profiles): fixes the model, layout, precision, offload "
        "and checkpointing, and lets clients pass its name as base_model",
    )
    parser.add_argument("--profile-model-dir", default=None, help="the profile's weights (overrides its model_dir)")
    parser.add_argument(
        "--sampler-engine",
        choices=("reference", "vllm"),
        default=None,
        help="what sampling clients of saved weights run on (default: the profile's, else reference)",
    )
    parser.add_argument(
        "--sampler-weights",
        choices=("merged", "adapter"),
        default=None,
        help="what a LoRA run's sampling clients run on: merged weights (default: the profile's, "
        "else merged) or adapter-only versions, which vLLM serves as a LoRA adapter (--sampler-"
        "engine vllm; start vLLM with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
    )
    parser.add_argument(
        "--vllm-url",
        default=None,
        metavar="URL",
        help="the vLLM server for --sampler-engine vllm (weightsync's worker extension, "
        "VLLM_SERVER_DEV_MODE=1, --enable-scale-out; docs/training-api.md)",
    )
    parser.add_argument(
        "--cpu-offload", action="store_true", help="FSDP2 CPU offload of parameters, gradients and optimizer state"
    )
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="recompute each decoder layer in backward"
    )
    parser.add_argument("--mixed-precision", choices=("none", "bf16"), default="none")
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor parallelism of dense models: each attention and MLP weight split over this many ranks "
        "(the ranks must be a multiple of it; the rest is FSDP2)",
    )
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert parallelism of Mixture-of-Experts models: the experts partitioned over this many ranks "
        "(the ranks must be a multiple of it)",
    )
    parser.add_argument(
        "--frozen-experts",
        default=None,
        metavar="FORMAT",
        help="Mixture-of-Experts models: hold the routed experts frozen in FORMAT (int4, int4:GROUP, "
        "int8 or bf16; weightsync.models.packed), dequantized on the fly, so a LoRA run fits a large "
        "MoE; full fine-tuning then trains all but the experts (default: experts are fp32 master "
        "weights that train like the rest)",
    )
    parser.add_argument("--long-poll-s", type=float, default=10.0, help="how long retrieve_future waits")
    parser.add_argument(
        "--gap-timeout-s",
        type=float,
        default=120.0,
        help="how long a request waits for a missing earlier seq_id before it fails",
    )
    parser.add_argument(
        "--session-timeout-s",
        type=float,
        default=600.0,
        help="a session with no heartbeat or request for this long is finished and its models "
        "unloaded (the SDK beats every 10 s)",
    )
    parser.add_argument("--max-body-mib", type=float, default=64.0, help="largest request body accepted")
    parser.add_argument(
        "--fwdbwd-max-chunk-len",
        type=int,
        default=1024,
        help="datums per forward_backward request the SDK is told to send (it splits larger calls "
        "into chunks sent in parallel)",
    )
    parser.add_argument("--log-level", default="INFO")


def require_training_extra() -> None:
    """The server reads the wire schema from the tinker SDK's wheel: without it, refuse to start
    (a server that says ready and then fails every forward_backward with HTTP 500, while the SDK
    retries for minutes, is worse)."""
    from weightsync.errors import ConfigError

    try:
        import tinker.proto.tinker_public_pb2  # noqa: F401 -- the schema itself, not just the package
    except ImportError:
        raise ConfigError(
            "serve-training needs the tinker SDK's wire schema, which is not installed: "
            "pip install 'weightsync[training]'"
        ) from None


def run(args: argparse.Namespace) -> int:
    from weightsync.trainer.commands import Worker, follow
    from weightsync.trainer.config import ParallelConfig
    from weightsync.trainer.parallel import build_mesh, close_runtime, init_runtime

    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    if not api_key:
        raise SystemExit(f"serve-training needs an API key: --api-key or ${API_KEY_ENV}")
    if "RANK" not in os.environ:  # a world of one: pick a free rendezvous port, never a fixed one
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    profile = None
    if args.profile:
        from weightsync.app.training.profiles import resolve_profile

        profile = resolve_profile(args.profile, model_dir=args.profile_model_dir)
        args.cpu_offload, args.activation_checkpointing = profile.cpu_offload, profile.activation_checkpointing
        args.mixed_precision, args.frozen_experts = profile.mixed_precision, profile.frozen_experts
        args.tp, args.ep = profile.tp, profile.ep
        args.sampler_engine = args.sampler_engine or profile.sampler_engine
        args.vllm_url = args.vllm_url or profile.sampler_url
        args.sampler_weights = args.sampler_weights or profile.sampler_weights
    args.sampler_engine = args.sampler_engine or "reference"
    args.sampler_weights = args.sampler_weights or "merged"
    if args.sampler_weights == "adapter" and args.sampler_engine != "vllm":
        raise SystemExit(
            "--sampler-weights adapter needs --sampler-engine vllm: the reference engine serves merged weights"
        )
    if args.sampler_engine == "vllm" and not args.vllm_url:  # every rank stops here, before the process group
        raise SystemExit(
            "sampler engine vllm needs the vLLM server's URL: --vllm-url URL (or the profile's [sampler] url)"
        )
    if args.frozen_experts is not None:  # every rank stops here, before the process group
        from weightsync.models.packed import PackFormat

        try:
            PackFormat.parse(args.frozen_experts)
        except ValueError as e:
            raise SystemExit(f"--frozen-experts: {e}") from None
    try:
        parallel = ParallelConfig(
            cpu_offload=args.cpu_offload,
            activation_checkpointing=args.activation_checkpointing,
            mixed_precision=args.mixed_precision,
            frozen_experts=args.frozen_experts,
            tp=args.tp,
            ep=args.ep,
        )
    except ValueError as e:  # every rank stops here, before the process group
        raise SystemExit(str(e)) from None
    runtime = init_runtime(parallel)
    mesh = build_mesh(parallel, runtime)
    worker = Worker(runtime, mesh, parallel)
    try:
        if runtime.rank != 0:
            # Followers stop when rank 0 says so (after it has finished the request in flight); a
            # SIGTERM to the whole job must not take a follower away in the middle of a collective.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            follow(worker)
            return 0
        return _serve(args, api_key, worker, profile)
    finally:
        close_runtime(runtime)


def _serve(args: argparse.Namespace, api_key: str, worker, profile) -> int:
    from weightsync.app.training.http import TrainingHTTPServer
    from weightsync.app.training.service import ServiceConfig, TrainingService
    from weightsync.trainer.commands import Commander

    aliases: tuple[tuple[str, str], ...] = ()
    if profile is not None:
        # The directory is written by rank 0 before any rank reads it: no model exists before
        # the first create_model, which reaches the other ranks after this.
        directory = profile.materialise(os.path.join(args.state_dir, "profiles"))
        aliases = ((profile.name, directory), (profile.key, directory))
        log.info("profile %s: %s", profile.key, profile.description)
    config = ServiceConfig(
        state_dir=args.state_dir,
        long_poll_s=args.long_poll_s,
        gap_timeout_s=args.gap_timeout_s,
        session_timeout_s=args.session_timeout_s,
        known_models=tuple(args.model),
        store=args.store,
        model_aliases=aliases,
        sampler_engine=args.sampler_engine,
        vllm_url=args.vllm_url,
        sampler_weights=args.sampler_weights,
        frozen_experts=args.frozen_experts,
    )
    service = TrainingService(config, Commander(worker))
    server = TrainingHTTPServer(
        (args.host, args.port),
        service,
        api_key=api_key,
        max_body_bytes=int(args.max_body_mib * 1024 * 1024),
        fwdbwd_max_chunk_len=args.fwdbwd_max_chunk_len,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.serve_in_thread("training-http")
    print(
        json.dumps(
            {
                "event": "ready",
                "url": server.url,
                "world_size": worker.world_size,
                "profile": profile.key if profile else None,
            }
        ),
        flush=True,
    )
    while not stop.wait(1.0):  # timed: a signal another thread takes wakes no untimed wait (agents/server.py)
        pass
    log.info("stopping")
    server.shutdown()
    service.close()
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: Sequence[str], nproc: int | None) -> int:
    """`weightsync serve-training`: this process (one rank) or `torchrun --nproc-per-node N` of
    it; N defaults to the profile's ranks. Returns the exit code."""
    argv = list(argv)
    args = _parser().parse_args(argv)
    if args.profile:  # here, before any rank starts: a bad profile is one error line (exit 2), not one per rank
        from weightsync.app.training.errors import NotFound
        from weightsync.app.training.profiles import resolve_profile
        from weightsync.errors import ConfigError

        try:
            ranks = resolve_profile(args.profile).ranks
        except NotFound as e:
            raise ConfigError(f"--profile {args.profile}: {e.args[0]}") from None
        nproc = ranks if nproc is None else nproc
    if nproc is None or nproc == 1 or "LOCAL_RANK" in os.environ:
        return main(argv)
    from weightsync.trainer.launch import run_torchrun

    return run_torchrun(nproc, "weightsync.app.training.serve", argv)


def to_argv(args: argparse.Namespace) -> list[str]:
    """The server's command line for a namespace that `add_arguments` parsed (to hand to torchrun)."""
    argv: list[str] = []
    for action in _parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            argv += [flag] if value else []
        elif isinstance(action, argparse._AppendAction):
            for item in value or ():
                argv += [flag, str(item)]
        elif value is not None and value != action.default:
            argv += [flag, str(value)]
    return argv


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m weightsync.app.training.serve", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from weightsync.errors import ConfigError

    args = _parser().parse_args(argv)
    _configure_logging(args.log_level)
    try:
        require_training_extra()
    except ConfigError as e:
        print(f"weightsync: error: {e}", file=sys.stderr)
        return 2
    return run(args)


def _configure_logging(level: str) -> None:
    from weightsync.logs import configure_logging

    configure_logging(level, rank=int(os.environ.get("RANK", "0")))


if __name__ == "__main__":
    from weightsync.trainer.parallel import exit_worker

    exit_worker(main())  # without finalization: see exit_worker; an exception still ends it the usual way
