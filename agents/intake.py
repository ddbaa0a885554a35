"""intake: the "offered" stage. Every way a version and its objects come into a sync agent.

    offer           (gRPC) a publisher or the agent upstream offers a manifest: parsed, its
                    signature and version checked (`accept`), recorded in the state's `known`,
                    and relayed to the peers once this agent holds the version's objects
    receive_object  (gRPC) a pushed object: checked against its content address and the
                    pending-bytes quota, relayed, handed to the early apply (`early_apply.py`)
                    and written to the cache
    poll_store      (sync thread) the store's newest version, when nobody pushed it
    fall_back       (sync thread) while every newer version it knows is broken: the store's
                    newest other one, so the agent serves the newest version it can verify

The store is the source of truth: a manifest read from it replaces a different one offered under
the same version number (an offer that never committed, or a forgery on an agent that does not
require signatures). Two different offers of one version are refused.

Not here: what happens to a version once known (`sync.py` and its stages), the gRPC plumbing
(`server.py`), waiting for pushed objects during a sync (`gather.py`).
"""

from __future__ import annotations

import logging
import time

from weightsync.agents.cache import AgentCache
from weightsync.agents.config import AgentConfig
from weightsync.agents.early_apply import EarlyApply
from weightsync.agents.state import AgentState, HeldOffer, Known
from weightsync.errors import FormatError, IntegrityError, ResourceExhausted, StaleVersion, WeightsyncError
from weightsync.format.chunk import MAX_CHUNK_BYTES, max_object_bytes, object_hash
from weightsync.format.hashing import is_hash_hex
from weightsync.format.manifest import ChunkPlacement, parse_manifest
from weightsync.metrics import Metrics
from weightsync.stores import Store
from weightsync.transport.push import Pusher
from weightsync.transport.signing import Verifier
from weightsync.versions import latest_version, list_versions, read_manifest_bytes, read_signature

log = logging.getLogger(__name__)


def check_model(serves: str, model: str) -> None:
    """FormatError unless an offer or object for `model` is for the model this agent `serves`."""
    if model != serves:
        raise FormatError(f"this agent serves {serves!r}, not {model!r}")


