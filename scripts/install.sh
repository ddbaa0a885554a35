# Sourced by the scripts that set up a venv (setup.sh, setup_vllm.sh, check_wheel.sh), from the
# repository root. `install PYTHON ARG...` is `pip install ARG...` into PYTHON's venv, done by uv
# where uv can be had: uv resolves and unpacks in Rust and unpacks each wheel once for every venv
# (on the idle 2-core machine, .venv took 146 s with pip and takes 49 s with uv; .venv-vllm ~4 min
# and 45 s; CI sets up three venvs at once). pip does it where uv cannot be installed, where uv
# fails (then it says so), or when WEIGHTSYNC_INSTALLER=pip. Both byte-compile what they install:
# with PYTHONDONTWRITEBYTECODE set (as on this project's machines) nothing else would, and every
# process would compile torch anew.
#
# uv reads none of pip's configuration, so what pip is configured with (pip.conf and PIP_*
# variables: find-links, index URLs, constraints, the CA bundle) is handed to it; a file:// index
# that does not exist is left out, as pip ignores it with a warning; and as pip does, uv takes the
# best version that any index offers (uv's default: the first index that has the package at all).
# uv itself lives in .venv-uv (its own venv, made once; scripts that run at the same time take
# turns making it).

UV_PIN="uv==0.13.8"
UV_VENV=".venv-uv"

_uv_ready() {
  [ -x "$UV_VENV/bin/uv" ] && return 0
  (
    flock 9
    [ -x "$UV_VENV/bin/uv" ] && exit 0
    rm -rf "$UV_VENV.part"
    python3 -m venv "$UV_VENV.part" && "$UV_VENV.part/bin/python" -m pip --disable-pip-version-check -q install "$UV_PIN" \
      && mv "$UV_VENV.part" "$UV_VENV"
  ) 9< scripts/install.sh > /dev/null 2>&1
  [ -x "$UV_VENV/bin/uv" ]
}

# pip's configuration as uv arguments, one per line; SSL_CERT_FILE=... first where pip names a CA bundle.
_pip_config_for_uv() {
  "$1" -m pip config list 2> /dev/null | "$1" -c '
import os, re, sys
seen = {}
for line in sys.stdin:  # "global.find-links='"'"'/opt/wheels'"'"'", ":env:.index-url=..."; the environment first
    m = re.match(r"[^.]*\.([a-z-]+)=(.*)$", line.strip())
    if m:
        value = m[2].strip("\x27\"")
        seen.setdefault(m[1], value)
def present(url):
    return not url.startswith("file://") or os.path.isdir(url[len("file://"):])
if "cert" in seen:
    print("SSL_CERT_FILE=" + seen["cert"])
for key, flag in (("index-url", "--index-url"), ("extra-index-url", "--extra-index-url"), ("find-links", "--find-links"), ("constraint", "--constraint")):
    for value in seen.get(key, "").split():
        if key == "constraint" or present(value):
            print(flag); print(value)
if seen.get("no-index", "").lower() in ("1", "true", "yes"):
    print("--no-index")
'
}

install() {
  local python="$1"
  shift
  if [ "${WEIGHTSYNC_INSTALLER:-uv}" != pip ] && _uv_ready; then
    local config=() env=()
    mapfile -t config < <(_pip_config_for_uv "$python")
    if [ "${config[0]:-}" != "${config[0]#SSL_CERT_FILE=}" ]; then
      env=("${config[0]}")
      config=("${config[@]:1}")
    fi
    if env ${env[@]+"${env[@]}"} "$UV_VENV/bin/uv" pip install -q --python "$python" --compile-bytecode \
      --index-strategy unsafe-best-match ${config[@]+"${config[@]}"} "$@"; then
      return 0
    fi
    echo "install: uv failed (above); installing with pip instead" >&2
  fi
  "$python" -m pip --disable-pip-version-check -q install "$@"
}
