"""publisher: the publisher process of a chaos run (`python -m bench.chaos publisher --spec FILE`),
and the digest a version of the trainer's weights must have.

It reads {"step", "slow_s", "skew_s"} lines on stdin and answers one JSON event per line. Not here:
starting and killing it (processes.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from bench.chaos.config import ARCH, MODEL
from harness.fake_trainer import FakeTrainer


def fake_trainer(seed: int) -> FakeTrainer:
    """The trainer every chaos process rebuilds: its weights depend only on (seed, step)."""
    from weightsync.models import ModelConfig

    return FakeTrainer(seed, config=ModelConfig(**ARCH))


def expected_digest(weights: dict, chunk_bytes: int) -> str:
    """The version digest a publisher with `chunk_bytes` writes for these bf16 weights."""
    from weightsync.format.hashing import xxh3_hex
    from weightsync.format.manifest import ChunkRef, TensorEntry, compute_digest
    from weightsync.format.tensors import dtype_of, raw_bytes

    entries = []
    for name in sorted(weights):
        tensor = weights[name].contiguous()
        dtype = dtype_of(tensor)
        data = raw_bytes(tensor)
        per_chunk = max(1, chunk_bytes // dtype.itemsize)
        count = tensor.numel()
        chunks = tuple(
            ChunkRef(
                start=s,
                stop=min(s + per_chunk, count),
                codec="same",
                raw=xxh3_hex(data[s * dtype.itemsize : min(s + per_chunk, count) * dtype.itemsize]),
            )
            for s in range(0, count, per_chunk)
        )
        entries.append(TensorEntry(name=name, dtype=dtype.name, shape=tuple(tensor.shape), chunks=chunks))
    return compute_digest(entries)


class _SkewedClock:
    """The `time` module as the publisher sees it, with time() shifted: clock skew in manifests."""

    def __init__(self, skew_s: float) -> None:
        self.skew_s = skew_s

    def time(self) -> float:
        return time.time() + self.skew_s

    def __getattr__(self, name: str):
        return getattr(time, name)


def publisher_main(spec_path: str) -> int:
    """The publisher process: reads {"step", "slow_s", "skew_s"} lines on stdin, publishes the
    trainer's weights of that step, answers one JSON event per line on stdout."""
    import weightsync.publisher as publisher_module
    from weightsync.publisher import Publisher, PublisherConfig
    from weightsync.stores import open_store
    from weightsync.transport.push import PushConfig, Pusher
    from weightsync.transport.signing import Signer

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec = json.loads(Path(spec_path).read_text())
    slow = {"s": 0.0}

    class SlowLink:
        """A slow encoder/uplink: each object costs `slow_s`, so a kill lands mid-upload."""

        def on_object(self, version, object_xxh3, obj, placement):
            if slow["s"]:
                time.sleep(slow["s"])

        def on_commit(self, manifest, manifest_bytes, signature):
            pass

        def on_failure(self, version, error):
            pass

    pusher = Pusher(
        PushConfig(
            targets=tuple(spec["targets"]),
            model=MODEL,
            token=spec["token"],
            give_up_after_s=spec["push_give_up_s"],
            retry_backoff_s=(0.1, 2.0),
        )
    )
    config = PublisherConfig(
        chunk_bytes=spec["chunk_bytes"], rebase_every=spec["rebase_every"], workers=1, max_in_flight=1
    )
    publisher = Publisher(
        open_store(spec["store"]),
        model=MODEL,
        config=config,
        signer=Signer.from_pem(spec["signing_key"]),
        listeners=[SlowLink(), pusher],
    )
    trainer = fake_trainer(spec["seed"])
    print(json.dumps({"event": "ready", "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        step = command["step"]
        slow["s"] = command.get("slow_s", 0.0)
        publisher_module.time = _SkewedClock(command.get("skew_s", 0.0))
        try:
            trainer.advance_to(step)
            result = publisher.publish(trainer.state_dict(), step=step).result()
            event = {
                "event": "committed",
                "step": step,
                "version": result.version,
                "digest": result.manifest.digest,
                "kind": result.manifest.kind,
                "created_unix_ms": result.manifest.created_unix_ms,
            }
        except Exception as e:  # noqa: BLE001 - the driver decides what a failure means; the process stays up
            event = {"event": "failed", "step": step, "error": f"{type(e).__name__}: {e}"}
        finally:
            publisher_module.time = time
        print(json.dumps(event), flush=True)
    publisher.close()
    pusher.close(timeout_s=5)
    return 0
