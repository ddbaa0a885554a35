"""delta_capture: the elements a version changes, recorded while the reader applies it.

An engine that patches weights in place needs, per tensor, the changed flat positions and their
old and new bit patterns. The reader has them only in passing: it decodes each delta chunk into
the range of the buffer that holds the parent's bytes. A `DeltaCapture` handed to
`Reader.advance_route` snapshots each range before it is decoded and compares it after (one copy
and one word-wise XOR scan per changed chunk, on the reader's apply threads, whatever the codec:
sparse, ctx, rans, xor, and folded chains alike), and keeps what differs: O(changed elements) of
memory. Several deltas applied one after another are merged: an element keeps its bits from
before the first and after the last, and one that came back to its old bits is not a change.

A route that applies a full version (a rebase, a state not on the target's chain) or ranges
applied before the reader ran (an agent's early apply) cannot be captured; `result()` is then
None and `reason` says why. `VersionDelta.revert(state)` writes the old bits back into the
state's buffers: the agent's copy goes back to the parent in O(delta).

Not here: applying (`reader.py`), deciding how an engine swaps (the agent), the engine's file
(`agents/engines/delta_file.py`).
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from weightsync.format.codecs.elements import UINT, scratch
from weightsync.format.codecs.planes import changed_positions, xor_words
from weightsync.format.dtypes import dtype_by_name
from weightsync.format.manifest import ChunkRef, Manifest, TensorEntry


@dataclasses.dataclass(frozen=True)
class TensorDelta:
    """One tensor's changed elements, in position order."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    positions: np.ndarray  # int64 flat positions, ascending
    old: np.ndarray  # unsigned words: the parent's bits there
    new: np.ndarray  # unsigned words: the version's bits there


@dataclasses.dataclass(frozen=True)
class VersionDelta:
    """Every element a version changes against its parent (the state the reader started from)."""

    parent: Manifest
    version: Manifest
    tensors: dict[str, TensorDelta]

    @property
    def changed(self) -> int:
        return sum(len(t.positions) for t in self.tensors.values())

    @property
    def elements(self) -> int:
        return sum(t.numel for t in self.version.tensors)

    def revert(self, state) -> None:
        """Puts the parent's bits back into `state` (a `WeightsState` holding `version`), which
        then holds the parent again."""
        for name, delta in self.tensors.items():
            words = state.buffers[name].view(UINT[dtype_by_name(delta.dtype).itemsize])
            words[delta.positions] = delta.old
        state.manifest = self.parent


class DeltaCapture:
    """Records the changes the reader makes to one state (see the module docstring)."""

    def __init__(self, parent: Manifest) -> None:
        self.parent = parent
        self.reason = ""
        """Why nothing can be captured ("" while it can)."""
        self._lock = threading.Lock()
        self._step = 0
        self._parts: dict[str, list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]]] = {}
        self._entries: dict[str, TensorEntry] = {}

    def refuse(self, reason: str) -> None:
        """Nothing can be captured on this route (a full version, ranges applied early)."""
        self.reason = self.reason or reason

    def next_version(self, manifest: Manifest) -> None:
        """The reader starts applying `manifest` (one of a chain, or a folded route's target)."""
        self._step += 1
        for tensor in manifest.tensors:
            self._entries[tensor.name] = tensor

    def before(self, tensor: TensorEntry, ref: ChunkRef, out: np.ndarray) -> np.ndarray | None:
        """The range's bytes before it is decoded (in this thread's scratch), or None."""
        if self.reason:
            return None
        old = scratch("capture_old", out.nbytes)
        old[:] = out
        return old

    def after(self, tensor: TensorEntry, ref: ChunkRef, out: np.ndarray, old: np.ndarray | None) -> None:
        """Records the chunk's changed elements, `old` being what `before` returned; `out` holds
        the chunk's elements in its own order (a box chunk's: the box's row-major order), and
        each is recorded at its flat index in the tensor."""
        if old is None:
            return
        itemsize = dtype_by_name(tensor.dtype).itemsize
        positions = changed_positions(xor_words(out, old, itemsize), itemsize)
        if len(positions) == 0:
            return
        local = positions.astype(np.int64)
        if ref.box is None:
            flat = local + ref.start
        else:
            where = np.unravel_index(local, ref.box.sizes)
            flat = np.ravel_multi_index(
                tuple(i + o for i, o in zip(where, ref.box.offsets, strict=True)), tensor.shape
            ).astype(np.int64)
        part = (
            self._step,
            int(flat[0]),
            flat,
            old.view(UINT[itemsize])[positions].copy(),
            out.view(UINT[itemsize])[positions].copy(),
        )
        with self._lock:
            self._parts.setdefault(tensor.name, []).append(part)

    def result(self, version: Manifest) -> VersionDelta | None:
        """The changes from the parent to `version` (the state's manifest now), or None when they
        could not be captured (`reason`)."""
        if self.reason:
            return None
        tensors = {}
        for name, parts in self._parts.items():
            entry = self._entries[name]
            parts.sort(key=lambda p: (p[0], p[1]))
            positions, old, new = _merge(parts) if len({p[0] for p in parts}) > 1 else _concat(parts)
            if len(positions):
                tensors[name] = TensorDelta(name, entry.dtype, tuple(entry.shape), positions, old, new)
        return VersionDelta(self.parent, version, tensors)


def _concat(parts: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One delta's chunks of one tensor, disjoint: joined in position order (flat ranges follow
    one another; the boxes of a tensor- or expert-parallel layout interleave, and are sorted)."""
    parts = sorted(parts, key=lambda p: p[1])
    positions = np.concatenate([p[2] for p in parts])
    old, new = np.concatenate([p[3] for p in parts]), np.concatenate([p[4] for p in parts])
    if len(positions) > 1 and not (np.diff(positions) > 0).all():
        order = np.argsort(positions, kind="stable")
        positions, old, new = positions[order], old[order], new[order]
    return positions, old, new


def _merge(parts: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Several deltas' changes of one tensor (in apply order): per position the first old bits and
    the last new ones; positions whose bits came back are dropped."""
    positions = np.concatenate([p[2] for p in parts])
    old = np.concatenate([p[3] for p in parts])
    new = np.concatenate([p[4] for p in parts])
    unique, first = np.unique(positions, return_index=True)
    _, last_reversed = np.unique(positions[::-1], return_index=True)
    last = len(positions) - 1 - last_reversed
    old, new = old[first], new[last]
    keep = old != new
    return unique[keep], old[keep], new[keep]
