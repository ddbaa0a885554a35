#!/usr/bin/env bash
# Sets up .venv with the test extras and runs the tests. Extra args go to pytest.
#   bash scripts/test.sh           every test, every tier (what CI runs); also sets up .venv-vllm
#                                  (the real vLLM, ~4 min and ~3.4 GB the first time) and requires
#                                  the real-vLLM tests to run rather than skip
#   bash scripts/test.sh --fast    the tier to run while working: deselects the marks slow,
#                                  distributed and gpu (2 minutes on 2 cores); no vLLM needed
set -euo pipefail
cd "$(dirname "$0")/.."
select=()
if [ "${1:-}" = "--fast" ]; then
  shift
  bash scripts/setup.sh test
  select=(-m "not slow and not distributed and not gpu")
else
  # The two venvs are independent: set them up side by side (mostly unpacking wheels).
  bash scripts/setup.sh test & tests_venv=$!
  bash scripts/setup_vllm.sh & vllm_venv=$!
  trap 'kill "$tests_venv" "$vllm_venv" 2>/dev/null || true' EXIT
  wait "$tests_venv" || { echo "test.sh: setting up .venv failed" >&2; exit 1; }
  wait "$vllm_venv" || { echo "test.sh: setting up .venv-vllm failed" >&2; exit 1; }
  trap - EXIT
  export WEIGHTSYNC_REQUIRE_VLLM=1
fi
# vLLM's CPU kernels without AMX unless asked otherwise: some VMs advertise AMX and fault on it
# (SIGILL in vLLM's attention, weightsync or not); the tests compare vLLM with itself and with
# the published bytes, which AMX does not change.
export WEIGHTSYNC_VLLM_NO_AMX="${WEIGHTSYNC_VLLM_NO_AMX:-1}"
# One worker per CPU, up to 4 (WEIGHTSYNC_TEST_WORKERS overrides; 0 runs in this process): many
# tests wait on processes they start, so two workers on two cores cut the wall time by ~30 %.
# --dist loadfile keeps a file's tests on one worker, so a module's server starts once. xdist hands
# out the files that hold the most tests first; handing out the longest-running first was tried
# and was slower beside two busy loops (25.9 min of tests against 20.6, one run each).
workers="${WEIGHTSYNC_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}"
[ "$workers" -gt 4 ] && workers=4
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile ${select[@]+"${select[@]}"} "$@"
