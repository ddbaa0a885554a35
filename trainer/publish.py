"""publish: hands each rank's own pieces of the model to the weightsync publisher, from the loop.

No rank gathers the model. Each rank hands in {HF name: local tensor} and {HF name: placement}:
a flat range for an FSDP dim-0 shard, boxes for a tensor- or expert-parallel piece, whatever
the mesh (`pieces.py`). A piece several ranks hold is published by the lowest of them; the
others declare its tensor. The publisher commits the version once every rank's part is durable
and rank 0 checked that the parts cover every tensor exactly once.

`publish()` blocks only for the publisher's bf16 snapshot copy of the local shards; encode and
upload overlap the following steps. Every version carries the model's files (config.json, and an
init directory's generation config and tokenizer: `model_files_of`), so that the store alone
is enough to serve it. With `push` targets, every rank also streams its objects to
the agents as they are encoded and offers each committed version (weightsync.transport.push), and rank 0
signs the manifests when a signing key is configured. Finished versions are collected without blocking and
reported as metrics; a failed version is logged and counted, training goes on (the next
version is a full one).

Not here: encoding, stores, commit protocol (all in weightsync.publisher), gathering (never).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from weightsync.errors import PublishError
from weightsync.format.probe import Probe
from weightsync.listen import listen_error
from weightsync.metrics import NULL_METRICS, PrometheusMetrics
from weightsync.model_files import read_model_files
from weightsync.models import ModelConfig
from weightsync.publisher import Publisher, ShardSpec
from weightsync.stores import open_store
from weightsync.trainer.config import ModelSpec, PublishConfig
from weightsync.trainer.pieces import Ownership
from weightsync.trainer.probe import version_probe
from weightsync.transport.push import PushConfig, Pusher
from weightsync.transport.rpc import TlsConfig, read_token
from weightsync.transport.signing import Signer

log = logging.getLogger(__name__)


def model_files_of(spec: ModelSpec, architecture: ModelConfig, config: PublishConfig) -> dict[str, bytes]:
    """The files an engine loads beside the published weights: the init directory's (config.json,
    generation config, tokenizer), or the config.json of a freshly initialised architecture, its
    dtype the one the publisher writes (weightsync.model_files)."""
    if spec.init_dir is not None:
        return read_model_files(spec.init_dir)
    doc = architecture.to_hf()
    doc["torch_dtype"] = config.publisher.cast_floats_to or "float32"
    return {"config.json": json.dumps(doc, indent=2, sort_keys=True).encode()}


def make_session_id() -> str:
    """One id for every rank of this job run (rank 0 draws it; a collective call)."""
    box = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class WeightPublisher:
    """Publishes the model every `config.every_steps` steps, each rank its own shards."""

    def __init__(
        self, config: PublishConfig, *, rank: int, world_size: int, model_files: Mapping[str, bytes] | None = None
    ) -> None:
        """`model_files`: what every version carries beside the weights (`model_files_of`)."""
        if config.store is None:
            raise ValueError("WeightPublisher needs train.publish.store")
        self.config = config
        self.rank = rank
        self.session = make_session_id()
        store = open_store(config.store)
        shard = ShardSpec(
            rank=rank, world_size=world_size, session=self.session, commit_timeout_s=config.commit_timeout_s
        )
        self.metrics = NULL_METRICS
        if config.metrics_port is not None and rank == 0:
            self.metrics = PrometheusMetrics(model=config.model)
            self.metrics.start_counters("publish")  # at 0 from the first scrape, not from the first version
            address = f"{config.metrics_host}:{config.metrics_port}"
            try:
                port = self.metrics.serve(config.metrics_port, config.metrics_host)
            except OSError as e:  # Prometheus' own "[Errno 98] Address already in use" names no port
                raise listen_error("train.publish.metrics_port", address, e) from None
            log.info("publisher metrics on http://%s:%d/metrics", config.metrics_host, port)
        self._pusher = None
        if config.push:
            self._pusher = Pusher(
                PushConfig(
                    targets=config.push,
                    model=config.model,
                    token=read_token(token_file=config.push_token_file),
                    tls=TlsConfig(ca=config.push_ca) if config.push_ca else None,
                    origin=f"trainer/rank-{rank}",
                ),
                metrics=self.metrics,
            )
        signer = Signer.from_pem(config.signing_key) if config.signing_key and rank == 0 else None
        self._publisher = Publisher(
            store,
            model=config.model,
            config=config.publisher,
            shard=shard,
            signer=signer,
            listeners=[self._pusher] if self._pusher is not None else [],
            metrics=self.metrics,
            model_files=model_files,
        )
        self._ownership = Ownership()
        self._pending: collections.deque[tuple[int, cf.Future, int]] = collections.deque()  # step, future, called at
        self._probe_prompts: list[list[int]] | None = None  # the run's, set by the first probe
        self.last_version: int | None = None
        self.last_committed_step: int | None = None
        self.failures = 0
        log.info(
            "publishing %s to %s every %d steps (session %s)", config.model, store.uri, config.every_steps, self.session
        )

    def due(self, step: int, last_step: int) -> bool:
        return step % self.config.every_steps == 0 or step == last_step

    def probe(self, engine: Any, *, kind: str = "full") -> Probe | None:
        """The parity probe of the version about to be published (`weightsync.trainer.probe`), on the
        prompts this publisher's first probe chose. Collective: every rank calls it."""
        probe = version_probe(engine, self.config, prompts=self._probe_prompts, kind=kind)
        if probe is not None:
            self._probe_prompts = [list(p) for p in probe.prompts]
        return probe

    def publish(
        self, state_dict: Mapping[str, torch.Tensor], step: int, *, probe: Probe | None = None
    ) -> dict[str, float]:
        """Hands this rank's pieces of `state_dict` (and the version's parity probe, which rank 0
        writes) to the publisher; returns the step's metrics: "publish/version", the version
        these weights become once committed (numbered now: the step's own, not the last commit),
        and "publish/wait_s", the seconds it blocked (the snapshot copy, plus any wait for a free
        in-flight slot). Collective: every rank calls it at the same step."""
        t0 = time.perf_counter()
        called_unix_ms = int(time.time() * 1000)
        tensors, placements = self._ownership.collect(state_dict)
        future = self._publisher.publish(
            tensors, step=step, placements=placements, probe=probe, layout_key=self._ownership.layout_key
        )
        self._pending.append((step, future, called_unix_ms))
        return {"publish/version": future.version, "publish/wait_s": time.perf_counter() - t0}

    def collect(self, *, wait: bool = False) -> dict[str, float]:
        """Settles the versions that finished (all of them with wait); returns their metrics, the
        newest one's under "publish/committed_version" and "publish/committed_step" (a version
        commits while later steps run)."""
        metrics: dict[str, float] = {}
        while self._pending and (wait or self._pending[0][1].done()):
            step, future, called_unix_ms = self._pending.popleft()
            try:
                result = future.result()
            except (PublishError, OSError) as e:
                self.failures += 1
                log.error("publish of step %d failed (training goes on; the next version is full): %s", step, e)
                continue
            self.last_version, self.last_committed_step = result.version, step
            self._log(result, step, called_unix_ms)
            metrics.update(
                {
                    "publish/committed_version": result.version,
                    "publish/committed_step": step,
                    "publish/latency_s": result.total_s,
                    "publish/encode_s": result.encode_s,
                    "publish/ratio": result.ratio,
                }
            )
        metrics["publish/failures"] = self.failures
        metrics["publish/in_flight"] = len(self._pending)
        return metrics

    def _log(self, result, step: int, called_unix_ms: int) -> None:
        if self.config.log_path is None or self.rank != 0:
            return
        row = {
            "version": result.version,
            "step": step,
            "kind": result.manifest.kind,
            "publish_call_unix_ms": called_unix_ms,
            "latency_s": result.total_s,
            "encode_s": result.encode_s,
            "snapshot_s": result.snapshot_s,
            "stored_bytes": result.stored_bytes,
            "ratio": result.ratio,
        }
        with open(self.config.log_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def close(self) -> dict[str, float]:
        """Waits for every version in flight (and its push); returns the metrics of those that finished."""
        try:
            return self.collect(wait=True)
        finally:
            self._publisher.close()
            if self._pusher is not None:
                self._pusher.close(timeout_s=30)
            if isinstance(self.metrics, PrometheusMetrics):
                self.metrics.close()
