"""swap: the "swapped" stage. A built version handed to the engine, vetted, and committed as served.

    swap     into the engine under the agent's swap policy (drain / in_flight / abort: what running
             requests do, `SwapPolicy`), in place where the engine patches the changed elements
             and the apply captured them, else whole (`delta_swap.py` chooses; the ledger says
             which path and why): the engine serves the version from here on
    vet      under the parity action refuse, the probe runs now (`parity.py`) and a breach raises
             ParityRefused: the version never counts as served, and the caller rolls back
    commit   the state file records the served version (crash-safe), the ledger its timings, the
             state names it; a version that took more than STALL_LOG_S from its offer is logged
             with where the time went

The refuse rule (parity action "refuse"; `refuse`): the agent serves the newest version that
passed the probe, or nothing, and says which. The version served before the refused one passed
(under refuse a version counts as served only once its probe passed, and one restored from the
cache at a restart is probed again): it goes back in bit for bit (the engine's undo log where it swapped
in place, O(delta); else the spare of a zero-copy engine, the cache's copy for a copying one). With none (a fresh agent, or a restored version that fails),
the engine is withdrawn where it can be (`Engine.withdraw`) and the agent serves nothing: version
0, not healthy (the reason names the refused version), `status --verify` fails. Versions older
than a refused one are never tried in its place (`AgentState.newest_ready`: a breach is the
engine's, not the version's); the next newer version is taken as it comes.

`serve_cached` hands the engine a version too: at start, the state file's version, read again
from the cache, verified, and vetted again under refuse.

Not here: building the version (`apply.py`), the probe itself (`parity.py`), the engines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from weightsync.agents.buffers import STALL_LOG_S, Buffers
from weightsync.agents.cache import AgentCache
from weightsync.agents.config import AgentConfig
from weightsync.agents.delta_swap import DeltaSwaps
from weightsync.agents.engines.base import Engine
from weightsync.agents.ledger import LedgerEntry
from weightsync.agents.parity import ParityRefused
from weightsync.agents.plan import Plan
from weightsync.agents.state import AgentState
from weightsync.delta_capture import DeltaCapture
from weightsync.errors import IntegrityError, WeightsyncError
from weightsync.format.manifest import Manifest
from weightsync.metrics import Metrics

log = logging.getLogger(__name__)


class Swapper:
    """Hands versions to one agent's engine (see the module docstring)."""

    def __init__(
        self,
        config: AgentConfig,
        state: AgentState,
        engine: Engine,
        buffers: Buffers,
        cache: AgentCache,
        delta_swaps: DeltaSwaps,
        *,
        metrics: Metrics,
    ) -> None:
        self.delta_swaps = delta_swaps
        self.config = config
        self.name = config.name
        self.state = state
        self.engine = engine
        self.buffers = buffers
        self.cache = cache
        self.metrics = metrics

    def swap_in(
        self,
        plan: Plan,
        entry: LedgerEntry,
        timings: dict[str, float],
        *,
        started: float,
        capture: DeltaCapture | None = None,
        vet: Callable[[int, Manifest], object] | None = None,
    ) -> None:
        """Swaps `plan`'s built version into the engine, vets it (`vet` raises to refuse it), and
        commits it as served. `timings` holds the seconds of the stages so far, `started` the
        monotonic time the sync began; the ledger entry gets them all. `capture`: what the apply
        changed, for an in-place swap (`delta_swap.py` chooses the path; the ledger says which)."""
        target = plan.target
        version = plan.version
        state = self.state
        with state.cond:
            state.swapping = version
        try:
            report = self.delta_swaps.swap(
                version, plan.staging, digest=target.manifest.digest, policy=self.config.swap_policy, capture=capture
            )
            if vet is not None:
                t_probe = time.monotonic()
                vet(version, target.manifest)
                timings["parity_probe"] = time.monotonic() - t_probe
            self.cache.write_state(version, target.manifest.digest)
        except BaseException:
            with state.cond:
                state.swapping = 0
            raise
        done = time.monotonic()
        with state.cond:  # the ledger first, so whoever waits for this version sees it complete
            entry.outcome, entry.digest = "served", target.manifest.digest
            entry.swap_path, entry.swap_path_reason = report.path, report.path_reason
            entry.served_unix_ms = int(time.time() * 1000)
            entry.timings_s.update(
                timings,
                swap=report.total_s,
                swap_pause=report.pause_s,
                total=done - started,
                since_offer=done - target.offered_at,
            )
            state.ledger.supersede(version)
            state.broken.forget_up_to(version)
            self.buffers.swapped(plan.staging, state.served_version)
            state.served_version, state.served_digest = version, target.manifest.digest
            state.swapping = 0
            state.refusal = ""
            state.pending_bytes = 0  # what was pushed for it no longer counts against the quota
            state.pushed = {a: pushed for a, pushed in state.pushed.items() if pushed[0] > version}
            state.cond.notify_all()
        self.metrics.set("agent/version", version)
        self.metrics.set("agent/broken_versions", len(state.broken))
        self.metrics.set("agent/newest_broken_version", state.broken.newest())
        self.metrics.observe("agent/swap_pause_s", report.pause_s)
        self.metrics.observe("agent/sync_s", done - target.offered_at)
        self.metrics.inc("agent/versions_served", path="deltas" if plan.start else "base")
        log.info(
            "%s: serving v%d (%s) %.3f s after the offer; swap pause %.2f ms",
            self.name,
            version,
            entry.path,
            done - target.offered_at,
            1000 * report.pause_s,
        )
        self._log_stall(entry, done - target.offered_at)

    def _log_stall(self, entry: LedgerEntry, since_offer_s: float) -> None:
        """A version that took more than STALL_LOG_S from its offer to being served is logged with
        where the time went, biggest stage first (the ledger keeps the same timings)."""
        if since_offer_s <= STALL_LOG_S:
            return
        t = entry.timings_s
        stages = {
            f"waiting for requests on the previous buffer's version (swap_policy {self.config.swap_policy})": t.get(
                "drain", 0.0
            ),
            "waiting for pushes": t.get("push_wait", 0.0),
            "fetching from the store": t.get("fetch", 0.0),
            "applying and verifying": t.get("apply", 0.0),
            "swapping into the engine": t.get("swap", 0.0),
            f"in earlier attempts that failed (last: {entry.error or '?'})": t.get("failed_attempts", 0.0),
        }
        accounted = sum(stages.values()) + t.get("gather", 0.0) - t.get("push_wait", 0.0) - t.get("fetch", 0.0)
        stages["queued behind the previous sync"] = max(0.0, since_offer_s - accounted)
        parts = ", ".join(f"{s:.1f} s {what}" for what, s in sorted(stages.items(), key=lambda kv: -kv[1]) if s >= 0.05)
        log.warning("%s: v%d took %.1f s from offer to serving: %s", self.name, entry.version, since_offer_s, parts)

    def refuse(self, refused: int, error: ParityRefused) -> None:
        """The refuse rule, after the probe refused `refused`, which the engine was already
        serving: the newest version that passed goes back in, bit for bit from the agent's copy
        (a zero-copy engine's served buffer was never touched; a copying engine's was put back by
        `Applier.restore_served_copy`: the delta reverted in place, else read from the cache), or
        the engine is withdrawn and the agent serves nothing. One ERROR line says which."""
        served = self.buffers.served
        manifest = served.manifest if served is not None else None
        version, digest = self.state.served()
        reason = "no version has passed the parity probe on this engine"
        if version and manifest is not None and manifest.digest == digest:
            try:
                if self.delta_swaps.undo(refused, policy=self.config.swap_policy) is None:  # else undone in place
                    self.engine.swap(version, served.state_dict(), digest=digest, policy=self.config.swap_policy)
            except WeightsyncError as e:
                reason = f"v{version}, the newest version that passed, could not be put back ({e})"
            else:
                if self.engine.zero_copy:  # requests may still run on the refused version's buffer, the spare
                    self.buffers.spare_served_as = refused
                self.cache.write_state(version, digest)
                self.metrics.inc("agent/parity_rollbacks")
                log.error(
                    "%s: %s: serving v%d again, the newest version that passed (bit for bit from the agent's copy)",
                    self.name,
                    error,
                    version,
                )
                return
        elif version:
            reason = f"the agent's copy of v{version}, the newest version that passed, is not available"
        self.serve_nothing(refused, f"{error}; {reason}: serving nothing until a newer version passes")

    def record_refusal(self, manifest: Manifest, error: ParityRefused) -> None:
        """A version the probe refused: refused for good, never a broken version to retry."""
        state = self.state
        with state.cond:
            entry = state.ledger.entry(manifest.version)
            entry.outcome, entry.error = "refused", f"{type(error).__name__}: {error}"
            state.refused[manifest.version] = manifest.digest
            state.last_error = f"v{manifest.version}: {entry.error}"
        self.metrics.inc("agent/errors")

    def serve_nothing(self, refused: int, reason: str) -> None:
        """The engine stops serving `refused` where it can (`withdraw`); the state's `refusal` says
        why, as health, `status` and `agent/serving` do while no version that passed is served."""
        withdraw = getattr(self.engine, "withdraw", None)
        if callable(withdraw):
            try:
                withdraw(reason)
            except WeightsyncError as e:
                reason += f" (the {self.engine.name} engine could not be withdrawn and may still serve v{refused}: {e})"
        else:
            reason += (
                f" (the {self.engine.name} engine cannot be withdrawn: it still serves v{refused}; send it no requests)"
            )
        if self.engine.zero_copy:  # requests may still run on the refused version's buffer, the spare
            self.buffers.spare_served_as = refused
        with self.state.cond:  # version 0: what status and health say (the state file keeps the last
            # version that passed, vetted again at a restart)
            self.state.served_version, self.state.served_digest = 0, ""
            self.state.refusal = reason
        self.metrics.set("agent/version", 0)
        log.error("%s: %s", self.name, reason)

    def serve_cached(self, *, vet: Callable[[int, Manifest], object] | None = None) -> None:
        """After a restart: serves the state file's version from the cache, verified again, and
        vetted again (`vet`: the probe under refuse; the engine may have changed): after a
        breach the agent serves nothing (the refuse rule)."""
        state_file = self.cache.read_state()
        if state_file is None:
            return
        version, digest = state_file
        try:
            weights = self.cache.reader.read(version)
            if weights.manifest.digest != digest:
                raise IntegrityError(f"cached v{version} has digest {weights.manifest.digest}, the state file {digest}")
            self.engine.swap(version, weights.state_dict(), digest=digest, policy=self.config.swap_policy)
            if vet is not None:
                vet(version, weights.manifest)
        except ParityRefused as e:  # nothing passed on this engine since the restart
            self.record_refusal(weights.manifest, e)
            reason = "no version has passed on this engine since the agent started"
            self.serve_nothing(version, f"{e}; {reason}: serving nothing until a newer version passes")
            return
        except WeightsyncError as e:
            self.state.last_error = f"restore: {e}"
            log.warning("%s: cannot serve cached v%d (%s); catching up from the store", self.name, version, e)
            return
        state = self.state
        with state.cond:
            self.buffers.served = weights
            state.served_version, state.served_digest = version, digest
            entry = state.ledger.entry(version, source="cache")
            entry.outcome, entry.path, entry.digest = "served", "cache", digest
            entry.served_unix_ms = int(time.time() * 1000)
        self.metrics.set("agent/version", version)
        log.info("%s: restarted serving v%d from its cache", self.name, version)
