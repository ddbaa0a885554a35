"""vllm_worker: the worker extension weightsync's vLLM engine drives inside each vLLM worker.

Start vLLM with
`--worker-extension-cls weightsync.agents.engines.vllm_worker.WeightsyncWorkerExtension` (and
`VLLM_SERVER_DEV_MODE=1`, which exposes `/collective_rpc`); vLLM mixes these methods into
every worker, and the agent's engine (`vllm.py`) calls them through
`POST /collective_rpc`. Arguments arrive as strings, results leave as JSON.

A full swap, in each worker:
    check    every tensor of the handoff file (safetensors on tmpfs, memory-mapped: no copy over
             the network per tensor) is hashed and compared with the hashes the agent sent; this
             touches nothing served (the engine runs it before pausing); a mismatch raises
    load     (server paused) vLLM's own in-place reload (`reload_weights`), which goes through the model's
             `load_weights`: the model fuses (`qkv_proj`, `gate_up_proj`, MoE experts into
             `w13_weight`/`w2_weight`) and shards (tensor parallel) the HF-named tensors itself;
             then the worker's placement plan is built (`placement.py`) and it holds the version
    digest   what the worker now holds, split back into HF names through the plan: for each HF
             tensor the slice this worker holds (dim, start, length), its dtype and the xxh3-128
             of its bytes. The agent hashes the same slices of the published tensors and compares.

An in-place delta swap (`delta_apply.py`): `weightsync_delta_stage` (serving) resolves the delta
file through the plan, gathers the old bits (the undo log), patches the unpacked copies and starts
rebuilding their kernel handles on a thread; `weightsync_delta_status` says when that is done;
`weightsync_delta_commit` (paused) scatters into the live parameters, rebinds the handles and
reloads natively the layers the plan cannot patch. `weightsync_delta_undo` stages the inverse,
`weightsync_audit` sums what the worker holds in bounded steps.

Where the bits are read: a parameter that still holds its data is read as it is served. On CPU,
vLLM repacks linear weights into a kernel format (oneDNN, or SGL's AMX layout) after loading and
frees the parameter; the worker keeps an unpacked copy of each (fused and sharded, taken right
before the repack), patches it, and rebuilds the kernel handle from it. MoE experts are read from
the tensors the kernel multiplies by, through the kernel's repack permutation (`placement.py`). A
parameter of none of these kinds cannot be verified, and the load says so rather than pass. The
load also runs a step vLLM 0.32 skips when it reloads MoE experts in place
(`_process_experts_after_reload`): without it the CPU kernel would serve unpacked weights.

This module is imported inside vLLM's workers, so it runs in an inference image that has only
torch, xxhash and safetensors: it imports those and the standard library, of weightsync only
the package __init__s on its path (which import only the standard library) and this package's
torch-only modules, and not numpy (tensors are hashed through a ctypes view of their memory).
Only the debugging RPCs that write files (`weightsync_save_params`, `weightsync_lora_save`) need
numpy, as safetensors' writer does; tests/agents/engines/test_vllm_worker.py runs the rest where
anything else is blocked.
Not here: pausing, draining, comparing digests, deciding what is served (`vllm.py`).
"""

from __future__ import annotations

import ctypes
import json
import time
from fnmatch import fnmatch
from typing import Any

import torch
import xxhash
from safetensors import safe_open

from weightsync.agents.engines import placement as pl
from weightsync.agents.engines.delta_apply import DeltaApplier

PROTOCOL = 2  # bumped when the RPCs below change incompatibly; the engine checks it


def _tensor_hash(tensor: torch.Tensor) -> str:
    """xxh3-128 of a tensor's bytes, as the engine's `_slice_hash` computes it of the published one."""
    flat = tensor.detach().contiguous().view(-1)
    if flat.numel() == 0:
        return xxhash.xxh3_128_hexdigest(b"")
    flat = flat.view(torch.uint8).cpu()
    # A buffer over the tensor's own memory (no copy, and no numpy, which the image may lack);
    # `flat` outlives the hashing, so the memory does.
    return xxhash.xxh3_128_hexdigest((ctypes.c_ubyte * flat.numel()).from_address(flat.data_ptr()))


