"""ledger: what one sync agent did with each version it heard of, for `status()` and operators.

One entry per version, newest first, bounded to `ledger_size` entries: where it came from, the
path that reached it (deltas or base + deltas) and the route it was applied by (chain or
folded, and why), bytes pushed and fetched, per-stage timings, the
outcome and the last error. Entries are plain dataclasses, so `status()` serialises them as they
are. Beside it, the broken versions: those newer than the served one that failed, each with its
error and its own retry backoff. Thread-safe: gRPC threads and the sync thread both write here.

Not here: deciding what to sync (`state.newest_ready`, `plan.py`), the crash-safe record of the
served version (the state file, `cache.py`), metrics (`weightsync/metrics.py`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque

from weightsync.retry import Backoff


@dataclasses.dataclass
class LedgerEntry:
    version: int
    outcome: str = "pending"  # served | failed | refused (parity probe) | superseded
    path: str = ""
    route: str = ""  # how the path was applied: "chain" (delta by delta) or "folded" (as one delta)
    route_reason: str = ""  # why that route (weightsync/format/codecs/fold.py plan_route)
    applied_early: int = 0  # chunks applied as their objects arrived, before the offer (early_apply.py)
    swap_path: str = ""  # how it went into the engine: "delta" (changed elements in place) or "full"
    swap_path_reason: str = ""  # why "full" where a delta was possible (agents/delta_swap.py)
    source: str = ""
    bytes_pushed: int = 0
    bytes_fetched: int = 0
    timings_s: dict[str, float] = dataclasses.field(default_factory=dict)
    error: str = ""
    offered_unix_ms: int = 0
    served_unix_ms: int = 0
    digest: str = ""
    parity: dict = dataclasses.field(default_factory=dict)  # the parity probe's report (agents/parity.py)


class Ledger:
    """The newest `size` entries, one per version."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._entries: deque[LedgerEntry] = deque(maxlen=size)
        self._by_version: dict[int, LedgerEntry] = {}

    def entry(self, version: int, **fields) -> LedgerEntry:
        """The entry of `version` (created if new), with `fields` set."""
        with self._lock:
            entry = self._by_version.get(version)
            if entry is None:
                entry = LedgerEntry(version=version)
                self._by_version[version] = entry
                self._entries.appendleft(entry)
                if len(self._by_version) > self._size:
                    live = {e.version for e in self._entries}
                    self._by_version = {v: e for v, e in self._by_version.items() if v in live}
            for key, value in fields.items():
                setattr(entry, key, value)
            return entry

    def supersede(self, served: int) -> None:
        """Versions older than the newly `served` one that were still pending never will be."""
        with self._lock:
            for entry in self._by_version.values():
                if entry.version < served and entry.outcome == "pending":
                    entry.outcome = "superseded"

    def to_json(self) -> list[dict]:
        with self._lock:
            return [dataclasses.asdict(e) for e in self._entries]


@dataclasses.dataclass
class BrokenVersion:
    """A version the agent could not verify (or the engine refused): never served, retried."""

    version: int
    digest: str  # of the manifest that failed; another manifest for the version is tried at once
    error: str
    failures: int = 0
    first_failed_unix_ms: int = 0
    retry_at: float = 0.0  # monotonic
    repeated: bool = False
    """The last failure had the same error as the one before: news to nobody."""


class BrokenVersions:
    """The versions newer than the served one that failed, each retried with its own backoff
    while the agent serves the newest version it can verify. Thread-safe."""

    def __init__(self, backoff: Backoff) -> None:
        self._backoff = backoff
        self._lock = threading.Lock()
        self._versions: dict[int, BrokenVersion] = {}

    def fail(self, version: int, digest: str, error: str, now: float) -> BrokenVersion:
        with self._lock:
            broken = self._versions.get(version)
            if broken is None or broken.digest != digest:
                broken = self._versions[version] = BrokenVersion(
                    version, digest, error, first_failed_unix_ms=int(time.time() * 1000)
                )
            broken.repeated = broken.failures > 0 and broken.error == error
            broken.error = error
            broken.failures += 1
            broken.retry_at = now + self._backoff.pause_s(broken.failures)
            return broken

    def waiting(self, version: int, digest: str | None, now: float) -> bool:
        """Whether this manifest of `version` (None: whichever failed) failed and its next retry
        is not due yet."""
        with self._lock:
            broken = self._versions.get(version)
            return broken is not None and digest in (None, broken.digest) and now < broken.retry_at

    def forget_up_to(self, served: int) -> None:
        """A version at or below the served one no longer matters."""
        with self._lock:
            self._versions = {v: b for v, b in self._versions.items() if v > served}

    def newest(self) -> int:
        with self._lock:
            return max(self._versions, default=0)

    def __len__(self) -> int:
        with self._lock:
            return len(self._versions)

    def to_json(self, now: float) -> list[dict]:
        with self._lock:
            return [
                {
                    "version": b.version,
                    "digest": b.digest,
                    "error": b.error,
                    "failures": b.failures,
                    "first_failed_unix_ms": b.first_failed_unix_ms,
                    "retry_in_s": max(0.0, b.retry_at - now),
                }
                for b in sorted(self._versions.values(), key=lambda b: -b.version)
            ]
