"""sitecustomize for the vLLM servers `weightsync.app.demo.vllm` starts with this directory on their
PYTHONPATH; every process of such a server imports it, nothing else does. Two opt-in changes to how
vLLM runs on a small CPU machine, neither to what it computes:

- WEIGHTSYNC_VLLM_NO_AMX=1: torch's AMX probe, which vLLM's CPU attention and SGL GEMM dispatch
  read, answers False (a VM that advertises AMX but faults on it).
- WEIGHTSYNC_VLLM_SPIN_S=S: vLLM's shared-memory message queues busy-wait S seconds after each
  message before sleeping on their ZeroMQ notification (vLLM: 1 s). The engine core and each
  worker read such a queue, so every isolated request or RPC costs each of them a second of a
  core: on a 2-core machine that CPU is taken from whatever else runs (measured: 10 requests 2 s
  apart, 10.6 CPU-s with 1 s, 1.5 with 0.1; the same latency).

Each change is applied when its module is first imported, so a process that never imports it
pays nothing: a server's helper processes (multiprocessing's resource tracker) import neither
torch nor vLLM, and importing torch here cost each of them a CPU-second.
"""

import importlib.abc
import importlib.machinery
import inspect
import os
import sys

TORCH_CPU = "torch.cpu"
SHM_QUEUES = "vllm.distributed.device_communicators.shm_broadcast"


def _no_amx(module) -> None:
    module._is_amx_tile_supported = lambda: False


def _spin_at_most(module, spin_s: float) -> None:
    """SpinCondition's busy_loop_s default (no caller passes it) becomes `spin_s`; a vLLM whose
    SpinCondition reads otherwise is left as it is, with a line on stderr saying so."""
    init = getattr(getattr(module, "SpinCondition", None), "__init__", None)
    parameters = list(inspect.signature(init).parameters.values()) if init else []
    if not parameters or parameters[-1].name != "busy_loop_s" or len(init.__defaults__ or ()) != 1:
        print(
            f"weightsync: {SHM_QUEUES}.SpinCondition has no busy_loop_s default; spin left as vLLM's", file=sys.stderr
        )
        return
    init.__defaults__ = (spin_s,)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds each module of `patches` ({module name: patch(module)}) like the path finder would
    and patches it once it has run, before anything else can use it."""

    def __init__(self, patches: dict) -> None:
        self.patches = patches

    def find_spec(self, name, path, target=None):
        patch = self.patches.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


_patches = {}
if os.environ.get("WEIGHTSYNC_VLLM_NO_AMX") == "1":
    _patches[TORCH_CPU] = _no_amx
if os.environ.get("WEIGHTSYNC_VLLM_SPIN_S"):
    spin_s = float(os.environ["WEIGHTSYNC_VLLM_SPIN_S"])
    _patches[SHM_QUEUES] = lambda module: _spin_at_most(module, spin_s)
if _patches:
    sys.meta_path.insert(0, _PatchOnImport(_patches))
