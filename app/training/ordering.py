"""ordering: a model's requests run in seq_id order, whatever order they arrive in.

The SDK numbers each training client's requests 1, 2, 3, ... (`seq_id`) and may send them
concurrently (the chunks of one forward_backward go out in parallel, the first one last), so
the server must reorder: a request whose predecessors have all arrived is released at once,
a later one waits in a buffer. A request repeating a seq_id already submitted, of the same kind,
is the SDK retrying one whose reply it lost (a reset or timed-out connection): it gets the first
request's future and runs nothing. Any other seq_id at or below one already released is refused
(a replay would apply a step twice). A request that waits longer than `gap_timeout_s` for a seq_id that
never comes is failed as a user error naming the missing id; the model is untouched.

States of one seq_id: absent -> buffered (waiting for a predecessor) -> released, or
buffered -> expired (failed after gap_timeout_s, or at once when its model is unloaded).

Not here: running the released requests (service.py).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from weightsync.app.training.errors import UserInputError

_REMEMBERED = 4096  # recent seq_ids whose request ids a retry can get back


class SeqIdOrder:
    """Releases callbacks in seq_id order, starting at `first`."""

    def __init__(self, *, first: int, gap_timeout_s: float, on_expired: Callable[[int, str, Exception], None]) -> None:
        self.next_seq_id = first
        self.gap_timeout_s = gap_timeout_s
        self._on_expired = on_expired
        self._buffered: dict[int, tuple[float, str, Callable[[], None]]] = {}
        self._submitted: OrderedDict[int, tuple[str, str]] = OrderedDict()  # seq_id -> (kind, request_id)
        self._lock = threading.Lock()

    def submit(self, seq_id: int, request_id: str, release: Callable[[], None], *, kind: str = "") -> str:
        """Calls `release` now (in order, with any buffered successors) or when its turn comes;
        returns the request id whose future carries the result: `request_id`, or for a retry of
        a seq_id already submitted with the same `kind`, the first request's (nothing runs again)."""
        with self._lock:
            earlier = self._submitted.get(seq_id)
            if earlier is not None and earlier[0] == kind:
                return earlier[1]
            if seq_id < self.next_seq_id or seq_id in self._buffered:
                raise UserInputError(
                    f"seq_id {seq_id} was already used for this model (next expected: "
                    f"{self.next_seq_id}); requests of a model need increasing seq_ids"
                )
            self._buffered[seq_id] = (time.monotonic(), request_id, release)
            self._submitted[seq_id] = (kind, request_id)
            while len(self._submitted) > _REMEMBERED:
                self._submitted.popitem(last=False)
            ready = self._pop_ready()
        for callback in ready:
            callback()
        return request_id

    def expire(self) -> None:
        """Fails buffered requests that waited longer than gap_timeout_s (called periodically)."""
        now = time.monotonic()
        with self._lock:
            if not self._buffered:
                return
            oldest = min(t for t, _, _ in self._buffered.values())
            if now - oldest < self.gap_timeout_s:
                return
            expired, self._buffered = self._buffered, {}
        for seq_id, (_, request_id, _) in sorted(expired.items()):
            self._on_expired(
                seq_id,
                request_id,
                UserInputError(
                    f"seq_id gap: request seq_id {seq_id} waited {self.gap_timeout_s:g} s for seq_id "
                    f"{self.next_seq_id}, which never arrived; a model's requests must carry consecutive seq_ids"
                ),
            )

    def fail_all(self, error: Exception) -> None:
        """Fails every buffered request with `error` (its model is gone: nothing will release them)."""
        with self._lock:
            failed, self._buffered = self._buffered, {}
        for seq_id, (_, request_id, _) in sorted(failed.items()):
            self._on_expired(seq_id, request_id, error)

    def _pop_ready(self) -> list[Callable[[], None]]:
        ready = []
        while self.next_seq_id in self._buffered:
            ready.append(self._buffered.pop(self.next_seq_id)[2])
            self.next_seq_id += 1
        return ready
