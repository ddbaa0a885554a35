"""retry.py: attempts, the deadline, which errors are retried, and final errors never retried."""

from __future__ import annotations

import logging

import pytest

from weightsync.errors import AccessDenied, IntegrityError, SignatureError
from weightsync.retry import Backoff, GaveUp, retry_call

NO_PAUSE = Backoff(first_s=0.0, max_s=0.0)


def _failing(errors: list[BaseException], then: object = "done"):
    calls = []

    def attempt():
        calls.append(len(calls) + 1)
        if errors:
            raise errors.pop(0)
        return then

    return attempt, calls


def test_a_transient_failure_is_retried_until_the_attempt_succeeds(caplog):
    attempt, calls = _failing([OSError("reset"), OSError("reset")])
    with caplog.at_level(logging.WARNING):
        result = retry_call(
            "read x", attempt, attempts=5, backoff=NO_PAUSE, retry_on=(OSError,), log=logging.getLogger("t")
        )
    assert result == "done" and calls == [1, 2, 3]
    assert [r.getMessage() for r in caplog.records][0].startswith("read x: attempt 1 of 5 failed (reset)")


def test_after_the_last_attempt_gave_up_carries_the_last_error():
    attempt, calls = _failing([OSError("one"), OSError("two"), OSError("three")])
    with pytest.raises(GaveUp, match=r"cannot read x \(gave up after 3 attempts in .* s\): three") as raised:
        retry_call("read x", attempt, attempts=3, backoff=NO_PAUSE, retry_on=(OSError,))
    assert calls == [1, 2, 3] and str(raised.value.last) == "three"


@pytest.mark.parametrize("final", [AccessDenied("token refused"), SignatureError("bad signature")])
def test_final_errors_are_raised_at_once_even_when_the_caller_retries_their_type(final):
    attempt, calls = _failing([final])
    with pytest.raises(type(final)):
        retry_call("x", attempt, attempts=5, backoff=NO_PAUSE, retry_on=(Exception,))
    assert calls == [1]


def test_an_error_the_caller_does_not_name_is_not_retried():
    attempt, calls = _failing([IntegrityError("corrupt")])
    with pytest.raises(IntegrityError):
        retry_call("x", attempt, attempts=5, backoff=NO_PAUSE, retry_on=(OSError,))
    assert calls == [1]


def test_no_attempt_starts_whose_pause_would_end_past_the_deadline():
    # A pause of an hour against a deadline of a second: one attempt, then GaveUp without sleeping.
    attempt, calls = _failing([OSError("down")] * 3)
    with pytest.raises(GaveUp):
        retry_call(
            "x", attempt, attempts=3, backoff=Backoff(first_s=3600, max_s=3600), retry_on=(OSError,), deadline_s=1
        )
    assert calls == [1]


def test_the_backoff_doubles_up_to_its_cap_and_jitter_stays_within_half():
    backoff = Backoff(first_s=0.5, max_s=3.0)
    assert [backoff.pause_s(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    jittered = Backoff(first_s=2.0, max_s=2.0, jitter=True)
    assert all(1.0 <= jittered.pause_s(3) <= 2.0 for _ in range(100))


@pytest.mark.parametrize("first_s, max_s", [(-1.0, 1.0), (2.0, 1.0)])
def test_a_backoff_that_makes_no_sense_is_refused(first_s, max_s):
    with pytest.raises(ValueError, match="0 <= first_s <= max_s"):
        Backoff(first_s=first_s, max_s=max_s)


def test_attempts_below_one_are_refused():
    with pytest.raises(ValueError, match="attempts must be >= 1, got 0"):
        retry_call("x", lambda: None, attempts=0, backoff=NO_PAUSE, retry_on=(OSError,))
