"""What every benchmark records about the machine it ran on, and how it writes its results."""

from __future__ import annotations

import json
import logging
import platform
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() is often empty on Linux)."""
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def write_results(base: Path, record: dict, markdown: str, *, indent: int = 2) -> None:
    """`base`.json and `base`.md beside each other, and the record as one JSON line on stdout."""
    base.parent.mkdir(parents=True, exist_ok=True)
    base.with_name(base.name + ".json").write_text(json.dumps(record, indent=indent))
    base.with_name(base.name + ".md").write_text(markdown)
    json.dump(record, sys.stdout)
    sys.stdout.write("\n")
    log.info("wrote %s.{json,md}", base)
