"""swap: the "swapped" stage. A built version handed to the engine, vetted, and committed as served.

    swap     `engine.swap` under the agent's swap policy (drain / in_flight / abort: what running
             requests do, `SwapPolicy`): the engine serves the version from here on
    vet      under the parity action refuse, the probe runs now (`parity.py`) and a breach raises
             ParityRefused: the version never counts as served, and the caller rolls back
    commit   the state file records the served version (crash-safe), the ledger its timings, the
             state names it; a version that took more than STALL_LOG_S from its offer is logged
             with where the time went

Two ways back, both here because both hand the engine a version again: `roll_back` (after the
probe refused a version the engine already served) and `serve_cached` (at start: the state
file's version, read again from the cache and verified).

Not here: building the version (`apply.py`), the probe itself (`parity.py`), the engines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from weightsync.agents.buffers import STALL_LOG_S, Buffers
from weightsync.agents.cache import AgentCache
from weightsync.agents.config import AgentConfig
from weightsync.agents.engines.base import Engine
from weightsync.agents.ledger import LedgerEntry
from weightsync.agents.plan import Plan
from weightsync.agents.state import AgentState
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
        *,
        metrics: Metrics,
    ) -> None:
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
        vet: Callable[[int, Manifest], object] | None = None,
    ) -> None:
        """Swaps `plan`'s built version into the engine, vets it (`vet` raises to refuse it), and
        commits it as served. `timings` holds the seconds of the stages so far, `started` the
        monotonic time the sync began; the ledger entry gets them all."""
        target = plan.target
        version = plan.version
        report = self.engine.swap(
            version, plan.staging.state_dict(), digest=target.manifest.digest, policy=self.config.swap_policy
        )
        if vet is not None:
            t_probe = time.monotonic()
            vet(version, target.manifest)
            timings["parity_probe"] = time.monotonic() - t_probe
        self.cache.write_state(version, target.manifest.digest)
        done = time.monotonic()
        state = self.state
        with state.cond:  # the ledger first, so whoever waits for this version sees it complete
            entry.outcome, entry.digest = "served", target.manifest.digest
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

    def roll_back(self, refused: int) -> None:
        """After the parity probe refused a version the engine was already serving: the served
        version goes back in, from the agent's copy of it (a zero-copy engine's served buffer was
        never touched; a copying engine's was read back from the cache by
        `Applier.restore_served_copy`)."""
        served = self.buffers.served
        manifest = served.manifest if served is not None else None
        version, digest = self.state.served()
        if version == 0 or manifest is None or manifest.digest != digest:
            log.error(
                "%s: v%d was refused by the parity probe, but the agent holds no earlier version to roll back "
                "to; the engine serves it until a version passes",
                self.name,
                refused,
            )
            return
        self.engine.swap(version, served.state_dict(), digest=digest, policy=self.config.swap_policy)
        if self.engine.zero_copy:  # requests may still run on the refused version's buffer, the spare
            self.buffers.spare_served_as = refused
        self.cache.write_state(version, digest)
        self.metrics.inc("agent/parity_rollbacks")
        log.warning("%s: rolled back from v%d to v%d", self.name, refused, version)

    def serve_cached(self) -> None:
        """After a restart: serves the state file's version from the cache, verified again."""
        state_file = self.cache.read_state()
        if state_file is None:
            return
        version, digest = state_file
        try:
            weights = self.cache.reader.read(version)
            if weights.manifest.digest != digest:
                raise IntegrityError(f"cached v{version} has digest {weights.manifest.digest}, the state file {digest}")
            self.engine.swap(version, weights.state_dict(), digest=digest, policy=self.config.swap_policy)
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
