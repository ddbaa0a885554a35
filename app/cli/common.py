"""cli.common: what every subcommand shares: the common flags, the store and model flags'
checks, sizes as people read them, one row per version, a progress bar, and the failure that
still prints its JSON.

Not here: the subcommands (`versions.py`, `agent.py`, `jobs.py`), the entry point (`__init__.py`).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from typing import Any

from weightsync.stores import store_uri_forms  # no torch, no boto3: --help stays instant


class Progress:
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


def check_model_flag(args: argparse.Namespace) -> str:
    """--model, checked before anything is read or written: a bad name is a usage error (exit 2)."""
    from weightsync.errors import ConfigError, FormatError
    from weightsync.format.layout import check_model_name

    try:
        return check_model_name(args.model)
    except FormatError as e:
        raise ConfigError(f"--model: {e}") from None


def open_store_flag(args: argparse.Namespace, *, existing: bool = False):
    """The store --store names. `existing`: for a command that reads, a directory that does not
    exist is a --store to fix (exit 2), not a store that holds nothing."""
    from weightsync.errors import ConfigError
    from weightsync.stores import LocalStore, open_store

    if getattr(args, "endpoint_url", None) and str(args.store).startswith("s3://"):
        store = open_store(args.store, endpoint_url=args.endpoint_url)
    else:
        store = open_store(args.store)
    if existing and isinstance(store, LocalStore) and not store.root.is_dir():
        raise ConfigError(
            f"--store {args.store}: {store.root} is not a directory, so it holds no store; check the path "
            "(a store directory is made by its first publish: weightsync publish, or the trainer's train.publish.store)"
        )
    return store


def check_model_in_store(store, model: str) -> None:
    """A --model the store has no versions of is a flag to fix (exit 2), naming the models the
    store holds: a mistyped name must not read as a model with no versions yet."""
    import difflib

    from weightsync.errors import ConfigError
    from weightsync.versions import latest_version, list_models

    if latest_version(store, model) is not None:
        return
    models = list_models(store)
    if not models:
        raise ConfigError(f"--model {model}: the store {store.uri} holds no models yet (is --store the right one?)")
    close = difflib.get_close_matches(model, models, n=1)
    shown = ", ".join(models[:10]) + (f" and {len(models) - 10} more" if len(models) > 10 else "")
    raise ConfigError(
        f"--model {model}: the store {store.uri} has no versions of {model!r}"
        + (f"; did you mean {close[0]!r}?" if close else ";")
        + f" it holds {shown}"
    )


def manifest_row(manifest) -> dict[str, Any]:
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


def format_size(n: int | None) -> str:
    """Bytes in the unit that shows them: 512 B, 28.6 kB, 1.2 MB, 3.4 GB (powers of 1000)."""
    if n is None:
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


class Failed(Exception):
    """A subcommand that ran but whose result is a failure (its JSON is still printed)."""

    def __init__(self, row: dict, message: str) -> None:
        super().__init__(message)
        self.row = row


def add_common_flags(parser: argparse.ArgumentParser, *, store: bool = True, model: bool = True) -> None:
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


def add_log_format_flag(parser: argparse.ArgumentParser) -> None:
    """For the long-running commands: their logs may go to a log shipper."""
    from weightsync.logs import LOG_FORMATS

    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        help="stderr log lines as text (default) or one JSON object per line (also for the processes it starts)",
    )
