"""packed: frozen linear weights held in 8 or 4 bits with per-group scales, dequantized on the fly.

A LoRA run on a large MoE must fit its frozen experts in memory. `PackedLinear` stands in for an
expert's `nn.Linear` (gate/up/down_proj) and holds its weight W (out x in) as

    int8   qweight (out, in) bytes        q in [-127, 127], one int8 per column
    int4   qweight (out, in / 2) bytes    q in [-7, 7], two per byte: column 2j in the low nibble,
                                          2j+1 in the high one, each stored as q + 8
    both   scales  bf16  (out, in / G)    one scale s per row and group of G input columns

The qweight bytes are held as a bf16 tensor of half as many columns (little-endian 16-bit words:
`qweight.view(torch.uint8)` gives the bytes back). bf16 is a storage type only, never computed
with: FSDP2 before torch 2.13 cannot hold an integer parameter (`fully_shard` fails with "only
Tensors of floating point dtype can require gradients", seen on 2.11), and bf16 is the one
floating dtype its MixedPrecisionPolicy never casts (param_dtype is bf16 or unset here), so
the bytes travel through sharding, all-gathers and DCP untouched, on every torch the trainer
supports.

with W ~ q * s (symmetric, absmax: s >= max |w| / qmax over the group, q = round-half-even(w /
s)). "bf16" is the same module holding W cast to bf16 (2x smaller than the fp32 master weights,
the baseline packed formats are measured against).

Exact by construction: every scale is rounded *up* to a float whose significand fits beside q's
inside bf16's 8 bits (int4: 5 significant bits, since |q| <= 7 takes 3; int8: a power of two,
since |q| <= 127 takes 7), so every q * s is a bf16 number, computed exactly in bf16 or fp32.
Hence:
- the trainer computes with exactly the bf16 tensor it publishes (`dequantize()`), whatever its
  compute dtype: frozen experts are at parity with an engine that loads the published weights,
  and publish the same bits every version (no delta bytes);
- packing is lossless on its own output: pack(dequantize(pack(w))) == pack(w), bit for bit, so
  an exported bf16 checkpoint re-packs into exactly the tensors the trainer held;
- |w - dequantize(pack(w))| <= s / 2 per group (half a quantization step; the rounding up costs
  int4 at most 1/16 of a step, int8 up to 2x the step of an unrestricted scale, still finer than
  int4 by 18x).
Packing is deterministic (elementwise fp32 ops and bit masks only). Scales are at least
MIN_SCALE (a group of zeros dequantizes to +0.0); non-finite weights are refused.

The forward pass dequantizes into the input's dtype and calls F.linear through an autograd
Function that saves the packed tensors, not the dequantized weight, and dequantizes again in
backward: otherwise every expert's full-precision weight would sit in the activation memory
from forward to backward, undoing the packing. Gradients reach the input only (so adapters,
attention and router upstream train as before, in full precision); the packed tensors are
parameters with requires_grad=False, so FSDP2 shards them by rows with their layer like any
weight (buffers would be replicated: every rank would hold every expert).

Not here: which experts get packed, when, and the sharded build (trainer/engine.py `_adapt`),
the dense model (decoder.py), the MoE block (moe.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from weightsync.errors import ConfigError

KINDS = ("bf16", "int8", "int4")
DEFAULT_GROUP_SIZE = 128
MIN_SCALE = 2.0**-100
"""Smallest scale (a normal float far below any weight): no group divides by zero or by a subnormal."""

_QMAX = {"int8": 127, "int4": 7}
_SCALE_MANTISSA_BITS = {"int8": 0, "int4": 4}  # explicit fp32 mantissa bits a scale keeps (see above)
PACKED_SUFFIXES = (".qweight", ".scales")


@dataclasses.dataclass(frozen=True)
class PackFormat:
    """How frozen weights are held: "bf16", or "int8" / "int4" with one scale per `group_size`
    input columns. Written "int4", "int4:64" (group 64), "int8", "bf16" (`parse`, `str`)."""

    kind: str
    group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"packed format must be one of {list(KINDS)}, got {self.kind!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 2:
            raise ConfigError(f"packed group size must be an integer >= 2, got {self.group_size!r}")
        if self.kind == "int4" and self.group_size % 2:
            raise ConfigError(f"int4 packs two columns per byte: the group size must be even, got {self.group_size}")

    @classmethod
    def parse(cls, text: str) -> PackFormat:
        """ "bf16", "int8", "int4", or "int8:G" / "int4:G" with group size G."""
        kind, sep, group = str(text).partition(":")
        if not sep:
            return cls(kind)
        if kind == "bf16" or not group.isdigit():
            raise ConfigError(f'packed format {text!r}: write "int4", "int8" or "bf16", or "int4:64" for group size 64')
        return cls(kind, int(group))

    def __str__(self) -> str:
        return (
            self.kind
            if self.kind == "bf16" or self.group_size == DEFAULT_GROUP_SIZE
            else f"{self.kind}:{self.group_size}"
        )

    @property
    def bits(self) -> int:
        return {"bf16": 16, "int8": 8, "int4": 4}[self.kind]

    def check_fits(self, in_features: int, what: str = "a weight") -> None:
        words = {"int4": 4, "int8": 2}.get(self.kind, 1)  # columns per 16-bit word of qweight
        if in_features % words:
            raise ConfigError(f"{what} has {in_features} input columns; {self.kind} needs a multiple of {words}")
        if self.kind != "bf16" and in_features % self.group_size:
            raise ConfigError(
                f"{what} has {in_features} input columns, not a multiple of the group size {self.group_size}; "
                f"pick a group size that divides it (their gcd is {math.gcd(in_features, self.group_size)})"
            )

    def packed_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes one (out, in) weight takes in this format, scales included."""
        if self.kind == "bf16":
            return 2 * out_features * in_features
        return out_features * in_features * self.bits // 8 + 2 * out_features * (in_features // self.group_size)


