"""ledger: what one sync agent did with each version it heard of, for `status()` and operators.

One entry per version, newest first, bounded to `ledger_size` entries: where it came from, the
path that reached it (deltas or base + deltas), bytes pushed and fetched, per-stage timings, the
outcome and the last error. Entries are plain dataclasses, so `status()` serialises them as they
are. Thread-safe: gRPC threads and the sync thread both write to it.

Not here: deciding what to sync (`sync.py`), the crash-safe record of the served version (the
state file, `cache.py`), metrics (`weightsync/metrics.py`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque


@dataclasses.dataclass
class LedgerEntry:
    version: int
    outcome: str = "pending"  # served | failed | superseded
    path: str = ""
    source: str = ""
    bytes_pushed: int = 0
    bytes_fetched: int = 0
    timings_s: dict[str, float] = dataclasses.field(default_factory=dict)
    error: str = ""
    offered_unix_ms: int = 0
    served_unix_ms: int = 0
    digest: str = ""


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
