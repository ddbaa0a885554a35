"""choice: which codec a delta chunk gets, and its payload.

Per chunk, by the fraction of elements that changed (thresholds measured on bf16 RL checkpoints):

- up to `ctx_up_to_density` (20 %), the change model: `rans` where the chunk has at least
  `rans_from_changes` (4096) changes, `ctx` below, unless their payload would exceed what
  `sparse` may be (random bits, where no context helps): then on as below;
- below `sparse_only_below` (20 %) `sparse`, above `xor_only_above` (40 %) `xor`, and in
  between both, keeping the smaller payload.

Never a codec above `highest_codec`: that is what the publisher's readers accept (its
`WriteFormat`; 3 writes what readers from before codec 4 read). Every setting is an argument
(`CodecChoice`), never a module global, so two publishers in one process that write for
different readers do not race.

Not here: the codecs (`planes.py`, `ctx.py`, `rans.py`), the change model and its scan
(`changes.py`), the `WriteFormat` (`weightsync.format.write_format`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from weightsync.format.codecs import (
    CODEC_CTX,
    CODEC_RANS,
    CODEC_SPARSE,
    CODEC_XOR,
    DEFAULT_ZSTD_LEVEL,
    check_highest_codec,
    ctx,
    rans,
)
from weightsync.format.codecs.changes import Changes, find_changes
from weightsync.format.codecs.elements import uint_view
from weightsync.format.codecs.planes import changed_positions, encode_sparse, encode_xor, xor_words


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodecChoice:
    """How `encode_delta` picks a delta chunk's codec: the highest codec the readers accept, and
    the measured thresholds (tuning, not compatibility: any setting writes what every reader of
    those codecs decodes)."""

    highest_codec: int = CODEC_RANS
    """The highest codec id to write (`WriteFormat.highest_codec`): 3 writes only `xor` and
    `sparse`, 4 adds `ctx`, 5 `rans`."""
    ctx_up_to_density: float = 0.20
    """The change model is tried up to this fraction of changed elements: its coders run once
    per change, so they get slow where most elements change, and `xor` wins there anyway."""
    rans_from_changes: int = 4096
    """Where the change model applies, chunks with at least this many changes get `rans`
    instead of `ctx`: its tables (~10-20 bytes per exponent class) cost what ctx's learning does
    at ~4k changes (measured on bf16 RL deltas: +0.2 % in all at this threshold, +1 % with
    every chunk rans), and its decoder is ~1.5x faster."""
    sparse_only_below: float = 0.20
    """Below this fraction changed, `sparse` alone (it wins clearly there)."""
    xor_only_above: float = 0.40
    """Above this fraction changed, `xor` alone; between the two bands both are tried."""

    def __post_init__(self) -> None:
        check_highest_codec(self.highest_codec)
        if not 0.0 <= self.ctx_up_to_density <= 1.0:
            raise ValueError(f"ctx_up_to_density must be a fraction in [0, 1], got {self.ctx_up_to_density}")
        if self.rans_from_changes < 1:
            raise ValueError(
                f"rans_from_changes must be >= 1 (to write no rans: highest_codec=4), got {self.rans_from_changes}"
            )
        if not 0.0 <= self.sparse_only_below <= self.xor_only_above <= 1.0:
            raise ValueError(
                "need 0 <= sparse_only_below <= xor_only_above <= 1, got "
                f"{self.sparse_only_below} and {self.xor_only_above}"
            )

    @property
    def modelled_up_to_density(self) -> float:
        """The density up to which `ctx`/`rans` are tried: 0 where the readers predate them."""
        return self.ctx_up_to_density if self.highest_codec >= CODEC_CTX else 0.0


DEFAULT_CHOICE = CodecChoice()


def encode_delta(
    new: np.ndarray,
    old: np.ndarray,
    itemsize: int,
    level: int = DEFAULT_ZSTD_LEVEL,
    *,
    dtype_name: str | None = None,
    changes: Changes | None = None,
    choice: CodecChoice | None = None,
) -> tuple[int, bytes, int] | None:
    """Encodes `new` against `old` (raw bytes of the same range); None if they are equal.

    Returns (codec id, payload, number of changed elements), the codec chosen as the module says.
    The change model checks cheaply whether `sparse` would be smaller (it gives up past a bound).
    `dtype_name` gives it its exponent classes (None: the bits are coded as integers, still
    lossless). `changes` are the changes already found on the tensors' device
    (`weightsync.format.codecs.diff`), which saves the host its scan.
    """
    choice = choice or DEFAULT_CHOICE
    if new.nbytes != old.nbytes:
        raise ValueError(f"new has {new.nbytes} bytes, old {old.nbytes}")
    count = new.nbytes // itemsize
    dtype_name = dtype_name or f"uint{8 * itemsize}"
    modelled_density = choice.modelled_up_to_density
    if changes is not None and not _describes(changes, new, old, itemsize):
        raise ValueError("the device changes do not describe these bytes (a parent out of step?)")
    if changes is not None and len(changes.positions) / max(count, 1) <= modelled_density:
        if len(changes.positions) == 0:
            return None
        coded = _emit_modelled(changes, dtype_name, itemsize, choice)
        if coded is not None:
            return *coded, len(changes.positions)
    if changes is None and modelled_density > 0:
        # The scan counts the changes too, giving up past the density: at RL change rates this
        # is the only pass over the chunk (the XOR below took as long as the scan).
        changes = find_changes(new, old, dtype_name, itemsize, ctx_capacity(count, modelled_density))
        if changes is not None:
            if len(changes.positions) == 0:
                return None
            coded = _emit_modelled(changes, dtype_name, itemsize, choice)
            if coded is not None:
                return *coded, len(changes.positions)
    x = xor_words(new, old, itemsize)
    positions = changed_positions(x, itemsize)
    changed = len(positions)
    if changed == 0:
        return None
    density = changed / count
    candidates = []
    if density <= choice.xor_only_above:
        candidates.append((CODEC_SPARSE, encode_sparse(x, positions, itemsize, level)))
    if density > choice.sparse_only_below:
        candidates.append((CODEC_XOR, encode_xor(x, itemsize, level)))
    codec_id, payload = min(candidates, key=lambda c: len(c[1]))
    return codec_id, payload, changed


def ctx_capacity(count: int, density: float) -> int:
    """The most changed elements of `count` for which the change model is tried:
    changed / count <= density, exactly as the float division decides it."""
    capacity = int(density * count)
    while capacity < count and (capacity + 1) / count <= density:
        capacity += 1
    while capacity > 0 and capacity / count > density:
        capacity -= 1
    return capacity


def _emit_modelled(changes: Changes, dtype_name: str, itemsize: int, choice: CodecChoice) -> tuple[int, bytes] | None:
    """(codec id, payload) in `rans` or `ctx` for the changes the scan found, or None when it
    would be larger than `sparse` may be (random bits, where no context helps)."""
    changed = len(changes.positions)
    limit = _sparse_bound(changed, itemsize)
    if choice.highest_codec >= CODEC_RANS and changed >= choice.rans_from_changes:
        payload = rans.emit(changes, dtype_name, itemsize, limit)
        return None if payload is None else (CODEC_RANS, payload)
    payload = ctx.emit(changes, dtype_name, itemsize, limit)
    return None if payload is None else (CODEC_CTX, payload)


def _describes(changes: Changes, new: np.ndarray, old: np.ndarray, itemsize: int) -> bool:
    """A cheap check (changed elements only) that device changes belong to these host bytes."""
    count = new.nbytes // itemsize
    if changes.count != count:
        return False
    positions = changes.positions
    return bool(
        np.array_equal(uint_view(new, itemsize)[positions], changes.new_bits)
        and np.array_equal(uint_view(old, itemsize)[positions], changes.old_bits)
    )


def _sparse_bound(changed: int, itemsize: int) -> int:
    """The modelled payload size past which `sparse` is worth trying instead: the half of one gap
    byte and the value bytes per change (sparse after zstd, on the data where ctx does worst:
    random bits, where no context helps)."""
    return changed * (itemsize + 1) // 2 + 1024
