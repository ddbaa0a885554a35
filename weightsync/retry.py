"""retry: the one way weightsync tries again: attempts, a deadline, a backoff, and which errors are final.

    Backoff        the pause before each next attempt: `first_s`, doubling up to `max_s`, with
                   optional jitter (a random 50-100 % of it, so that many clients that failed
                   together do not come back together)
    retry_call     runs an attempt until it succeeds, at most `attempts` times and no new attempt
                   after `deadline_s`; then GaveUp, which carries the last error

Final errors are never retried, whatever the caller asks: a refused token (AccessDenied) or a
refused signature (SignatureError) is the same on every attempt, and hammering a server with it
only fills its logs. Everything else is retried only if the caller names its type.

Not here: what each caller counts as transient (the S3 store's error table, an engine's HTTP
status codes), long-running workers that keep going after failures (they use `Backoff` alone).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from weightsync.errors import AccessDenied, SignatureError, WeightsyncError

T = TypeVar("T")

FINAL_ERRORS: tuple[type[BaseException], ...] = (AccessDenied, SignatureError)
"""Errors no retry can fix: raised at once, everywhere."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Backoff:
    """The pause after the n-th failure (n >= 1): first_s * 2**(n-1), at most max_s."""

    first_s: float
    max_s: float
    jitter: bool = False
    """Pause a random 50-100 % of the figure."""

    def __post_init__(self) -> None:
        if not 0 <= self.first_s <= self.max_s:
            raise ValueError(f"backoff needs 0 <= first_s <= max_s, got {self.first_s} and {self.max_s}")

    def pause_s(self, failures: int) -> float:
        pause = min(self.max_s, self.first_s * 2 ** max(0, failures - 1))
        return pause * random.uniform(0.5, 1.0) if self.jitter else pause


class GaveUp(WeightsyncError):
    """Every attempt failed (or the deadline came first); `last` is the last attempt's error."""

    def __init__(self, what: str, attempts: int, elapsed_s: float, last: BaseException) -> None:
        super().__init__(f"cannot {what} (gave up after {attempts} attempts in {elapsed_s:.1f} s): {last}")
        self.what, self.attempts, self.elapsed_s, self.last = what, attempts, elapsed_s, last

    def __reduce__(self):  # picklable like every weightsync error
        return (GaveUp, (self.what, self.attempts, self.elapsed_s, self.last))


def retry_call(
    what: str,
    attempt: Callable[[], T],
    *,
    attempts: int,
    backoff: Backoff,
    retry_on: tuple[type[BaseException], ...],
    deadline_s: float | None = None,
    log: logging.Logger | None = None,
) -> T:
    """`attempt()` until it returns, retrying the errors of `retry_on` (never FINAL_ERRORS), at
    most `attempts` times, and no new attempt once the pause would end after `deadline_s` from
    now; then GaveUp. Each retried failure is logged at WARNING on `log` (if given), saying what."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    started = time.monotonic()
    deadline = None if deadline_s is None else started + deadline_s
    for n in range(1, attempts + 1):
        try:
            return attempt()
        except FINAL_ERRORS:
            raise
        except retry_on as e:
            error = e
        pause = backoff.pause_s(n)
        if n == attempts or (deadline is not None and time.monotonic() + pause > deadline):
            break
        if log is not None:
            log.warning("%s: attempt %d of %d failed (%s); again in %.2f s", what, n, attempts, error, pause)
        time.sleep(pause)
    raise GaveUp(what, n, time.monotonic() - started, error)
