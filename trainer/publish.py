"""publish: hands each rank's own FSDP2 shards to the weightsync publisher, from the loop.

No rank gathers the model. A dim-0 FSDP2 shard of a row-major tensor is one contiguous flat
element range of the global tensor; its start comes from the DTensor's chunk metadata
(`__create_chunk_list__`, which accounts for uneven and empty shards), so each rank hands in
{HF name: local shard} and {HF name: (global shape, flat start)}. Tensors replicated across an
axis (HSDP replicas, plain buffers) are published by the ranks at coordinate 0 of that axis
only. The publisher commits the version once every rank's part is durable.

`publish()` blocks only for the publisher's bf16 snapshot copy of the local shards; encode and
upload overlap the following steps. With `push` targets, every rank also streams its objects to
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
import math
import time
import uuid
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from weightsync.errors import LayoutError, PublishError
from weightsync.format.probe import Probe
from weightsync.listen import listen_error
from weightsync.metrics import NULL_METRICS, PrometheusMetrics
from weightsync.publisher import Placement, Publisher, ShardSpec
from weightsync.stores import open_store
from weightsync.trainer.config import PublishConfig
from weightsync.trainer.probe import version_probe
from weightsync.transport.push import PushConfig, Pusher
from weightsync.transport.rpc import TlsConfig, read_token
from weightsync.transport.signing import Signer

log = logging.getLogger(__name__)


def flat_start(global_shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    """The flat element offset of a chunk that covers whole trailing dims (a dim-0 shard).

    Raises LayoutError for a chunk that is not one contiguous flat range (e.g. a dim-1 shard).
    """
    if len(global_shape) != len(offsets) or len(offsets) != len(sizes):
        raise LayoutError(f"chunk offsets {offsets} / sizes {sizes} do not match shape {global_shape}")
    if not global_shape:
        return 0
    trailing = math.prod(global_shape[1:])
    if math.prod(sizes) == 0:
        # An empty shard (more ranks than rows): place it at the end of what precedes it.
        return min(offsets[0], global_shape[0]) * trailing
    if tuple(offsets[1:]) != (0,) * (len(offsets) - 1) or tuple(sizes[1:]) != tuple(global_shape[1:]):
        raise LayoutError(
            f"a shard at offsets {tuple(offsets)} with sizes {tuple(sizes)} of shape "
            f"{tuple(global_shape)} is not a contiguous flat range; only dim-0 sharding is published"
        )
    if offsets[0] + sizes[0] > global_shape[0]:
        raise LayoutError(f"a shard at row {offsets[0]} with {sizes[0]} rows overruns shape {tuple(global_shape)}")
    return offsets[0] * trailing


def collect_local_shards(
    state_dict: Mapping[str, torch.Tensor], *, rank: int
) -> tuple[dict[str, torch.Tensor], dict[str, Placement]]:
    """This rank's part of `state_dict`: (local tensors, placements of the sharded ones).

    DTensors sharded on dim 0 give their local shard and its flat range; a tensor replicated
    along a mesh axis is kept only by the rank at coordinate 0 of that axis; plain tensors
    (whole on every rank) are kept by global rank 0 only, with no placement.
    """
    tensors: dict[str, torch.Tensor] = {}
    placements: dict[str, Placement] = {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, DTensor):
            if rank == 0:
                tensors[name] = tensor.detach()
            continue
        if not _owns(tensor):
            continue
        local = tensor.to_local().detach()
        if not local.is_contiguous():
            local = local.contiguous()
        if not any(isinstance(p, Shard) for p in tensor.placements):
            tensors[name] = local  # replicated everywhere: a whole tensor from one owner
            continue
        chunks = tensor.__create_chunk_list__()
        if len(chunks) != 1:
            raise LayoutError(f"{name}: a local shard in {len(chunks)} pieces cannot be published as one range")
        chunk = chunks[0]
        global_shape = tuple(tensor.shape)
        start = flat_start(global_shape, tuple(chunk.offsets), tuple(chunk.sizes))
        tensors[name] = local
        placements[name] = Placement(global_shape=global_shape, start=start)
    return tensors, placements


def _owns(tensor: DTensor) -> bool:
    """True unless another rank along a replicated mesh axis holds the same data first."""
    mesh = tensor.device_mesh
    for axis, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            if mesh.get_local_rank(axis) != 0:
                return False
        elif not isinstance(placement, Shard):
            raise LayoutError(f"cannot publish a tensor with placement {placement} (reduce it first)")
    return True


def make_session_id() -> str:
    """One id for every rank of this job run (rank 0 draws it; a collective call)."""
    box = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class WeightPublisher:
    """Publishes the model every `config.every_steps` steps, each rank its own shards."""

    def __init__(self, config: PublishConfig, *, rank: int, world_size: int) -> None:
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
        )
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

    def publish(self, state_dict: Mapping[str, torch.Tensor], step: int, *, probe: Probe | None = None) -> float:
        """Hands this rank's shards of `state_dict` (and the version's parity probe, which rank 0
        writes) to the publisher; returns the seconds it blocked (the snapshot copy, plus any
        wait for a free in-flight slot)."""
        t0 = time.perf_counter()
        called_unix_ms = int(time.time() * 1000)
        tensors, placements = collect_local_shards(state_dict, rank=self.rank)
        future = self._publisher.publish(tensors, step=step, placements=placements, probe=probe)
        self._pending.append((step, future, called_unix_ms))
        return time.perf_counter() - t0

    def collect(self, *, wait: bool = False) -> dict[str, float]:
        """Settles the versions that finished (all of them with wait); returns their metrics."""
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
                    "publish/version": result.version,
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