class WeightsyncWorkerExtension:
    """Methods vLLM adds to each worker (`--worker-extension-cls`). Names carry a `weightsync_`
    prefix so they cannot clash with the worker's own."""

    # ------------------------------------------------------------------ RPCs

    def weightsync_info(self) -> dict[str, Any]:
        """Who this worker is: protocol, model class, tensor-parallel rank/size, dtype, and the HF
        tensor names its model loads (what the engine checks a version's names against)."""
        model = self.model_runner.model
        rank, size = pl.tp_rank_size(model)
        return {
            "protocol": PROTOCOL,
            "model_class": type(model).__name__,
            "tp_rank": rank,
            "tp_size": size,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "hf_names": _hf_names(model),
        }

    def weightsync_check(self, path: str, expected_json: str) -> dict[str, Any]:
        """Hashes every tensor of the handoff file and compares with `expected_json` ({hf_name:
        xxh3 of its bytes}); raises on any difference. Touches nothing served, so the engine runs
        it before pausing the server."""
        started = time.perf_counter()
        expected = json.loads(expected_json)
        with safe_open(path, framework="pt") as handoff:
            names = list(handoff.keys())  # noqa: SIM118 - safe_open has no __iter__
            if sorted(names) != sorted(expected):
                missing, extra = sorted(set(expected) - set(names)), sorted(set(names) - set(expected))
                raise ValueError(
                    f"handoff {path} does not hold the announced tensors: missing {missing[:5]}, unexpected {extra[:5]}"
                )
            for name in names:
                actual = _tensor_hash(handoff.get_tensor(name))
                if actual != expected[name]:
                    raise ValueError(
                        f"handoff {path}: {name} hashes to {actual}, the agent sent {expected[name]}; "
                        "the handoff was damaged between the agent and this worker"
                    )
        return {"tensors": len(names), "check_s": time.perf_counter() - started}

    def weightsync_load(self, path: str, held: str = "", native_json: str = "[]") -> dict[str, Any]:
        """Reloads the model from the handoff file through vLLM's own load path; the worker then
        holds version `held` (the engine's tag), plans it (modules matching the fnmatch patterns
        of `native_json` are reloaded natively in later swaps) and returns the digest of what it
        holds."""
        started = time.perf_counter()
        with safe_open(path, framework="pt") as handoff:
            names = list(handoff.keys())  # noqa: SIM118 - safe_open has no __iter__
            self._weightsync_reload((n, handoff.get_tensor(n)) for n in names)
        loaded = time.perf_counter()
        self._weightsync_native = list(json.loads(native_json))
        self._weightsync_applier().reset(held, self._weightsync_plan())
        digest = self.weightsync_digest()
        digest["timings_s"] = {"load": loaded - started, "digest": time.perf_counter() - loaded}
        return digest

    def weightsync_digest(self) -> dict[str, Any]:
        """{"tensors": {hf_name: [dim, start, length, dtype, xxh3]}, "unverifiable": [...]} for
        what this worker holds now (dim -1: the whole tensor)."""
        model = self.model_runner.model
        plan = self._weightsync_applier().plan or self._weightsync_plan()
        tensors = {}
        for name, places in plan.held.items():
            for place in places:
                start, length = (
                    place.box[place.dim] if place.dim >= 0 else (0, place.hf_shape[0] if place.hf_shape else 1)
                )
                dtype = str(plan.targets[place.target].dtype).removeprefix("torch.")
                tensors[name] = [place.dim, start, length, dtype, _tensor_hash(pl.read_box(place, plan))]
        return {"tensors": tensors, "unverifiable": plan.unreadable, "tp_rank": pl.tp_rank_size(model)[0]}

    def weightsync_save_params(self, path: str) -> int:
        """Writes this worker's parameters (vLLM names, fused, its tensor-parallel shard) to a
        safetensors file: live ones as served, repacked ones as the unpacked copies the worker
        keeps (after a load through weightsync); returns how many it wrote."""
        from safetensors.torch import save_file

        model = self.model_runner.model
        copies = getattr(self, "_weightsync_copies", {})
        params = {}
        for name, param in model.named_parameters():
            tensor = param if param.numel() > 0 else copies.get(name)
            if tensor is not None:
                params[name] = tensor.detach().cpu().contiguous()
        save_file(params, path)
        return len(params)

    # ------------------------------------------------------------------ in-place delta swaps

    def weightsync_plan(self) -> dict[str, Any]:
        """The placement plan's summary (`placement.Plan.summary`): per HF tensor its boxes on this
        rank, owned or not, and the layers reloaded natively, with why."""
        applier = self._weightsync_applier()
        return (applier.plan or self._weightsync_plan()).summary() | {"held": applier.held}

    def weightsync_delta_stage(self, path: str) -> dict[str, Any]:
        """Starts staging the delta file at `path` on a thread (`DeltaApplier.stage`), while
        serving; `weightsync_delta_status` answers its sums once done."""
        applier = self._weightsync_applier()
        return applier.begin(lambda: applier.stage(path))

    def weightsync_delta_undo(self, expect: str) -> dict[str, Any]:
        """Starts staging the inverse of the last delta swap (which made `expect` held) from the
        undo log, likewise."""
        applier = self._weightsync_applier()
        return applier.begin(lambda: applier.stage_undo(expect))

    def weightsync_delta_status(self) -> dict[str, Any]:
        return self._weightsync_applier().status()

    def weightsync_delta_commit(self) -> dict[str, Any]:
        """Makes the staged delta served (the server is paused): scatter, rebind, native layers.
        A native reload replaced those layers' unpacked copies: the plan is read again (such a
        swap keeps no undo log anyway)."""
        applier = self._weightsync_applier()
        reloaded = []

        def reload(tensors: list) -> None:
            reloaded.append(True)
            self._weightsync_reload(iter(tensors))

        result = applier.commit(reload)
        if reloaded:
            applier.reset(applier.held, self._weightsync_plan())
        return result

    def weightsync_delta_discard(self) -> dict[str, Any]:
        self._weightsync_applier().discard()
        return self._weightsync_applier().status()

    def weightsync_audit(self, max_elements: str, pass_id: str = "") -> dict[str, Any]:
        """Sums up to `max_elements` more owned elements of audit pass `pass_id` from memory."""
        return self._weightsync_applier().audit_step(int(max_elements), pass_id)

    def weightsync_poke(self, hf_name: str, position: str, bits: str) -> dict[str, Any]:
        """Writes one element's bits where this worker holds it (fault drills, tests)."""
        return self._weightsync_applier().poke(hf_name, int(position), int(bits))

    # ------------------------------------------------------------------ LoRA adapters (engine lora_name)

    def weightsync_lora_info(self) -> dict[str, Any]:
        """{"enabled": bool, "max_rank", "modules": module names an adapter may target (packed ones
        split back, e.g. q_proj, not qkv_proj), "ids": the adapter ids this worker has registered}."""
        manager = _lora_manager(self)
        if manager is None:
            return {"enabled": False, "max_rank": 0, "modules": [], "ids": []}
        adapters = manager._adapter_manager
        packed = getattr(adapters, "packed_modules_mapping", None) or {}
        modules = set()
        for module in adapters.supported_lora_modules:
            modules.update(packed.get(module) or [module])
        return {
            "enabled": True,
            "max_rank": int(adapters.lora_config.max_lora_rank),
            "modules": sorted(modules),
            "ids": sorted(int(i) for i in manager.list_adapters()),
        }

    def weightsync_lora_load(self, lora_id: str, path: str) -> dict[str, Any]:
        """Replaces registered adapter `lora_id` by the PEFT directory `path` (server paused),
        through vLLM's own adapter loader; the next step activates it again. Returns its digest."""
        from vllm.lora.request import LoRARequest

        started = time.perf_counter()
        manager = _lora_manager(self, required=True)
        lora = manager._load_adapter(
            LoRARequest(lora_name=f"weightsync-{lora_id}", lora_int_id=int(lora_id), lora_path=path)
        )
        manager._adapter_manager.remove_adapter(lora.id)  # also frees its slot
        manager._adapter_manager.add_adapter(lora)
        loaded = time.perf_counter()
        digest = self.weightsync_lora_digest(lora_id)
        digest["timings_s"] = {"load": loaded - started}
        return digest

    def weightsync_lora_digest(self, lora_id: str) -> dict[str, Any]:
        """{"tensors": {peft name: [dtype, xxh3]}} of adapter `lora_id` as this worker holds it:
        lora_A as loaded, lora_B with vLLM's scaling folded in (what it multiplies by)."""
        return {
            "tensors": {
                name: [str(t.dtype).removeprefix("torch."), _tensor_hash(t)]
                for name, t in _lora_tensors(self, int(lora_id)).items()
            }
        }

    def weightsync_lora_save(self, lora_id: str, path: str) -> int:
        """Writes adapter `lora_id` as this worker holds it (`weightsync_lora_digest`'s tensors) to
        a safetensors file (tests, debugging); returns how many tensors it wrote."""
        from safetensors.torch import save_file

        tensors = {n: t.detach().cpu().contiguous() for n, t in _lora_tensors(self, int(lora_id)).items()}
        save_file(tensors, str(path))
        return len(tensors)

    # ------------------------------------------------------------------ internals

    def _weightsync_applier(self) -> DeltaApplier:
        applier = getattr(self, "_weightsync_delta", None)
        if applier is None:
            applier = self._weightsync_delta = DeltaApplier(_build_cpu_handle)
        return applier

    def _weightsync_plan(self) -> pl.Plan:
        native = getattr(self, "_weightsync_native", [])
        return pl.build_plan(
            self.model_runner.model,
            getattr(self, "_weightsync_copies", {}),
            exclude=lambda module: next((f"native_reload lists {p!r}" for p in native if fnmatch(module, p)), ""),
        )

    def _weightsync_reload(self, weights: Any) -> None:
        """vLLM's in-place reload of `weights` (HF names), with the repack hooked (below)."""
        self._weightsync_hook_repacking()
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)

    def _weightsync_hook_repacking(self) -> None:
        """Wraps each layer's `process_weights_after_loading` (once) so that the weights it is about
        to repack are copied first (`placement.keep_copy`), for the plan to patch and read; copies
        of parameters the step left in place are dropped again."""
        if getattr(self, "_weightsync_hooked", False):
            return
        self._weightsync_copies: dict[str, torch.Tensor] = {}
        model = self.model_runner.model
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            original = getattr(method, "process_weights_after_loading", None)
            if original is None or getattr(original, "_weightsync_wrapped", False):
                continue

            def capture(layer, *args, _original=original, **kwargs):
                prefix = _names_by_module(model).get(id(layer))
                kept = {}
                if prefix is not None:
                    for pname, param in layer.named_parameters(recurse=False):
                        if param.numel() > 0 and not pl.is_expert_weight(layer, pname):  # read live
                            kept[pname] = pl.keep_copy(param)
                result = (
                    _process_experts_after_reload(layer, _original, *args, **kwargs)
                    if pl.is_routed_experts(layer)
                    else _original(layer, *args, **kwargs)
                )
                for pname, copy in kept.items():
                    full = f"{prefix}.{pname}" if prefix else pname
                    if getattr(layer, pname).numel() == 0:
                        self._weightsync_copies[full] = copy
                    else:
                        self._weightsync_copies.pop(full, None)
                return result

            capture._weightsync_wrapped = True
            method.process_weights_after_loading = capture
        self._weightsync_hooked = True


