"""The vLLM servers' sitecustomize (`weightsync.app.demo.vllm.server_site_env`): what
WEIGHTSYNC_VLLM_NO_AMX and WEIGHTSYNC_VLLM_SPIN_S change in a vLLM process, and the values refused.
The vLLM cases run vLLM's own interpreter (`.venv-vllm`) on vLLM's own module."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness import vllm as vh
from weightsync.app.demo.vllm import NO_AMX_ENV, SPIN_ENV, server_site_env

PROBE = """
import json, torch.cpu
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
print(json.dumps({"spin": SpinCondition.__init__.__defaults__, "amx": torch.cpu._is_amx_tile_supported()}))
"""


def _probe(settings: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (NO_AMX_ENV, SPIN_ENV)}
    env.update(settings)
    env.update(server_site_env(env))
    python = vh.vllm_python()
    if python is None:
        vh.require_vllm()
        pytest.skip("no vLLM venv")
    done = subprocess.run([python, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.vllm
@pytest.mark.slow
def test_the_spin_setting_reaches_vllms_message_queues_and_amx_is_off():
    seen = _probe({SPIN_ENV: "0.25", NO_AMX_ENV: "1"})
    assert seen == {"spin": [0.25], "amx": False}


@pytest.mark.vllm
@pytest.mark.slow
def test_without_either_setting_vllm_is_left_as_it_is():
    assert server_site_env({"PYTHONPATH": "/x"}) == {}
    assert _probe({})["spin"] == [1]


def test_the_spin_setting_alone_adds_the_site_directory_and_no_isa_cap():
    added = server_site_env({SPIN_ENV: "0.1", "PYTHONPATH": "/x"})
    first, rest = added["PYTHONPATH"].split(os.pathsep, 1)
    assert first.endswith("vllm_site") and os.path.isfile(os.path.join(first, "sitecustomize.py"))
    assert rest == "/x" and "ONEDNN_MAX_CPU_ISA" not in added
    assert server_site_env({NO_AMX_ENV: "1"})["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan"])
def test_a_spin_that_is_not_positive_seconds_is_refused(value):
    with pytest.raises(ValueError, match=f"{SPIN_ENV}='{value}': expected seconds > 0"):
        server_site_env({SPIN_ENV: value})


def test_amx_is_off_from_the_first_import_of_torch_and_a_process_without_torch_does_not_load_it():
    """The switches patch their modules as they are first imported: a server's helper processes
    (multiprocessing's resource tracker), which never import torch, do not pay for importing it."""
    env = {k: v for k, v in os.environ.items() if k not in (NO_AMX_ENV, SPIN_ENV)}
    env.update({NO_AMX_ENV: "1", SPIN_ENV: "0.1"})
    env.update(server_site_env(env))
    probe = "import sys; print(json.dumps(['torch' in sys.modules, 'vllm' in sys.modules]))"
    plain = subprocess.run([sys.executable, "-c", f"import json; {probe}"], env=env, capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout) == [False, False]
    amx = "import torch; print(torch.cpu._is_amx_tile_supported())"
    done = subprocess.run([sys.executable, "-c", amx], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
