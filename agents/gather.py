"""gather: the "gathered" stage. Every object of a plan's path brought into the agent's cache.

Objects come by push when pushes are expected (the target was offered by a pusher, or pushes
arrived lately: a store poll can see a commit before its push lands): the gather waits while
pushes bring objects it lacks, up to push_wait_s for each next one, and fetches the rest from the
store, relaying each fetched object to the peers (they lack it too). An agent nobody pushes to
fetches at once. Then the path's manifests enter the cache (after their objects: the cache stays
a valid store), and offers held for the peers up to the target go out (`state.HeldOffer`).

The ledger entry gets the bytes that came by push for this path and the bytes fetched; objects
the cache held already (unchanged chunks of earlier versions) count as neither.

Not here: deciding the path (`plan.py`), checking the objects' bytes (`apply.py`: the reader
hashes each before decoding), what pushers send (`intake.py`).
"""

from __future__ import annotations

import concurrent.futures as cf
import time

from weightsync.agents.cache import AgentCache
from weightsync.agents.config import AgentConfig
from weightsync.agents.ledger import LedgerEntry
from weightsync.agents.plan import Plan
from weightsync.agents.state import AgentState
from weightsync.errors import ObjectNotFound
from weightsync.format.manifest import ChunkRef
from weightsync.metrics import Metrics
from weightsync.stores import Store
from weightsync.transport.push import Pusher

PUSHES_EXPECTED_S = 60.0
"""After the last offer by push, pushes are still expected for 10 poll intervals plus this long."""


class Gatherer:
    """Brings plans' objects into one agent's cache (see the module docstring)."""

    def __init__(
        self,
        config: AgentConfig,
        state: AgentState,
        cache: AgentCache,
        *,
        upstream: Store | None = None,
        relay: Pusher | None = None,
        metrics: Metrics,
    ) -> None:
        self.config = config
        self.state = state
        self.cache = cache
        self.upstream = upstream
        self.relay = relay
        self.metrics = metrics
        self._pool = cf.ThreadPoolExecutor(
            max(1, int(getattr(upstream, "io_concurrency", 4))), thread_name_prefix="ws-agent-fetch"
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def gather(self, plan: Plan, entry: LedgerEntry) -> dict[str, float]:
        """Brings every object of `plan.path` into the cache, then its manifests; the seconds
        spent waiting for pushes and fetching ({"push_wait", "fetch"})."""
        refs: dict[str, ChunkRef] = {}
        for known in plan.path:
            for tensor in known.manifest.tensors:
                for ref in tensor.chunks:
                    if ref.object is not None:
                        refs[ref.address_key] = ref  # the cache keeps objects by address, packed or not
        missing = self.cache.missing(refs)
        started = time.monotonic()
        if missing and self._pushes_expected(plan.target.pushed):
            missing = wait_for_pushes(self.state, self.cache, missing, self.config.push_wait_s)
        fetching = time.monotonic()
        fetched = self._fetch(missing, plan.version) if missing else 0
        timings = {"push_wait": fetching - started, "fetch": time.monotonic() - fetching}
        entry.bytes_fetched += fetched
        entry.bytes_pushed = self.state.pushed_bytes({ref.object for ref in refs.values()})
        for known in plan.path:  # manifests after their objects: the cache stays a valid store
            self.cache.put_manifest(known.manifest.version, known.data)
        if self.relay is not None:  # the peers may have every object up to the target now
            for offer in self.state.take_held_offers(lambda offer: offer.version <= plan.version):
                self.relay.offer(offer.version, offer.manifest, offer.signature, hops=offer.hops)
        return timings

    def _pushes_expected(self, pushed: bool) -> bool:
        """Whether to wait for pushes before fetching: the version was offered by push, or pushes
        arrived lately (a store poll can see a commit before the push of it lands)."""
        since_offer = time.monotonic() - self.state.last_push_offer
        return pushed or since_offer < 10 * self.config.poll_interval_s + PUSHES_EXPECTED_S

    def _fetch(self, missing: dict[str, ChunkRef], version: int) -> int:
        """Fetches objects from the store into the cache and relays them to the peers as part of
        `version` (the peers lack them too); returns the bytes fetched."""
        if self.upstream is None:
            raise ObjectNotFound(f"{len(missing)} objects never arrived and this agent has no store to fetch from")
        relay = self.relay
        on_object = None if relay is None else lambda ref, obj: relay.on_object(version, ref.object, obj)
        total = self.cache.fetch(self.upstream, missing, self._pool, on_object)
        self.metrics.inc("agent/bytes_received", total, source="store")
        return total


def wait_for_pushes(
    state: AgentState, cache: AgentCache, missing: dict[str, ChunkRef], push_wait_s: float
) -> dict[str, ChunkRef]:
    """Waits while pushes bring objects of `missing` (up to `push_wait_s` for each next one);
    what is still missing. Objects of other versions do not count: while versions come faster
    than a follower gets the ones it lacks, they arrive all the time, and counting them kept a
    follower waiting for objects nobody would push (issue 16)."""
    deadline = time.monotonic() + push_wait_s
    with state.cond:
        seen = state.pushed_objects
    # Objects cached before `seen` was read announce no more progress: look for them once
    # first, or an offer that overtook its last objects (they land while the sync starts)
    # would wait push_wait_s for progress that already happened.
    missing = cache.missing(missing)
    while missing and not state.closed:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        seen = state.wait_for_pushes(seen, remaining)
        still = cache.missing(missing)
        if len(still) < len(missing):
            deadline = time.monotonic() + push_wait_s
        missing = still
    return missing
