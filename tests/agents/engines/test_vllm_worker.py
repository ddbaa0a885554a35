"""The vLLM worker extension (agents/engines/vllm_worker.py) runs inside vLLM's worker processes, in
an inference image that has torch, xxhash and safetensors and nothing else of ours. A child process
blocks every other third-party module before anything is imported (numpy included, which the torch
wheel does not require), imports the extension and runs its checks and digests on real tensors and
a real handoff file. The extension against a real vLLM: test_vllm.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch
import xxhash
from safetensors.torch import save_file

from weightsync.agents.engines.vllm_worker import PROTOCOL

# The child: a meta-path finder installed first, so that torch itself meets it. Allowed: the
# standard library, torch and the distributions torch requires (its own wheel brings them),
# xxhash, safetensors and weightsync. Anything else is "not installed" (ModuleNotFoundError, as
# in the image; torch runs without numpy when numpy is absent).
_CHILD = r"""
import importlib.abc, importlib.metadata as md, json, re, sys

needed = {"torch", "xxhash", "safetensors"}
needed |= {re.split(r"[ ;<>=!~\[(]", r)[0].lower().replace("_", "-") for r in md.requires("torch") or () if "extra ==" not in r}
allowed = {"weightsync"} | {
    top for top, dists in md.packages_distributions().items() if {d.lower().replace("_", "-") for d in dists} & needed
}
blocked = []

class OnlyTheImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in sys.stdlib_module_names or top in allowed or top in sys.builtin_module_names:
            return None
        blocked.append(name)
        raise ModuleNotFoundError(f"No module named {name!r} (not in the inference image)", name=name)

sys.meta_path.insert(0, OnlyTheImage())
assert "numpy" not in allowed, "numpy must be blocked for this test to mean anything"

import torch
from weightsync.agents.engines.vllm_worker import PROTOCOL, WeightsyncWorkerExtension

handoff, hashes = sys.argv[1], json.loads(sys.argv[2])

class Runner:  # what vLLM's worker offers the extension, for a plain torch model
    def __init__(self, model):
        self.model = model

class Worker(WeightsyncWorkerExtension):
    def __init__(self, model):
        self.model_runner = Runner(model)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
worker = Worker(model)
info = worker.weightsync_info()
checked = worker.weightsync_check(handoff, json.dumps(hashes))
bad = dict(hashes, **{next(iter(hashes)): "0" * 32})
try:
    worker.weightsync_check(handoff, json.dumps(bad))
    raise SystemExit("a wrong hash passed the check")
except ValueError as e:
    assert "damaged between the agent and this worker" in str(e), e
digest = worker.weightsync_digest()
held = {name: p.detach() for name, p in model.named_parameters()}
print(json.dumps({
    "protocol": PROTOCOL,
    "info": info,
    "checked": checked["tensors"],
    "digest": digest,
    "held": {name: [str(t.dtype), list(t.shape), t.float().flatten().tolist()] for name, t in held.items()},
    "blocked": sorted(set(blocked)),
    "numpy": "numpy" in sys.modules,
}))
"""


def test_the_worker_extension_runs_with_only_torch_xxhash_and_safetensors(tmp_path):
    generator = torch.Generator().manual_seed(1)
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 4, generator=generator).to(torch.bfloat16),
        "model.norm.weight": torch.randn(4, generator=generator).to(torch.float16),
        "model.steps": torch.arange(5, dtype=torch.int64),
        "model.empty": torch.zeros(0, 3),
    }
    handoff = tmp_path / "handoff.safetensors"
    save_file(tensors, str(handoff))
    # What the engine sends: xxh3-128 of each tensor's bytes, computed here without the extension.
    hashes = {
        name: xxhash.xxh3_128_hexdigest(t.contiguous().view(-1).view(torch.uint8).numpy())
        for name, t in tensors.items()
    }
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(handoff), json.dumps(hashes)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["numpy"], "the extension (or torch under it) imported numpy"
    assert "numpy" in result["blocked"], "torch looked for numpy and was told it is not there"
    assert result["protocol"] == PROTOCOL and result["info"]["protocol"] == PROTOCOL
    assert result["info"]["hf_names"] == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert result["info"]["dtype"] == "bfloat16" and (result["info"]["tp_rank"], result["info"]["tp_size"]) == (0, 1)
    assert result["checked"] == len(tensors)
    # The digest of what the worker holds is the xxh3 of each parameter's bytes, as hashed here.
    for name, (dtype, shape, values) in result["held"].items():
        param = (
            torch.tensor(values, dtype=torch.float32).reshape(shape).to(getattr(torch, dtype.removeprefix("torch.")))
        )
        want = xxhash.xxh3_128_hexdigest(param.contiguous().view(-1).view(torch.uint8).numpy())
        assert result["digest"]["tensors"][name] == [-1, 0, shape[0], "bfloat16", want], name
    assert result["digest"]["unverifiable"] == []
