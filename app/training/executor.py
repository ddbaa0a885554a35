"""executor: the one thread that runs a training service's jobs, in the order they were released.

Every job that touches the model (create, forward_backward, optim_step, save, load, publish,
unload) runs here, one at a time, because the ranks execute one command at a time. Requests of one
model are released in seq_id order first (`ordering.SeqIdOrder`, via `submit_ordered`); a job's
result or error resolves its future (`futures.py`), its error keeping its category (a user error
is not logged as a server failure).

Not here: what the jobs do (`service.py`, `sampler_weights.py`), the order of seq_ids (`ordering.py`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from weightsync.app.training.errors import NotFound, UserInputError
from weightsync.app.training.futures import FutureTable, Outcome
from weightsync.app.training.ordering import SeqIdOrder
from weightsync.app.training.sessions import Sessions

log = logging.getLogger(__name__)

Job = Callable[[], Outcome]


class Executor:
    """Runs jobs on one thread; each resolves or fails the future of its request id."""

    def __init__(self, futures: FutureTable, sessions: Sessions) -> None:
        self.futures = futures
        self.sessions = sessions
        self._jobs: queue.Queue[tuple[str, Job, str | None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="training-executor", daemon=True)
        self._thread.start()

    def enqueue(self, request_id: str, job: Job, session_id: str | None = None) -> None:
        """Queues `job`; the session (if any) counts as busy until it has run."""
        if session_id is not None:
            self.sessions.job_started(session_id)
        self._jobs.put((request_id, job, session_id))

    def submit_ordered(
        self, order: SeqIdOrder, seq_id: int, request_id: str, job: Job, *, session_id: str, model_id: str
    ) -> str:
        """Queues `job` once every earlier seq_id of its model has been released; the request id to
        answer with: `request_id`, or for a retried seq_id the first request's (the new future
        is then dropped unused)."""
        kind = request_id.rsplit("-", 1)[0]
        try:
            answered = order.submit(seq_id, request_id, lambda: self.enqueue(request_id, job, session_id), kind=kind)
        except BaseException:  # refused (a seq_id already released, say): nobody will ask for the future
            self.futures.discard(request_id)
            raise
        if answered != request_id:
            log.info("seq_id %d of %s retried: answering with %s", seq_id, model_id, answered)
            self.futures.discard(request_id)
        return answered

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            request_id, job, session_id = item
            try:
                outcome = job()
            except Exception as e:  # every failure goes to the caller's future, with its category
                if not isinstance(e, (UserInputError, NotFound)):
                    log.exception("request %s failed", request_id)
                self.futures.fail(request_id, e)
            else:
                self.futures.resolve(request_id, outcome)
            finally:
                if session_id is not None:
                    self.sessions.job_ended(session_id)

    def close(self, timeout_s: float = 60.0) -> None:
        """Runs what is queued, then stops."""
        self._jobs.put(None)
        self._thread.join(timeout=timeout_s)
