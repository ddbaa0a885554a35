#!/usr/bin/env bash
# The repository's hygiene gate (a CI step): `ruff check` and `ruff format --check` with the ruff
# pinned in pyproject.toml's dev extra, and the large-file guard. Installs that ruff into .venv if
# it is not there.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
pin=$(.venv/bin/python - <<'PY'
import re, tomllib
dev = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["dev"]
print(next(d for d in dev if re.match(r"ruff\s*==", d)).replace(" ", ""))
PY
)
if [ "$(.venv/bin/ruff --version 2>/dev/null | awk '{print "ruff==" $2}')" != "$pin" ]; then
  .venv/bin/python -m pip --disable-pip-version-check -q install "$pin"
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python scripts/check_file_sizes.py
