"""sessions: the Tinker sessions a training service has open, finished, or let expire.

A session is open from its creation (or, after a restart, from the first call that names it: a
restarted server has forgotten its sessions and must not refuse their clients) until its client
finishes it or it goes silent: no heartbeat, no request and no job of its own for
`session_timeout_s`. A finished session's first reason stays; every later call naming it is
refused with SessionFinished.

Not here: what finishing does to the session's models (`service.py` unloads them), the jobs
themselves (`executor.py`, which reports each session's jobs as busy while they run).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from weightsync.app.training.errors import SessionFinished


def session_of(model_id: str) -> str:
    """The session a model belongs to: model ids are "<session id>:train:<seq id>"."""
    return model_id.split(":", 1)[0]


class Sessions:
    """Open and finished sessions; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._finished: dict[str, dict[str, Any]] = {}  # session id -> its finish reason (the first one)
        self._last_seen: dict[str, float] = {}  # open session id -> monotonic time of its last heartbeat or request
        self._busy: collections.Counter[str] = collections.Counter()  # session id -> its jobs queued or running

    def check_open(self, session_id: str) -> None:
        """Refuses a finished session; an open one (known or not) counts as seen now, for its expiry."""
        with self._lock:
            finished = self._finished.get(session_id)
            if finished is None:
                self._last_seen[session_id] = time.monotonic()
        if finished is not None:
            by = "by its client" if finished["type"] != "expired" else f"({finished['detail']})"
            raise SessionFinished(f"session {session_id} was finished ({finished['type']}) {by}")

    def finish(self, session_id: str, status: str, detail: Any) -> bool:
        """Marks the session finished (the first reason stays); whether this was the first time."""
        with self._lock:
            first = session_id not in self._finished
            self._finished.setdefault(session_id, {"type": status, "detail": detail})
            self._last_seen.pop(session_id, None)
        return first

    def job_started(self, session_id: str) -> None:
        """A job of the session was queued: a session with jobs queued or running does not expire."""
        with self._lock:
            self._busy[session_id] += 1

    def job_ended(self, session_id: str) -> None:
        """One of the session's jobs ended: its silence counts from now."""
        with self._lock:
            self._busy[session_id] -= 1
            if not self._busy[session_id]:
                del self._busy[session_id]
            if session_id in self._last_seen:
                self._last_seen[session_id] = time.monotonic()

    def silent(self, timeout_s: float) -> list[str]:
        """Open sessions with no call and no job for `timeout_s`."""
        cutoff = time.monotonic() - timeout_s
        with self._lock:
            return [s for s, seen in self._last_seen.items() if seen < cutoff and s not in self._busy]
