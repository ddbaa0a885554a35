"""delta_handoff: the agent side of an in-place delta swap, before any engine is called.

From a captured `VersionDelta` (weightsync/delta_capture.py) and the workers' plan summaries
(`placement.Plan.summary`), an engine gets:

- `check_plans`: the summaries checked (every element of every planned tensor owned by exactly one
  rank) into `Plans`: which tensors are patched in place and which layers reload natively;
- `write_delta`: the one small file per swap (`delta_file.py`): changed positions and new bits of
  the planned tensors, whole tensors of native layers the version changes;
- `expected_sums`: the position digest's sums over the changed elements, of the old bits (what the
  workers must gather before writing) and of the new ones (what they must read back after), over
  every rank (`rank`: one rank's owned part, for engines whose workers check alone);
- `version_sum`: D(v) over the planned tensors of a whole version (the audit's reference);
- `delta_misfit`: why a delta cannot go in place on what the engine serves (its parent, its size).

Not here: the RPCs and pauses of an engine (`vllm_delta.py`, `sglang_delta.py`), the workers' side
(`delta_apply.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from weightsync.agents.engines.delta_file import TensorChanges, write_delta_file
from weightsync.agents.engines.position_digest import add, position_sum, tensor_id, weights_sum
from weightsync.errors import LayoutError

_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def tag(version: int, digest: str) -> str:
    """How engines and workers name a version they hold."""
    return f"v{version}:{digest}"


def delta_misfit(delta, served_version: int | None, served_digest: str | None, max_changed_fraction: float) -> str:
    """Why `delta` must go in whole on an engine serving (`served_version`, `served_digest`): not
    on its parent, or changing more than `max_changed_fraction` of the elements (delta_max_changed_
    fraction: past it a whole reload costs less than the scatter). "" when it may go in place."""
    parent = delta.parent
    if served_version != parent.version or served_digest != parent.digest:
        return f"the engine serves v{served_version}, the delta is on v{parent.version}"
    fraction = delta.changed / max(1, delta.elements)
    if fraction > max_changed_fraction:
        return (
            f"the version changes {100 * fraction:.1f} % of the elements, over the delta budget "
            f"({100 * max_changed_fraction:.1f} %, delta_max_changed_fraction)"
        )
    return ""


@dataclasses.dataclass(frozen=True)
class Plans:
    """The workers' plans, checked."""

    ranks: list[dict]
    """Each rank's summary (`placement.Plan.summary`), in rank order."""
    planned: frozenset[str]
    """HF tensors patched in place."""
    native: dict[str, dict]
    """Module -> {"reason", "hf_names"}: layers the engine's own loader reloads."""
    dtypes: dict[str, str]
    """Planned HF tensor -> the dtype the workers hold it in."""

    @property
    def native_names(self) -> frozenset[str]:
        return frozenset(name for entry in self.native.values() for name in entry["hf_names"])


def check_plans(summaries: list[dict], shapes: Mapping[str, tuple[int, ...]]) -> Plans:
    """`Plans` from the workers' summaries; LayoutError unless each element of each planned tensor
    of `shapes` (HF name -> shape) is owned by exactly one rank and no tensor is unaccounted for."""
    owned: dict[str, int] = {}
    dtypes: dict[str, str] = {}
    native: dict[str, dict] = {}
    for summary in summaries:
        for module, entry in summary["native"].items():
            merged = native.setdefault(module, {"reason": entry["reason"], "hf_names": []})
            merged["hf_names"] = sorted(set(merged["hf_names"]) | set(entry["hf_names"]))
        for name, places in summary["placements"].items():
            for box, is_owned, dtype in places:
                dtypes[name] = dtype
                if is_owned:
                    owned[name] = owned.get(name, 0) + int(np.prod([length for _, length in box]))
    native_names = {name for entry in native.values() for name in entry["hf_names"]}
    planned = set(owned) - native_names
    for name in planned:
        numel = int(np.prod(shapes[name])) if name in shapes else -1
        if owned[name] != numel:
            raise LayoutError(f"the workers' plans own {owned[name]} elements of {name}, which has {numel}")
    missing = sorted(set(shapes) - planned - native_names)
    if missing:
        raise LayoutError(f"no worker plans {len(missing)} tensors, e.g. {missing[:5]}")
    return Plans(list(summaries), frozenset(planned), native, {n: dtypes[n] for n in planned})


def write_delta(
    path: Path, delta, weights: Mapping[str, torch.Tensor], plans: Plans, *, parent: str, version: str
) -> tuple[int, list[str]]:
    """Writes the swap's file; (its bytes, the HF tensors sent whole for a native reload)."""
    entries, dense = [], []
    for name in sorted(delta.tensors):
        change = delta.tensors[name]
        if name in plans.native_names:
            continue
        dtype = weights[name].dtype
        if plans.dtypes.get(name) != str(dtype).removeprefix("torch."):
            raise LayoutError(f"{name} is {dtype}, the workers hold it as {plans.dtypes.get(name)}")
        entries.append(
            TensorChanges(
                name=name,
                dtype=dtype,
                shape=change.shape,
                positions=torch.from_numpy(change.positions),
                values=_values(change.new, dtype),
            )
        )
    touched = {name for name in delta.tensors if name in plans.native_names}
    for entry in plans.native.values():
        if touched & set(entry["hf_names"]):  # the whole layer, or its processing sees partial weights
            for name in entry["hf_names"]:
                dense.append(name)
                t = weights[name]
                entries.append(TensorChanges(name=name, dtype=t.dtype, shape=tuple(t.shape), dense=t))
    return write_delta_file(path, entries, parent=parent, version=version), dense


def expected_sums(delta, plans: Plans, *, rank: int | None = None) -> tuple[int, int]:
    """(sum over the old bits, sum over the new bits) of the changed elements of planned tensors:
    all of them, or those rank `rank` owns."""
    old_sum = new_sum = 0
    for name, change in delta.tensors.items():
        if name not in plans.planned:
            continue
        positions = torch.from_numpy(change.positions)
        keep = (
            None if rank is None else _owned_by(positions, change.shape, plans.ranks[rank]["placements"].get(name, []))
        )
        if keep is not None:
            positions = positions[keep]
        old, new = (torch.from_numpy(b.astype(np.int64)) for b in (change.old, change.new))
        if keep is not None:
            old, new = old[keep], new[keep]
        tid = tensor_id(name)
        old_sum, new_sum = (
            add(old_sum, position_sum(tid, positions, old)),
            add(new_sum, position_sum(tid, positions, new)),
        )
    return old_sum, new_sum


def version_sum(weights: Mapping[str, torch.Tensor], plans: Plans) -> int:
    """D(v) over the planned tensors of a whole version."""
    return weights_sum({name: weights[name] for name in plans.planned})


def _owned_by(positions: torch.Tensor, shape: tuple[int, ...], places: list) -> torch.Tensor:
    keep = torch.zeros_like(positions, dtype=torch.bool)
    for box, owned, _ in places:
        if not owned:
            continue
        rest, inside = positions, torch.ones_like(keep)
        for (start, length), size in reversed(list(zip(box, shape, strict=True))):
            coord = rest % size
            rest = rest // size
            inside &= (coord >= start) & (coord < start + length)
        keep |= inside
    return keep


def _values(words: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(words.view(_SIGNED[words.itemsize])).view(dtype)
