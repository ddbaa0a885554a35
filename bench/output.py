"""output: how a benchmark writes its result: JSON and markdown files beside each other, and one JSON
line on stdout.

Not here: what a result records about the machine (harness/machine.py).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def write_results(base: Path, record: dict, markdown: str, *, indent: int = 2) -> None:
    """`base`.json and `base`.md beside each other, and the record as one JSON line on stdout."""
    base.parent.mkdir(parents=True, exist_ok=True)
    base.with_name(base.name + ".json").write_text(json.dumps(record, indent=indent))
    base.with_name(base.name + ".md").write_text(markdown)
    json.dump(record, sys.stdout)
    sys.stdout.write("\n")
    log.info("wrote %s.{json,md}", base)
