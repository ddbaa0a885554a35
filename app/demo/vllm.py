"""vllm: how the demo (and the test harness) starts a vLLM server for an agent's `vllm` engine,
and waits until it answers.

The server is vLLM's OpenAI-compatible one with weightsync's worker extension and the dev routes
(docs/vllm.md), with flags that run on a small CPU machine. vLLM lives in its own environment
(`scripts/setup_vllm.sh` makes `.venv-vllm`), which must also have weightsync installed.

Not here: driving the server (`weightsync.agents.engines.vllm`), processes and their lifetimes
(the caller's).
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from weightsync.cpus import usable_cpus

SERVED_MODEL_NAME = "m"
NO_AMX_ENV = "WEIGHTSYNC_VLLM_NO_AMX"
"""Set to 1: the vLLM servers started here run vLLM's CPU kernels without AMX: on a VM that
advertises AMX in cpuid but faults on it (seen 2026-11-28: SIGILL in vLLM's
`cpu_attention_with_kv_cache` on the first request, a server without weightsync too). oneDNN is
capped below AMX and torch's AMX probe answers False (`vllm_site/sitecustomize.py`)."""
SPIN_ENV = "WEIGHTSYNC_VLLM_SPIN_S"
"""Seconds (> 0): how long the vLLM servers started here busy-wait for the next message on their
internal queues before they sleep (vLLM's own: 1 s, a core's second per isolated request;
`vllm_site/sitecustomize.py`)."""
SITE_DIRECTORY = Path(__file__).with_name("vllm_site")


def server_site_env(env: dict[str, str]) -> dict[str, str]:
    """What `env` (a server's environment) needs added for NO_AMX_ENV and SPIN_ENV: the
    sitecustomize directory first on PYTHONPATH, oneDNN's ISA cap. Empty when neither is set."""
    no_amx, spin = env.get(NO_AMX_ENV) == "1", env.get(SPIN_ENV, "")
    if spin:
        try:
            ok = float(spin) > 0
        except ValueError:
            ok = False
        if not ok:
            # 0 would send every message through vLLM's notification socket, which drops a
            # notification still unread and then waits up to 5 s for its periodic recheck
            raise ValueError(f"{SPIN_ENV}={spin!r}: expected seconds > 0 (vLLM's own is 1)")
    if not (no_amx or spin):
        return {}
    added = {"PYTHONPATH": os.pathsep.join(p for p in (str(SITE_DIRECTORY), env.get("PYTHONPATH", "")) if p)}
    if no_amx:
        added["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"
    return added


def find_vllm_python(explicit: str | None = None) -> str | None:
    """The interpreter that runs vLLM: `explicit`, else $WEIGHTSYNC_VLLM_PYTHON, else
    ./.venv-vllm/bin/python (the working directory, then the source checkout), else None. An
    interpreter named explicitly is the only candidate: one that does not exist is None, never
    silently replaced by another."""
    if explicit:
        return explicit if Path(explicit).exists() else None
    candidates = [os.environ.get("WEIGHTSYNC_VLLM_PYTHON")]
    candidates += [
        str(base / ".venv-vllm" / "bin" / "python") for base in (Path.cwd(), Path(__file__).resolve().parents[2])
    ]
    return next((c for c in candidates if c and Path(c).exists()), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(process: subprocess.Popen, url: str, log_path: Path, deadline: float) -> None:
    """Until the server at `url` answers /health; a RuntimeError with the end of its log if its
    process exits first or `deadline` (time.monotonic()) passes: a server that cannot start (a
    wrong flag, a socket path too long, no memory) must not leave its agent waiting for it."""
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM at {url} exited with {process.returncode}:\n{_tail(log_path)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except OSError:  # URLError included: not listening yet
            pass
        if time.monotonic() >= deadline:
            raise RuntimeError(f"vLLM at {url} did not answer /health in time:\n{_tail(log_path)}")
        time.sleep(1.0)


def _tail(log_path: Path, nbytes: int = 4000) -> str:
    data = log_path.read_bytes() if log_path.exists() else b""
    return data[-nbytes:].decode("utf-8", "replace")


def server_tmp_dir() -> Path:
    """A new directory for one server's temporary files, in the system temporary directory: its
    path stays short, as the ZeroMQ socket paths under it must (108 bytes at most)."""
    return Path(tempfile.mkdtemp(prefix="weightsync-vllm-"))


def vllm_server_command(
    python: str,
    model_dir: str | os.PathLike,
    port: int,
    *,
    tmp_dir: str | os.PathLike,
    extension: bool = True,
    dev_mode: bool = True,
    max_model_len: int = 256,
    extra_args: tuple[str, ...] = (),
) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of a vLLM server on 127.0.0.1:`port` serving `model_dir` as model "m".

    vLLM's temporary files (its ZeroMQ IPC sockets, its distributed-init file) go in `tmp_dir`
    (from `server_tmp_dir`), which the caller removes once the server has stopped: in the system
    temporary directory, every server stopped by a signal leaves ~7 sockets and a vllm_dist_* file
    behind, a thousand files a day on a machine that runs the tests."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["TMPDIR"] = os.fspath(tmp_dir)
    # vllm-cpu's default binding ("auto") pins its worker process, every thread of it, to the
    # first cores of the NUMA node and leaves the rest to its scheduler: every server on a machine
    # then computes on the same cores (on 2 cores: all on core 0) while the other stays idle or runs
    # whatever else there is. Unpinned, with the thread count auto would give, the kernel places
    # them. A caller's own VLLM_CPU_OMP_THREADS_BIND (tensor parallelism: one list per worker) or
    # OMP_NUM_THREADS wins.
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() - 1)))
    env.update(server_site_env(env))
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    else:
        env.pop("VLLM_SERVER_DEV_MODE", None)
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        "4",
        *extra_args,
    ]
    if extension:
        from weightsync.agents.engines.vllm import EXTENSION  # torch: only for a server with the extension

        argv += ["--worker-extension-cls", EXTENSION]
    return argv, env
