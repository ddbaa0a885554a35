"""vllm_lora: what the vllm engine needs to serve LoRA adapter-only versions (engine `lora_name`).

An adapter-only version (manifest weights_kind "adapter", published by a LoRA run's
`save_weights_for_sampler`) holds only `{module}.lora_A.weight` (rank x in) and
`{module}.lora_B.weight` (out x rank) per adapted linear layer, in the trainer's names. vLLM
serves it on top of the base model it was started with, as the adapter requests name in `model`.

The engine hands it over as a PEFT directory (what vLLM's adapter loader reads): the tensors under
`base_model.model.{name}` in `adapter_model.safetensors`, and `adapter_config.json` with the rank
and alpha (scale = alpha / rank, as the trainer's `trainer/lora.py`). vLLM keeps lora_A as
loaded and folds the scale into lora_B (`lora_b *= alpha / rank`, in its dtype); the digest each
worker reports is of those tensors, so the expected one here is computed the same way.

Not here: pausing, loading, the worker side (`vllm.py`, `vllm_worker.py`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from weightsync.agents.engines.base import check_layout
from weightsync.errors import IntegrityError, LayoutError
from weightsync.format.hashing import xxh3_hex

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
SUFFIX_A, SUFFIX_B = ".lora_A.weight", ".lora_B.weight"


def adapter_rank(version: int, weights: Mapping[str, torch.Tensor], lora_info: Mapping[str, Any]) -> int:
    """The adapter's rank, after refusing (before the server is touched) a version vLLM cannot
    serve: not adapter tensors, A/B not in pairs, ranks that differ or exceed --max-lora-rank,
    modules the served model cannot adapt (e.g. a norm)."""
    check_layout(None, weights)
    if not weights:
        raise LayoutError(f"v{version} holds no tensors; an adapter-only version holds lora_A/lora_B pairs")
    modules = {}
    for name, tensor in weights.items():
        if not name.endswith((SUFFIX_A, SUFFIX_B)) or tensor.dim() != 2:
            raise LayoutError(
                f"v{version} holds {name} {tuple(tensor.shape)}, which is not a LoRA adapter matrix "
                f"(*{SUFFIX_A} / *{SUFFIX_B}, 2-D): the store model is not an adapter-only one"
            )
        modules.setdefault(name.rsplit(".", 2)[0], {})[name[-len(SUFFIX_A) :]] = tensor
    ranks = set()
    for module, pair in sorted(modules.items()):
        if set(pair) != {SUFFIX_A, SUFFIX_B}:
            raise LayoutError(f"v{version}: {module} has {sorted(pair)} but needs both lora_A and lora_B")
        a, b = pair[SUFFIX_A], pair[SUFFIX_B]
        if a.shape[0] != b.shape[1]:
            raise LayoutError(
                f"v{version}: {module} lora_A is {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                "A must be (rank, in) and B (out, rank)"
            )
        ranks.add(int(a.shape[0]))
    if len(ranks) != 1:
        raise LayoutError(f"v{version} mixes adapter ranks {sorted(ranks)}; one rank per adapter")
    rank = ranks.pop()
    if rank > lora_info["max_rank"]:
        raise LayoutError(
            f"v{version} is a rank-{rank} adapter but the vLLM server takes rank <= "
            f"{lora_info['max_rank']}: start it with --max-lora-rank {rank} or more"
        )
    targets = sorted({module.rsplit(".", 1)[-1] for module in modules} - set(lora_info["modules"]))
    if targets:
        raise LayoutError(
            f"v{version} adapts {targets}, which the served model cannot take adapters on "
            f"(it can: {lora_info['modules']}); train the LoRA without them"
        )
    return rank


def write_peft_dir(
    directory: Path,
    weights: Mapping[str, torch.Tensor],
    rank: int,
    alpha: float,
    write_tensors: Callable[[Path, Mapping[str, torch.Tensor]], dict[str, str]],
) -> dict[str, str]:
    """Writes the PEFT directory vLLM loads; returns {file's tensor name: xxh3 of its bytes}."""
    directory.mkdir(parents=True)
    hashes = write_tensors(directory / WEIGHTS_FILE, {PEFT_PREFIX + name: t for name, t in weights.items()})
    targets = sorted({name.rsplit(".", 3)[-3] for name in weights})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": targets,
        "bias": "none",
        "use_rslora": False,
    }
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    return hashes


def held_hash(tensor: torch.Tensor, name: str, dtype: torch.dtype, scale: float) -> str:
    """xxh3 of the tensor as a vLLM worker holds it: in the LoRA dtype, lora_B times the scale
    (the same in-place multiply vLLM does, so the same rounding)."""
    held = tensor.detach().to("cpu").to(dtype, copy=True).contiguous()
    if name.endswith(SUFFIX_B) and scale != 1:
        held *= scale
    flat = held.reshape(-1)
    return xxh3_hex(memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else b"")


def verify(
    version: int,
    weights: Mapping[str, torch.Tensor],
    reports: list[dict[str, Any]],
    scale: float,
    expected: Mapping[tuple[str, str], str],
    dtypes: Mapping[str, torch.dtype],
) -> None:
    """Each worker's digest of the adapter it now holds against the published tensors
    (`expected`: by (name, dtype), computed before the pause; others are computed here)."""
    for rank, report in enumerate(reports):
        held = report.get("tensors") if isinstance(report, dict) else None
        if not isinstance(held, dict):
            raise IntegrityError(f"worker {rank} answered with no adapter digest: {str(report)[:300]}")
        missing, unexpected = sorted(set(weights) - set(held)), sorted(set(held) - set(weights))
        if missing or unexpected:
            raise LayoutError(
                f"worker {rank} holds an adapter that differs from v{version}: {len(missing)} tensors "
                f"missing {missing[:5]}, {len(unexpected)} unexpected {unexpected[:5]}"
            )
        for name, (dtype, actual) in held.items():
            if dtype not in dtypes:
                raise LayoutError(f"worker {rank} holds {name} in {dtype}, which weightsync cannot compare")
            want = expected.get((name, dtype)) or held_hash(weights[name], name, dtypes[dtype], scale)
            if want != actual:
                raise IntegrityError(
                    f"worker {rank} holds adapter tensor {name} with digest {actual}, v{version} "
                    f"has {want}: the engine does not serve what was published"
                )
