"""chain: the delta chain a publisher extends, and when the next version rebases instead.

Each version is a delta against the previous snapshot, or a full version (a rebase) when
- there is no parent (the first version, or a parent that failed or cannot be read),
- a version of the chain failed (nothing may be built on top of it),
- the tensor layout changed (a name, dtype or shape: a delta never changes the layout),
- the job's layout changed (`layout_key`: the same on every rank, so all of them rebase together),
  or this rank's placements did (its delta is against its own previous piece; the other ranks may
  then write deltas, and the commit fails on the disagreement: a failed version, never a wrong
  delta, and every rank's next one is full),
- the chain reached `rebase_every` deltas,
- or the chain's deltas add up to more than `rebase_chain_ratio` times the base: a long chain
  costs a catching-up reader more than a fresh base would.

A sharded publisher decides from what every rank knows (`planning_horizon`), so that the ranks
of one job make the same choice for the same version without talking to each other.

Not here: encoding and committing (`publisher.py`), reading versions back (`reader.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Collection, Mapping

from weightsync.errors import WeightsyncError
from weightsync.format.dtypes import dtype_by_name
from weightsync.format.tensors import Snapshot, SnapshotTensor, describe_layout_change, layout_of
from weightsync.shards import Placement, placements_for
from weightsync.stores import Store
from weightsync.versions import resolve_chain

log = logging.getLogger(__name__)

TensorLayout = dict[str, tuple[str, tuple[int, ...]]]
"""name -> (dtype name, shape): what a delta must keep from its parent."""


@dataclasses.dataclass
class ChainTotals:
    """Stored bytes of one delta chain's versions, filled in as they commit (under the
    publisher's lock)."""

    by_version: dict[int, int] = dataclasses.field(default_factory=dict)
    base: int = 0  # the chain's full version

    def known(self, horizon: int | None) -> tuple[int, int]:
        """(base bytes, delta bytes) counting only versions <= `horizon` (None: all committed)."""
        counted = {v: b for v, b in self.by_version.items() if horizon is None or v <= horizon}
        base = counted.pop(self.base, 0)
        return base, sum(counted.values())


@dataclasses.dataclass(frozen=True)
class Chain:
    """The delta parent the next publish diffs against."""

    version: int
    base: int
    snapshot: Snapshot
    layout: TensorLayout
    placements: dict[str, Placement]
    length: int  # deltas since the base
    totals: ChainTotals
    copied: threading.Event  # set once `snapshot` is complete (copied by its publish() call)
    layout_key: str | None = None  # the caller's name of the job's layout (Publisher.publish)


def planning_horizon(version: int, *, max_in_flight: int, sharded: bool) -> int | None:
    """The newest version whose outcome every rank knows when planning `version` (sharded).

    Ranks learn commits and failures at different moments, so a plan that used everything a
    rank knows could make one rank write a delta and another a full version of the same
    version. But a rank plans `version` only after its publish slot frees, i.e. after the
    version `max_in_flight` before it finished on that rank, commit or failure: every rank
    knows that far, and sharded plans use nothing newer. None (unsharded): use everything.
    """
    return version - max_in_flight if sharded else None


def rebase_reason(
    chain: Chain | None,
    tensor_layout: TensorLayout,
    placements: Mapping[str, Placement],
    layout_key: str | None = None,
    *,
    failed: Collection[int],
    horizon: int | None,
    rebase_every: int,
    rebase_chain_ratio: float,
) -> str | None:
    """Why the next version must be full (None: it is a delta on `chain`). `failed`: versions
    that will never commit; only those up to `horizon` count."""
    if chain is None:
        return "no parent"
    failures = [v for v in failed if (horizon is None or v <= horizon) and chain.base <= v <= chain.version]
    if failures:
        return f"v{min(failures)} of the chain failed"
    if chain.layout != tensor_layout:
        return "layout changed: " + describe_layout_change(chain.layout, tensor_layout, expected_is="the last version")
    if chain.layout_key != layout_key:
        return "the job's layout changed (mesh or placements)"
    if chain.placements != placements:
        return "the shards' placements changed"
    if chain.length + 1 > rebase_every:
        return f"chain reached {rebase_every} deltas"
    base_bytes, delta_bytes = chain.totals.known(horizon)
    if base_bytes and delta_bytes > rebase_chain_ratio * base_bytes:
        return f"chain holds {delta_bytes} bytes of deltas, over {rebase_chain_ratio}x its base"
    return None


_SET = threading.Event()  # a snapshot that is complete from the start (read back from the store)
_SET.set()


def chain_from_store(store: Store, model: str, latest: int, *, workers: int) -> Chain | None:
    """Version `latest` of the store as the first delta parent (None if there is none, or it
    cannot be read: an unreadable latest version must not stop publishing)."""
    if latest < 1:
        return None
    from weightsync.reader import Reader  # reading back is the reader's job

    try:
        manifests = resolve_chain(store, model, latest)
        state = Reader(store, model=model, workers=workers).read(latest)
    except WeightsyncError as e:
        log.warning("%s: cannot read v%d as delta parent (%s); publishing a full version", model, latest, e)
        return None
    snapshot = {
        t.name: SnapshotTensor(dtype_by_name(t.dtype), t.shape, state.buffers[t.name]) for t in state.manifest.tensors
    }
    log.info("%s: delta parent is v%d from %s", model, latest, store.uri)
    return Chain(
        version=latest,
        base=manifests[0].version,
        snapshot=snapshot,
        layout=layout_of(snapshot),
        placements=placements_for({n: (t.dtype, t.shape) for n, t in snapshot.items()}, {}),
        length=len(manifests) - 1,
        totals=ChainTotals(by_version={m.version: m.stored_bytes for m in manifests}, base=manifests[0].version),
        copied=_SET,
    )
