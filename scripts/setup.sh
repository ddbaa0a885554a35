#!/usr/bin/env bash
# Creates .venv (if missing) and installs weightsync into it with the given extras.
# torch is pinned to the CPU build first so that weightsync's `torch>=2.7` never pulls a CUDA
# build; set WEIGHTSYNC_TORCH to install another (e.g. "torch==2.13.0" on a GPU box with CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
source scripts/install.sh  # install: uv, or pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  install .venv/bin/python "${WEIGHTSYNC_TORCH:-torch==2.13.0}"
fi
if [ -n "$extras" ]; then
  install .venv/bin/python -e ".[$extras]"
else
  install .venv/bin/python -e .
fi
