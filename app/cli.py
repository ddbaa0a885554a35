"""cli: the `weightsync` command — publish, pull, ls, verify, gc, agent, status, keygen, train, demo,
serve-training.

Thin: each subcommand parses its flags, calls the library, and prints either a human summary
or (with --json) one JSON document on stdout. Exit code 0 only on success; errors print one line
`weightsync: error: ...` on stderr and exit 1; usage errors (argparse's) and unusable config
files (ConfigError) exit 2. Heavy modules (torch, numpy) are imported inside the handlers, so
`--help` is instant.

Adding a subcommand: write `_cmd_NAME(args) -> dict` and its `_add_NAME(subparsers)`, and list
the latter in `_SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

# Light (standard library only: no torch, no boto3, so --help stays instant): the registries'
# names and the swap policies, for choices and help.
from weightsync.agents.engines import engine_types
from weightsync.agents.engines.swap_policy import SwapPolicy
from weightsync.app.demo.run import DEMO_ENGINES
from weightsync.stores import store_uri_forms

log = logging.getLogger("weightsync.app.cli")


# ------------------------------------------------------------------------------ utilities


class _Progress:
    """A tqdm bar on stderr over bytes, or nothing when stderr is not a terminal or with --json."""

    def __init__(self, args: argparse.Namespace, total: int | None, desc: str) -> None:
        self._bar = None
        if not args.json and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, leave=False)

    def __call__(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _model(args: argparse.Namespace) -> str:
    """--model, checked before anything is read or written: a bad name is a usage error (exit 2)."""
    from weightsync.errors import ConfigError, FormatError
    from weightsync.format.layout import check_model_name

    try:
        return check_model_name(args.model)
    except FormatError as e:
        raise ConfigError(f"--model: {e}") from None


def _store(args: argparse.Namespace):
    from weightsync.stores import open_store

    if getattr(args, "endpoint_url", None) and str(args.store).startswith("s3://"):
        return open_store(args.store, endpoint_url=args.endpoint_url)
    return open_store(args.store)


def _manifest_row(manifest) -> dict[str, Any]:
    """One version as `ls`, `publish` and `--json` show it. `ratio` is the one compression ratio
    weightsync reports: the model's bytes over what the version adds to the store (its chunk
    objects and its manifest)."""
    raw, stored, manifest_bytes = manifest.raw_bytes, manifest.stored_bytes, len(manifest.to_bytes())
    return {
        "version": manifest.version,
        "kind": manifest.kind,
        "parent": manifest.parent,
        "base": manifest.base,
        "step": manifest.step,
        "created": datetime.datetime.fromtimestamp(manifest.created_unix_ms / 1000, datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "raw_bytes": raw,
        "stored_bytes": stored,
        "manifest_bytes": manifest_bytes,
        "ratio": raw / (stored + manifest_bytes),
        "tensors": len(manifest.tensors),
        "digest": manifest.digest,
    }


def _size(n: int | None) -> str:
    """Bytes in the unit that shows them: 512 B, 28.6 kB, 1.2 MB, 3.4 GB (powers of 1000)."""
    if n is None:
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------------------- subcommands


def _cmd_publish(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.checkpoint_io import checkpoint_dtypes
    from weightsync.format.codecs.warmup import on_first_kernel_compile
    from weightsync.publisher import PublisherConfig, publish_once
    from weightsync.transport.signing import Signer

    _model(args)
    store = _store(args)
    checkpoint = _open_checkpoint(args.checkpoint)
    signer = Signer.from_pem(args.signing_key) if args.signing_key else None
    config_kwargs: dict[str, Any] = {
        "chunk_bytes": int(args.chunk_mib * 2**20),
        "zstd_level": args.zstd_level,
        # A one-shot command never waits to compile kernels it may not need (a delta compiles
        # what it needs, and says so).
        "warm_up_kernels": False,
    }
    if args.keep_dtypes:
        config_kwargs["cast_floats_to"] = None
    if args.workers:
        config_kwargs["workers"] = args.workers
    if args.manifest_format is not None or args.highest_codec is not None:  # for older readers
        from weightsync.format.codecs import CODEC_IDS
        from weightsync.format.write_format import WriteFormat

        limits: dict[str, int] = {}
        if args.manifest_format is not None:
            limits["manifest_format"] = args.manifest_format
        if args.highest_codec is not None:
            limits["highest_codec"] = CODEC_IDS[args.highest_codec]
        config_kwargs["write_format"] = WriteFormat(**limits)
    config = PublisherConfig(**config_kwargs)
    _note_dtype_cast(checkpoint_dtypes(checkpoint), config.cast_floats_to)
    _warn_if_step_does_not_advance(store, args.model, args.step)
    progress = _Progress(args, None, f"publish {args.model}")  # bytes after the bf16 cast: unknown up front
    try:
        with on_first_kernel_compile(_say_kernels_compile):  # a delta on a machine without them
            result = publish_once(
                store, checkpoint, model=args.model, step=args.step, config=config, signer=signer, progress=progress
            )
    finally:
        progress.close()
    model_files = _store_model_files(store, args.model, args.checkpoint)
    row = _manifest_row(result.manifest)
    row.update(
        model=args.model,
        model_files=sorted(model_files),
        changed_elements=result.changed_elements,
        total_elements=result.total_elements,
        seconds=result.total_s,
        full_reason=result.full_reason,
        signed_by=None if signer is None else signer.key_id,
    )
    if not args.json:
        what = f"delta on v{row['parent']}" if row["parent"] is not None else f"full: {result.full_reason}"
        print(
            f"published {args.model} v{row['version']} ({what}): {_size(row['raw_bytes'])} -> "
            f"{_size(row['stored_bytes'] + row['manifest_bytes'])} ({row['ratio']:.1f}x) in {row['seconds']:.2f} s"
            + ("" if signer is None else f", signed by key {signer.key_id}")
        )
    return row


def _open_checkpoint(paths: list[str]):
    """Safetensors files or HF-style directories, or one torch DCP directory (what FSDP ranks save)."""
    from weightsync.checkpoint_io import is_dcp_checkpoint, open_checkpoint

    if any(is_dcp_checkpoint(p) for p in paths):
        if len(paths) != 1:
            from weightsync.errors import LayoutError

            raise LayoutError("a torch DCP checkpoint is published on its own: give its directory alone")
        from weightsync.trainer.checkpoint import open_dcp_checkpoint

        return open_dcp_checkpoint(paths[0])
    return open_checkpoint(paths)


def _store_model_files(store, model: str, checkpoint_paths: list[str]) -> list[str]:
    """An HF-style directory's config and tokenizer files go to the store beside the weights, so
    that `pull --out` writes a directory an engine loads."""
    from pathlib import Path

    from weightsync.model_files import put_model_files, read_model_files

    files: dict[str, bytes] = {}
    for path in checkpoint_paths:
        if Path(path).is_dir():
            files.update(read_model_files(path))
    put_model_files(store, model, files)
    return sorted(files)


def _note_dtype_cast(dtypes: dict[str, Any], cast_floats_to: str | None) -> None:
    """Says which tensors the publisher casts (fp32 weights are served as bf16 unless kept)."""
    if cast_floats_to is None:
        return
    import torch

    target = getattr(torch, cast_floats_to)
    cast: dict[str, int] = {}
    for dtype in dtypes.values():
        if dtype is not None and dtype.is_floating_point and dtype != target:
            name = str(dtype).removeprefix("torch.")
            cast[name] = cast.get(name, 0) + 1
    if cast:
        which = ", ".join(f"{n} {dtype} tensor{'s' if n > 1 else ''}" for dtype, n in sorted(cast.items()))
        print(
            f"weightsync: casting {which} to {cast_floats_to}, what inference serves "
            "(--keep-dtypes publishes them as they are)",
            file=sys.stderr,
        )


def _say_kernels_compile() -> None:
    print(
        "weightsync: compiling the codec kernels, once per machine (numba caches them; ~15-25 s)...",
        file=sys.stderr,
        flush=True,
    )


def _warn_if_step_does_not_advance(store, model: str, step: int | None) -> None:
    """A --step at or before the latest version's step is almost always a mistake (a resumed
    trainer's old step, a typo): versions are still numbered in publish order, so say so."""
    from weightsync.versions import latest_version, read_manifest

    latest = latest_version(store, model)
    if step is None or latest is None:
        return
    last_step = read_manifest(store, model, latest).step
    if last_step is not None and step <= last_step:
        word = "repeats" if step == last_step else "goes back from"
        print(
            f"weightsync: warning: --step {step} {word} the last published step {last_step} (v{latest}); "
            f"publishing anyway as v{latest + 1}",
            file=sys.stderr,
        )


