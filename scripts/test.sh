#!/usr/bin/env bash
# Sets up .venv with the test extras and runs the tests. Extra args go to pytest.
#   bash scripts/test.sh           every test, every tier (what CI runs); also sets up .venv-vllm
#                                  (the real vLLM, ~4 min and ~3.4 GB the first time) and requires
#                                  the real-vLLM tests to run rather than skip
#   bash scripts/test.sh --fast    the tier to run while working: deselects the marks slow,
#                                  distributed and gpu (a few minutes on 2 cores); no vLLM needed
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
select=()
if [ "${1:-}" = "--fast" ]; then
  shift
  select=(-m "not slow and not distributed and not gpu")
else
  bash scripts/setup_vllm.sh
  export WEIGHTSYNC_REQUIRE_VLLM=1
fi
exec .venv/bin/python -m pytest ${select[@]+"${select[@]}"} "$@"
