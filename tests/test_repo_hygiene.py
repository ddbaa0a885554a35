"""The repository's hygiene gate (scripts/lint.sh, a CI step) refuses what it exists to refuse: the
large-file guard fails on a tracked file over its limit and names it, and passes on this tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GUARD = REPO / "scripts" / "check_file_sizes.py"


def git(cwd: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True, capture_output=True
    )


def test_the_large_file_guard_refuses_a_tracked_binary_and_names_it(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(GUARD, tmp_path / "scripts" / GUARD.name)
    (tmp_path / "small.txt").write_text("fine\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    ok = subprocess.run([sys.executable, f"scripts/{GUARD.name}"], cwd=tmp_path, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    (tmp_path / "model.whl").write_bytes(b"\0" * 600_000)
    git(tmp_path, "add", "model.whl")
    refused = subprocess.run([sys.executable, f"scripts/{GUARD.name}"], cwd=tmp_path, capture_output=True, text=True)
    assert refused.returncode == 1 and "model.whl: 0.6 MB" in refused.stderr, refused.stderr


def test_this_tree_passes_the_large_file_guard():
    result = subprocess.run([sys.executable, str(GUARD)], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
