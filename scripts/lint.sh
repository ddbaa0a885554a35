#!/usr/bin/env bash
# The repository's hygiene gate (a CI step): `ruff check` and `ruff format --check` with the ruff
# pinned in pyproject.toml's dev extra, and the large-file guard. Ruff goes into a venv of its own
# (.venv-lint, seconds), so the gate needs neither torch nor .venv and runs before they exist.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
pin=$("$python" - <<'PY'
import re, tomllib
dev = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["dev"]
print(next(d for d in dev if re.match(r"ruff\s*==", d)).replace(" ", ""))
PY
)
[ -x .venv-lint/bin/python ] || "$python" -m venv .venv-lint
if [ "$(.venv-lint/bin/ruff --version 2>/dev/null | awk '{print "ruff==" $2}')" != "$pin" ]; then
  .venv-lint/bin/python -m pip --disable-pip-version-check -q install "$pin"
fi
.venv-lint/bin/ruff check .
.venv-lint/bin/ruff format --check .
"$python" scripts/check_file_sizes.py
