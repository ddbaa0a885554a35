"""apply: the "applied" stage. A plan's path applied into its staging buffer, every byte checked.

Chunks pushed with their placement were applied into the spare as they arrived (`early_apply.py`);
the plan took over those the target's manifest confirms. The Reader applies the rest of the path
from the cache into the staging buffer, checking each object's hash before decoding and each
chunk's raw hash after; at the target every byte is covered by a checked hash, and the raw hashes
by the version digest. Two or more deltas are applied folded (range by range, one hash pass per
chunk, `weightsync/format/codecs/fold.py`); the ledger records the route (chain or folded) and why.

Beside the apply rides a capture of every element it changes, old and new bits (`delta_swap.py`),
for an engine that patches what changed in place instead of taking the whole version.

A copying engine's one buffer is the agent's copy of the served version, rewritten in place: after
a failed sync `restore_served_copy` puts the captured old bits back (O(delta)) or reads it back
from the cache, so that what `status --verify` hashes and the next delta's parent are the served
bytes again.

Not here: choosing the path (`plan.py`), bringing its objects in (`gather.py`), the engine (`swap.py`).
"""

from __future__ import annotations

import logging

from weightsync.agents.buffers import Buffers
from weightsync.agents.cache import AgentCache
from weightsync.agents.delta_swap import DeltaSwaps
from weightsync.agents.ledger import LedgerEntry
from weightsync.agents.plan import Plan
from weightsync.agents.state import AgentState
from weightsync.delta_capture import DeltaCapture
from weightsync.errors import IntegrityError, WeightsyncError

log = logging.getLogger(__name__)


class Applier:
    """Applies plans into staging buffers for one agent (see the module docstring)."""

    def __init__(
        self, state: AgentState, cache: AgentCache, buffers: Buffers, delta_swaps: DeltaSwaps, *, name: str
    ) -> None:
        self.state = state
        self.cache = cache
        self.reader = cache.reader
        self.buffers = buffers
        self.delta_swaps = delta_swaps
        self.name = name

    def apply(self, plan: Plan, entry: LedgerEntry) -> tuple[dict[str, float], DeltaCapture | None]:
        """Applies `plan.path` into `plan.staging`; the early decodes' timings for the ledger, and
        what the apply changed (`delta_swap.py`: None when the swap must take the full path)."""
        # The reader re-reads the whole chain's manifests from the cache, also those of the
        # versions it does not apply again: a cached one that rotted is put back first.
        good = {known.manifest.version: known.data for known in plan.chain[: plan.start]}
        self.cache.repair(good, good.get)
        # Several deltas behind: folded into one pass per chunk range (weightsync/format/codecs/fold.py).
        done = plan.early.done if len(plan.path) == 1 else frozenset()
        capture = self.delta_swaps.capture(plan.staging)  # the changed elements, for an in-place swap
        route = self.reader.advance_route(plan.staging, plan.version, done=done, capture=capture)
        if route is not None:
            entry.route, entry.route_reason = route.kind, route.reason
        entry.applied_early = len(done)
        # The early decodes' span, and how much of it the sync waited out.
        early = {"early_apply": plan.early.span_s, "early_wait": plan.early.wait_s} if plan.early.span_s else {}
        return early, capture

    def restore_served_copy(self, zero_copy: bool) -> None:
        """After a failed sync on a copying engine, whose one buffer the sync rewrote in place: the
        agent's copy goes back to the served version, read again from the cache (its chain is
        kept there). A version of another layout never gets here (`check_fit` refuses it before
        anything is written); this is the path of the rarer failures (a reload the server
        refused, a digest the workers disagree with, an apply that failed half-way)."""
        served = self.buffers.served
        version, digest = self.state.served()
        if zero_copy or served is None or version == 0:
            return  # zero-copy: the sync wrote into the spare; nothing served: nothing to restore
        manifest = served.manifest
        if manifest is not None and (manifest.version, manifest.digest) == (version, digest):
            return  # the failure came before the buffer was touched
        if self.delta_swaps.revert(served):  # the captured old bits back: O(delta)
            return
        try:
            self.reader.advance_route(served, version)
            if served.manifest is None or served.manifest.digest != digest:
                raise IntegrityError(f"the cache's v{version} is not the one served")
        except WeightsyncError as e:
            served.manifest = None  # `status --verify` says the copy is unavailable; the next sync reads a base
            served.buffers.clear()
            log.error(
                "%s: cannot rebuild the agent's copy of the served v%d from its cache after a failed sync (%s); "
                "the next version is applied from its base",
                self.name,
                version,
                e,
            )
            return
        log.info("%s: the agent's copy of v%d is back after the failed sync", self.name, version)
