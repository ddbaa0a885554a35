"""The demo trainer's rollout source (app/demo/rl.py): when no rollout comes, its error says why,
from the rollout workers' statistics beside the queue: nothing sampled, or every group sampled
scored the same (such groups carry no GRPO signal and are not queued)."""

from __future__ import annotations

import json
import time

import pytest

from weightsync.app.demo.rl import RolloutSource


def _source(queue_dir) -> RolloutSource:
    return RolloutSource(
        str(queue_dir), dp_rank=0, dp_size=1, current_step=lambda: 31, max_staleness_steps=4, wait_timeout_s=0.2
    )


def test_a_queue_no_worker_feeds_names_the_workers(tmp_path):
    with pytest.raises(TimeoutError, match="sampled nothing in that time: are they running"):
        _source(tmp_path)._claim(4)


def test_groups_without_a_reward_signal_are_named_as_the_reason(tmp_path):
    now = time.time()
    rows = [{"t": now + 60, "reward": 0.0, "queued": False, "version": 31}] * 5  # within the wait
    rows.append({"t": now - 3600, "reward": 1.0, "queued": True, "version": 3})  # before the wait: not counted
    (tmp_path / "stats-w0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "{torn")
    with pytest.raises(
        TimeoutError,
        match=r"sampled 5 groups in that time, none with a reward signal .*mean "
        r"reward 0\.00",
    ):
        _source(tmp_path)._claim(4)
