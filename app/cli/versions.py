"""cli.versions: the commands on a store's versions: publish, pull, ls, verify, gc.

Not here: the agent's commands (`agent.py`), the long-running jobs (`jobs.py`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from weightsync.app.cli.common import (
    Failed,
    Progress,
    add_common_flags,
    check_model_flag,
    check_model_in_store,
    format_size,
    manifest_row,
    open_store_flag,
)


def _cmd_publish(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.checkpoint_io import checkpoint_dtypes
    from weightsync.format.codecs.warmup import on_first_kernel_compile
    from weightsync.publisher import PublisherConfig, publish_once
    from weightsync.transport.signing import Signer

    check_model_flag(args)
    store = open_store_flag(args)
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
    model_files = _model_files_of(args.checkpoint)
    progress = Progress(args, None, f"publish {args.model}")  # bytes after the bf16 cast: unknown up front
    try:
        with on_first_kernel_compile(_say_kernels_compile):  # a delta on a machine without them
            result = publish_once(
                store,
                checkpoint,
                model=args.model,
                step=args.step,
                config=config,
                signer=signer,
                progress=progress,
                model_files=model_files,
            )
    finally:
        progress.close()
    row = manifest_row(result.manifest)
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
            f"published {args.model} v{row['version']} ({what}): {format_size(row['raw_bytes'])} -> "
            f"{format_size(row['stored_bytes'] + row['manifest_bytes'])} ({row['ratio']:.1f}x) in {row['seconds']:.2f} s"
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


def _model_files_of(checkpoint_paths: list[str]) -> dict[str, bytes]:
    """An HF-style directory's config and tokenizer files: they travel with the version, so that
    `pull --out` writes a directory an engine loads."""
    from pathlib import Path

    from weightsync.model_files import read_model_files

    files: dict[str, bytes] = {}
    for path in checkpoint_paths:
        if Path(path).is_dir():
            files.update(read_model_files(path))
    return files


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

    check_model_flag(args)
    store = open_store_flag(args, existing=True)
    check_model_in_store(store, args.model)
    reader = Reader(store, model=args.model, workers=args.workers)
    version = reader.resolve(args.version)
    manifest = read_manifest(reader.store, args.model, version)
    # The engine's files (config, tokenizer): from --template, else as the store keeps them.
    model_files = (
        read_model_files(args.template) if args.template else get_model_files(reader.store, args.model, manifest)
    )
    if args.template and "config.json" not in model_files:
        from weightsync.errors import ConfigError

        raise ConfigError(f"--template {args.template} has no config.json: give a model directory (HF layout)")
    refuse_clashes(args.out, model_files)  # before any byte is written
    progress = Progress(args, manifest.raw_bytes, f"pull v{version}")
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
            f"pulled {args.model} v{version} ({format_size(manifest.raw_bytes)}, verified) into {args.out}: "
            f"{', '.join(f.name for f in files)}"
        )
        if "config.json" not in model_files:
            print(
                f"weightsync: note: no config.json was published with v{version}; an engine needs one beside the "
                "weights: pull with --template MODEL_DIR, or publish the model's HF directory",
                file=sys.stderr,
            )
    return row


def _cmd_ls(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.versions import list_models

    store = open_store_flag(args, existing=True)
    if args.model is None:
        models = list_models(store)
        if not args.json:
            print("\n".join(models) if models else f"no models in {store.uri}")
        return {"store": store.uri, "models": models}
    from weightsync.errors import WeightsyncError
    from weightsync.versions import list_versions, read_manifest

    check_model_flag(args)
    check_model_in_store(store, args.model)
    rows = []
    for version in list_versions(store, args.model):
        try:
            rows.append(manifest_row(read_manifest(store, args.model, version)))
        except WeightsyncError as e:  # one bad manifest must not hide the others
            rows.append({"version": version, "error": f"{type(e).__name__}: {e}"})
    if not args.json:
        if rows:
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
                    f"{'-' if r['step'] is None else r['step']:>7} {r['created']:>25} {format_size(r['raw_bytes']):>12} "
                    f"{format_size(r['stored_bytes'] + r['manifest_bytes']):>12} {ratio:>7}  {r['digest'][:12]}"
                )
    return {"store": store.uri, "model": args.model, "versions": rows}


def _cmd_verify(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.errors import WeightsyncError
    from weightsync.reader import Reader
    from weightsync.versions import list_versions, read_manifest

    check_model_flag(args)
    store = open_store_flag(args, existing=True)
    check_model_in_store(store, args.model)
    reader = Reader(store, model=args.model, workers=args.workers)
    versions = list_versions(reader.store, args.model) if args.all else [reader.resolve(args.version)]
    results = []
    for version in versions:
        try:
            progress = Progress(args, read_manifest(reader.store, args.model, version).raw_bytes, f"verify v{version}")
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
        raise Failed(row, f"{len(failed)} of {len(results)} versions failed verification: {failed}")
    return row


def _cmd_gc(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.stores.retention import collect_garbage

    check_model_flag(args)
    store = open_store_flag(args, existing=True)
    check_model_in_store(store, args.model)
    plan = collect_garbage(
        store,
        args.model,
        keep=args.keep,
        protect=set(args.protect),
        grace_s=args.grace_s,
        dry_run=args.dry_run,
    )
    row = {**plan.to_json(), "dry_run": args.dry_run}
    if not args.json:
        verb = "would delete" if args.dry_run else "deleted"
        print(
            f"{verb} versions {list(plan.delete_versions) or 'none'} and {len(plan.delete_objects)} objects "
            f"({format_size(plan.delete_bytes)}); kept versions {list(plan.keep_versions)}; "
            f"{plan.young_unreferenced} unreferenced objects younger than the grace period kept"
        )
    return row


def _add_publish(sub) -> None:
    p = sub.add_parser(
        "publish",
        help="publish a checkpoint as the next version",
        description="Publish safetensors files, an HF-style directory or a torch DCP checkpoint directory (what "
        "FSDP ranks save) as the model's next version (a delta on the latest version when the layout allows).",
    )
    add_common_flags(p)
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
        help="newest manifest format to write: 1 (no packs, for format-1 readers), 2 (packs) or 3 (box chunks, the default)",
    )
    p.set_defaults(handler=_cmd_publish)


def _add_pull(sub) -> None:
    p = sub.add_parser(
        "pull",
        help="rebuild a version and write it as safetensors",
        description="Rebuild a version from its base and deltas, verify every hash, and "
        "write it as safetensors (sharded with an index above 5 GiB) with the files an engine needs to load it.",
    )
    add_common_flags(p)
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
    add_common_flags(p, model=False)  # --model is optional here
    p.add_argument("--model", help="model whose versions to list (default: list models)")
    p.set_defaults(handler=_cmd_ls)


def _add_verify(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="rebuild versions and check every hash",
        description="Rebuild versions and check every chunk and digest; exit 1 if any fails.",
    )
    add_common_flags(p)
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
    add_common_flags(p)
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


def add_parsers(sub) -> None:
    for add in (_add_publish, _add_pull, _add_ls, _add_verify, _add_gc):
        add(sub)
