"""The large-file guard: no tracked file over 500 kB, so a binary (a wheel, a checkpoint, a plot
run) cannot slip into the history, where it would stay forever. A file that must be larger is
named in ALLOWED with the reason.

    python scripts/check_file_sizes.py        # exit 1 and the offenders if any
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

LIMIT_BYTES = 500 * 1000
ALLOWED: dict[str, str] = {}  # path -> why it may be larger


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    too_big = []
    for name in filter(None, listed.decode().split("\0")):
        path = root / name
        if path.is_file() and path.stat().st_size > LIMIT_BYTES and name not in ALLOWED:
            too_big.append(f"  {name}: {path.stat().st_size / 1e6:.1f} MB")
    if too_big:
        print(
            f"files over {LIMIT_BYTES // 1000} kB are tracked (keep binaries out of the repository, or name the file "
            "in scripts/check_file_sizes.py's ALLOWED with the reason):\n" + "\n".join(too_big),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
