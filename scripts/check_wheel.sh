#!/usr/bin/env bash
# Builds the wheel from this working tree and proves it works without the source tree: the wheel
# holds the application layer (weightsync/app, app/demo), the decoder (weightsync/models) and the
# trainer's example configs; installed (not editable) into a fresh venv, `weightsync demo --quick
# --regions 1` runs and a safetensors file survives `weightsync publish` + `weightsync pull` bit
# for bit. torch==2.13.0 goes in first (set WEIGHTSYNC_TORCH for another), as in scripts/setup.sh;
# the installer's cache (scripts/install.sh) is reused. Set KEEP=1 to keep the temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
python="${PYTHON:-python3}"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/weightsync-wheel.XXXXXX")"
if [ -z "${KEEP:-}" ]; then trap 'rm -rf "$tmp"' EXIT; else echo "check_wheel: keeping $tmp"; fi
say() { echo "check_wheel: $*"; }

# A copy of the tracked and new (not ignored) files: a stale build/ or .egg-info in the checkout
# must not leak deleted modules into the wheel.
mkdir -p "$tmp/src" "$tmp/dist" "$tmp/run"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -e "$f" ] && printf '%s\0' "$f"
done | tar --null -T - -cf - | tar -xf - -C "$tmp/src"

"$python" -m venv "$tmp/venv"
pip() { "$tmp/venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip wheel --no-deps -w "$tmp/dist" "$tmp/src"
wheel="$(ls "$tmp"/dist/weightsync-*.whl)"
say "built $(basename "$wheel")"

"$tmp/venv/bin/python" - "$wheel" <<'EOF'
import fnmatch, sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["weightsync/app/cli/*.py", "weightsync/app/demo/*.py", "weightsync/models/*.py", "weightsync/agents/*.py",
        "weightsync/trainer/*.py", "weightsync/trainer/configs/*.toml", "weightsync/transport/v1/sync_pb2.py"]
missing = [p for p in need if not fnmatch.filter(names, p)]
strays = [n for n in names if n.split("/")[0] not in ("weightsync",) and ".dist-info/" not in n]
if missing or strays:
    sys.exit(f"check_wheel: wheel lacks {missing}, or has files outside weightsync/: {strays}")
print(f"check_wheel: wheel has {len(names)} files, all of {need}")
EOF

source scripts/install.sh  # install: uv, or pip
install "$tmp/venv/bin/python" "${WEIGHTSYNC_TORCH:-torch==2.13.0}"
install "$tmp/venv/bin/python" "$wheel[demo]"
cd "$tmp/run"  # nothing of the checkout on sys.path from here on
bin="$tmp/venv/bin"
"$bin/python" -c "
import weightsync, weightsync.app.demo, weightsync.trainer, sys
assert '$tmp/venv/' in weightsync.__file__ and '$tmp/venv/' in weightsync.app.demo.__file__, weightsync.__file__
from importlib.resources import files
assert files('weightsync.trainer').joinpath('configs/sft_tiny.toml').is_file()
"

# One region of two agents (a leader relaying to its follower): what the wheel must hold runs, at
# three quarters of the CPU of the default 2 x 2 (tests/app/test_demo.py runs that shape from source).
say "weightsync demo --quick --regions 1 (installed wheel)"
"$bin/weightsync" demo --quick --regions 1 --out-dir "$tmp/run/demo" > "$tmp/run/demo.log" 2>&1 \
  || { tail -n 40 "$tmp/run/demo.log"; say "demo failed"; exit 1; }
tail -n 3 "$tmp/run/demo.log"

say "publish + pull round trip"
"$bin/python" - <<'EOF'
import torch
from safetensors.torch import save_file
g = torch.Generator().manual_seed(0)
save_file({"embed.weight": torch.randn(64, 48, generator=g).to(torch.bfloat16),
           "layers.0.mlp.weight": torch.randn(96, 64, generator=g).to(torch.bfloat16),
           "layers.0.norm.weight": torch.ones(64, dtype=torch.float32),
           "step": torch.tensor(7, dtype=torch.int64)}, "ckpt.safetensors")
EOF
"$bin/weightsync" publish --store "file://$tmp/run/store" --model tiny --keep-dtypes ckpt.safetensors
"$bin/weightsync" pull --store "file://$tmp/run/store" --model tiny --out pulled
"$bin/python" - <<'EOF'
import pathlib
import torch
from safetensors import safe_open
def tensors(paths):
    out = {}
    for path in paths:
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out
a, b = tensors(["ckpt.safetensors"]), tensors(sorted(pathlib.Path("pulled").glob("*.safetensors")))
assert a.keys() == b.keys(), (sorted(a), sorted(b))
for k in a:  # bytes, not values: -0.0 and NaN payloads must survive too
    same = a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
    assert same and a[k].reshape(-1).view(torch.uint8).numpy().tobytes() \
        == b[k].reshape(-1).view(torch.uint8).numpy().tobytes(), k
print(f"check_wheel: {len(a)} tensors round-tripped bit for bit")
EOF
say "ok"
