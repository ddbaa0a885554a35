"""weightsync/logs.py: one logging setup for every process."""

from __future__ import annotations

import io
import json
import logging
import sys

from weightsync.logs import LOG_FORMAT_ENV, configure_logging


def test_the_handler_follows_sys_stderr_so_a_closed_capture_stream_is_never_written(monkeypatch):
    """An in-process CLI call under a captured stderr used to leave a handler bound to that stream:
    after it closed, every agent thread's log line was a '--- Logging error ---' traceback."""
    monkeypatch.delenv(LOG_FORMAT_ENV, raising=False)  # configure_logging exports it: restored after
    captured = io.StringIO()
    monkeypatch.setattr(sys, "stderr", captured)
    configure_logging(logging.WARNING)
    logging.getLogger("weightsync.test").warning("while captured")
    assert "while captured" in captured.getvalue()
    captured.close()
    later = io.StringIO()
    monkeypatch.setattr(sys, "stderr", later)
    logging.getLogger("weightsync.test").warning("after the capture closed")
    assert "Logging error" not in later.getvalue() and later.getvalue().endswith("after the capture closed\n")


def test_json_lines_carry_the_context(monkeypatch):
    monkeypatch.delenv(LOG_FORMAT_ENV, raising=False)
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    configure_logging(logging.INFO, "json", agent="a1", region="eu")
    logging.getLogger("weightsync.test").info("hello %s", "there")
    record = json.loads(out.getvalue().strip().splitlines()[-1])
    assert (record["message"], record["level"], record["agent"], record["region"]) == (
        "hello there",
        "INFO",
        "a1",
        "eu",
    )