def _cmd_pull(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.checkpoint_io import write_safetensors
    from weightsync.model_files import get_model_files, read_model_files, refuse_clashes, write_model_files
    from weightsync.reader import Reader
    from weightsync.versions import read_manifest

    _model(args)
    reader = Reader(_store(args), model=args.model, workers=args.workers)
    version = reader.resolve(args.version)
    manifest = read_manifest(reader.store, args.model, version)
    # The engine's files (config, tokenizer): from --template, else as the store keeps them.
    model_files = read_model_files(args.template) if args.template else get_model_files(reader.store, args.model)
    if args.template and "config.json" not in model_files:
        from weightsync.errors import ConfigError

        raise ConfigError(f"--template {args.template} has no config.json: give a model directory (HF layout)")
    refuse_clashes(args.out, model_files)  # before any byte is written
    progress = _Progress(args, manifest.raw_bytes, f"pull v{version}")
    try:
        state = reader.read(version, progress=progress)
    finally:
        progress.close()
    files = write_safetensors(
        state.state_dict(),
        args.out,
        metadata={
            "weightsync_model": args.model,
            "weightsync_version": str(version),
            "weightsync_digest": manifest.digest,
        },
    )
    files += write_model_files(args.out, model_files)
    row = {
        "model": args.model,
        "version": version,
        "digest": manifest.digest,
        "raw_bytes": manifest.raw_bytes,
        "files": [str(f) for f in files],
    }
    if not args.json:
        print(
            f"pulled {args.model} v{version} ({_size(manifest.raw_bytes)}, verified) into {args.out}: "
            f"{', '.join(f.name for f in files)}"
        )
        if "config.json" not in model_files:
            print(
                "weightsync: note: no config.json was published with this model; an engine needs one beside the "
                "weights: pull with --template MODEL_DIR, or publish the model's HF directory",
                file=sys.stderr,
            )
    return row


def _cmd_ls(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.versions import list_models

    store = _store(args)
    if args.model is None:
        models = list_models(store)
        if not args.json:
            print("\n".join(models) if models else f"no models in {store.uri}")
        return {"store": store.uri, "models": models}
    from weightsync.errors import WeightsyncError
    from weightsync.versions import list_versions, read_manifest

    rows = []
    for version in list_versions(store, args.model):
        try:
            rows.append(_manifest_row(read_manifest(store, args.model, version)))
        except WeightsyncError as e:  # one bad manifest must not hide the others
            rows.append({"version": version, "error": f"{type(e).__name__}: {e}"})
    if not args.json:
        if not rows:
            print(f"{args.model} has no versions in {store.uri}")
        else:
            print(
                f"{'version':>7} {'kind':>5} {'parent':>6} {'base':>5} {'step':>7} {'created':>25} "
                f"{'raw':>12} {'stored':>12} {'ratio':>7}  digest"
            )
            for r in rows:
                if "error" in r:
                    print(f"{r['version']:>7} UNREADABLE: {r['error']}")
                    continue
                ratio = "-" if r["ratio"] is None else f"{r['ratio']:.1f}x"
                print(
                    f"{r['version']:>7} {r['kind']:>5} {r['parent'] or '-':>6} {r['base']:>5} "
                    f"{'-' if r['step'] is None else r['step']:>7} {r['created']:>25} {_size(r['raw_bytes']):>12} "
                    f"{_size(r['stored_bytes'] + r['manifest_bytes']):>12} {ratio:>7}  {r['digest'][:12]}"
                )
    return {"store": store.uri, "model": args.model, "versions": rows}


def _cmd_verify(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.errors import VersionNotFound, WeightsyncError
    from weightsync.reader import Reader
    from weightsync.versions import list_versions, read_manifest

    reader = Reader(_store(args), model=args.model, workers=args.workers)
    versions = list_versions(reader.store, args.model) if args.all else [reader.resolve(args.version)]
    if not versions:
        raise VersionNotFound(f"{args.model} has no versions in {args.store}")
    results = []
    for version in versions:
        try:
            progress = _Progress(args, read_manifest(reader.store, args.model, version).raw_bytes, f"verify v{version}")
            try:
                manifest = reader.verify(version, progress=progress)
            finally:
                progress.close()
            results.append({"version": version, "ok": True, "digest": manifest.digest})
        except WeightsyncError as e:
            results.append({"version": version, "ok": False, "error": f"{type(e).__name__}: {e}"})
        if not args.json:
            r = results[-1]
            print(f"v{version}: {'ok' if r['ok'] else 'FAILED: ' + r['error']}")
    failed = [r["version"] for r in results if not r["ok"]]
    row = {"model": args.model, "versions": results, "ok": not failed}
    if failed:
        raise _Failed(row, f"{len(failed)} of {len(results)} versions failed verification: {failed}")
    return row


def _cmd_gc(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.stores.retention import collect_garbage

    plan = collect_garbage(
        _store(args), args.model, keep=args.keep, protect=set(args.protect), grace_s=args.grace_s, dry_run=args.dry_run
    )
    row = {**plan.to_json(), "dry_run": args.dry_run}
    if not args.json:
        verb = "would delete" if args.dry_run else "deleted"
        print(
            f"{verb} versions {list(plan.delete_versions) or 'none'} and {len(plan.delete_objects)} objects "
            f"({_size(plan.delete_bytes)}); kept versions {list(plan.keep_versions)}; "
            f"{plan.young_unreferenced} unreferenced objects younger than the grace period kept"
        )
    return row


def _cmd_demo(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.app.demo import DemoConfig, run_demo

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
    if args.quick:  # what the CI test runs: enough SFT that some samples are right (else no group teaches
        # anything and the trainer waits for rollouts: after 30 steps, reward ~0.03, it sampled ~13
        # groups per group it used; after 60, reward ~0.07, ~3.5), then two GRPO steps
        overrides = {"warmup_steps": 60, "rl_steps": 2, "group_size": 4, "groups_per_step": 2, **overrides}
    summary = run_demo(DemoConfig(**overrides), echo=(lambda _: None) if args.json else print)
    if not summary["all_bit_exact"]:
        raise _Failed(summary, "some agents do not serve the last version bit for bit")
    return summary


def _cmd_agent(args: argparse.Namespace) -> dict[str, Any]:
    config = agent_config(args)
    from weightsync.agents.server import run_agent  # after the config is known good: it imports torch
    from weightsync.logs import configure_logging

    configure_logging(
        logging.INFO if args.verbose else logging.WARNING, args.log_format, agent=config.name, region=config.region
    )

    def ready(server) -> None:
        # One line on stdout as soon as the agent listens: what scripts (and the demo) wait for.
        print(
            json.dumps(
                {
                    "event": "ready",
                    "agent": config.name,
                    "address": server.address,
                    "engine_url": server.engine.url,
                    "metrics_port": server.metrics_port,
                }
            ),
            flush=True,
        )

    run_agent(config, ready=ready)
    return {"agent": config.name, "stopped": True}


def agent_config(args: argparse.Namespace):
    """The AgentConfig `weightsync agent` runs with: --config's file with the flags on top, every
    flag applied or refused with a reason (ConfigError)."""
    from weightsync.agents.config import load_agent_config
    from weightsync.errors import ConfigError

    engine_flags = {flag: (option, getattr(args, dest)) for flag, (dest, option) in _ENGINE_FLAGS.items()}
    if args.config is None and all(value is None for _, value in engine_flags.values()):
        raise ConfigError(
            "weightsync agent needs an engine: give --model-dir DIR (the reference engine serving that HF "
            "directory), --engine TYPE with its settings (e.g. --engine vllm --engine-url http://127.0.0.1:8000), "
            "or --config FILE with an [agent.engine] table"
        )
    return load_agent_config(
        args.config,
        engine_flags=engine_flags,
        model=args.model,
        cache_dir=args.cache_dir,
        name=args.name,
        region=args.region,
        listen=args.listen,
        health_listen=args.health_listen,
        store=args.store,
        peers=tuple(args.peer) or None,
        token_file=args.token_file,
        trusted_keys=tuple(args.trusted_key) or None,
        require_signatures=args.require_signatures or None,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        poll_interval_s=args.poll_interval_s,
        swap_policy=args.swap_policy,
    )


_ENGINE_FLAGS = {  # flag -> (argparse dest, the [agent.engine] option it sets)
    "--engine": ("engine", "type"),
    "--model-dir": ("model_dir", "model_dir"),
    "--engine-port": ("engine_port", "port"),
    "--engine-url": ("engine_url", "url"),
    "--engine-root": ("engine_root", "root"),
    "--template-dir": ("template_dir", "template_dir"),
    "--reload-url": ("reload_url", "reload_url"),
}


def _cmd_status(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.transport.rpc import AgentClient, TlsConfig, read_token
    from weightsync.transport.v1 import sync_pb2

    tls = TlsConfig(ca=args.ca, cert=args.cert, key=args.key, server_name=args.server_name) if args.ca else None
    client = AgentClient(args.agent, tls=tls, token=read_token(token_file=args.token_file))
    try:
        reply = client.status(timeout_s=args.timeout_s, verify=args.verify)
    finally:
        client.close()
    row = _message_json(reply)
    if not reply.HasField("engine_state"):  # an agent from before engine states: its own word for both
        reply.engine_state.state, reply.engine_state.version = sync_pb2.EngineState.SERVING, reply.current_version
        if args.verify:
            same = bool(reply.served_digest) and reply.served_digest == reply.current_digest
            reply.verification.ok, reply.verification.hashed = same, "the bytes the agent serves (an older agent)"
            reply.verification.error = "" if same else f"they hash to {reply.served_digest!r}"
    engine = reply.engine_state
    engine_state = sync_pb2.EngineState.State.Name(engine.state)
    engine_serving = engine.state == sync_pb2.EngineState.SERVING and engine.version == reply.current_version
    if not args.json:
        serving = (
            f"serving {reply.model} v{reply.current_version} [{reply.current_digest[:12]}]"
            if reply.current_version
            else f"serving nothing of {reply.model}"
        )
        engine_says = (
            f"serving v{engine.version}" if engine.state == sync_pb2.EngineState.SERVING else engine_state
        ) + (f" ({engine.reason})" if engine.reason else "")
        print(
            f"agent {reply.agent} ({reply.region}) {serving}, newest known v{reply.target_version}, "
            f"engine {reply.engine}: {engine_says}, peers {list(reply.peers) or '-'}"
        )
        if reply.unhealthy:
            print(f"not healthy: {reply.unhealthy}")
        if args.verify:
            check = reply.verification
            if check.hashed == "nothing":
                print(f"not verified: {check.error}")
            else:
                verdict = f"bit-exact, {reply.served_digest}" if check.ok else f"MISMATCH: {check.error}"
                print(f"verified {check.hashed}: {verdict}")
        if reply.last_error:
            print(f"last error: {reply.last_error}")
        for b in reply.broken:  # never served; retried while an older good version is served
            print(f"broken v{b.version}: {b.failures} failed attempts, next in {b.retry_in_s:.1f}s: {b.error}")
        print(
            f"{'version':>7} {'outcome':>10} {'source':>14} {'pushed':>10} {'fetched':>10} {'total':>8} "
            f"{'pause':>8}  path / error"
        )
        for e in reply.ledger:
            total = e.timings_s.get("since_offer")
            pause = e.timings_s.get("swap_pause")
            print(
                f"{e.version:>7} {e.outcome:>10} {e.source[:14]:>14} {_size(e.bytes_pushed):>10} "
                f"{_size(e.bytes_fetched):>10} {'-' if total is None else f'{total:.3f}s':>8} "
                f"{'-' if pause is None else f'{1000 * pause:.2f}ms':>8}  {e.error or e.path}"
            )
    if args.verify:
        if not reply.current_version:
            raise _Failed(row, f"agent {reply.agent} serves no version of {reply.model}: nothing to verify")
        if not engine_serving:
            raise _Failed(
                row,
                f"the {reply.engine} engine does not serve v{reply.current_version}: {engine_state}"
                + (f" v{engine.version}" if engine.state == sync_pb2.EngineState.SERVING else "")
                + (f" ({engine.reason})" if engine.reason else ""),
            )
        if not reply.verification.ok:
            raise _Failed(row, f"v{reply.current_version} does not verify: {reply.verification.error}")
    return row


def _message_json(message) -> dict[str, Any]:
    """A protobuf message as JSON-ready data with every field present, integers as numbers
    (MessageToDict writes 64-bit integers as strings) and enums by name."""
    from google.protobuf.descriptor import FieldDescriptor
    from google.protobuf.json_format import MessageToDict

    doc = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    int64 = {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }

    def numbers(descriptor, value):
        message_type = descriptor.message_type
        if isinstance(value, dict) and message_type is not None and not message_type.GetOptions().map_entry:
            return fix(message_type, value)
        if descriptor.type in int64 and isinstance(value, str):
            return int(value)
        return value

    def fix(message_type, doc: dict) -> dict:
        for field in message_type.fields:
            if field.name not in doc:
                continue
            value = doc[field.name]
            if isinstance(value, list):  # a repeated field
                doc[field.name] = [numbers(field, v) for v in value]
            else:
                doc[field.name] = numbers(field, value)
        return doc

    return fix(message.DESCRIPTOR, doc)


def _cmd_keygen(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.transport.signing import Signer

    signer = Signer.generate()
    private, public = f"{args.out}.pem", f"{args.out}.pub"
    signer.write(private, public)  # ConfigError (exit 2) for a missing directory or an existing key
    if not args.json:
        print(
            f"wrote {private} (private, mode 600: give it to the publisher) and {public} "
            f"(public: give it to agents as a trusted key); key id {signer.key_id}"
        )
    return {"private_key": private, "public_key": public, "key_id": signer.key_id}


def _cmd_train(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.trainer.launch import run_train_args

    code = run_train_args(args)
    row = {"config": args.config, "exit_code": code}
    if code != 0:
        raise _Failed(row, f"training exited with code {code}")
    return row


def _cmd_serve_training(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.app.training.serve import launch, require_training_extra, to_argv

    require_training_extra()  # before any rank starts

    code = launch(to_argv(args), args.nproc)
    row = {"exit_code": code}
    if code != 0:
        raise _Failed(row, f"the training server exited with code {code}")
    return row


class _Failed(Exception):
    """A subcommand that ran but whose result is a failure (its JSON is still printed)."""

    def __init__(self, row: dict, message: str) -> None:
        super().__init__(message)
        self.row = row


# ------------------------------------------------------------------------------- parsers


def _common(parser: argparse.ArgumentParser, *, store: bool = True, model: bool = True) -> None:
    if store:
        parser.add_argument("--store", required=True, help=f"store URI: {store_uri_forms()}")
        parser.add_argument(
            "--endpoint-url",
            help="S3 endpoint (MinIO, R2, Ceph...); default: boto3's own settings ($AWS_ENDPOINT_URL, profile)",
        )
    if model:
        parser.add_argument("--model", required=True, help="model name, e.g. qwen3-0.6b-grpo or org/name")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")


def _add_publish(sub) -> None:
    p = sub.add_parser(
        "publish",
        help="publish a checkpoint as the next version",
        description="Publish safetensors files, an HF-style directory or a torch DCP checkpoint directory (what "
        "FSDP ranks save) as the model's next version (a delta on the latest version when the layout allows).",
    )
    _common(p)
    p.add_argument(
        "checkpoint", nargs="+", help=".safetensors files, HF-style directories, or one torch DCP checkpoint directory"
    )
    p.add_argument("--step", type=int, help="trainer step recorded in the manifest")
    p.add_argument("--chunk-mib", type=float, default=4.0, help="largest chunk in MiB (default 4)")
    p.add_argument("--zstd-level", type=int, default=1, help="zstd level 1-22 (default 1: fast and small)")
    p.add_argument("--keep-dtypes", action="store_true", help="keep float dtypes instead of casting to bf16")
    p.add_argument("--signing-key", help="Ed25519 private key (PEM, from `weightsync keygen`) to sign the version with")
    p.add_argument("--workers", type=int, help="encode threads (default: CPU count)")
    from weightsync.format.codecs import CODEC_NAMES, CODEC_SPARSE  # the registry only: no numpy

    p.add_argument(
        "--highest-codec",
        choices=[name for codec_id, name in sorted(CODEC_NAMES.items()) if codec_id >= CODEC_SPARSE],
        help="newest codec to write, for older readers: sparse is what every reader decodes (default: all)",
    )
    p.add_argument(
        "--manifest-format",
        type=int,
        help="newest manifest format to write: 1 (no packs, for format-1 readers) or 2 (default)",
    )
    p.set_defaults(handler=_cmd_publish)


def _add_pull(sub) -> None:
    p = sub.add_parser(
        "pull",
        help="rebuild a version and write it as safetensors",
        description="Rebuild a version from its base and deltas, verify every hash, and "
        "write it as safetensors (sharded with an index above 5 GiB) with the files an engine needs to load it.",
    )
    _common(p)
    p.add_argument("--version", type=int, help="version to pull (default: latest)")
    p.add_argument(
        "--out",
        required=True,
        help="output directory: the weights, plus the model's config and tokenizer files (from --template, "
        "else as published from an HF directory); files weightsync did not write are never replaced",
    )
    p.add_argument("--template", help="model directory (HF layout) to copy config.json and the tokenizer from")
    p.add_argument("--workers", type=int, help="read threads (default: CPU count)")
    p.set_defaults(handler=_cmd_pull)


def _add_ls(sub) -> None:
    p = sub.add_parser("ls", help="list models, or the versions of one model")
    _common(p, model=False)  # --model is optional here
    p.add_argument("--model", help="model whose versions to list (default: list models)")
    p.set_defaults(handler=_cmd_ls)


def _add_verify(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="rebuild versions and check every hash",
        description="Rebuild versions and check every chunk and digest; exit 1 if any fails.",
    )
    _common(p)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--version", type=int, help="version to verify (default: latest)")
    which.add_argument("--all", action="store_true", help="verify every version")
    p.add_argument("--workers", type=int, help="read threads (default: CPU count)")
    p.set_defaults(handler=_cmd_verify)


def _add_gc(sub) -> None:
    p = sub.add_parser(
        "gc",
        help="delete old versions and unreferenced chunks",
        description="Keep the newest N versions (and the bases and deltas they need, and any "
        "protected version); delete the rest.",
    )
    _common(p)
    p.add_argument("--keep", type=int, required=True, help="newest versions to keep (>= 1)")
    p.add_argument("--protect", type=int, nargs="*", default=[], help="versions to keep regardless")
    p.add_argument(
        "--grace-s",
        type=float,
        default=3600.0,
        help="never delete unreferenced chunks younger than this (in-flight publishes; default 3600)",
    )
    p.add_argument("--dry-run", action="store_true", help="show what would be deleted, delete nothing")
    p.set_defaults(handler=_cmd_gc)


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
    _common(p, store=False, model=False)
    p.add_argument("--store", help=f"store URI (default: file://OUT_DIR/store); any of {store_uri_forms()}")
    p.add_argument("--out-dir", help=f"working directory, recreated on each run (default {default.out_dir})")
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
    p.add_argument("--quick", action="store_true", help="a few steps of each phase (what CI runs)")
    p.set_defaults(handler=_cmd_demo)


def _add_agent(sub) -> None:
    p = sub.add_parser(
        "agent",
        help="run a sync agent beside an inference engine",
        description="Run a sync agent: receive pushed versions, relay them to peers, fetch what is "
        "missing from the store, verify everything, hot-swap the engine's weights. "
        "Settings come from --config (TOML, [agent] table) and the flags below. "
        "Prints one JSON line when listening; stops gracefully on SIGTERM/SIGINT.",
    )
    _common(p, store=False, model=False)
    p.add_argument("--config", help="agent TOML file (see agents/config.py)")
    p.add_argument("--model", help="model name this agent serves")
    p.add_argument("--cache-dir", help="local cache directory (crash-safe; a restart serves from it)")
    p.add_argument("--store", help=f"store URI to fetch from and poll: {store_uri_forms()}")
    p.add_argument("--listen", help="gRPC host:port (default 127.0.0.1:0)")
    p.add_argument("--health-listen", help="plaintext host:port serving only gRPC health (Kubernetes grpc probes)")
    p.add_argument("--name", help="agent name (default: hostname)")
    p.add_argument("--region", help="region name (default 'default')")
    p.add_argument("--peer", action="append", default=[], help="downstream agent host:port to relay to (repeatable)")
    engine = p.add_argument_group(
        "engine",
        "The inference engine beside the agent. Each flag sets one [agent.engine] option, on top of the "
        "--config file's table; one the engine type lacks is refused. Other options: the --config file "
        "(docs/agents.md, Engines).",
    )
    engine.add_argument(
        "--engine",
        choices=engine_types(),
        help="engine type (default: the --config file's, else reference); must agree with the --config file's",
    )
    engine.add_argument(
        "--model-dir", help="reference: HF-style directory giving the engine its architecture and first weights"
    )
    engine.add_argument("--engine-port", type=int, help="reference: its HTTP port (default: any free port)")
    engine.add_argument("--engine-url", help="vllm, sglang: the server's base URL, e.g. http://127.0.0.1:8000")
    engine.add_argument("--engine-root", help="safetensors_dir, sglang: the directory snapshots are written to")
    engine.add_argument(
        "--template-dir", help="safetensors_dir, sglang: HF directory whose config and tokenizer go into each snapshot"
    )
    engine.add_argument("--reload-url", help="safetensors_dir: the URL that has the server reload a snapshot")
    p.add_argument("--token-file", help="bearer token callers must present (or $WEIGHTSYNC_TOKEN)")
    p.add_argument("--trusted-key", action="append", default=[], help="publisher public key (PEM), repeatable")
    p.add_argument("--require-signatures", action="store_true", help="refuse unsigned versions")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (0: any)")
    p.add_argument(
        "--metrics-host",
        help="address /metrics binds (default 127.0.0.1: this host only; 0.0.0.0 for a Prometheus elsewhere)",
    )
    p.add_argument("--poll-interval-s", type=float, help="how often to check the store for new versions")
    p.add_argument(
        "--swap-policy",
        choices=SwapPolicy.names(),
        help="how requests running at a swap meet the new version (default drain; docs/agents.md)",
    )
    _add_log_format(p)
    p.set_defaults(handler=_cmd_agent)


def _add_status(sub) -> None:
    p = sub.add_parser(
        "status",
        help="show an agent's version, its engine's state, ledger and last error",
        description="Ask a running agent for its current version, what its engine serves (serving, or "
        "empty, paused, unreachable, with the reason), its ledger of recent versions (path, bytes pushed "
        "and fetched, timings) and its last error.",
    )
    _common(p, store=False, model=False)
    p.add_argument("--agent", required=True, help="agent gRPC address host:port")
    p.add_argument("--token-file", help="bearer token file (or $WEIGHTSYNC_TOKEN)")
    p.add_argument("--ca", help="CA certificate (PEM) to verify a TLS agent")
    p.add_argument("--cert", help="client certificate (PEM) for mTLS")
    p.add_argument("--key", help="client key (PEM) for mTLS")
    p.add_argument("--server-name", help="name to check the agent's certificate against")
    p.add_argument("--timeout-s", type=float, default=10.0, help="deadline of the call (default 10)")
    p.add_argument(
        "--verify",
        action="store_true",
        help="have the agent re-hash its copy of the served version against the version's digest and, where "
        "the engine reports a digest of what it holds (vllm, reference), have the engine compare what it holds "
        "with that copy; the output says what was hashed. Exit 1 unless they match and the engine serves "
        "that version (also when nothing is served)",
    )
    p.set_defaults(handler=_cmd_status)


def _add_keygen(sub) -> None:
    p = sub.add_parser("keygen", help="make an Ed25519 key pair for signing manifests")
    _common(p, store=False, model=False)
    p.add_argument("--out", required=True, help="path prefix: writes PREFIX.pem (private) and PREFIX.pub")
    p.set_defaults(handler=_cmd_keygen)


def _add_train(sub) -> None:
    from weightsync.trainer.launch import add_train_arguments

    p = sub.add_parser(
        "train",
        help="run the FSDP2 trainer (publishing in its loop)",
        description="Run the FSDP2 trainer from a TOML config; --nproc N starts N ranks with torchrun on this machine.",
    )
    _common(p, store=False, model=False)
    add_train_arguments(p)
    _add_log_format(p)
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
    _add_log_format(p)
    p.set_defaults(handler=_cmd_serve_training)


_SUBCOMMANDS: list[Callable] = [
    _add_publish,
    _add_pull,
    _add_ls,
    _add_verify,
    _add_gc,
    _add_agent,
    _add_status,
    _add_keygen,
    _add_train,
    _add_demo,
    _add_serve_training,
]


def build_parser() -> argparse.ArgumentParser:
    from weightsync import __version__

    parser = argparse.ArgumentParser(
        prog="weightsync",
        description="Lossless, chunked, verified weight deltas from an RL trainer to inference servers.",
    )
    parser.add_argument("--version", action="version", version=f"weightsync {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def _add_log_format(parser: argparse.ArgumentParser) -> None:
    """For the long-running commands: their logs may go to a log shipper."""
    from weightsync.logs import LOG_FORMATS

    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        help="stderr log lines as text (default) or one JSON object per line (also for the processes it starts)",
    )


def main(argv: list[str] | None = None) -> int:
    from weightsync.logs import configure_logging

    args = build_parser().parse_args(argv)
    configure_logging(logging.INFO if args.verbose else logging.WARNING, getattr(args, "log_format", None))
    from weightsync.errors import ConfigError, WeightsyncError

    try:
        row, code = args.handler(args), 0
    except _Failed as e:
        row, code = e.row, 1
        print(f"weightsync: error: {e}", file=sys.stderr)
    except (WeightsyncError, OSError, ValueError) as e:
        print(f"weightsync: error: {e}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}))
        return 2 if isinstance(e, ConfigError) else 1
    except KeyboardInterrupt:
        print("weightsync: interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(row, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
