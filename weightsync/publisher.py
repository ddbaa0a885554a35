"""publisher: turns successive state dicts into committed versions in a store.

`Publisher.publish(state_dict)` takes a host snapshot synchronously (the only part the caller
waits for) and returns a Future; encoding, upload and commit run in the background. The stages
overlap per tensor and chunk: a tensor's chunks are encoded as soon as it is copied (while
publish() copies the next), each object goes to the listeners (the push) and to its upload as
soon as it is encoded, and a delta's objects are packed (`pack.py`) with each full pack uploaded
while encoding goes on; publish() to commit is then close to the slowest stage, not their sum. Each
version is a delta against the previous snapshot, or a full version (a rebase) when `chain.py`
says so; each tensor is cut into chunks by `format/chunking.py`.

Lifecycle of one version (states in order; any failure ends it):
    snapshot   -> caller's thread, under the in-flight bound (blocks while max_in_flight run);
                  the version is planned from the tensors' layout first, then copied tensor by tensor
    encode     -> each copied tensor's chunks encoded on the worker pool and written: full versions
                  one content-addressed object per chunk, deltas into packs
    wait       -> the previous version has finished (commits happen in version order), and
                  for a delta its parent committed (else this version fails, the next rebases)
    commit     -> the manifest, create-only; the version exists from here on
                  (sharded: this rank's part, then rank 0 merges every rank's part and commits
                  the one manifest while the others wait for it; see `shards.py`)

A sharded publisher (`shard=ShardSpec(...)`) is one of N trainer ranks: it publishes only its
local shards, each with a `Placement` (global shape and a flat element offset, or boxes: a
tensor-parallel shard on any dim, `format/boxes.py`), and the version commits once every rank's
part is durable and rank 0 checked that the parts cover every tensor exactly once. It never
reads a parent from the store: a new job session starts with a full version.

What the versions may use (manifest format, highest codec id) is `PublisherConfig.write_format`,
for the oldest reader they must serve (docs/format.md, "Versions of the format"); every encode
gets it as an argument, so publishers in one process may write for different readers.

The first publish() also starts compiling the delta codecs' kernels (numba) in a low-priority
thread, so that on a machine whose numba cache is empty the first delta does not compile them.

Listeners (the gRPC push client) see each encoded object as soon as it exists, concurrently
with its upload, and the manifest once committed; they must queue, not block.
Not here: reading versions back (`reader.py`), deleting them (`stores/retention.py`), the delta
chain and its rebase policy (`chain.py`), where chunks are cut (`format/chunking.py`).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from weightsync import __version__
from weightsync.chain import Chain, ChainTotals, chain_from_store, planning_horizon, rebase_reason
from weightsync.cpus import usable_cpus
from weightsync.errors import ObjectNotFound, PublishError, VersionConflict
from weightsync.format import layout
from weightsync.format.boxes import Box
from weightsync.format.chunk import MAX_CHUNK_BYTES, encode_chunk, object_hash
from weightsync.format.chunking import box_chunks, chunk_ranges
from weightsync.format.codecs import CODEC_IDS, CODEC_NAMES, DEFAULT_ZSTD_LEVEL, MAX_ZSTD_LEVEL
from weightsync.format.codecs.changes import Changes
from weightsync.format.codecs.choice import CodecChoice
from weightsync.format.codecs.diff import DeviceParent
from weightsync.format.codecs.warmup import BackgroundWarmUp
from weightsync.format.dtypes import DType, dtype_by_name
from weightsync.format.manifest import (
    CODEC_SAME,
    FORMAT_BOXES,
    KIND_DELTA,
    KIND_FULL,
    WEIGHTS_KINDS,
    ChunkPlacement,
    ChunkRef,
    Manifest,
    TensorEntry,
    compute_digest,
    lowest_format,
    parse_manifest,
)
from weightsync.format.pack import DEFAULT_PACK_BYTES, PackSlot, PackWriter
from weightsync.format.probe import Probe
from weightsync.format.tensors import Snapshot, SnapshotTensor, copy_tensor, snapshot_layout
from weightsync.format.write_format import WriteFormat
from weightsync.metrics import NULL_METRICS, Metrics
from weightsync.model_files import put_model_file_copies, put_model_file_objects
from weightsync.shards import (
    PartHeader,
    Placement,
    ShardSpec,
    delete_parts,
    merge_parts,
    placements_for,
    wait_for_commit,
    wait_for_parts,
    write_abort,
    write_part,
)
from weightsync.stores import Store
from weightsync.transport.signing import Signer
from weightsync.versions import commit_manifest, latest_version, read_manifest, read_signature

log = logging.getLogger(__name__)

FILES_TOUCH_S = 600.0
"""The model files' objects are touched again at a commit this long after the last touch: gc's
grace period (an hour by default) protects them only until a manifest names them, and a first
version may come late (a long first step)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublisherConfig:
    chunk_bytes: int = 4 * 1024 * 1024
    """Largest chunk, in bytes: the unit of encoding, storage, transfer and retry. 1-4 MiB
    parallelises best and costs no compression ratio."""
    cast_floats_to: str | None = "bfloat16"
    """Floating tensors are cast to this dtype in the snapshot (what inference serves);
    None keeps every dtype as handed in."""
    zstd_level: int = DEFAULT_ZSTD_LEVEL
    """zstd level for every chunk (1 = fastest, 19 = smallest)."""
    workers: int = dataclasses.field(default_factory=usable_cpus)
    """Threads that encode and upload chunks (zstd and numpy release the GIL); default: the CPUs
    this process may use (weightsync.cpus.usable_cpus)."""
    max_in_flight: int = 2
    """Versions encoding or uploading at once; publish() blocks while this many run."""
    rebase_every: int = 16
    """A delta chain holds at most this many deltas; the next version is full."""
    rebase_chain_ratio: float = 1.0
    """Rebase when the chain's deltas add up to more than this times the base's bytes."""
    parent_from_store: bool = True
    """On the first publish, read the store's latest version as the delta parent (a restarted
    trainer or a CLI publish then writes a delta instead of a full version)."""
    write_format: WriteFormat = WriteFormat()
    """What the versions may use, for the oldest reader they must serve: the manifest format
    (1: no packs) and the highest codec id (3: what readers before codec 4 decode). Default:
    everything this build writes. docs/format.md, "Versions of the format"."""
    pack_bytes: int | None = None
    """A delta's chunk objects are written into packs of up to this many bytes (docs/format.md,
    "Packs"): a few store writes per version instead of one per changed chunk. None: 8 MiB
    (`DEFAULT_PACK_BYTES`) where `write_format` allows packs, none where it does not; 0 writes
    every chunk as its own object whatever the format allows. Full versions always do: their big
    objects gain nothing from packing, and content addressing shares them between versions."""
    weights_kind: str = "model"
    """What the versions hold, written to the manifest's producer.weights_kind: "model" (a whole
    model's weights, LoRA merged in or not) or "adapter" (LoRA adapter tensors only, for engines
    that serve adapters). Agents refuse a kind their engine does not serve."""
    device_diff: bool = False
    """Keep the last published weights beside the trainer's (one more copy of the model on its
    GPU) and find each chunk's changes there (`weightsync.format.codecs.diff`): only the changed elements
    cross to the host for encoding. Tensors the snapshot casts use the host scan. It saves the
    host's cores, not time: the diff runs inside publish(), while the host scan overlaps the
    copy on the encode threads. With 16 host cores, 1 GiB bf16 committed in 0.27-0.34 s with it
    and 0.21-0.24 s without (H100, `python -m bench.device_diff --publish 4`)."""

    warm_up_kernels: bool = True
    """From the first publish(), compile the delta codecs' kernels (numba) in a low-priority
    thread, so that on a machine whose numba cache is empty the first delta does not compile
    them. A one-shot publish (the CLI) turns it off: it would wait at exit for kernels it may
    never use, and a delta compiles what it needs anyway."""

    def __post_init__(self) -> None:
        if not 4096 <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [4096, {MAX_CHUNK_BYTES}], got {self.chunk_bytes}")
        if self.cast_floats_to is not None and not dtype_by_name(self.cast_floats_to).floating:
            raise ValueError(f"cast_floats_to must be a floating dtype such as 'bfloat16', got {self.cast_floats_to!r}")
        if not 1 <= self.zstd_level <= MAX_ZSTD_LEVEL:
            raise ValueError(f"zstd_level must be in [1, {MAX_ZSTD_LEVEL}], got {self.zstd_level}")
        if self.workers < 1 or self.max_in_flight < 1:
            raise ValueError("workers and max_in_flight must be at least 1")
        if self.pack_bytes is not None and self.pack_bytes < 0:
            raise ValueError(f"pack_bytes must be >= 0 (0 = no packs) or None (the default), got {self.pack_bytes}")
        if self.pack_bytes and not self.write_format.packs:
            raise ValueError(
                f"pack_bytes={self.pack_bytes} asks for packs, which manifest format "
                f"{self.write_format.manifest_format} cannot hold: leave pack_bytes unset (no packs then) "
                "or write manifest format 2"
            )
        if self.rebase_every < 0 or self.rebase_chain_ratio < 0:
            raise ValueError("rebase_every and rebase_chain_ratio must be >= 0 (0 = every version full)")
        if self.weights_kind not in WEIGHTS_KINDS:
            raise ValueError(f"weights_kind must be one of {WEIGHTS_KINDS}, got {self.weights_kind!r}")

    @property
    def effective_pack_bytes(self) -> int:
        """The pack size the publisher writes deltas in; 0: no packs (see `pack_bytes`)."""
        if self.pack_bytes is not None:
            return self.pack_bytes
        return DEFAULT_PACK_BYTES if self.write_format.packs else 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublishResult:
    """What one publish committed, and what it cost."""

    manifest: Manifest
    manifest_bytes: int
    snapshot_s: float  # the caller's wait
    encode_s: float  # encode + upload of all chunks
    commit_s: float  # wait for earlier versions + manifest write
    total_s: float  # publish() call to commit
    full_reason: str | None = None
    """Why the version is full rather than a delta (None for a delta), e.g. "no parent" or the
    tensors whose name, dtype or shape changed."""

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def raw_bytes(self) -> int:
        """Bytes of the published weights."""
        return self.manifest.raw_bytes

    @property
    def stored_bytes(self) -> int:
        """Bytes of the chunk objects the version names, manifest excluded."""
        return self.manifest.stored_bytes

    @property
    def changed_elements(self) -> int:
        return self.manifest.stats["changed_elements"]

    @property
    def total_elements(self) -> int:
        return self.manifest.stats["total_elements"]

    @property
    def ratio(self) -> float:
        """Raw bytes over bytes stored for this version (chunks and manifest)."""
        return self.raw_bytes / max(1, self.stored_bytes + self.manifest_bytes)


