"""state: what one sync agent knows and serves, in one place, under its one condition variable.

A version lives in an agent in these states; the sync thread takes it through them in order
(`sync.py`), one module per stage:

    offered   its manifest was accepted and waits in `known` (intake.py): offered by a pusher,
              found by a store poll, or taken as a fallback while newer versions are broken
    planned   chosen as the target; its chain resolved, the engine asked whether it fits, the
              buffer to build it in and the path from that buffer's version fixed (plan.py)
    gathered  every object of the path in the cache: by push, else from the store (gather.py)
    applied   the staging buffer holds it, every byte checked against its hash (apply.py)
    swapped   the engine serves it (swap.py); once its probe passed under the parity action
              refuse, it is committed: `served_version` names it and the state file records it
    probed    the engine's numbers compared with the trainer's (parity.py)

A failure at any stage leaves what is served untouched and puts the version in `broken` (retried
with its own backoff); a parity refusal puts it in `refused` (never served again). The gRPC
threads write `known` and the push counters, the sync thread the rest; everything here is read
and written under `cond`, which is notified whenever a waiter may care: a version served, an
object pushed, the agent closing.

Not here: the buffers the versions are built in (`buffers.py`), the cache on disk (`cache.py`),
the ledger's entries and the broken versions' backoff (`ledger.py`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from weightsync.agents.ledger import BrokenVersions, Ledger
from weightsync.format.manifest import Manifest
from weightsync.retry import Backoff

RETRY_BACKOFF = Backoff(first_s=0.5, max_s=10.0)
"""A broken version's retries: 0.5 s after its first failure, doubling up to 10 s."""


@dataclasses.dataclass
class Known:
    """A manifest the agent accepted (offered, or found in the store) and has not served yet."""

    manifest: Manifest
    data: bytes
    signature: bytes | None
    source: str
    offered_unix_ms: int
    offered_at: float  # monotonic
    pushed: bool  # offered by a pusher (publisher or upstream agent)
    failures: int = 0  # sync attempts that failed verification with this manifest on the path


@dataclasses.dataclass
class HeldOffer:
    """An offer to relay to the peers once the objects it still waits for have come.

    A pusher offers a commit while the version's last objects may still be in flight (it does not
    wait for its stream's reply), so an offer can come before them. Relayed at once, it would
    reach the peers before the objects this agent relays as they arrive, and a peer's pusher that
    is done with a version drops its later objects: the peers would wait for pushes that never
    come, then fetch from the store. Held until its objects have come by push (intake.py), or
    until the sync has fetched the rest (gather.py)."""

    version: int
    manifest: bytes
    signature: bytes | None
    hops: int
    waiting: set[str]


class AgentState:
    """The agent's shared state (see the module docstring); attributes are read and written
    under `cond`, the methods take it themselves."""

    def __init__(self, *, ledger_size: int) -> None:
        self.cond = threading.Condition()
        self.served_version = 0
        self.served_digest = ""
        self.known: dict[int, Known] = {}
        """Accepted manifests newer than the served version, by version."""
        self.refused: dict[int, str] = {}
        """Versions the parity probe refused (version -> manifest digest): never served again."""
        self.broken = BrokenVersions(RETRY_BACKOFF)
        self.ledger = Ledger(ledger_size)
        self.swapping = 0
        """The version being swapped into the engine, from the swap until it is committed or
        failed (0: none): the engine may serve it before `served_version` names it."""
        self.refusal = ""
        """Why the agent serves nothing under the parity refuse rule ("" while it serves a version
        that passed, or none was refused; swap.py)."""
        self.last_error = ""
        self.closed = False
        # What pushers sent since the last swap (intake.py writes, gather.py reads):
        self.pushed_objects = 0
        """Objects received so far: the gather watches it to see pushes advance."""
        self.pushed: dict[str, tuple[int, int]] = {}
        """Address -> (version it was pushed for, bytes) of objects that came by push and were new
        here, until that version is served or superseded: what the ledger counts as pushed."""
        self.pending_bytes = 0
        """Bytes pushed since the last swap: bounded by the agent's max_pending_bytes."""
        self.last_push_offer = float("-inf")
        """Monotonic time of the last offer that came by push."""
        self.held_offers: dict[int, HeldOffer] = {}
        """Offers to relay once their objects are here, by version."""
        self.changed = threading.Event()
        """Set after each sync attempt (served or failed): what the health watch wakes on (`server.py`)."""

    def served(self) -> tuple[int, str]:
        with self.cond:
            return self.served_version, self.served_digest

    def newest_known(self) -> int:
        """The newest version offered or found in the store and not served yet (0: none)."""
        with self.cond:
            return max(self.known, default=0)

    def newest_ready(self) -> Known | None:
        """The sync's next target: the newest accepted version that is newer than every refused
        one (the refuse rule: a breach is the engine's, so an older version would fail alike) and
        not a broken one waiting for its retry. Forgets accepted versions the served one overtook."""
        now = time.monotonic()
        with self.cond:
            for version in [v for v in self.known if v <= self.served_version]:
                del self.known[version]
            refused = max(self.refused, default=0)
            ready = [
                v for v, k in self.known.items() if v > refused and not self.broken.waiting(v, k.manifest.digest, now)
            ]
            return self.known[max(ready)] if ready else None

    def wait_for_version(self, version: int, timeout_s: float) -> bool:
        """Blocks until `version` (or newer) is served; False on timeout."""
        with self.cond:
            return self.cond.wait_for(lambda: self.served_version >= version, timeout=timeout_s)

    def wait_for_pushes(self, seen: int, timeout_s: float) -> int:
        """Waits until an object is pushed after the count `seen` (or the agent closes, or
        `timeout_s` passes); the count now."""
        with self.cond:
            self.cond.wait_for(lambda: self.pushed_objects != seen or self.closed, timeout=timeout_s)
            return self.pushed_objects

    def take_held_offers(self, ready: Callable[[HeldOffer], bool]) -> list[HeldOffer]:
        """The held offers `ready` says may go to the peers now, oldest first, no longer held."""
        with self.cond:
            released = [offer for offer in self.held_offers.values() if ready(offer)]
            for offer in released:
                del self.held_offers[offer.version]
        return sorted(released, key=lambda o: o.version)

    def pushed_bytes(self, addresses: set[str]) -> int:
        """The bytes of these objects that came by push."""
        with self.cond:
            return sum(self.pushed[a][1] for a in addresses if a in self.pushed)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
