#!/usr/bin/env bash
# Sets up .venv and runs the end-to-end demo on embedded defaults. Extra args go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
exec .venv/bin/weightsync demo "$@"