class PublishListener(Protocol):
    """Sees a version's bytes as they are made (the gRPC push client is one). Called from the
    publisher's threads: implementations queue the work and return at once."""

    def on_object(self, version: int, object_xxh3: str, obj: bytes, placement: ChunkPlacement | None) -> None:
        """An encoded chunk object of `version`, before its upload is durable, and where it goes
        (for receivers that apply objects as they arrive; None for a box chunk)."""

    def on_commit(self, manifest: Manifest, manifest_bytes: bytes, signature: bytes | None) -> None:
        """The version committed (on a sharded publish: called on every rank)."""

    def on_failure(self, version: int, error: BaseException) -> None:
        """`version` will never commit."""


@dataclasses.dataclass(kw_only=True, eq=False)
class _Job:
    """One accepted publish, from `publish` (planned under the lock) to its settled future; it
    travels from the caller's thread to a version worker, and the next job waits on it."""

    version: int
    parent: int | None  # None: a full version
    base: int
    step: int | None
    full_reason: str | None  # why the version is full (None: a delta)
    placements: dict[str, Placement]
    chunks: dict[str, list[tuple[int, int, int | Box]]]
    """Each tensor's chunks: (local start, local stop, global flat start or global box)."""
    snapshot: Snapshot  # filled by the caller's thread while the encoders start on what is there
    parent_snapshot: Snapshot | None  # what the delta is taken against; None for a full version
    totals: ChainTotals  # the chain's stored bytes, shared with the jobs of the same chain
    t0: float = 0.0  # perf_counter at publish()
    snapshot_s: float = 0.0
    previous: _Job | None = None  # the job accepted just before: commits wait for it
    progress: Callable[[int], None] | None = None
    changes: dict = dataclasses.field(default_factory=dict)  # {name: {chunk start: ctx changes}}, device_diff
    probe: dict | None = None  # the parity probe's manifest form (producer["probe"])
    future: PublishFuture = dataclasses.field(init=False)  # the caller's
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set once this job and every earlier one has finished, committed or failed."""
    copy_done: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set when the caller's thread has finished (or given up) copying `snapshot`."""
    parent_copied: threading.Event | None = None  # the parent snapshot's copy_done (delta only)
    copied: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue)
    """Names of the tensors copied into `snapshot` so far, in copy order, then None when all
    are (or the exception that stopped the copy): what the encoders start on."""

    def __post_init__(self) -> None:
        self.future = PublishFuture(self.version)