# ----------------------------------------------------------------------------- pack / dequantize


def pack(weight: torch.Tensor, fmt: PackFormat) -> dict[str, torch.Tensor]:
    """The tensors `PackedLinear` holds for `weight` (out, in), by parameter name: {"weight"}
    (bf16) or {"qweight", "scales"}. Deterministic; works on any slice of rows alike."""
    if weight.dim() != 2:
        raise ValueError(f"pack takes a 2-D weight (out, in), got shape {tuple(weight.shape)}")
    fmt.check_fits(weight.shape[1])
    w = weight.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("cannot pack a weight with NaN or infinite values")
    if fmt.kind == "bf16":
        return {"weight": w.to(torch.bfloat16)}
    rows, cols = w.shape
    qmax = _QMAX[fmt.kind]
    groups = w.reshape(rows, cols // fmt.group_size, fmt.group_size)
    scales = _round_up(groups.abs().amax(dim=-1) / qmax, _SCALE_MANTISSA_BITS[fmt.kind]).clamp_min(MIN_SCALE)
    q = torch.round(groups / scales.unsqueeze(-1)).clamp_(-qmax, qmax).reshape(rows, cols).to(torch.int8)
    if fmt.kind == "int4":
        nibbles = (q + 8).to(torch.uint8).reshape(rows, cols // 2, 2)
        q = nibbles[..., 0] | (nibbles[..., 1] << 4)
    # The scales convert exactly (<= 5 significant bits); the bytes are held as bf16 words.
    return {"qweight": q.contiguous().view(torch.bfloat16), "scales": scales.to(torch.bfloat16)}


def _round_up(x: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """Each positive fp32 value rounded up to the nearest float with `mantissa_bits` explicit
    mantissa bits (a carry into the exponent is the right answer, as IEEE's layout makes it)."""
    drop = 23 - mantissa_bits
    bits = x.contiguous().view(torch.int32)
    return ((bits + ((1 << drop) - 1)) & ~((1 << drop) - 1)).view(torch.float32)


def dequantize(
    tensors: Mapping[str, torch.Tensor], fmt: PackFormat, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The weight (out, in) `pack` describes, in `dtype` (bf16, fp32 or fp16 hold it exactly:
    every value is a bf16 number; fp16 only while within its range)."""
    if fmt.kind == "bf16":
        return tensors["weight"].to(dtype)
    scales = tensors["scales"]
    if fmt.kind == "int4":
        qweight = tensors["qweight"].view(torch.uint8)
        # One table lookup per byte gives both columns' q: a third of the kernels (and of the time,
        # on a CPU) of masking, shifting, interleaving and offsetting the nibbles one op at a time.
        q = F.embedding(qweight.int(), _int4_table(dtype, qweight.device)).reshape(qweight.shape[0], -1)
    else:
        q = tensors["qweight"].view(torch.int8).to(dtype)
    rows, cols = q.shape
    groups = q.reshape(rows, cols // fmt.group_size, fmt.group_size) * scales.to(dtype).unsqueeze(-1)
    return groups.reshape(rows, cols)


_INT4_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _int4_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(256, 2): a byte's (low nibble - 8, high nibble - 8) in `dtype`, made once per dtype and device."""
    table = _INT4_TABLES.get((dtype, device))
    if table is None:
        byte = torch.arange(256)
        table = (torch.stack((byte & 0x0F, byte >> 4), dim=-1) - 8).to(dtype=dtype, device=device)
        _INT4_TABLES[(dtype, device)] = table
    return table


# --------------------------------------------------------------------------------- the module


class _DequantLinear(torch.autograd.Function):
    """y = x W^T with W dequantized from the packed tensors in forward and again in backward;
    only the packed tensors are saved. Gradient for x only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fmt: PackFormat, names: tuple[str, ...], *tensors: torch.Tensor) -> torch.Tensor:
        ctx.fmt, ctx.names, ctx.in_features = fmt, names, x.shape[-1]
        ctx.save_for_backward(*tensors)
        if x.numel() == 0:  # an expert no token picked: no weight to unpack
            return x.new_zeros(*x.shape[:-1], tensors[0].shape[0])
        return F.linear(x, dequantize(dict(zip(names, tensors, strict=True)), fmt, x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_x = None
        if ctx.needs_input_grad[0] and grad.numel():
            weight = dequantize(dict(zip(ctx.names, ctx.saved_tensors, strict=True)), ctx.fmt, grad.dtype)
            grad_x = grad.matmul(weight)
        elif ctx.needs_input_grad[0]:
            grad_x = grad.new_zeros(*grad.shape[:-1], ctx.in_features)
        return (grad_x, None, None, *(None for _ in ctx.saved_tensors))


class PackedLinear(nn.Module):
    """A bias-free linear layer whose weight never trains, held in `fmt` (module docstring).

    Its parameters (requires_grad=False) are `weight` (bf16) or `qweight` and `scales`; every
    one is cut by rows alike, so an FSDP2 dim-0 shard dequantizes on its own."""

    def __init__(self, in_features: int, out_features: int, fmt: PackFormat, *, device=None) -> None:
        super().__init__()
        fmt.check_fits(in_features)
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        shapes = _packed_shapes(out_features, in_features, fmt)
        for name, (shape, dtype) in shapes.items():
            self.register_parameter(
                name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
            )
        self.packed_names = tuple(shapes)

    def packed_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.packed_names}

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The weight this layer computes with (bf16 values; in `dtype`). On a local shard of each
        parameter it is that shard's rows."""
        tensors = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in self.packed_tensors().items()}
        with torch.no_grad():
            return dequantize(tensors, self.fmt, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DequantLinear.apply(x, self.fmt, self.packed_names, *self.packed_tensors().values())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt}"


def _packed_shapes(
    out_features: int, in_features: int, fmt: PackFormat
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    if fmt.kind == "bf16":
        return {"weight": ((out_features, in_features), torch.bfloat16)}
    words = in_features // (4 if fmt.kind == "int4" else 2)  # 16-bit words of packed bytes
    return {
        "qweight": ((out_features, words), torch.bfloat16),
        "scales": ((out_features, in_features // fmt.group_size), torch.bfloat16),
    }


# ---------------------------------------------------------------------- experts of a whole model


def expert_projection_names(model: nn.Module) -> list[str]:
    """Module names of every routed expert's gate/up/down projection (`...mlp.experts.E.gate_proj`);
    the shared expert and dense MLPs are not experts here."""
    return [
        name
        for name, _ in model.named_modules()
        if ".experts." in f".{name}" and name.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj")
    ]


def pack_experts(model: nn.Module, fmt: PackFormat) -> list[str]:
    """Replaces each routed expert's projections with empty `PackedLinear`s on the same device
    (meta, before sharding); returns their names. The weights come later (`pack_state_dict`)."""
    names = expert_projection_names(model)
    for name in names:
        linear = model.get_submodule(name)
        if hasattr(linear, "lora_A"):
            raise ConfigError(
                f"{name} has LoRA adapters, which cannot sit on a packed expert: set the LoRA "
                "settings' train_experts=False, or unset parallel.frozen_experts"
            )
        if not isinstance(linear, nn.Linear) or linear.bias is not None:
            raise ConfigError(f"{name} is not a bias-free linear layer; cannot pack it")
        parent, _, leaf = name.rpartition(".")
        packed = PackedLinear(linear.in_features, linear.out_features, fmt, device=linear.weight.device)
        setattr(model.get_submodule(parent), leaf, packed)
    return names


def packed_modules(model: nn.Module) -> dict[str, PackedLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, PackedLinear)}


def pack_state_dict(state: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """A full (unsharded) state dict with HF names, with each packed layer's `weight` replaced by
    the tensors `model`'s PackedLinear holds (what the build loads into the sharded model)."""
    out = dict(state)
    for name, module in packed_modules(model).items():
        out.pop(f"{name}.weight")
        out.update({f"{name}.{k}": v for k, v in pack(state[f"{name}.weight"], module.fmt).items()})
    return out


def dequantized_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (the model's own, sharded or gathered) with every packed layer's tensors replaced
    by its bf16 `weight` under the HF name: what is published and exported. Layers whose tensors
    are not in `state` (a gathered dict on a rank that got none) are left out."""
    out = dict(state)
    for name, module in packed_modules(model).items():
        keys = [f"{name}.{k}" for k in module.packed_names]
        if module.fmt.kind == "bf16" or keys[0] not in out:
            continue
        tensors = {k: out.pop(key) for k, key in zip(module.packed_names, keys, strict=True)}
        out[f"{name}.weight"] = _dequantize_any(tensors, module)
    return out


def _dequantize_any(tensors: dict[str, torch.Tensor], module: PackedLinear) -> torch.Tensor:
    first = tensors["qweight"]
    if not isinstance(first, DTensor):
        return dequantize({k: v.detach() for k, v in tensors.items()}, module.fmt)
    # Rows are independent: each rank dequantizes its own dim-0 shard, laid out as the packed ones.
    with torch.no_grad():
        local = dequantize({k: v.to_local() for k, v in tensors.items()}, module.fmt)
    shape = (module.out_features, module.in_features)
    return DTensor.from_local(local, first.device_mesh, first.placements, shape=shape, stride=(shape[1], 1))
