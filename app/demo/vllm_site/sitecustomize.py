"""sitecustomize for the vLLM servers `weightsync.app.demo.vllm` starts with this directory on their
PYTHONPATH; every process of such a server imports it, nothing else does. Two opt-in changes to how
vLLM runs on a small CPU machine, neither to what it computes:

- WEIGHTSYNC_VLLM_NO_AMX=1: torch's AMX probe, which vLLM's CPU attention and SGL GEMM dispatch
  read, answers False (a VM that advertises AMX but faults on it).
- WEIGHTSYNC_VLLM_SPIN_S=S: vLLM's shared-memory message queues busy-wait S seconds after each
  message before sleeping on their ZeroMQ notification (vLLM: 1 s). The engine core and each
  worker read such a queue, so every isolated request or RPC costs each of them a second of a
  core: on a 2-core machine that CPU is taken from whatever else runs (measured: 10 requests 2 s
  apart, 10.6 CPU-s with 1 s, 1.5 with 0.1; the same latency). Applied when vLLM imports the
  module, so a process that never does pays nothing.
"""

import importlib.abc
import importlib.machinery
import inspect
import os
import sys

if os.environ.get("WEIGHTSYNC_VLLM_NO_AMX") == "1":
    import torch.cpu

    torch.cpu._is_amx_tile_supported = lambda: False

SHM_QUEUES = "vllm.distributed.device_communicators.shm_broadcast"


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
    """Finds vLLM's shm_broadcast like the path finder would and patches it once it has run."""

    def __init__(self, spin_s: float) -> None:
        self.spin_s = spin_s

    def find_spec(self, name, path, target=None):
        if name != SHM_QUEUES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _spin_at_most(module, self.spin_s)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("WEIGHTSYNC_VLLM_SPIN_S"):
    sys.meta_path.insert(0, _PatchOnImport(float(os.environ["WEIGHTSYNC_VLLM_SPIN_S"])))
