"""delta_swap: which path each swap takes into the engine, and the O(delta) rollback.

An engine that patches changed elements in place (`engines.base.DeltaEngine`) needs, per swap,
what the version changes against the version it serves: the agent captures that while its reader
applies the version into the buffer that holds the served one (`weightsync/delta_capture.py`).
The agent's choice, per swap:

    capture   the engine accepts deltas and the buffer holds the version it serves -> a capture
              rides along the reader's apply; otherwise no capture: the full path
    swap      a capture that holds the version's changes -> engine.swap_delta (the engine may
              still take the full path: a restarted server, a gap over its budget, workers whose
              state diverged); none (a full version, a rebase, a route through a base) ->
              engine.swap. The report says which path and why; the ledger keeps it
    refuse    the parity probe refused the version: the engine's undo log goes back
              (engine.undo, O(delta)) and the agent's buffer gets the captured old bits back
              (O(delta)); without an undo log, the agent's usual full swap of the previous version

Entry points: `capture(staging)` and `revert(state)` for the apply stage (`apply.py`), `swap(...)`
and `undo(refused)` for the swap stage (`swap.py`).

Not here: applying versions (the reader), the engines' own paths (`engines/vllm_delta.py`).
"""

from __future__ import annotations

import dataclasses
import logging

from weightsync.agents.engines.base import Engine, SwapReport, accepts_deltas
from weightsync.agents.engines.swap_policy import SwapPolicy
from weightsync.delta_capture import DeltaCapture, VersionDelta
from weightsync.reader import WeightsState

log = logging.getLogger(__name__)


class DeltaSwaps:
    """One agent's delta-swap choices (see the module docstring)."""

    def __init__(self, engine: Engine, *, name: str) -> None:
        self.engine = engine
        self.name = name
        self.enabled = accepts_deltas(engine)
        self._served_delta: VersionDelta | None = None
        """The delta of the version the engine serves, while it is the last one swapped in."""
        self._applied: VersionDelta | None = None
        """The delta of the version being swapped in (its buffer holds it; not served yet)."""

    def capture(self, staging: WeightsState) -> DeltaCapture | None:
        """A capture for the reader's apply into `staging`, or None (the full path)."""
        if not self.enabled or staging.manifest is None or self.engine.zero_copy:
            return None
        if self.engine.served_version() != staging.manifest.version:
            return None
        return DeltaCapture(staging.manifest)

    def swap(
        self, version: int, staging: WeightsState, *, digest: str, policy: SwapPolicy, capture: DeltaCapture | None
    ) -> SwapReport:
        """`staging` (holding `version`) into the engine, by the path the capture allows."""
        delta = capture.result(staging.manifest) if capture is not None else None
        weights = staging.state_dict()
        if delta is None:
            reason = (
                capture.reason
                if capture is not None
                else ("the engine takes whole versions" if not self.enabled else "no delta from the served version")
            )
            report = self.engine.swap(version, weights, digest=digest, policy=policy)
            self._served_delta = self._applied = None
            return dataclasses.replace(report, path="full", path_reason=report.path_reason or reason)
        self._applied = delta
        report = self.engine.swap_delta(version, delta, weights=weights, digest=digest, policy=policy)
        self._served_delta = delta if report.path == "delta" else None
        if report.path != "delta":
            log.info("%s: v%d went in whole: %s", self.name, version, report.path_reason)
        return report

    def undo(self, refused: int, *, policy: SwapPolicy) -> SwapReport | None:
        """The engine's O(delta) undo of `refused` (the last version swapped in), or None."""
        delta = self._served_delta
        if delta is None or delta.version.version != refused:
            return None
        report = self.engine.undo(refused, policy=policy)
        self._served_delta = None
        return report

    def revert(self, state: WeightsState) -> bool:
        """Puts the captured old bits back into `state` when it holds the version just applied
        (O(delta)); False when there is nothing to revert from (the caller reads the cache)."""
        delta = self._applied
        if delta is None or state.manifest is None or state.manifest.digest != delta.version.digest:
            return False
        delta.revert(state)
        self._applied = None
        log.info("%s: the agent's copy is back on v%d (%d elements)", self.name, delta.parent.version, delta.changed)
        return True
