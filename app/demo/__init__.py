"""demo: the whole product on one machine — an asynchronous RL loop whose weights weightsync syncs.

`weightsync demo` starts, on embedded defaults (a local store under ./weightsync-demo, or S3
when `--store s3://...` is given):

    trainer          FSDP2, 2 ranks under torchrun (weightsync.app.demo.rl): an SFT warm start on
                     a verifiable task (two-number addition), then GRPO on rollouts; every step
                     is published as a version, each rank its own shards, and pushed to one
                     agent per region
    2 regions x 2    sync agents (`weightsync agent`), each beside its reference inference
    agents           server; leaders relay to followers, everyone verifies and hot-swaps
    rollout workers  sample groups from every server, score them, queue them for the trainer;
                     each rollout records the weight version that produced it

The trainer never waits for inference (it publishes and moves on; it waits for rollouts only if
the queue runs dry) and inference never waits for the trainer (servers answer with whatever
version they serve); staleness is bounded by `max_staleness_steps`. The demo prints a live
progress view, then a table per version (delta size and ratio, time to commit, time to each
agent, swap pause, staleness), checks that every agent serves the last version bit for bit
(each re-hashes the bytes it serves), and writes `summary.json` and `summary.png`. Every process
it starts it stops, also on Ctrl-C. Not here: any of those parts (their own modules).
"""

from __future__ import annotations

from weightsync.app.demo.run import DemoConfig, run_demo

__all__ = ["DemoConfig", "run_demo"]
