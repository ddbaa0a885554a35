"""sync: the agent's core. Offers and objects in, a verified version out, swapped into the engine.

The gRPC threads only record what arrives (`intake.py`): an offered manifest (parsed, signature
checked, version checked against what is served) and pushed objects (each checked against its
content address, then written to the local cache). One sync thread does the rest, one version at
a time, taking it through the stages of its life in order (`state.py` lists them), one module each:

    offered   -> intake.py  the newest known version that is neither refused nor waiting for a
                            retry is the target; the store is polled every poll_interval_s for
                            versions nobody pushed
    planned   -> plan.py    its staging buffer, chain and path; the engine asked whether it fits
    gathered  -> gather.py  every object of the path in the cache, by push or from the store
    applied   -> apply.py   the path applied into the staging buffer, every byte checked
    swapped   -> swap.py    engine.swap; vetted by the probe under refuse; committed as served
    probed    -> parity.py  the engine's numbers against the trainer's (in the background
                            unless the action is refuse, where a breach refuses the version for
                            good and the refuse rule decides what is served: swap.py)

A failure at any stage leaves what the engine serves untouched; a copying engine's one buffer,
which apply rewrites in place, is put back as the served version (the captured delta reverted,
O(delta), else read back from the cache: `Applier.restore_served_copy`). The failure is
recorded in the ledger, a corrupt cached object is deleted so it is fetched again, and the version
is broken: retried with its own growing backoff (0.5 s doubling to 10 s) and reported in
`status()["broken"]` and the `agent/broken_versions` metric. A version the parity probe refused is
refused for good: never retried, never a fallback, and no older version is tried in its place;
the agent serves the newest version that passed, or nothing (swap.py, the refuse rule). Meanwhile the agent serves the
newest version it can verify: when every newer version it knows is broken, it takes the store's
newest other one above the served one as a target (`Intake.fall_back`), going down one version per
failure; a newer good version is taken as soon as it is known. Nothing unverified is ever served.

At start, beside the sync thread, a low-priority thread compiles the delta codecs' kernels (or
loads them from numba's cache), so a fresh machine does not compile them inside its first delta.

Memory: zero-copy engines serve the agent's buffers, so the agent double-buffers (under drain the
buffer of two versions back is rebuilt once its last request ends, under in_flight and abort a
token step after the swap); copying engines use one buffer. Received objects live in the cache on
disk, not in memory.

Not here: the gRPC plumbing (`server.py`), each stage (above), the served and spare buffers
(`buffers.py`), chunks applied before their offer (`early_apply.py`), the cache, its state file,
repairs and gc (`cache.py`), `status --verify` and health (`signals.py`), engines (`engines/`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from weightsync.agents import signals
from weightsync.agents.apply import Applier
from weightsync.agents.buffers import Buffers
from weightsync.agents.cache import AgentCache
from weightsync.agents.config import AgentConfig
from weightsync.agents.delta_swap import DeltaSwaps
from weightsync.agents.early_apply import EarlyApply
from weightsync.agents.engines.base import Engine, check_engine, check_swap_policy, check_weights_kind
from weightsync.agents.gather import Gatherer
from weightsync.agents.intake import Intake
from weightsync.agents.parity import ParityChecker, ParityRefused
from weightsync.agents.plan import Planner
from weightsync.agents.state import AgentState, Known
from weightsync.agents.swap import Swapper
from weightsync.errors import FormatError, IntegrityError, WeightsyncError
from weightsync.format import codecs
from weightsync.metrics import NULL_METRICS, Metrics
from weightsync.stores import Store
from weightsync.transport.push import Pusher
from weightsync.transport.signing import Verifier

log = logging.getLogger(__name__)

STUCK_WARN_S = 60.0
"""While versions keep failing with the errors already logged, the agent says it is stuck this often."""


class SyncAgent:
    """Receives, verifies and serves versions of one model (see the module docstring)."""

    def __init__(
        self,
        config: AgentConfig,
        engine: Engine,
        *,
        upstream: Store | None = None,
        verifier: Verifier | None = None,
        relay: Pusher | None = None,
        metrics: Metrics = NULL_METRICS,
    ) -> None:
        check_engine(engine)  # an engine handed in directly, not opened by the registry, too
        check_swap_policy(config.swap_policy, engine.swap_policies, engine=f"the {engine.name} engine")
        check_weights_kind(config.weights_kind, engine.weights_kinds, engine=f"the {engine.name} engine")
        self.config = config
        self.model = config.model
        self.engine = engine
        self.upstream = upstream
        self.relay = relay
        self.metrics = metrics
        self.state = AgentState(ledger_size=config.ledger_size)
        self.cache = AgentCache(config.cache_path, model=config.model, name=config.name, workers=config.workers)
        self.buffers = Buffers(engine)
        self.early = EarlyApply(self.buffers, enabled=config.apply_early, workers=config.workers, name=config.name)
        # The stages, in the order a version meets them; each gets what it works on, nothing more.
        self.intake = Intake(
            config, self.state, self.cache, upstream=upstream, verifier=verifier, relay=relay, early=self.early, metrics=metrics
        )  # fmt: skip
        self.planner = Planner(
            config, self.state, self.cache, self.buffers, self.early, engine, upstream=upstream, verifier=verifier
        )
        self.gatherer = Gatherer(config, self.state, self.cache, upstream=upstream, relay=relay, metrics=metrics)
        self.delta_swaps = DeltaSwaps(engine, name=config.name)  # in place, where the engine can
        self.applier = Applier(self.state, self.cache, self.buffers, self.delta_swaps, name=config.name)
        self.swapper = Swapper(config, self.state, engine, self.buffers, self.cache, self.delta_swaps, metrics=metrics)
        self.parity = ParityChecker(config.parity, engine, self.state, name=config.name, metrics=metrics)
        self.health = signals.HealthCheck(
            self.state, engine, upstream=upstream, model=config.model, name=config.name, metrics=metrics
        )
        self.started_unix_ms = int(time.time() * 1000)
        self._thread: threading.Thread | None = None
        self._next_stuck_warning = 0.0  # monotonic
        self.warm_up: codecs.BackgroundWarmUp | None = None  # the kernels' warm-up, started by start()

    # ------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Serves the last good version from the cache (if any), then starts syncing; the delta
        codecs' kernels warm up beside it (`codecs.BackgroundWarmUp`)."""
        self.swapper.serve_cached(vet=self.parity.after_swap if self.parity.blocking else None)
        # Kernels for bf16 (what publishers cast floats to) and what it serves, compiled while it waits.
        served = self.buffers.served.manifest.tensors if self.buffers.served is not None else ()
        self.warm_up = codecs.BackgroundWarmUp(
            {"bfloat16"} | {t.dtype for t in served}, thread_name=f"ws-agent-warm-up-{self.config.name}"
        )
        self._thread = threading.Thread(target=self._run, name=f"ws-agent-{self.config.name}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.state.close()
        if self.warm_up is not None:
            self.warm_up.stop()
        if self._thread is not None:
            self._thread.join(timeout=60)
        if self.warm_up is not None:
            self.warm_up.close()
        self.gatherer.close()
        self.early.close()
        self.parity.close()
        if self.relay is not None:
            self.relay.close(timeout_s=2)

    @property
    def served_version(self) -> int:
        return self.state.served_version

    @property
    def changed(self) -> threading.Event:
        """Set after each sync attempt (served or failed): what the health watch wakes on (`server.py`)."""
        return self.state.changed

    def wait_for_version(self, version: int, timeout_s: float) -> bool:
        """Blocks until `version` (or newer) is served; False on timeout."""
        return self.state.wait_for_version(version, timeout_s)

    # ------------------------------------------------------------------------- sync thread

    def _run(self) -> None:
        state = self.state
        next_poll = 0.0
        while True:
            with state.cond:
                if state.closed:
                    return
                if state.newest_ready() is None:
                    state.cond.wait(timeout=max(0.0, min(next_poll - time.monotonic(), 1.0)))
            if state.closed:
                return
            if self.upstream is not None and time.monotonic() >= next_poll:
                next_poll = time.monotonic() + self.config.poll_interval_s
                self.intake.poll_store()
            target = state.newest_ready()
            if target is None:
                self._idle()
                continue
            try:
                self._attempt(target)
            except Exception as e:  # never let the sync thread die: record, back off, retry
                if not isinstance(e, WeightsyncError):
                    log.exception("%s: unexpected error syncing v%d", self.config.name, target.manifest.version)
                self._record_failure(target, e)
                if state.newest_ready() is None:
                    self.intake.fall_back()

    def _idle(self) -> None:
        """Nothing to sync: the spare catches up with the served version (not while pushed
        chunks are being applied into it), then objects that waited for it are applied early."""
        if self.early.hold():
            try:
                self.buffers.catch_up_spare()
            finally:
                self.early.release()
        self.early.resume(self.state.served_version)

    def _attempt(self, target: Known) -> None:
        """One try at serving `target`; on any failure the served version stays served."""
        started = time.monotonic()
        # A copying engine's one buffer is the staging one: nobody hashes it while a sync may rewrite it.
        with self.buffers.rewrite_lock if not self.engine.zero_copy else contextlib.nullcontext():
            try:
                self._sync(target, started)
            except BaseException as e:
                try:
                    self.applier.restore_served_copy(self.engine.zero_copy)
                except Exception:  # the first error is the one to report, and the refuse below must run
                    log.exception("%s: the served version's copy could not be restored", self.config.name)
                if isinstance(e, ParityRefused):  # the refuse rule (swap.py)
                    self.swapper.refuse(target.manifest.version, e)
                # Kept in the ledger, so that the time a version took is explained in full (a drain
                # that timed out, a fetch that failed) when a later attempt serves it.
                entry = self.state.ledger.entry(target.manifest.version)
                with self.state.cond:
                    entry.timings_s["failed_attempts"] = entry.timings_s.get("failed_attempts", 0.0) + (
                        time.monotonic() - started
                    )
                raise
            finally:
                self.early.release()
                self.state.changed.set()

    def _sync(self, target: Known, started: float) -> None:
        """Takes `target` through the stages, in order (the module docstring)."""
        version = target.manifest.version
        entry = self.state.ledger.entry(version)
        try:
            plan = self.planner.plan(target)
        except (IntegrityError, FormatError):
            self._forget_failed_path([target])  # a parent that exists nowhere, or bases that disagree
            raise
        entry.path = plan.describe()
        timings = {"drain": plan.drain_s}
        try:
            t_gather = time.monotonic()
            timings |= self.gatherer.gather(plan, entry)
            t_apply = time.monotonic()
            early, capture = self.applier.apply(plan, entry)
            timings |= early | {"gather": t_apply - t_gather, "apply": time.monotonic() - t_apply}
        except (IntegrityError, FormatError) as e:
            self._forget_failed_path(list(plan.path))
            raise type(e)(
                f"v{version} failed verification ({e}); its unverified parts are dropped and fetched again"
            ) from e
        # Under refuse the version counts as served only once its probe passed.
        vet = self.parity.after_swap if self.parity.blocking else None
        self.swapper.swap_in(plan, entry, timings, started=started, capture=capture, vet=vet)
        if not self.parity.blocking:
            self.parity.after_swap(version, target.manifest)  # on its own thread: no delay
        self.cache.collect(
            keep=self.config.cache_keep_versions,
            protect={self.state.served_version} | self.buffers.versions(),
            grace_s=self.config.cache_grace_s,
            good_copy=self.planner.good_copy,
        )

    # ----------------------------------------------------------------------- failures

    def _forget_failed_path(self, path: list[Known]) -> None:
        """After a path failed verification: corrupt cached objects go (fetched again), the path's
        unserved manifests leave the cache (they have no good copy until the next attempt
        rewrites them), and an offered manifest that failed twice is forgotten (if it was real,
        the store or the next offer brings it back)."""
        state = self.state
        served = {
            known.manifest.version: known.data for known in path if known.manifest.version <= state.served_version
        }
        self.cache.repair(
            [known.manifest.version for known in path], served.get, objects_of=[known.manifest for known in path]
        )
        for known in path:
            version = known.manifest.version
            if known.source == "store":
                continue
            known.failures += 1
            if known.failures >= 2:
                with state.cond:
                    if state.known.get(version) is known:
                        del state.known[version]
                log.warning(
                    "%s: forgetting the v%d offered by %s: it failed verification twice",
                    self.config.name,
                    version,
                    known.source,
                )

    def _record_failure(self, target: Known, error: BaseException) -> None:
        manifest = target.manifest
        if isinstance(error, ParityRefused):  # never retried: not a broken version (the rule logged it)
            self.swapper.record_refusal(manifest, error)
            return
        version = manifest.version
        state = self.state
        entry = state.ledger.entry(version)
        entry.outcome, entry.error = "failed", f"{type(error).__name__}: {error}"
        state.last_error = f"v{version}: {entry.error}"
        broken = state.broken.fail(version, manifest.digest, entry.error, time.monotonic())
        self.metrics.inc("agent/errors")
        self.metrics.set("agent/broken_versions", len(state.broken))
        self.metrics.set("agent/newest_broken_version", state.broken.newest())
        retry_s = broken.retry_at - time.monotonic()
        if not broken.repeated:
            log.warning(
                "%s: v%d failed (%d times; next try in %.1f s): %s",
                self.config.name,
                version,
                broken.failures,
                retry_s,
                entry.error,
            )
            return
        # The same error again (a layout that can never fit the engine, a store that lost an
        # object): said once above; now only that the agent is stuck, at a bounded rate.
        log.debug("%s: v%d failed again (%d times): %s", self.config.name, version, broken.failures, entry.error)
        now = time.monotonic()
        if now >= self._next_stuck_warning:
            self._next_stuck_warning = now + STUCK_WARN_S
            log.warning(
                "%s: stuck on v%d: %d newer version(s) fail to sync; v%d failed %d times with the same error "
                "(next try in %.1f s; `weightsync status` lists them): %s",
                self.config.name,
                state.served_version,
                len(state.broken),
                version,
                broken.failures,
                retry_s,
                entry.error,
            )

    # ----------------------------------------------------------------------- signals

    def verify_served(self) -> str:
        """The version digest the agent's copy of the served version re-hashes to ("" when there is
        none); `signals.verify` says more."""
        return signals.verify(self.state, self.buffers, self.engine)["digest"]

    def check_health(self) -> str:
        """Why the agent is not healthy, "" when it is (`signals.HealthCheck`)."""
        return self.health.check()

    def status(self, *, verify: bool = False, verify_timeout_s: float = 5.0) -> dict:
        verification = signals.verify(self.state, self.buffers, self.engine, verify_timeout_s) if verify else None
        engine_state = signals.engine_state(self.engine)
        unhealthy = self.health.reason()[0]
        state = self.state
        with state.cond:
            target = max(state.known, default=state.served_version)
            status = {
                "agent": self.config.name,
                "region": self.config.region,
                "model": self.model,
                "current_version": state.served_version,
                "current_digest": state.served_digest,
                "target_version": max(target, state.served_version),
                "ledger": state.ledger.to_json(),
                "last_error": state.last_error,
                "engine": self.engine.name,
                "engine_state": engine_state,
                "unhealthy": unhealthy,
                "peers": list(self.config.peers),
                "started_unix_ms": self.started_unix_ms,
                "served_digest": verification["digest"] if verification else "",
                "broken": state.broken.to_json(time.monotonic()),
                "refused": sorted(state.refused),
                "parity": self.parity.last.to_json() if self.parity.last is not None else None,
            }
        if verification is not None:
            status["verification"] = {k: verification[k] for k in ("ok", "hashed", "error")}
        return status
