"""futures: request ids, pending results and the long-poll behind `retrieve_future`.

Every queued call answers at once with a request id; its result is fetched later by
`/api/v1/retrieve_future`. A poll waits up to `long_poll_s` for the result and otherwise
answers `try_again` (the SDK then polls again). A result is kept until `retention_s` after it
completed, then dropped; a poll for an id never issued, or one dropped, is answered 404 (the
SDK treats that as fatal, which is right: the result is gone).

A result is one of: a JSON document, protobuf bytes (forward_backward and sampling results,
which the SDK asks for with `Accept: application/x-protobuf`), or an error with its category.

Not here: what runs the request (service.py), HTTP (http.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from typing import Any

from weightsync.app.training.errors import NotFound, TrainingError


@dataclasses.dataclass
class Outcome:
    """A finished request: exactly one of json, proto, error is set."""

    json: dict[str, Any] | None = None
    proto: bytes | None = None
    error: str | None = None
    category: str = "server"
    weight_version: int | None = None
    """Sampling results: the weight version that produced them (sent as X-Weight-Version)."""


class FutureTable:
    """Thread-safe map from request id to its (eventual) outcome."""

    def __init__(self, *, retention_s: float = 3600.0) -> None:
        self._lock = threading.Condition()
        self._outcomes: dict[str, Outcome | None] = {}
        self._completed_at: dict[str, float] = {}
        self._counter = itertools.count(1)
        self.retention_s = retention_s

    def create(self, prefix: str = "req") -> str:
        with self._lock:
            request_id = f"{prefix}-{next(self._counter)}"
            self._outcomes[request_id] = None
            return request_id

    def discard(self, request_id: str) -> None:
        """Forgets a future nobody will be told about (a retried request's duplicate)."""
        with self._lock:
            self._outcomes.pop(request_id, None)
            self._completed_at.pop(request_id, None)

    def resolve(self, request_id: str, outcome: Outcome) -> None:
        with self._lock:
            self._outcomes[request_id] = outcome
            self._completed_at[request_id] = time.monotonic()
            self._drop_expired()
            self._lock.notify_all()

    def fail(self, request_id: str, error: BaseException) -> None:
        category = error.category if isinstance(error, TrainingError) else "server"
        message = str(error) or type(error).__name__
        if not isinstance(error, TrainingError):
            message = f"{type(error).__name__}: {message}"
        self.resolve(request_id, Outcome(error=message, category=category))

    def wait(self, request_id: str, timeout_s: float) -> Outcome | None:
        """The outcome, or None if it is still pending after timeout_s."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if request_id not in self._outcomes:
                    raise NotFound(
                        f"unknown request id {request_id!r} (never issued, or its result expired "
                        f"{self.retention_s:.0f} s after it completed)"
                    )
                outcome = self._outcomes[request_id]
                remaining = deadline - time.monotonic()
                if outcome is not None or remaining <= 0:
                    return outcome
                self._lock.wait(remaining)

    def pending(self) -> int:
        with self._lock:
            return sum(1 for o in self._outcomes.values() if o is None)

    def _drop_expired(self) -> None:
        cutoff = time.monotonic() - self.retention_s
        for request_id in [r for r, t in self._completed_at.items() if t < cutoff]:
            del self._completed_at[request_id], self._outcomes[request_id]
