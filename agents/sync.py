"""sync: the agent's core — offers and objects in, a verified version out, swapped into the engine.

gRPC threads only record what arrives: an offered manifest (parsed, signature checked, version
checked against what is served) and pushed objects (each checked against its content address,
then written to the local cache). One sync thread does the rest, one version at a time:

    idle     -> nothing newer than the served version is known, or all of it is broken and
                waiting for its retry (the store is polled every poll_interval_s for versions
                nobody pushed)
    gather   -> the newest known version that is not waiting for a retry is the target. Its
                path is planned: the deltas after the staging buffer's version when that
                version is on the target's chain, else the target's base and its deltas. Every
                object of the path is brought into the cache: by push, or from the store once
                pushes stall for push_wait_s (or at once when nobody is pushing). Manifests
                enter the cache after their objects.
    apply    -> chunks pushed with their placement were applied into the spare as they arrived
                (`early_apply.py`); those the target's manifest confirms are kept, the others get
                the parent's bytes back. The Reader applies the rest of the path from the cache
                into the staging buffer, checking each object's hash before decoding and each
                chunk's raw hash after; at the target every byte is covered by a checked hash,
                and the raw hashes by the version digest. Two or more deltas are applied folded
                (range by range, one hash pass per chunk, `weightsync/format/codecs/fold.py`); the ledger
                records the route (chain or folded) and why.
    swap     -> engine.swap under the agent's swap policy (drain / in_flight / abort: what running
                requests do, `SwapPolicy`); the state file records the served version
                (crash-safe), the ledger its timings; old cache entries are collected. A version
                that took more than STALL_LOG_S from its offer is logged with where the time went.
    probe    -> a version that carries a parity probe is checked against what the engine computes
                (`parity.py`): on its own thread under the warn and alert actions, in the swap's
                path under refuse, where a breach swaps the previous version back in (the spare of
                a zero-copy engine, the cache's copy for a copying one) and the version is refused
                for good: never retried, never a fallback; a newer version is taken as it comes.
Before gather, the engine is asked whether it would take the target's layout (`check_fit`): a
version it would refuse fails there, before a byte is fetched or written. A failure in gather,
apply or swap leaves what the engine serves untouched, and a copying engine's one buffer, which
apply rewrites in place, is read back from the cache as the served version; the failure is
recorded, a corrupt cached object is deleted so it is fetched again, and the version is broken: retried with
its own growing backoff (0.5 s doubling to 10 s) and reported in `status()["broken"]` and the
`agent/broken_versions` metric. Meanwhile the agent serves the newest version it can verify: when
every newer version it knows is broken, it takes the store's newest other one above the served
one as a target (an older base and its deltas), going down one version per failure; a newer
good version is taken as soon as it is known. Nothing unverified is ever served.

At start, beside the sync thread, a low-priority thread compiles the delta codecs' kernels (or
loads them from numba's cache), so a fresh machine does not compile them inside its first delta.

Memory: zero-copy engines serve the agent's buffers, so the agent double-buffers (under drain the
buffer of two versions back is rebuilt once its last request ends, under in_flight and abort a
token step after the swap); copying engines use one buffer. Received objects live in the cache on disk, not in memory.

Not here: the gRPC plumbing (`server.py`), what pushers send (`intake.py`), the served and spare
buffers (`buffers.py`), the cache, its state file, repairs and gc (`cache.py`), the ledger and
broken versions (`ledger.py`), `status --verify` and health (`signals.py`), engines (`engines/`).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import logging
import threading
import time

from weightsync.agents import signals
from weightsync.agents.buffers import STALL_LOG_S, Buffers
from weightsync.agents.cache import AgentCache
from weightsync.agents.config import AgentConfig
from weightsync.agents.delta_swap import DeltaSwaps
from weightsync.agents.early_apply import EarlyApply
from weightsync.agents.engines.base import (
    Engine,
    check_engine,
    check_swap_policy,
    check_weights_kind,
    manifest_layout,
)
from weightsync.agents.intake import PushIntake, check_model
from weightsync.agents.ledger import BrokenVersions, Ledger, LedgerEntry
from weightsync.agents.parity import ParityChecker, ParityRefused, ParityReport
from weightsync.errors import (
    FormatError,
    IntegrityError,
    LayoutError,
    ObjectNotFound,
    StaleVersion,
    WeightsyncError,
)
from weightsync.format import codecs
from weightsync.format.manifest import KIND_FULL, ChunkPlacement, ChunkRef, Manifest, parse_manifest
from weightsync.metrics import NULL_METRICS, Metrics
from weightsync.reader import WeightsState, check_delta_layout
from weightsync.stores import Store
from weightsync.transport.push import Pusher
from weightsync.transport.signing import Verifier
from weightsync.versions import latest_version, list_versions, read_manifest_bytes, read_signature

log = logging.getLogger(__name__)

_RETRY_S = (0.5, 10.0)  # a broken version's retry backoff: first, most


@dataclasses.dataclass
class _Known:
    """A manifest the agent accepted (offered, or found in the store) and has not served yet."""

    manifest: Manifest
    data: bytes
    signature: bytes | None
    source: str
    offered_unix_ms: int
    offered_at: float  # monotonic
    pushed: bool  # offered by a pusher (publisher or upstream agent)
    failures: int = 0  # sync attempts that failed verification with this manifest on the path


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
        self.config = config
        self.engine = engine
        self.upstream = upstream
        self.verifier = verifier
        self.relay = relay
        self.metrics = metrics
        check_engine(engine)  # an engine handed in directly, not opened by the registry, too
        check_swap_policy(config.swap_policy, engine.swap_policies, engine=f"the {engine.name} engine")
        check_weights_kind(config.weights_kind, engine.weights_kinds, engine=f"the {engine.name} engine")
        self.model = config.model
        self.cache = AgentCache(config.cache_path, model=config.model, name=config.name, workers=config.workers)
        self.reader = self.cache.reader
        self._cond = threading.Condition()
        self._known: dict[int, _Known] = {}
        self.buffers = Buffers(engine, self._cond)
        self.delta_swaps = DeltaSwaps(engine, name=config.name)
        self.early = EarlyApply(self.buffers, enabled=config.apply_early, workers=config.workers, name=config.name)
        self._served_version = 0
        self._served_digest = ""
        self.intake = PushIntake(
            config,
            self.cache,
            accept=self._accept,
            served_version=lambda: self._served_version,
            relay=relay,
            metrics=metrics,
            cond=self._cond,
            apply_early=lambda *obj: self.early.submit(*obj, self._served_version),
        )
        self.ledger = Ledger(config.ledger_size)
        self.broken = BrokenVersions(_RETRY_S)
        self.parity = ParityChecker(
            config.parity,
            engine,
            name=config.name,
            metrics=metrics,
            record=self._record_parity,
            served_version=lambda: self._served_version,
        )
        self._refused: dict[int, str] = {}
        """Versions the parity probe refused (version -> manifest digest): never served again."""
        self.last_error = ""
        self.started_unix_ms = int(time.time() * 1000)
        self.changed = threading.Event()
        """Set after each sync attempt (served or failed): what the health watch wakes on (`server.py`)."""
        self._health = signals.HealthCheck(self)
        self._closed = False
        self._thread: threading.Thread | None = None
        self.warm_up: codecs.BackgroundWarmUp | None = None  # the kernels' warm-up, started by start()
        self._fetch_pool = cf.ThreadPoolExecutor(
            max(1, int(getattr(upstream, "io_concurrency", 4))), thread_name_prefix="ws-agent-fetch"
        )

    # ------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Serves the last good version from the cache (if any), then starts syncing; the delta
        codecs' kernels warm up beside it (`codecs.BackgroundWarmUp`)."""
        self._restore()
        # Kernels for bf16 (what publishers cast floats to) and what it serves, compiled while it waits.
        served = self.buffers.served.manifest.tensors if self.buffers.served is not None else ()
        self.warm_up = codecs.BackgroundWarmUp(
            {"bfloat16"} | {t.dtype for t in served}, thread_name=f"ws-agent-warm-up-{self.config.name}"
        )
        self._thread = threading.Thread(target=self._run, name=f"ws-agent-{self.config.name}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self.warm_up is not None:
            self.warm_up.stop()
        if self._thread is not None:
            self._thread.join(timeout=60)
        if self.warm_up is not None:
            self.warm_up.close()
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)
        self.early.close()
        self.parity.close()
        if self.relay is not None:
            self.relay.close(timeout_s=2)

    @property
    def served_version(self) -> int:
        return self._served_version

    def wait_for_version(self, version: int, timeout_s: float) -> bool:
        """Blocks until `version` (or newer) is served; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._served_version < version:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(timeout=remaining)
            return True

    # ------------------------------------------------------------------- incoming (gRPC threads)

    def offer(
        self, *, model: str, version: int, manifest: bytes, signature: bytes, objects: list[str], origin: str, hops: int
    ) -> tuple[bool, list[str]]:
        """An offer from a publisher or an upstream agent: (wanted, objects still missing)."""
        return self.intake.offer(
            model=model,
            version=version,
            manifest=manifest,
            signature=signature,
            objects=objects,
            origin=origin,
            hops=hops,
        )

    def receive_object(
        self,
        *,
        model: str,
        version: int,
        address: str,
        data: memoryview | bytes,
        placement: ChunkPlacement | None = None,
    ) -> bool:
        """One pushed object: kept (True) if new, verified against its address first; applied
        into the spare at once when its placement allows (`early_apply.py`)."""
        return self.intake.receive_object(model=model, version=version, address=address, data=data, placement=placement)

    def _accept(
        self, data: bytes, signature: bytes | None, source: str, *, pushed: bool, expect_version: int | None = None
    ) -> _Known:
        """Parses and checks a manifest (signature, model, not older than served); records it.

        The store is the source of truth: a manifest read from it replaces a different one that
        was offered under the same version number (an offer that never committed, or a forgery
        on an agent that does not require signatures). Two different offers are refused."""
        manifest = parse_manifest(data)
        check_model(self.model, manifest.model)
        kind = manifest.producer.get("weights_kind", "model")
        if kind != self.config.weights_kind:
            raise FormatError(
                f"v{manifest.version} of {manifest.model} holds {kind!r} weights, but this agent's engine "
                f"serves {self.config.weights_kind!r} weights (agent weights_kind); point the agent at "
                "the store model of the right kind (LoRA runs publish merged weights and adapters apart)"
            )
        if expect_version is not None and manifest.version != expect_version:
            raise FormatError(f"offer says v{expect_version} but its manifest is v{manifest.version}")
        if self.verifier is not None and (signature or self.config.require_signatures):
            self.verifier.verify(data, signature)
        with self._cond:
            if manifest.version < self._served_version:
                raise StaleVersion(f"v{manifest.version} is older than the served v{self._served_version}")
            if manifest.version == self._served_version and manifest.digest != self._served_digest:
                raise IntegrityError(f"v{manifest.version} differs from the one served (digest mismatch): a replay?")
            known = self._known.get(manifest.version)
            if known is not None and known.manifest.digest == manifest.digest:
                known.pushed = known.pushed or pushed
                return known
            if known is not None and source != "store":
                raise IntegrityError(f"two different manifests offered as v{manifest.version}")
            if known is not None:
                log.warning(
                    "%s: v%d in the store differs from the one offered by %s; the store's wins",
                    self.config.name,
                    manifest.version,
                    known.source,
                )
            known = _Known(manifest, data, signature, source, int(time.time() * 1000), time.monotonic(), pushed)
            if manifest.version > self._served_version:
                self._known[manifest.version] = known
                self.ledger.entry(manifest.version, source=source, offered_unix_ms=known.offered_unix_ms)
                self._cond.notify_all()
            return known

    # ------------------------------------------------------------------------- sync thread

    def _run(self) -> None:
        next_poll = 0.0
        while True:
            with self._cond:
                if self._closed:
                    return
                target = self._newest()
                if target is None:
                    self._cond.wait(timeout=max(0.0, min(next_poll - time.monotonic(), 1.0)))
            if self._closed:
                return
            if self.upstream is not None and time.monotonic() >= next_poll:
                next_poll = time.monotonic() + self.config.poll_interval_s
                self._poll_store()
            target = self._newest()
            if target is None:
                if self.early.hold():  # not while pushed chunks are being applied into the spare
                    try:
                        self.buffers.catch_up_spare()
                    finally:
                        self.early.release()
                self.early.resume(self._served_version)
                continue
            try:
                self._sync_to(target)
            except Exception as e:  # never let the sync thread die: record, back off, retry
                if not isinstance(e, WeightsyncError):
                    log.exception("%s: unexpected error syncing v%d", self.config.name, target.manifest.version)
                self._record_failure(target.manifest, e)
                if self._newest() is None:
                    self._fall_back()

    def _newest(self) -> _Known | None:
        """The newest accepted version that is not a broken one waiting for its retry."""
        now = time.monotonic()
        with self._cond:
            for version in [v for v in self._known if v <= self._served_version]:
                del self._known[version]
            ready = [
                v
                for v, k in self._known.items()
                if not self.broken.waiting(v, k.manifest.digest, now) and self._refused.get(v) != k.manifest.digest
            ]
            return self._known[max(ready)] if ready else None

    def _fall_back(self) -> None:
        """While every newer version the agent knows is broken: the newest other version in the
        store above the served one becomes a target, so that the agent serves the newest version
        it can verify (an older base and its deltas) while the broken ones wait for their retry."""
        if self.upstream is None:
            return
        version = None
        try:
            with self._cond:
                skip = set(self._known) | {self._served_version}
            now = time.monotonic()
            candidates = [
                v
                for v in list_versions(self.upstream, self.model)
                if v > self._served_version
                and v not in skip
                and v not in self._refused
                and not self.broken.waiting(v, None, now)
            ]
            if not candidates:
                return
            version = max(candidates)
            _, data = read_manifest_bytes(self.upstream, self.model, version)
            self._accept(data, read_signature(self.upstream, self.model, version, data), "store", pushed=False)
            log.info("%s: falling back to v%d while newer versions are broken", self.config.name, version)
        except WeightsyncError as e:
            log.warning("%s: no fallback version from %s: %s", self.config.name, self.upstream.uri, e)
            if version is not None:  # its manifest does not read: broken too, so the next try goes lower
                self.broken.fail(version, "", f"{type(e).__name__}: {e}", time.monotonic())

    def _poll_store(self) -> None:
        try:
            latest = latest_version(self.upstream, self.model)
            if latest is None or latest <= self._served_version:
                return
            with self._cond:
                newest = max(self._known, default=0)
                known = self._known.get(latest)
            # Nothing new, unless what we hold for the store's latest did not come from the store:
            # then read the store's (one GET) so that a bogus or uncommitted offer cannot hide it.
            if latest < newest or (known is not None and known.source == "store"):
                return
            _, data = read_manifest_bytes(self.upstream, self.model, latest)
            if known is not None and data == known.data:
                return
            known = self._accept(data, read_signature(self.upstream, self.model, latest, data), "store", pushed=False)
            if self.relay is not None:  # the peers get it from us, objects included, as we fetch them
                self.relay.offer(latest, known.data, known.signature, hops=1)
        except WeightsyncError as e:
            self.last_error = f"store poll: {e}"
            log.warning("%s: polling %s failed: %s", self.config.name, self.upstream.uri, e)

    def _sync_to(self, target: _Known) -> None:
        started = time.monotonic()
        # A copying engine's one buffer is the staging one: nobody hashes it while a sync may rewrite it.
        with self.buffers.rewrite_lock if not self.engine.zero_copy else contextlib.nullcontext():
            try:
                self._sync_version(target)
            except BaseException as e:
                self._restore_served_copy()
                if isinstance(e, ParityRefused):
                    self._roll_back(target.manifest.version)
                # Kept in the ledger, so that the time a version took is explained in full (a drain
                # that timed out, a fetch that failed) when a later attempt serves it.
                entry = self.ledger.entry(target.manifest.version)
                with self._cond:
                    entry.timings_s["failed_attempts"] = entry.timings_s.get("failed_attempts", 0.0) + (
                        time.monotonic() - started
                    )
                raise
            finally:
                self.early.release()
                self.changed.set()

    def _roll_back(self, refused: int) -> None:
        """After the parity probe refused a version the engine was already serving: the served
        version goes back in, from the agent's copy of it (a zero-copy engine's served buffer was
        never touched; a copying engine's was read back from the cache by `_restore_served_copy`)."""
        served = self.buffers.served
        manifest = served.manifest if served is not None else None
        if self._served_version == 0 or manifest is None or manifest.digest != self._served_digest:
            log.error(
                "%s: v%d was refused by the parity probe, but the agent holds no earlier version to roll back "
                "to; the engine serves it until a version passes",
                self.config.name,
                refused,
            )
            return
        if self.delta_swaps.undo(refused, policy=self.config.swap_policy) is None:  # else O(delta) undone
            self.engine.swap(
                self._served_version, served.state_dict(), digest=self._served_digest, policy=self.config.swap_policy
            )
        if self.engine.zero_copy:  # requests may still run on the refused version's buffer, the spare
            self.buffers.spare_served_as = refused
        self.cache.write_state(self._served_version, self._served_digest)
        self.metrics.inc("agent/parity_rollbacks")
        log.warning("%s: rolled back from v%d to v%d", self.config.name, refused, self._served_version)

    def _restore_served_copy(self) -> None:
        """After a failed sync on a copying engine, whose one buffer the sync rewrote in place: the
        agent's copy goes back to the served version, read again from the cache (its chain is
        kept there), so that what `status --verify` hashes and the next delta's parent are the
        served bytes again. A version of another layout never gets here (`check_fit` refuses it
        before anything is written); this is the path of the rarer failures (a reload the server
        refused, a digest the workers disagree with, an apply that failed half-way)."""
        served = self.buffers.served
        if self.engine.zero_copy or served is None or self._served_version == 0:
            return  # zero-copy: the sync wrote into the spare; nothing served: nothing to restore
        manifest = served.manifest
        if manifest is not None and (manifest.version, manifest.digest) == (self._served_version, self._served_digest):
            return  # the failure came before the buffer was touched
        if self.delta_swaps.revert(served):  # the captured old bits back: O(delta)
            return
        try:
            self.reader.advance_route(served, self._served_version)
            if served.manifest is None or served.manifest.digest != self._served_digest:
                raise IntegrityError(f"the cache's v{self._served_version} is not the one served")
        except WeightsyncError as e:
            served.manifest = None  # `status --verify` says the copy is unavailable; the next sync reads a base
            served.buffers.clear()
            log.error(
                "%s: cannot rebuild the agent's copy of the served v%d from its cache after a failed sync (%s); "
                "the next version is applied from its base",
                self.config.name,
                self._served_version,
                e,
            )
            return
        log.info("%s: the agent's copy of v%d is back after the failed sync", self.config.name, self._served_version)

    def _sync_version(self, target: _Known) -> None:
        version = target.manifest.version
        entry = self.ledger.entry(version)
        t0 = time.monotonic()
        staging, drain_s = self.buffers.staging(self.config.name, self.config.swap_policy)
        early = self.early.take(staging, target.manifest)  # chunks applied as they arrived
        t_gather = time.monotonic()
        timings: dict[str, float] = {"drain": drain_s}
        try:
            chain = self._chain(target)
        except (IntegrityError, FormatError):
            self._forget_failed_path([target])  # a parent that exists nowhere, or bases that disagree
            raise
        # Before any byte is fetched or written: a version the engine would refuse for its layout
        # (another vocabulary, another architecture) must not touch the buffer a copying engine
        # is handed, which is the agent's copy of what it serves.
        try:
            self.engine.check_fit(manifest_layout(target.manifest.layout))
        except LayoutError as e:
            raise LayoutError(f"v{version} does not fit what the {self.engine.name} engine serves: {e}") from e
        start = 0
        if staging.manifest is not None:
            for i, known in enumerate(chain):
                same = known.manifest.version == staging.manifest.version
                if same and known.manifest.digest == staging.manifest.digest:
                    start = i + 1
        path = chain[start:]
        entry.path = (
            f"deltas {staging.manifest.version}->{version}"
            if start
            else f"base {chain[0].manifest.version} + {len(chain) - 1} deltas"
        )
        try:
            self._gather(target, path, entry, timings)
            # The reader re-reads the whole chain's manifests from the cache, also those of the
            # versions it does not apply again: a cached one that rotted is put back first.
            good = {known.manifest.version: known.data for known in chain[:start]}
            self.cache.repair(good, good.get)
            t_apply = time.monotonic()
            # Several deltas behind: folded into one pass per chunk range (weightsync/format/codecs/fold.py).
            done = early.done if len(path) == 1 else frozenset()
            capture = self.delta_swaps.capture(staging)  # the changed elements, for an in-place swap
            route = self.reader.advance_route(staging, version, done=done, capture=capture)
            if route is not None:
                entry.route, entry.route_reason = route.kind, route.reason
            entry.applied_early = len(done)
            if early.span_s:  # the early decodes' span, and how much of it the sync waited out
                timings.update(early_apply=early.span_s, early_wait=early.wait_s)
        except (IntegrityError, FormatError) as e:
            self._forget_failed_path(path)
            raise type(e)(
                f"v{version} failed verification ({e}); its unverified parts are dropped and fetched again"
            ) from e
        t_swap = time.monotonic()
        report = self.delta_swaps.swap(
            version, staging, digest=target.manifest.digest, policy=self.config.swap_policy, capture=capture
        )
        if self.parity.blocking:  # under refuse the version counts as served only once it passed
            t_probe = time.monotonic()
            self.parity.after_swap(version, target.manifest)
            timings["parity_probe"] = time.monotonic() - t_probe
        self.cache.write_state(version, target.manifest.digest)
        done = time.monotonic()
        with self._cond:  # the ledger first, so whoever waits for this version sees it complete
            entry.outcome, entry.digest = "served", target.manifest.digest
            entry.swap_path, entry.swap_path_reason = report.path, report.path_reason
            entry.served_unix_ms = int(time.time() * 1000)
            entry.timings_s.update(
                timings,
                gather=t_apply - t_gather,
                apply=t_swap - t_apply,
                swap=report.total_s,
                swap_pause=report.pause_s,
                total=done - t0,
                since_offer=done - target.offered_at,
            )
            self.ledger.supersede(version)
            self.broken.forget_up_to(version)
            self.buffers.swapped(staging, self._served_version)
            self._served_version, self._served_digest = version, target.manifest.digest
            self.intake.swapped()
            self._cond.notify_all()
        self.metrics.set("agent/version", version)
        self._report_broken()
        self.metrics.observe("agent/swap_pause_s", report.pause_s)
        self.metrics.observe("agent/sync_s", done - target.offered_at)
        self.metrics.inc("agent/versions_served", path="deltas" if start else "base")
        log.info(
            "%s: serving v%d (%s) %.3f s after the offer; swap pause %.2f ms",
            self.config.name,
            version,
            entry.path,
            done - target.offered_at,
            1000 * report.pause_s,
        )
        self._log_stall(entry, done - target.offered_at)
        if not self.parity.blocking:
            self.parity.after_swap(version, target.manifest)  # on its own thread: no delay
        self._collect_cache()

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
        log.warning(
            "%s: v%d took %.1f s from offer to serving: %s", self.config.name, entry.version, since_offer_s, parts
        )

    def _chain(self, target: _Known) -> list[_Known]:
        """The target's chain, base first, from accepted manifests, the cache or the store."""
        chain = [target]
        while chain[-1].manifest.kind != KIND_FULL:
            parent = chain[-1].manifest.parent
            chain.append(self._manifest(parent))
            if chain[-1].manifest.base != chain[-2].manifest.base:
                raise FormatError(f"v{chain[-2].manifest.version} and its parent v{parent} disagree on their base")
            # Said before the engine's check_fit, which would name only the tensor that differs.
            check_delta_layout(self.model, chain[-1].manifest, chain[-2].manifest)
        chain.reverse()
        return chain

    def _manifest(self, version: int, *, cached: bool = True) -> _Known:
        """An accepted manifest, else the cache's (unless not `cached`), else the store's, checked."""
        with self._cond:
            known = self._known.get(version)
        if known is not None:
            return known
        for store in (self.cache.store if cached else None, self.upstream):
            if store is None:
                continue
            try:
                manifest, data = read_manifest_bytes(store, self.model, version)
            except WeightsyncError:
                continue
            if store is self.upstream and self.verifier is not None:
                signature = read_signature(store, self.model, version, data)
                if signature or self.config.require_signatures:
                    self.verifier.verify(data, signature)
            return _Known(manifest, data, None, "store", 0, time.monotonic(), False)
        raise IntegrityError(f"v{version}, needed to reach a newer version, is neither cached nor in the store")

    def _gather(self, target: _Known, path: list[_Known], entry: LedgerEntry, timings: dict[str, float]) -> None:
        """Brings every object of `path` into the cache (push, else store), then its manifests;
        `timings` gets the seconds spent waiting for pushes and fetching."""
        refs: dict[str, ChunkRef] = {}
        for known in path:
            for tensor in known.manifest.tensors:
                for ref in tensor.chunks:
                    if ref.object is not None:
                        refs[ref.address_key] = ref  # the cache keeps objects by address, packed or not
        missing = self.cache.missing(refs)
        # Wait for pushes while they make progress when they are expected; an agent nobody
        # pushes to fetches at once.
        started = time.monotonic()
        if missing and self.intake.expected(target.pushed):
            missing = self.intake.wait(missing, lambda: self._closed)
        fetching = time.monotonic()
        fetched = self._fetch(missing, target.manifest.version) if missing else 0
        timings.update(push_wait=fetching - started, fetch=time.monotonic() - fetching)
        entry.bytes_fetched += fetched
        entry.bytes_pushed += sum(r.size for r in refs.values()) - fetched
        for known in path:  # manifests after their objects: the cache stays a valid store
            self.cache.put_manifest(known.manifest.version, known.data)
        self.intake.objects_gathered(target.manifest.version)

    def _fetch(self, missing: dict[str, ChunkRef], version: int) -> int:
        """Fetches objects from the store into the cache and relays them to the peers as part of
        `version` (the peers lack them too); returns the bytes fetched."""
        if self.upstream is None:
            raise ObjectNotFound(f"{len(missing)} objects never arrived and this agent has no store to fetch from")
        relay = self.relay
        on_object = None if relay is None else lambda ref, obj: relay.on_object(version, ref.object, obj)
        total = self.cache.fetch(self.upstream, missing, self._fetch_pool, on_object)
        self.metrics.inc("agent/bytes_received", total, source="store")
        return total

    def _forget_failed_path(self, path: list[_Known]) -> None:
        """After a path failed verification: corrupt cached objects go (fetched again), the path's
        unserved manifests leave the cache (they have no good copy until the next attempt
        rewrites them), and an offered manifest that failed twice is forgotten (if it was real,
        the store or the next offer brings it back)."""
        served = {
            known.manifest.version: known.data for known in path if known.manifest.version <= self._served_version
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
                with self._cond:
                    if self._known.get(version) is known:
                        del self._known[version]
                log.warning(
                    "%s: forgetting the v%d offered by %s: it failed verification twice",
                    self.config.name,
                    version,
                    known.source,
                )

    # --------------------------------------------------------------------- state and ledger

    def _restore(self) -> None:
        """After a restart: serve the last good version from the cache, verified again."""
        state_file = self.cache.read_state()
        if state_file is None:
            return
        version, digest = state_file
        try:
            state = self.reader.read(version)
            if state.manifest.digest != digest:
                raise IntegrityError(f"cached v{version} has digest {state.manifest.digest}, the state file {digest}")
            self.engine.swap(version, state.state_dict(), digest=digest, policy=self.config.swap_policy)
        except WeightsyncError as e:
            self.last_error = f"restore: {e}"
            log.warning("%s: cannot serve cached v%d (%s); catching up from the store", self.config.name, version, e)
            return
        self.buffers.served, self._served_version, self._served_digest = state, version, digest
        entry = self.ledger.entry(version, source="cache")
        entry.outcome, entry.path, entry.digest = "served", "cache", digest
        entry.served_unix_ms = int(time.time() * 1000)
        self.metrics.set("agent/version", version)
        log.info("%s: restarted serving v%d from its cache", self.config.name, version)

    def _collect_cache(self) -> None:
        protect = {self._served_version} | self.buffers.versions()
        self.cache.collect(
            keep=self.config.cache_keep_versions,
            protect=protect,
            grace_s=self.config.cache_grace_s,
            good_copy=self._good_copy,
        )

    def _good_copy(self, version: int) -> bytes | None:
        """The manifest of `version` as accepted or as the store has it (checked), never the
        cache's own copy: what a damaged cached one is put back from."""
        try:
            return self._manifest(version, cached=False).data
        except WeightsyncError:
            return None

    def _record_failure(self, manifest: Manifest, error: BaseException) -> None:
        version = manifest.version
        entry = self.ledger.entry(version)
        entry.outcome, entry.error = "failed", f"{type(error).__name__}: {error}"
        if isinstance(error, ParityRefused):
            entry.outcome = "refused"
            with self._cond:
                self._refused[version] = manifest.digest
        self.last_error = f"v{version}: {entry.error}"
        broken = self.broken.fail(version, manifest.digest, entry.error, time.monotonic())
        self.metrics.inc("agent/errors")
        self._report_broken()
        log.warning(
            "%s: v%d failed (%d times; next try in %.1f s): %s",
            self.config.name,
            version,
            broken.failures,
            broken.retry_at - time.monotonic(),
            entry.error,
        )

    def _record_parity(self, report: ParityReport) -> None:
        """A probe's figures go into its version's ledger entry (status shows the newest too)."""
        with self._cond:
            self.ledger.entry(report.version).parity = report.to_json()

    def _report_broken(self) -> None:
        self.metrics.set("agent/broken_versions", len(self.broken))
        self.metrics.set("agent/newest_broken_version", self.broken.newest())

    def served(self) -> tuple[int, str, WeightsState | None]:
        """(version, digest, the agent's buffer of it) of what is served now, read together."""
        with self._cond:
            return self._served_version, self._served_digest, self.buffers.served

    def newest_known(self) -> int:
        """The newest version offered or found in the store and not served yet (0: none)."""
        with self._cond:
            return max(self._known, default=0)

    def verify_served(self) -> str:
        """The version digest the agent's copy of the served version re-hashes to ("" when there is
        none); `signals.verify` says more."""
        return signals.verify(self)["digest"]

    def check_health(self) -> str:
        """Why the agent is not healthy, "" when it is (`signals.HealthCheck`)."""
        return self._health.check()

    def status(self, *, verify: bool = False, verify_timeout_s: float = 5.0) -> dict:
        verification = signals.verify(self, verify_timeout_s) if verify else None
        engine_state = signals.engine_state(self.engine)
        unhealthy = self._health.reason()[0]
        with self._cond:
            target = max(self._known, default=self._served_version)
            status = {
                "agent": self.config.name,
                "region": self.config.region,
                "model": self.model,
                "current_version": self._served_version,
                "current_digest": self._served_digest,
                "target_version": max(target, self._served_version),
                "ledger": self.ledger.to_json(),
                "last_error": self.last_error,
                "engine": self.engine.name,
                "engine_state": engine_state,
                "unhealthy": unhealthy,
                "peers": list(self.config.peers),
                "started_unix_ms": self.started_unix_ms,
                "served_digest": verification["digest"] if verification else "",
                "broken": self.broken.to_json(time.monotonic()),
                "refused": sorted(self._refused),
                "parity": self.parity.last.to_json() if self.parity.last is not None else None,
            }
        if verification is not None:
            status["verification"] = {k: verification[k] for k in ("ok", "hashed", "error")}
        return status
