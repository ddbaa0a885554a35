"""logs: one way to configure logging for every weightsync process, as text or as JSON lines.

`configure_logging(level, fmt, **context)` is called once per process (the CLI, each trainer rank,
the training server, an agent); every record then carries the context given (rank, region, agent)
so that lines from many processes can be told apart. `fmt="json"` writes one JSON object per line
(`ts`, `level`, `logger`, `message`, the context, and `exc` with the traceback when there is
one), what log shippers (Loki, CloudWatch, Datadog) ingest without parsing. Processes that a
command starts (torchrun ranks, an engine) inherit the choice through WEIGHTSYNC_LOG_FORMAT.

Not here: metrics (`metrics.py`).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys

LOG_FORMATS = ("text", "json")
LOG_FORMAT_ENV = "WEIGHTSYNC_LOG_FORMAT"


class JsonFormatter(logging.Formatter):
    def __init__(self, context: dict[str, object]) -> None:
        super().__init__()
        self.context = context

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **self.context,
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def log_format_from_env(default: str = "text") -> str:
    fmt = os.environ.get(LOG_FORMAT_ENV, default)
    if fmt not in LOG_FORMATS:
        raise ValueError(f"{LOG_FORMAT_ENV}={fmt!r}: use one of {list(LOG_FORMATS)}")
    return fmt


class _StderrHandler(logging.StreamHandler):
    """Writes to `sys.stderr` as it is at each record, not as it was when configured (as logging's
    own last-resort handler does): a host that swaps sys.stderr for a while (pytest's capture, an
    in-process call of the CLI) leaves no handler writing to a stream that has since closed."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler's __init__ and setStream assign it
        pass


def configure_logging(level: int | str = logging.INFO, fmt: str | None = None, **context: object) -> None:
    """Configures the root logger for this process (replacing what an earlier call set up), and
    exports the format for the processes it starts. `fmt` None: WEIGHTSYNC_LOG_FORMAT, else text."""
    fmt = log_format_from_env() if fmt is None else fmt
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: use one of {list(LOG_FORMATS)}")
    os.environ[LOG_FORMAT_ENV] = fmt
    handler = _StderrHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter({k: v for k, v in context.items() if v is not None}))
    else:
        where = " ".join(f"[{k}{v}]" if k == "rank" else f"[{v}]" for k, v in context.items() if v is not None)
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s {where + ' ' if where else ''}%(name)s %(levelname)s: %(message)s")
        )
    # Replace the handler an earlier call installed, and only that one: a host process's own
    # handlers (pytest's capture, an application's) stay.
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "weightsync", False)]:
        root.removeHandler(old)
    handler.weightsync = True
    root.addHandler(handler)
    root.setLevel(level)