def _build_cpu_handle(module: torch.nn.Module, weight: torch.Tensor) -> Any:
    """A linear's new CPU kernel handle (`cpu_linear`), made by vLLM's own dispatch from a stand-in
    module holding `weight` (a clone: zentorch's unpacked path keeps a reference to it)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    stand_in = torch.nn.Module()
    stand_in.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
    dispatch_cpu_unquantized_gemm(stand_in, remove_weight=True)
    return stand_in.cpu_linear


def _lora_manager(worker: Any, required: bool = False) -> Any:
    """The worker's LoRA manager (vLLM's LRUCacheWorkerLoRAManager), None without --enable-lora."""
    manager = getattr(worker.model_runner, "lora_manager", None)
    if manager is None and required:
        raise RuntimeError("this vLLM server was started without --enable-lora")
    return manager


def _lora_tensors(worker: Any, lora_id: int) -> dict[str, torch.Tensor]:
    """Adapter `lora_id`'s tensors under their PEFT names ({module}.lora_A.weight / .lora_B.weight).
    vLLM packs q/k/v (gate/up) adapters into one entry per fused layer, with lists: split back."""
    adapters = _lora_manager(worker, required=True)._adapter_manager
    lora = adapters.get_adapter(lora_id)
    if lora is None:
        raise KeyError(f"no LoRA adapter with id {lora_id} is registered in this worker")
    tensors = {}
    for module_name, weights in lora.loras.items():
        if isinstance(weights.lora_a, list):
            subs = adapters.packed_modules[module_name]
            pairs = zip(subs, weights.lora_a, weights.lora_b, strict=True)
        else:
            pairs = [(module_name, weights.lora_a, weights.lora_b)]
        for sub, a, b in pairs:
            if a is not None:
                tensors[f"{sub}.lora_A.weight"], tensors[f"{sub}.lora_B.weight"] = a, b
    return tensors


_MODULE_NAMES: dict[int, dict[int, str]] = {}


def _names_by_module(model: torch.nn.Module) -> dict[int, str]:
    names = _MODULE_NAMES.get(id(model))
    if names is None:
        names = _MODULE_NAMES[id(model)] = {id(m): n for n, m in model.named_modules()}
    return names


def _hf_names(model: torch.nn.Module) -> list[str]:
    """The HF tensor names the model's parameters are loaded from (fused ones split back)."""
    return sorted({name for names in pl.build_plan(model, {}).modules.values() for name in names})


