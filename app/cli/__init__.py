"""cli: the `weightsync` command — publish, pull, ls, verify, gc, agent, status, keygen, train, demo,
serve-training.

Thin: each subcommand parses its flags, calls the library, and prints either a human summary
or (with --json) one JSON document on stdout. Exit codes: 0 on success; 1 when the command ran and
failed (one line `weightsync: error: ...` on stderr); 2 for a setting to fix (argparse's usage
errors, ConfigError: a bad flag, config file or store URI). Heavy modules (torch, numpy) are
imported inside the handlers, so `--help` is instant.

The subcommands live in one module per group: `versions.py` (publish, pull, ls, verify, gc),
`agent.py` (agent, status, keygen), `jobs.py` (train, demo, serve-training); `common.py` holds what
they share. Adding a subcommand: write its handler and its parser in its group's module and list
the parser in that module's `add_parsers`.

Not here: anything a command does (the library, the agent, the trainer, the demo).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from weightsync.app.cli import agent, jobs, versions
from weightsync.app.cli.common import Failed

log = logging.getLogger("weightsync.app.cli")


def build_parser() -> argparse.ArgumentParser:
    from weightsync import __version__

    parser = argparse.ArgumentParser(
        prog="weightsync",
        description="Lossless, chunked, verified weight deltas from an RL trainer to inference servers.",
    )
    parser.add_argument("--version", action="version", version=f"weightsync {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (versions, agent, jobs):
        group.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from weightsync.logs import configure_logging

    args = build_parser().parse_args(argv)
    configure_logging(logging.INFO if args.verbose else logging.WARNING, getattr(args, "log_format", None))
    from weightsync.errors import ConfigError, WeightsyncError

    try:
        row, code = args.handler(args), 0
    except Failed as e:
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
