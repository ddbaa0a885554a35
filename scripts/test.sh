#!/usr/bin/env bash
# Sets up .venv with the test extras and runs the tests. Extra args go to pytest.
#   bash scripts/test.sh           every test, every tier (what CI runs); also sets up .venv-vllm
#                                  (the real vLLM, ~1 min and ~3.4 GB the first time) and requires
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
  # .venv-vllm (the longer install) is set up beside .venv and then beside the first tests: the
  # tests that start vLLM wait for it (harness/vllm.py wait_for_setup reads $WEIGHTSYNC_VLLM_SETUP).
  vllm_setup="$(mktemp -d)"
  (
    status=0
    bash scripts/setup_vllm.sh > "$vllm_setup/log" 2>&1 || status=$?
    echo "$status" > "$vllm_setup/rc.part" && mv "$vllm_setup/rc.part" "$vllm_setup/rc"
  ) &
  vllm_venv=$!
  trap 'kill "$vllm_venv" 2>/dev/null || true' EXIT
  bash scripts/setup.sh test || { echo "test.sh: setting up .venv failed" >&2; exit 1; }
  export WEIGHTSYNC_VLLM_SETUP="$vllm_setup" WEIGHTSYNC_REQUIRE_VLLM=1
fi
# vLLM's CPU kernels without AMX unless asked otherwise: some VMs advertise AMX and fault on it
# (SIGILL in vLLM's attention, weightsync or not); the tests compare vLLM with itself and with
# the published bytes, which AMX does not change.
export WEIGHTSYNC_VLLM_NO_AMX="${WEIGHTSYNC_VLLM_NO_AMX:-1}"
# vLLM's internal queues busy-wait 0.1 s after a message instead of 1 s unless asked otherwise: the
# tests send vLLM isolated requests and RPCs, each of which cost its engine core and worker a
# second of a core that the other tests, on 2 cores, wait for (app/demo/vllm_site/sitecustomize.py).
export WEIGHTSYNC_VLLM_SPIN_S="${WEIGHTSYNC_VLLM_SPIN_S:-0.1}"
# One OpenMP thread per process unless asked otherwise: the workers and the processes they start
# (servers, trainers, agents) already outnumber the CPUs, and a second torch thread in each only
# spins at OpenMP barriers while its partner waits for a CPU. Four heavy files (-n 4) beside two
# busy loops: 224-231 s and ~320 CPU-s with torch's default threads, 198-203 s and ~275 CPU-s
# with one. The tests' results do not depend on it (a 1-CPU machine runs them with one thread).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Two workers per CPU, up to 4 (WEIGHTSYNC_TEST_WORKERS overrides; 0 runs in this process): many
# tests wait on processes they start, and on a shared machine each worker is one more share of the
# CPU. --dist loadfile keeps a file's tests on one worker, so a module's server starts once;
# --no-loadscope-reorder keeps tests/conftest.py's order (the longest files first).
cpus="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1)"  # nproc obeys both
workers="${WEIGHTSYNC_TEST_WORKERS:-$((2 * cpus))}"
[ "$workers" -gt 4 ] && workers=4
pytest=(.venv/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder ${select[@]+"${select[@]}"} "$@")
[ -n "${vllm_setup:-}" ] || exec "${pytest[@]}"
rc=0
"${pytest[@]}" || rc=$?
wait "$vllm_venv" || true  # the vLLM tests waited for it; a run that selected none did not
trap - EXIT
if [ "$(cat "$vllm_setup/rc" 2>/dev/null)" != 0 ]; then
  tail -n 40 "$vllm_setup/log" >&2
  echo "test.sh: setting up .venv-vllm failed" >&2
  [ "$rc" -ne 0 ] || rc=1
fi
rm -rf "$vllm_setup"
exit "$rc"