def _process_experts_after_reload(layer: torch.nn.Module, original: Any, *args: Any, **kwargs: Any) -> Any:
    """Runs vLLM's post-load step of a fused-experts layer, then the experts kernel's own one where
    vLLM skipped it.

    vLLM 0.32's UnquantizedFusedMoEMethod calls `fused_experts.process_weights_after_loading` (the
    CPU kernels' repack into their grouped-gemm layout) only on the first load; on an in-place reload
    it copies the new weights into the kernel's tensors unpacked, and the CPU kernel then reads
    checkpoint-layout bytes as packed ones (measured: greedy tokens of the same weights reloaded
    differ from a fresh server's). Where that step did not run during a reload, it is run here, on
    the freshly loaded layer, as a first load runs it."""
    experts = getattr(getattr(layer.quant_method, "moe_kernel", None), "fused_experts", None)
    if experts is None:  # first load: vLLM runs every step
        return original(layer, *args, **kwargs)
    ran = []
    step = experts.process_weights_after_loading

    def flagged(*a: Any, **kw: Any) -> Any:
        ran.append(True)
        return step(*a, **kw)

    experts.process_weights_after_loading = flagged
    try:
        result = original(layer, *args, **kwargs)
    finally:
        del experts.process_weights_after_loading  # back to the class's method
    if not ran:
        step(layer)
    return result
