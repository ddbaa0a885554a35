#!/usr/bin/env bash
# Checks pyproject.toml's torch floor rather than assuming it: installs that torch release (or
# the one given: bash scripts/check_torch_floor.sh 2.7.0) into a fresh venv with weightsync, then
# runs the TOML loop on 2 gloo ranks (FSDP2, DCP checkpoints, sharded publish) and resumes it from
# its checkpoint. Not a CI step: an old torch from PyPI is a CUDA build of several GB. Run it when
# the floor or the trainer's torch APIs change. KEEP=1 keeps the temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
floor="${1:-$(python3 -c 'import re,tomllib; d=tomllib.load(open("pyproject.toml","rb"))["project"]["dependencies"]; print(next(re.sub(r"^torch\s*>=\s*", "", x) for x in d if re.match(r"torch\s*>=", x)))')}"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/weightsync-torch-floor.XXXXXX")"
if [ -z "${KEEP:-}" ]; then trap 'rm -rf "$tmp"' EXIT; fi
say() { echo "check_torch_floor: $*"; }
"${PYTHON:-python3}" -m venv "$tmp/venv"
pip() { "$tmp/venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install "torch==$floor"
pip install -c <(echo "torch==$floor") "$repo"
say "torch $("$tmp/venv/bin/python" -c 'import torch; print(torch.__version__)')"
cd "$tmp"
train() {
  "$tmp/venv/bin/python" -m torch.distributed.run --standalone --nproc-per-node 2 -m weightsync.trainer.train \
    --config "$repo/trainer/configs/sft_tiny.toml" --set train.steps="$1" --set train.checkpoint.every_steps=3
}
train 6 > first.log 2>&1 || { tail -n 30 first.log; say "torch $floor: the 2-rank loop failed"; exit 1; }
train 8 > resumed.log 2>&1 || { tail -n 30 resumed.log; say "torch $floor: resuming failed"; exit 1; }
grep -q '"step": 7' resumed.log && ! grep -q '"step": 1,' resumed.log \
  || { tail -n 30 resumed.log; say "torch $floor: the second run did not resume at step 7"; exit 1; }
versions=$(ls runs/sft_tiny/store/models/sft-tiny/versions | wc -l)
say "torch $floor: 6 steps, resumed to 8, $versions versions published: ok"
