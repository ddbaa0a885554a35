"""intake: what pushers send a sync agent (a publisher, or the agent upstream of it in a relay).

Runs on gRPC threads and only records: an offered manifest goes to the agent's `accept` (parsed,
signature checked, version checked against what is served) and is relayed to the peers once this
agent holds the version's objects; a pushed object is checked against its content address and the
pending-bytes quota, relayed, handed to the early apply (`early_apply.py`) and written to the
cache. The sync thread asks it whether pushes are expected and waits while they make progress
before it fetches the rest from the store.

Not here: choosing, verifying and applying versions (`sync.py`), the gRPC plumbing (`server.py`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from weightsync.agents.cache import AgentCache
from weightsync.agents.config import AgentConfig
from weightsync.errors import FormatError, IntegrityError, ResourceExhausted
from weightsync.format.chunk import MAX_CHUNK_BYTES, max_object_bytes, object_hash
from weightsync.format.hashing import is_hash_hex
from weightsync.format.manifest import ChunkPlacement, ChunkRef
from weightsync.metrics import Metrics
from weightsync.transport.push import Pusher


@dataclasses.dataclass
class _HeldOffer:
    """An offer to relay once the objects it still waits for have come (and gone on to the peers).

    A pusher offers a commit while the version's last objects may still be in flight (it does not
    wait for its stream's reply), so an offer can come before them. Relayed at once, it would
    reach the peers before the objects this agent relays as they arrive, and a peer's pusher that
    is done with a version drops its later objects: the peers would wait for pushes that never
    come, then fetch from the store. Held until its objects have come by push, or until the sync
    has fetched the rest (`PushIntake.objects_gathered`)."""

    version: int
    manifest: bytes
    signature: bytes | None
    hops: int
    waiting: set[str]


def _arrived(offer: _HeldOffer, address: str) -> bool:
    """Marks `address` as here; whether `offer` waits for nothing more."""
    offer.waiting.discard(address)
    return not offer.waiting


def check_model(serves: str, model: str) -> None:
    if model != serves:
        raise FormatError(f"this agent serves {serves!r}, not {model!r}")


class PushIntake:
    """Offers and objects pushed to one agent; `cond` is the agent's (progress is announced on it)."""

    def __init__(
        self,
        config: AgentConfig,
        cache: AgentCache,
        *,
        accept: Callable,
        served_version: Callable[[], int],
        relay: Pusher | None,
        metrics: Metrics,
        cond: threading.Condition,
        apply_early: Callable[[int, str, memoryview | bytes, ChunkPlacement | None], None] | None = None,
    ) -> None:
        self.config = config
        self._apply_early = apply_early  # EarlyApply.submit: before the cache, so an offer that
        # finds an object cached finds its early apply started (the sync waits for it)
        self.model = config.model
        self.cache = cache
        self._accept = accept
        self._served_version = served_version
        self.relay = relay
        self.metrics = metrics
        self._cond = cond
        self.pending_bytes = 0  # pushed since the last swap: bounded by config.max_pending_bytes
        self.progress = 0  # objects received so far; the sync thread watches it to see pushes advance
        self.last_offer = float("-inf")  # monotonic time of the last offer that came by push
        self._held: dict[int, _HeldOffer] = {}  # offers to relay, by version, until their objects are here

    def offer(
        self, *, model: str, version: int, manifest: bytes, signature: bytes, objects: list[str], origin: str, hops: int
    ) -> tuple[bool, list[str]]:
        """An offer from a publisher or an upstream agent: (wanted, objects still missing)."""
        check_model(self.model, model)
        if hops > self.config.max_hops:
            raise FormatError(f"offer of v{version} relayed {hops} times (max {self.config.max_hops}): a relay loop?")
        if not manifest:  # objects-only: a version still being published
            if any(not is_hash_hex(a) for a in objects):
                raise FormatError("objects must be 32-character lowercase hex content addresses")
            if version <= self._served_version():
                return False, []
            return True, [a for a in objects if not self.cache.has_object(a)]
        known = self._accept(bytes(manifest), bytes(signature) or None, origin, pushed=True, expect_version=version)
        self.last_offer = time.monotonic()
        objects = {c.object for t in known.manifest.tensors for c in t.chunks if c.object}
        with self._cond:
            if version <= self._served_version():
                return False, []
            # Looked for under the lock that receive_object takes after caching an object, so
            # none can land unseen between this look and the offer being held (_HeldOffer).
            missing = sorted(a for a in objects if not self.cache.has_object(a))
            hold = self.relay is not None and bool(missing)
            if hold:
                self._held[version] = _HeldOffer(version, known.data, known.signature, hops + 1, set(missing))
        if self.relay is not None and not hold:
            self.relay.offer(version, known.data, known.signature, hops=hops + 1)
        return True, missing

    def _release(self, ready: Callable[[_HeldOffer], bool]) -> None:
        with self._cond:
            released = [offer for offer in self._held.values() if ready(offer)]
            for offer in released:
                del self._held[offer.version]
        for offer in sorted(released, key=lambda o: o.version):
            self.relay.offer(offer.version, offer.manifest, offer.signature, hops=offer.hops)

    def objects_gathered(self, version: int) -> None:
        """The sync holds every object up to `version` (pushed or fetched and relayed): held offers
        up to it go to the peers."""
        if self._held:
            self._release(lambda offer: offer.version <= version)

    def receive_object(
        self,
        *,
        model: str,
        version: int,
        address: str,
        data: memoryview | bytes,
        placement: ChunkPlacement | None = None,
    ) -> bool:
        """One pushed object: kept (True) if new, verified against its address first."""
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
        if version <= self._served_version():
            return False  # stale: nothing can use it any more
        if self.cache.has_object(address):
            return False
        with self._cond:
            if self.pending_bytes + len(data) > self.config.max_pending_bytes:
                self.metrics.inc("agent/objects_rejected", reason="quota")
                raise ResourceExhausted(
                    f"{self.pending_bytes} pushed bytes await a version; limit {self.config.max_pending_bytes}"
                )
            self.pending_bytes += len(data)
        if self.relay is not None:  # before the cache: an object an offer finds cached is relayed already
            self.relay.on_object(version, address, data, placement)
        if self._apply_early is not None:
            self._apply_early(version, address, data, placement)
        self.cache.put_object(address, data)
        self.metrics.inc("agent/bytes_received", len(data), source="push")
        if self.relay is not None:  # under the lock (in _release): an offer held just now is seen
            self._release(lambda offer: _arrived(offer, address))
        with self._cond:
            self.progress += 1
            self._cond.notify_all()
        return True

    def expected(self, pushed: bool) -> bool:
        """Whether to wait for pushes before fetching: the version was offered by push, or pushes
        arrived lately (a store poll can see a commit before the push of it lands)."""
        return pushed or time.monotonic() - self.last_offer < 10 * self.config.poll_interval_s + 60

    def wait(self, missing: dict[str, ChunkRef], closed: Callable[[], bool]) -> dict[str, ChunkRef]:
        """Waits while pushes bring objects of `missing` (up to push_wait_s for each next one);
        what is still missing. Objects of other versions do not count: while versions come
        faster than a follower gets the ones it lacks, they arrive all the time, and counting
        them kept a follower waiting for objects nobody would push (issue 16)."""
        deadline = time.monotonic() + self.config.push_wait_s
        with self._cond:
            seen = self.progress
        # Objects cached before `seen` was read announce no more progress: look for them once
        # first, or an offer that overtook its last objects (they land while the sync starts)
        # would wait push_wait_s for progress that already happened.
        missing = self.cache.missing(missing)
        while missing and not closed():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            with self._cond:
                self._cond.wait_for(lambda seen=seen: self.progress != seen or closed(), timeout=remaining)
                seen = self.progress
            still = self.cache.missing(missing)
            if len(still) < len(missing):
                deadline = time.monotonic() + self.config.push_wait_s
            missing = still
        return missing

    def swapped(self) -> None:
        """A version was served: what was pushed for it no longer counts against the quota."""
        self.pending_bytes = 0
