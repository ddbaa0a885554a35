"""SeqIdOrder on its own: requests released in seq_id order, and what becomes of buffered ones."""

from __future__ import annotations

from weightsync.app.training.errors import SessionFinished
from weightsync.app.training.ordering import SeqIdOrder


def test_requests_buffered_behind_a_gap_fail_when_their_model_is_unloaded():
    failed, released = [], []
    order = SeqIdOrder(first=1, gap_timeout_s=3600, on_expired=lambda seq, rid, err: failed.append((seq, rid, err)))
    order.submit(1, "r1", lambda: released.append(1))
    order.submit(4, "r4", lambda: released.append(4))  # 2 and 3 never come
    order.submit(3, "r3", lambda: released.append(3))
    assert released == [1] and failed == []

    error = SessionFinished("session s1 was finished by its client")
    order.fail_all(error)
    assert [(seq, rid) for seq, rid, _ in failed] == [(3, "r3"), (4, "r4")]
    assert all(err is error for _, _, err in failed)
    order.submit(2, "r2", lambda: released.append(2))  # the buffer is empty: nothing else runs
    assert released == [1, 2]