class Intake:
    """Offers and objects for one agent, pushed or found in the store (see the module docstring)."""

    def __init__(
        self,
        config: AgentConfig,
        state: AgentState,
        cache: AgentCache,
        *,
        upstream: Store | None = None,
        verifier: Verifier | None = None,
        relay: Pusher | None = None,
        early: EarlyApply | None = None,
        metrics: Metrics,
    ) -> None:
        self.config = config
        self.model = config.model
        self.state = state
        self.cache = cache
        self.upstream = upstream
        self.verifier = verifier
        self.relay = relay
        self.early = early
        self.metrics = metrics

    # ------------------------------------------------------------------------ gRPC threads

    def offer(
        self, *, model: str, version: int, manifest: bytes, signature: bytes, objects: list[str], origin: str, hops: int
    ) -> tuple[bool, list[str]]:
        """An offer from a publisher or an upstream agent: (wanted, objects still missing)."""
        check_model(self.model, model)
        if hops > self.config.max_hops:
            raise FormatError(f"offer of v{version} relayed {hops} times (max {self.config.max_hops}): a relay loop?")
        state = self.state
        if not manifest:  # objects-only: a version still being published
            if any(not is_hash_hex(a) for a in objects):
                raise FormatError("objects must be 32-character lowercase hex content addresses")
            if version <= state.served_version:
                return False, []
            return True, [a for a in objects if not self.cache.has_object(a)]
        known = self.accept(bytes(manifest), bytes(signature) or None, origin, pushed=True, expect_version=version)
        objects = {c.object for t in known.manifest.tensors for c in t.chunks if c.object}
        with state.cond:
            state.last_push_offer = time.monotonic()
            if version <= state.served_version:
                return False, []
            # Looked for under the lock that receive_object takes after caching an object, so
            # none can land unseen between this look and the offer being held (HeldOffer).
            missing = sorted(a for a in objects if not self.cache.has_object(a))
            hold = self.relay is not None and bool(missing)
            if hold:
                state.held_offers[version] = HeldOffer(version, known.data, known.signature, hops + 1, set(missing))
        if self.relay is not None and not hold:
            self.relay.offer(version, known.data, known.signature, hops=hops + 1)
        return True, missing

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
        check_model(self.model, model)
        if not is_hash_hex(address):
            raise FormatError(f"object address {address!r} is not 32 lowercase hex characters")
        if len(data) > max_object_bytes(MAX_CHUNK_BYTES):
            raise FormatError(f"object of {len(data)} bytes is over the format's limit")
        if object_hash(data) != address:
            self.metrics.inc("agent/objects_rejected", reason="hash")
            raise IntegrityError(
                f"object {address} of v{version} does not match its content address (corrupt in flight)"
            )
        state = self.state
        if version <= state.served_version:
            return False  # stale: nothing can use it any more
        if self.cache.has_object(address):
            return False
        with state.cond:
            if state.pending_bytes + len(data) > self.config.max_pending_bytes:
                self.metrics.inc("agent/objects_rejected", reason="quota")
                raise ResourceExhausted(
                    f"{state.pending_bytes} pushed bytes await a version; limit {self.config.max_pending_bytes}"
                )
            state.pending_bytes += len(data)
        try:
            if self.relay is not None:  # before the cache: an object an offer finds cached is relayed already
                self.relay.on_object(version, address, data, placement)
            if self.early is not None:  # before the cache, so an offer that finds an object cached
                # finds its early apply started (the sync waits for it)
                self.early.submit(version, address, data, placement, state.served_version)
            self.cache.put_object(address, data)
        except BaseException:  # not kept (a full disk, say): its bytes no longer count against the quota
            with state.cond:
                state.pending_bytes -= len(data)
            raise
        self.metrics.inc("agent/bytes_received", len(data), source="push")
        if self.relay is not None:  # under the lock: an offer held just now is seen
            for offer in self.state.take_held_offers(lambda offer: _arrived(offer, address)):
                self.relay.offer(offer.version, offer.manifest, offer.signature, hops=offer.hops)
        with state.cond:
            state.pushed[address] = (version, len(data))
            state.pushed_objects += 1
            state.cond.notify_all()
        return True

    # ------------------------------------------------------------------------- sync thread

    def poll_store(self) -> None:
        """Accepts the store's newest version when it is new here (and relays its offer)."""
        state = self.state
        try:
            latest = latest_version(self.upstream, self.model)
            if latest is None or latest <= state.served_version:
                return
            with state.cond:
                newest = max(state.known, default=0)
                known = state.known.get(latest)
            # Nothing new, unless what we hold for the store's latest did not come from the store:
            # then read the store's (one GET) so that a bogus or uncommitted offer cannot hide it.
            if latest < newest or (known is not None and known.source == "store"):
                return
            _, data = read_manifest_bytes(self.upstream, self.model, latest)
            if known is not None and data == known.data:
                return
            known = self.accept(data, read_signature(self.upstream, self.model, latest, data), "store", pushed=False)
            if self.relay is not None:  # the peers get it from us, objects included, as we fetch them
                self.relay.offer(latest, known.data, known.signature, hops=1)
        except WeightsyncError as e:
            state.last_error = f"store poll: {e}"
            log.warning("%s: polling %s failed: %s", self.config.name, self.upstream.uri, e)

    def fall_back(self) -> None:
        """While every newer version the agent knows is broken: the newest other version in the
        store above the served one becomes a target, so that the agent serves the newest version
        it can verify (an older base and its deltas) while the broken ones wait for their retry."""
        if self.upstream is None:
            return
        state = self.state
        version = None
        try:
            with state.cond:
                skip = set(state.known) | {state.served_version}
                served, refused = state.served_version, set(state.refused)
            now = time.monotonic()
            candidates = [
                v
                for v in list_versions(self.upstream, self.model)
                # never in place of a refused version (the refuse rule, swap.py)
                if v > max([served, *refused]) and v not in skip and not state.broken.waiting(v, None, now)
            ]
            if not candidates:
                return
            version = max(candidates)
            _, data = read_manifest_bytes(self.upstream, self.model, version)
            self.accept(data, read_signature(self.upstream, self.model, version, data), "store", pushed=False)
            log.info("%s: falling back to v%d while newer versions are broken", self.config.name, version)
        except WeightsyncError as e:
            log.warning("%s: no fallback version from %s: %s", self.config.name, self.upstream.uri, e)
            if version is not None:  # its manifest does not read: broken too, so the next try goes lower
                state.broken.fail(version, "", f"{type(e).__name__}: {e}", time.monotonic())

    # ------------------------------------------------------------------------------ accept

    def accept(
        self, data: bytes, signature: bytes | None, source: str, *, pushed: bool, expect_version: int | None = None
    ) -> Known:
        """Parses and checks a manifest (signature, model, weights kind, not older than served);
        records it in the state's `known` (see the module docstring for which copy wins)."""
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
        state = self.state
        with state.cond:
            if manifest.version < state.served_version:
                raise StaleVersion(f"v{manifest.version} is older than the served v{state.served_version}")
            if manifest.version == state.served_version and manifest.digest != state.served_digest:
                raise IntegrityError(f"v{manifest.version} differs from the one served (digest mismatch): a replay?")
            known = state.known.get(manifest.version)
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
            known = Known(manifest, data, signature, source, int(time.time() * 1000), time.monotonic(), pushed)
            if manifest.version > state.served_version:
                state.known[manifest.version] = known
                state.ledger.entry(manifest.version, source=source, offered_unix_ms=known.offered_unix_ms)
                state.cond.notify_all()
            return known


def _arrived(offer: HeldOffer, address: str) -> bool:
    """Marks `address` as here; whether `offer` waits for nothing more."""
    offer.waiting.discard(address)
    return not offer.waiting