class PublishFuture(cf.Future):
    """What `Publisher.publish` returns: the future of a version numbered when it was accepted, so
    the caller can say which version its call becomes before it commits (a failed one burns its
    number)."""

    def __init__(self, version: int) -> None:
        super().__init__()
        self.version = version


class Publisher:
    """Publishes versions of one model to one store. Thread-safe; use as a context manager."""

    def __init__(
        self,
        store: Store,
        *,
        model: str,
        config: PublisherConfig | None = None,
        shard: ShardSpec | None = None,
        signer: Signer | None = None,
        listeners: Sequence[PublishListener] = (),
        metrics: Metrics = NULL_METRICS,
        model_files: Mapping[str, bytes] | None = None,
    ) -> None:
        """`model_files`: the files an engine loads beside the weights ({"config.json": bytes, ...};
        weightsync.model_files), stored once by the committer and named by every version it
        commits, or kept as older readers find them (`WriteFormat.model_files`)."""
        self.store = store
        self.model = layout.check_model_name(model)
        self.config = config or PublisherConfig()
        self.shard = shard
        self.signer = signer
        self.listeners = tuple(listeners)
        self.metrics = metrics
        self._prefix = layout.model_prefix(model)
        self._encode_pool = cf.ThreadPoolExecutor(self.config.workers, thread_name_prefix="ws-encode")
        # Uploads wait on the network, not the CPU: their own pool, as wide as the store likes.
        # The semaphore bounds encoded objects waiting for upload, so a slow store slows the
        # encoders instead of piling a version's objects up in memory.
        io_workers = max(1, int(getattr(store, "io_concurrency", 4)))
        self._io_pool = cf.ThreadPoolExecutor(io_workers, thread_name_prefix="ws-upload")
        self._pending_uploads = threading.BoundedSemaphore(2 * io_workers)
        self._version_pool = cf.ThreadPoolExecutor(self.config.max_in_flight, thread_name_prefix="ws-version")
        self._slots = threading.BoundedSemaphore(self.config.max_in_flight)
        self._lock = threading.Lock()
        self._next_version: int | None = None
        self._chain: Chain | None = None
        # A sharded job never diffs against the store: each rank would need its own ranges of a
        # version that other ranks wrote. Its first version is a full one.
        self._loaded_parent = not self.config.parent_from_store or shard is not None
        self._last_job: _Job | None = None
        self._spare: Snapshot | None = None  # a snapshot no version reads any more, for reuse
        self._failed: set[int] = set()  # versions that will never commit
        self._device_parent = DeviceParent() if self.config.device_diff else None
        # Every encode gets the choice as an argument: publishers in one process that write for
        # different readers share no setting.
        self._codec_choice = CodecChoice(highest_codec=self.config.write_format.highest_codec)
        self.warm_up: BackgroundWarmUp | None = None  # the delta kernels' warm-up, from the first publish()
        self._files_doc: dict | None = None  # producer.files of every version committed here
        self._model_files = dict(model_files or {})
        self._files_touched_at = time.monotonic()
        if model_files and (shard is None or shard.is_committer):
            if self.config.write_format.model_files:
                self._files_doc = put_model_file_objects(store, model, model_files)
            else:
                put_model_file_copies(store, model, model_files)
        self._closed = False

    # ------------------------------------------------------------------------------ public

    def publish(
        self,
        state_dict: Mapping,
        *,
        step: int | None = None,
        progress: Callable[[int], None] | None = None,
        placements: Mapping[str, Placement] | None = None,
        probe: Probe | None = None,
        layout_key: str | None = None,
    ) -> PublishFuture:
        """Snapshots `state_dict` now; returns a Future of the committed version (its `version` is
        the number it commits as).

        `probe`: the version's numerical-parity probe (`weightsync.format.probe`), written into
        its manifest's producer object; a sharded publisher's committer (rank 0) writes its own.

        `progress`, if given, is called from a background thread with the raw bytes of each
        chunk as it is encoded and stored. `placements` (sharded publishers only) says where
        each local shard sits in its global tensor; tensors without one are whole tensors.
        `layout_key` (sharded): a name of the whole job's layout, the same on every rank (the
        trainer's digest of every rank's pieces); when it changes, every rank's next version is
        full at once, not only those of the ranks whose own pieces moved.
        """
        if self._closed:
            raise PublishError("publisher is closed")
        probe_doc = probe.to_json() if probe is not None else None  # a probe over its bound fails here
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if placements and self.shard is None:
            raise ValueError("placements need a sharded publisher (Publisher(..., shard=ShardSpec(...)))")
        unknown = sorted(set(placements or ()) - set(state_dict))
        if unknown:
            raise ValueError(f"placements name tensors that are not in the state dict: {unknown[:5]}")
        boxed = sorted(n for n, p in (placements or {}).items() if p.boxes is not None)
        if boxed and self.config.write_format.manifest_format < FORMAT_BOXES:
            raise ValueError(
                f"{boxed[0]!r} is placed as boxes (a shard that is not one flat range), which needs manifest "
                f"format {FORMAT_BOXES}; this publisher writes at most format "
                f"{self.config.write_format.manifest_format}: raise its manifest_format, or hand in dim-0 shards"
            )
        t0 = time.perf_counter()
        self._slots.acquire()
        try:
            # Checked and planned before any byte is copied; the version worker then encodes
            # each tensor as soon as it is copied, so publish() to commit overlaps the copy.
            planned = snapshot_layout(state_dict, self.config.cast_floats_to)
            where = placements_for(planned, placements or {})
            chunks = {name: self._chunks_of(dtype, shape, where[name]) for name, (dtype, shape) in planned.items()}
            if self.warm_up is None and self.config.warm_up_kernels:  # the next version is likely a delta
                self.warm_up = BackgroundWarmUp(
                    {dtype.name for dtype, _ in planned.values()},
                    thread_name="ws-publisher-warm-up",
                    codec_ids=[i for i in CODEC_NAMES if i <= self.config.write_format.highest_codec],
                )
            with self._lock:
                spare, self._spare = self._spare, None
                tensor_layout = {n: (d.name, shape) for n, (d, shape) in planned.items()}
                job = self._plan({}, tensor_layout, where, chunks, step, layout_key)
                job.t0, job.previous, job.progress, job.probe = t0, self._last_job, progress, probe_doc
                if self._device_parent is not None:  # on the tensors' device, before the host copy
                    job.changes = self._device_parent.diff(
                        state_dict, planned, job.version, job.parent, lambda n: [(a, b) for a, b, _ in chunks[n]]
                    )
                worker = self._version_pool.submit(self._run, job)
                self._last_job = job
        except BaseException:
            self._slots.release()
            raise
        worker.add_done_callback(lambda w: self._worker_done(w, job))
        spare = spare or {}
        try:
            for name, (dtype, shape) in planned.items():
                job.snapshot[name] = copy_tensor(state_dict[name], dtype, shape, spare.get(name))
                job.copied.put(name)
        except BaseException as e:  # the version fails (its number is burnt); the caller hears it now
            job.copied.put(e)
            raise
        finally:
            job.copy_done.set()
        job.snapshot_s = time.perf_counter() - t0
        job.copied.put(None)
        return job.future

    def _worker_done(self, worker: cf.Future, job: _Job) -> None:
        if worker.cancelled():  # close(wait=False) dropped it before it ran
            job.future.set_exception(PublishError(f"publisher closed before version {job.version} ran"))
            job.finished.set()
        self._slots.release()

    def close(self, wait: bool = True) -> None:
        """Stops accepting versions; with wait, returns when every accepted one has finished."""
        self._closed = True
        if self.warm_up is not None:  # no more versions: no delta will need the kernels not yet compiled
            self.warm_up.stop()
        self._version_pool.shutdown(wait=wait, cancel_futures=not wait)
        self._encode_pool.shutdown(wait=wait, cancel_futures=not wait)
        self._io_pool.shutdown(wait=wait, cancel_futures=not wait)
        if wait and self.warm_up is not None:
            self.warm_up.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close(wait=True)

    # ----------------------------------------------------------------------------- planning

    def _plan(
        self,
        snapshot: Snapshot,
        tensor_layout: dict[str, tuple[str, tuple[int, ...]]],
        placements: dict[str, Placement],
        chunks: dict[str, list[tuple[int, int, int | Box]]],
        step: int | None,
        layout_key: str | None = None,
    ) -> _Job:
        """Numbers the version and picks its parent from the layout the snapshot will have (the
        snapshot is filled later); called under the lock, in publish order."""
        if self._next_version is None:
            latest = latest_version(self.store, self.model)
            self._next_version = (latest or 0) + 1
        if not self._loaded_parent:
            self._loaded_parent = True
            self._chain = chain_from_store(self.store, self.model, self._next_version - 1, workers=self.config.workers)
        version = self._next_version
        self._next_version += 1
        chain = self._chain
        reason = rebase_reason(
            chain,
            tensor_layout,
            placements,
            layout_key,
            failed=self._failed,
            horizon=planning_horizon(version, max_in_flight=self.config.max_in_flight, sharded=self.shard is not None),
            rebase_every=self.config.rebase_every,
            rebase_chain_ratio=self.config.rebase_chain_ratio,
        )
        if reason:
            log.info("%s v%d: full version (%s)", self.model, version, reason)
            parent_snapshot, base, length, parent_copied = None, version, 0, None
        else:
            parent_snapshot, base, length, parent_copied = chain.snapshot, chain.base, chain.length + 1, chain.copied
        parent = None if reason else chain.version
        totals = ChainTotals(base=version) if reason else chain.totals
        job = _Job(
            version=version,
            parent=parent,
            base=base,
            step=step,
            full_reason=reason,
            placements=placements,
            chunks=chunks,
            snapshot=snapshot,
            parent_snapshot=parent_snapshot,
            totals=totals,
            parent_copied=parent_copied,
        )
        self._chain = Chain(
            version, base, snapshot, tensor_layout, placements, length, totals, job.copy_done, layout_key
        )
        self._failed = {v for v in self._failed if v >= base}  # older failures cannot matter any more
        return job

    # ---------------------------------------------------------------------------- execution

    def _run(self, job: _Job) -> None:
        """Drives one version; its caller's future settles as soon as the outcome is known."""
        try:
            result = self._encode_and_commit(job)
            if job.parent_snapshot is not None:
                # The parent has now served both its own version and this delta: reuse it.
                # (Before settling the future, so the caller's next publish can have it.)
                with self._lock:
                    self._spare = job.parent_snapshot
            job.future.set_result(result)
        except BaseException as e:
            job.future.set_exception(self._fail(job, e))
        finally:
            # `finished` is set only after the predecessor's, so waiting on the latest version's
            # means waiting on all earlier ones, failed or not: that is what keeps commit order.
            if job.previous is not None:
                job.previous.finished.wait()
            # Then forget it: every job linked to the one before would keep every version's
            # job alive for the publisher's life (its manifest, and with device_diff its host
            # copies of the changes: ~0.3 GB per GiB-version at 1.3 % changed).
            job.previous = None
            job.changes = {}
            job.finished.set()

    def _fail(self, job: _Job, e: BaseException) -> BaseException:
        with self._lock:
            # Anything planned on top of this version is doomed; a later publish rebases. Unsharded:
            # the very next one. Sharded: the first one planned past the horizon (see chain.planning_horizon),
            # so that every rank rebases the same version.
            self._failed.add(job.version)
            if self.shard is None and self._chain is not None and self._chain.version >= job.version:
                self._chain = None
            if isinstance(e, VersionConflict):
                self._next_version = None  # someone else owns these numbers; re-read the store
        log.error("%s v%d failed: %s", self.model, job.version, e)
        self.metrics.inc("publish/failures")
        if self.shard is not None:  # any rank's failure fails the version for all: tell them now
            write_abort(self.store, self.model, job.version, self.shard.session, f"rank {self.shard.rank}: {e}")
        self._notify("on_failure", job.version, e)
        if isinstance(e, (PublishError, VersionConflict)):
            return e
        error = PublishError(f"{self.model} version {job.version} was not published: {e}")
        error.__cause__ = e
        return error

    def _encode_and_commit(self, job: _Job) -> PublishResult:
        version, snapshot, parent_snapshot = job.version, job.snapshot, job.parent_snapshot
        placements = job.placements
        t_encode = time.perf_counter()
        packer = None
        if parent_snapshot is not None and self.config.effective_pack_bytes:
            packer = PackWriter(self.config.effective_pack_bytes, self._upload_pack, layout.pack_key)
        futures: dict[str, list[cf.Future]] = {}
        tensors, changed, total = [], 0, 0
        if job.parent_copied is not None:
            # Only with publish() called from several threads can the parent still be copying.
            job.parent_copied.wait()
        try:
            # Each tensor's chunks go to the encoders as soon as the caller's thread copied it.
            while (name := job.copied.get()) is not None:
                if isinstance(name, BaseException):
                    raise PublishError(f"{self.model} v{version}: the snapshot copy failed: {name}") from name
                tensor = snapshot[name]
                futures[name] = [
                    self._encode_pool.submit(
                        self._encode_one,
                        version,
                        tensor,
                        parent_snapshot,
                        job.parent or 0,
                        name,
                        start,
                        stop,
                        where,
                        packer,
                        job.changes.get(name, {}).get(start),
                    )
                    for start, stop, where in job.chunks[name]
                ]
            encoded = {}
            for name in sorted(futures):
                chunk_futures = futures[name]
                encoded[name] = []
                for f in chunk_futures:
                    ref, n_changed, upload, slot = f.result()
                    if upload is not None:
                        upload.result()
                    if job.progress is not None:
                        job.progress(ref.count * snapshot[name].dtype.itemsize)
                    encoded[name].append((ref, slot))
                    changed += n_changed
            for upload in packer.finish() if packer is not None else ():
                upload.result()
            for name, chunks in encoded.items():
                # Packed refs learn their pack's key once it is sealed (all are, after finish).
                refs = tuple(
                    ref if slot is None else dataclasses.replace(ref, key=slot.pack.key, offset=slot.offset)
                    for ref, slot in chunks
                )
                tensor = snapshot[name]
                total += tensor.nbytes // tensor.dtype.itemsize
                tensors.append(
                    TensorEntry(name=name, dtype=tensor.dtype.name, shape=placements[name].global_shape, chunks=refs)
                )
        except BaseException:
            for chunk_futures in futures.values():
                for f in chunk_futures:
                    f.cancel()
            raise
        encode_s = time.perf_counter() - t_encode

        t_commit = time.perf_counter()
        self._wait_for_previous(job)
        header = PartHeader(
            version=version,
            parent=job.parent,
            base=job.base,
            kind=KIND_FULL if parent_snapshot is None else KIND_DELTA,
            step=job.step,
        )
        stats = {"changed_elements": changed, "total_elements": total}
        if self.shard is None:
            manifest = self._commit(header, tensors, stats, probe=job.probe)
        elif self.shard.is_committer:
            manifest = self._commit_sharded(header, tensors, stats, probe=job.probe)
        else:
            write_part(self.store, self.model, self.shard, header, tensors, stats)
            manifest = wait_for_commit(self.store, self.model, self.shard, version)
            # Every rank offers the version to the agents, so each sends whatever of its own
            # objects an agent still lacks; duplicate offers are harmless.
            data = manifest.to_bytes()
            self._notify("on_commit", manifest, data, read_signature(self.store, self.model, version, data))
        data = manifest.to_bytes()
        commit_s = time.perf_counter() - t_commit
        stored = manifest.stored_bytes
        with self._lock:
            job.totals.by_version[manifest.version] = stored
        result = PublishResult(
            manifest=manifest,
            manifest_bytes=len(data),
            snapshot_s=job.snapshot_s,
            encode_s=encode_s,
            commit_s=commit_s,
            total_s=time.perf_counter() - job.t0,
            full_reason=job.full_reason,
        )
        self._record(result)
        log.info(
            "%s v%d committed: %s, %.1f MB -> %.2f MB (%.1fx), %.2f s",
            self.model,
            version,
            manifest.kind,
            result.raw_bytes / 1e6,
            (stored + len(data)) / 1e6,
            result.ratio,
            result.total_s,
        )
        return result

    def _commit(
        self, header: PartHeader, tensors: list[TensorEntry], stats: dict[str, int], *, probe: dict | None = None
    ) -> Manifest:
        """Writes the one manifest of a version (signed if we sign) and tells the listeners."""
        producer = {"name": "weightsync", "version": __version__, "host": socket.gethostname()}
        if probe is not None:
            producer["probe"] = probe
        if self.config.weights_kind != "model":  # absent means "model": manifests before the field stay as they were
            producer["weights_kind"] = self.config.weights_kind
        if self._files_doc is not None:
            if time.monotonic() - self._files_touched_at > FILES_TOUCH_S:  # gc spares them till a manifest names them
                put_model_file_objects(self.store, self.model, self._model_files)
                self._files_touched_at = time.monotonic()
            producer["files"] = self._files_doc
        if self.shard is not None:
            producer.update(session=self.shard.session, ranks=self.shard.world_size)
        manifest = Manifest(
            model=self.model,
            version=header.version,
            parent=header.parent,
            base=header.base,
            kind=header.kind,
            step=header.step,
            created_unix_ms=int(time.time() * 1000),
            tensors=tuple(tensors),
            digest=compute_digest(tensors),
            producer=producer,
            stats=stats,
            format=lowest_format(tensors),  # older readers still read what needs nothing newer
        )
        data = manifest.to_bytes()
        parse_manifest(data)  # never commit a manifest a reader would refuse
        self._check_write_format(manifest)  # nor one the readers we write for would
        signature = self.signer.sign(data) if self.signer is not None else None
        commit_manifest(self.store, manifest, signature)
        self._notify("on_commit", manifest, data, signature)
        return manifest

    def _check_write_format(self, manifest: Manifest) -> None:
        allowed = self.config.write_format
        highest = max(
            (CODEC_IDS[c.codec] for t in manifest.tensors for c in t.chunks if c.codec != CODEC_SAME), default=0
        )
        if manifest.format > allowed.manifest_format or highest > allowed.highest_codec:
            raise PublishError(
                f"{self.model} v{manifest.version} would be manifest format {manifest.format} with codec {highest}; "
                f"the publisher writes at most {allowed}"
            )

    def _commit_sharded(
        self, header: PartHeader, tensors: list[TensorEntry], stats: dict[str, int], *, probe: dict | None = None
    ) -> Manifest:
        """Rank 0: our part, everyone's parts, one manifest — or an abort marker that every rank sees."""
        spec, version = self.shard, header.version
        write_part(self.store, self.model, spec, header, tensors, stats)
        parts = wait_for_parts(self.store, self.model, spec, version)
        merged_header, merged, merged_stats = merge_parts(self.model, spec, parts)
        if merged_header.parent is not None:
            parent = read_manifest(self.store, self.model, merged_header.parent)  # VersionNotFound: it failed
            if parent.producer.get("session") != spec.session:
                raise PublishError(f"v{merged_header.parent} was committed by another job; cannot be our parent")
        manifest = self._commit(merged_header, merged, merged_stats, probe=probe)
        delete_parts(self.store, self.model, version, spec.session)
        return manifest

    def _record(self, result: PublishResult) -> None:
        m = self.metrics
        m.inc("publish/versions", kind=result.manifest.kind)
        m.set("publish/version", result.version)
        m.observe("publish/latency_s", result.total_s)
        m.observe("publish/snapshot_s", result.snapshot_s)
        m.observe("publish/encode_s", result.encode_s)
        m.inc("publish/stored_bytes", result.stored_bytes + result.manifest_bytes)
        m.set("publish/ratio", result.ratio)
        m.set("publish/changed_fraction", result.changed_elements / max(1, result.total_elements))

    def _notify(self, event: str, *args) -> None:
        for listener in self.listeners:
            try:
                getattr(listener, event)(*args)
            except Exception:  # a listener's bug must not fail the publish it observes
                log.exception("%s: publish listener %r failed in %s", self.model, listener, event)

    def _wait_for_previous(self, job: _Job) -> None:
        previous = job.previous
        if previous is None:
            return
        previous.finished.wait()
        error = previous.future.exception()
        if error is not None and job.parent_snapshot is not None:
            raise PublishError(
                f"{self.model} version {job.version} is a delta on version {job.parent}, which failed: {error}"
            ) from error
        # A full version does not need its predecessor; commit order is all we waited for.

    def _chunks_of(
        self, dtype: DType, shape: tuple[int, ...], placement: Placement
    ) -> list[tuple[int, int, int | Box]]:
        """A local tensor's chunks (`format/chunking.py`): (local start, local stop, where the
        chunk sits in the global tensor: its flat start, or its box)."""
        if placement.boxes is not None:
            return box_chunks(placement.boxes, dtype.itemsize, self.config.chunk_bytes)
        ranges = chunk_ranges(dtype.itemsize, shape, self.config.chunk_bytes)
        return [(start, stop, placement.start + start) for start, stop in ranges]

    def _encode_one(
        self,
        version: int,
        tensor: SnapshotTensor,
        parent: Snapshot | None,
        parent_version: int,
        name: str,
        start: int,
        stop: int,
        where: int | Box,
        packer: PackWriter | None,
        changes: Changes | None = None,
    ) -> tuple[ChunkRef, int, cf.Future | None, PackSlot | None]:
        """Encodes local elements [start, stop) (global: from flat `where` on, or box `where`) against `parent` (version
        `parent_version`; None and 0 for a full version) and queues the upload, or adds the object
        to the version's pack; returns (ref, changed elements, upload, pack slot).
        A packed ref gets its key and offset once its pack is sealed. `changes`: found on the
        device (device_diff)."""
        size = tensor.dtype.itemsize
        new = tensor.data[start * size : stop * size]
        old = None if parent is None else parent[name].data[start * size : stop * size]
        codec_id, raw_hex, obj, changed = encode_chunk(
            new,
            old,
            tensor.dtype,
            self.config.zstd_level,
            changes=None if old is None else changes,
            choice=self._codec_choice,
        )
        region = {"box": where} if isinstance(where, Box) else {"start": where, "stop": where + stop - start}
        if obj is None:
            return ChunkRef(codec=CODEC_SAME, raw=raw_hex, **region), 0, None, None
        obj_hash = object_hash(obj)
        key = layout.chunk_key(obj_hash)
        ref = ChunkRef(codec=CODEC_NAMES[codec_id], raw=raw_hex, object=obj_hash, key=key, size=len(obj), **region)
        # A box chunk goes without a placement: an agent applies it after the offer (the push's
        # placement frame holds a flat range only; docs/format.md, "Boxes").
        placement = None if ref.box is not None else ChunkPlacement(name, ref.start, ref.stop, parent_version)
        self._notify("on_object", version, obj_hash, obj, placement)
        if packer is not None:
            return ref, changed, None, packer.add(obj)
        self._pending_uploads.acquire()
        try:
            upload = self._io_pool.submit(self._write_object, self._prefix + key, obj)
        except BaseException:
            self._pending_uploads.release()
            raise
        upload.add_done_callback(lambda _: self._pending_uploads.release())
        return ref, changed, upload, None

    def _upload_pack(self, key: str, data: bytes) -> cf.Future:
        """A sealed pack, uploaded on the I/O pool. A plain put, no touch first: a pack is new
        bytes (its key is their hash), and a put of an existing one rewrites the same bytes."""
        self._pending_uploads.acquire()
        try:
            upload = self._io_pool.submit(self.store.put, self._prefix + key, data)
        except BaseException:
            self._pending_uploads.release()
            raise
        upload.add_done_callback(lambda _: self._pending_uploads.release())
        return upload

    def _write_object(self, key: str, obj: bytes) -> None:
        # Content-addressed: if it exists it holds these bytes. Touch it so that gc's grace
        # period protects it until our manifest commits.
        try:
            self.store.touch(key)
        except ObjectNotFound:
            self.store.put(key, obj)


def publish_once(
    store: Store,
    state_dict: Mapping,
    *,
    model: str,
    step: int | None = None,
    config: PublisherConfig | None = None,
    progress: Callable[[int], None] | None = None,
    signer: Signer | None = None,
    model_files: Mapping[str, bytes] | None = None,
) -> PublishResult:
    """Publishes one version and waits for its commit (what the CLI does)."""
    with Publisher(store, model=model, config=config, signer=signer, model_files=model_files) as publisher:
        return publisher.publish(state_dict, step=step, progress=progress).result()
