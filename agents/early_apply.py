"""early_apply: pushed chunks applied as they arrive, before their version's offer.

A publisher pushes each chunk object as soon as it is encoded, with where it goes (tensor,
element range, and the version it was encoded against: ObjectFrame fields 5-8), and offers the
version once it commits. Applied only after the offer, the whole decode came after the commit:
for a 1 GiB model at lr 1e-6 on the benchmark's 2-core machines, 0.76 s of the 2.11 s from
publish() to serving. Applied as they arrive, chunks decode while later ones are still encoded,
and the offer finds most of the version done.

Nothing applied early is trusted until the signed manifest comes:
- objects go only into the spare buffer (zero-copy engines), only while it holds exactly the
  served version with no request on it, and only when the placement's parent is that version.
  The claim marks the spare as being rewritten (its manifest is None), and the sync thread
  takes it over (`take`) before it touches the spare;
- each object is checked as the reader would check it: its header's dtype and element count
  against the parent's tensor, the decoded range against the header's raw hash. Placements that
  overlap one already written are skipped;
- at the sync, a range applied early counts as done only if the target is the claimed version,
  its parent is the version the spare held, and its manifest names the same object, codec and
  raw hash for exactly that range (then its bytes are the published ones, as the reader would
  have made them). Every other range written early is copied back from the served buffer (which
  still holds the parent), and the reader applies it as usual: a wrong or lying placement costs
  time, never bytes.

Copying engines get nothing applied early: their one buffer is the one served (and checked by
`status(verify=True)`) between syncs. Objects that arrive while the sync thread holds the spare
(the previous version still applying or swapping) wait, and are applied once the spare has
caught up (`resume`), if their version is still ahead.

The decode threads run at a lower CPU priority: on a host that also serves requests (or, in the
benchmark, also encodes), the early decode takes the cores that are idle.

Not here: the sync (`sync.py`), the buffers (`buffers.py`), the reader that applies the rest.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import dataclasses
import logging
import threading
import time

import numpy as np

from weightsync.agents.buffers import Buffers
from weightsync.cpus import lower_this_thread_priority
from weightsync.errors import WeightsyncError
from weightsync.format.chunk import apply_chunk, unpack_chunk
from weightsync.format.codecs import CODEC_NAMES
from weightsync.format.dtypes import dtype_by_name
from weightsync.format.manifest import CODEC_SAME, ChunkPlacement, Manifest, TensorEntry
from weightsync.reader import WeightsState

log = logging.getLogger(__name__)

Range = tuple[str, int, int]  # tensor name, flat element range [start, stop)


@dataclasses.dataclass(frozen=True)
class _Applied:
    """What a range applied early holds: what the manifest must name for it to count."""

    address: str
    codec: str
    raw: str


@dataclasses.dataclass
class _Claim:
    """The spare buffer, taken for one version's early chunks."""

    version: int
    parent: Manifest  # what the spare held when claimed (the served version)
    state: WeightsState  # the spare
    tensors: dict[str, TensorEntry]
    written: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)  # sorted, per tensor
    applied: dict[Range, _Applied] = dataclasses.field(default_factory=dict)  # written and checked
    running: int = 0
    first_start: float | None = None  # monotonic: the first early decode began
    last_end: float | None = None  # and the last one ended


@dataclasses.dataclass(frozen=True)
class Taken:
    """What the sync got from a claim: the ranges done (for the reader to skip), and for the
    ledger how long the early decodes ran (first start to last end) and how long the sync waited
    for the last of them."""

    done: frozenset[Range] = frozenset()
    span_s: float = 0.0
    wait_s: float = 0.0


class EarlyApply:
    """Applies pushed chunks into the spare before their offer (see the module docstring)."""

    def __init__(self, buffers: Buffers, *, enabled: bool, workers: int, name: str) -> None:
        self.buffers = buffers
        self.enabled = enabled and buffers.engine.zero_copy
        self.name = name
        self._lock = threading.Condition()
        self._claim: _Claim | None = None
        self._sync_holds_spare = False  # the sync thread is using the spare: no claim now
        self._waiting: list[tuple[int, str, bytes | memoryview, ChunkPlacement]] = []  # one version's
        self._pool = (
            cf.ThreadPoolExecutor(
                max(1, workers), thread_name_prefix="ws-early", initializer=lower_this_thread_priority
            )
            if self.enabled
            else None
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ gRPC threads

    def submit(
        self,
        version: int,
        address: str,
        data: bytes | memoryview,
        placement: ChunkPlacement | None,
        served_version: int,
    ) -> None:
        """A pushed object (checked against its address and cached already) and its placement."""
        if not self.enabled or placement is None or placement.parent == 0 or version <= served_version:
            return
        with self._lock:
            claim = self._claim
            if claim is None:
                claim = self._try_claim(version, placement.parent)
                if claim is None:
                    self._wait(version, address, data, placement, served_version)
                    return
            elif claim.version != version:
                return  # the reader applies it after the offer
            claim.running += 1
        self._start(claim, [(address, data, placement)])

    def _wait(
        self, version: int, address: str, data: bytes | memoryview, placement: ChunkPlacement, served_version: int
    ) -> None:
        """Keeps an object for `resume` while the spare is not ready for it: the sync thread
        holds it, or has yet to bring it up to the served version. Only the newest version's."""
        if placement.parent < served_version:
            return  # its parent will never be in the spare again
        if self._waiting and self._waiting[0][0] != version:
            if self._waiting[0][0] > version:
                return
            self._waiting.clear()
        self._waiting.append((version, address, data, placement))

    def _try_claim(self, version: int, parent: int) -> _Claim | None:
        """The spare, claimed for `version` if it holds the served version `parent` and nothing
        runs on it; None if not (call under the lock)."""
        buffers = self.buffers
        spare, served = buffers.spare, buffers.served
        if self._sync_holds_spare or spare is None or served is None or served.manifest is None:
            return None
        if (
            spare.manifest is None
            or served.manifest.version != parent
            or (spare.manifest.version, spare.manifest.digest) != (parent, served.manifest.digest)
        ):
            return None
        if not buffers.engine.wait_unused(buffers.spare_served_as, 0.0):
            return None
        claim = _Claim(version, spare.manifest, spare, {t.name: t for t in spare.manifest.tensors})
        spare.manifest = None  # being rewritten: nothing may take it for the parent now
        self._claim = claim
        return claim

    # ------------------------------------------------------------------ decode threads

    def _apply(self, claim: _Claim, address: str, data: bytes | memoryview, placement: ChunkPlacement) -> None:
        with self._lock:
            if claim.first_start is None:
                claim.first_start = time.monotonic()
        where: Range = (placement.tensor, placement.start, placement.stop)
        try:
            tensor = claim.tensors.get(placement.tensor)
            if tensor is None or not 0 <= placement.start < placement.stop <= tensor.nbytes // _itemsize(tensor):
                return
            header, _ = unpack_chunk(data)
            dtype = dtype_by_name(tensor.dtype)
            if header.dtype != dtype or header.count != placement.stop - placement.start:
                return
            with self._lock:
                if not _take_range(claim.written.setdefault(placement.tensor, []), placement.start, placement.stop):
                    return  # overlaps a range written already: a bad placement
            out = claim.state.buffers[placement.tensor][
                placement.start * dtype.itemsize : placement.stop * dtype.itemsize
            ]
            raw = header.raw_xxh3.hex()
            apply_chunk(data, out, dtype, raw, header.codec_id)
            with self._lock:
                claim.applied[where] = _Applied(address, CODEC_NAMES[header.codec_id], raw)
        except WeightsyncError as e:  # written, not applied: `take` puts the parent's bytes back
            log.debug("%s: early apply of %s for v%d failed: %s", self.name, address, claim.version, e)
        except Exception:  # never lose the thread; the reader applies it again
            log.exception("%s: early apply of %s for v%d failed", self.name, address, claim.version)
        finally:
            with self._lock:
                claim.running -= 1
                claim.last_end = time.monotonic()
                self._lock.notify_all()

    # ------------------------------------------------------------------ sync thread

    def take(self, staging: WeightsState, target: Manifest) -> Taken:
        """Called by the sync thread before it touches `staging`: ends any claim (waiting for its
        decodes), keeps the ranges that `target` confirms and puts the parent's bytes back in the
        others; until `release`, nothing is claimed."""
        with self._lock:
            self._sync_holds_spare = True
            claim, self._claim = self._claim, None
            if claim is None:
                return Taken()
            waited = time.monotonic()
            self._lock.wait_for(lambda: claim.running == 0)
            waited = time.monotonic() - waited
        refs = {(t.name, c.start, c.stop): c for t in target.tensors for c in t.chunks if c.codec != CODEC_SAME}
        done, reason = set(), ""
        if claim.state is not staging:
            reason = "the claimed buffer is not the one staged"  # cannot happen; be safe anyway
        elif target.version != claim.version or target.parent != claim.parent.version:
            reason = f"the target is v{target.version} on v{target.parent}, not the claimed v{claim.version}"
        else:
            for where, applied in claim.applied.items():
                ref = refs.get(where)
                if ref is not None and (ref.object, ref.codec, ref.raw) == (
                    applied.address,
                    applied.codec,
                    applied.raw,
                ):
                    done.add(where)
            written = sum(len(ranges) for ranges in claim.written.values())
            if len(done) < written:
                reason = f"{written - len(done)} of {written} chunks written early do not match the manifest"
        if claim.state is staging:
            self._restore(claim, done)
        if reason:  # another target is routine (a newer version overtook); unconfirmed ranges are not
            level = logging.INFO if target.version != claim.version else logging.WARNING
            log.log(level, "%s: redoing chunks applied early for v%d: %s", self.name, claim.version, reason)
        span = claim.last_end - claim.first_start if claim.first_start and claim.last_end else 0.0
        return Taken(frozenset(done), span, waited)

    def _restore(self, claim: _Claim, keep: set[Range]) -> None:
        """Puts the parent's bytes back into every range written early but not kept (from the
        served buffer, which holds the parent while the sync thread holds the spare)."""
        served = self.buffers.served
        restorable = (
            served is not None
            and served.manifest is not None
            and (served.manifest.version, served.manifest.digest) == (claim.parent.version, claim.parent.digest)
        )
        for name, ranges in claim.written.items():
            itemsize = _itemsize(claim.tensors[name])
            for start, stop in ranges:
                if (name, start, stop) in keep or not restorable:
                    continue
                lo, hi = start * itemsize, stop * itemsize
                np.copyto(claim.state.buffers[name][lo:hi], served.buffers[name][lo:hi])
        # Unrestorable (cannot happen while the sync thread holds the spare): the spare stays
        # invalid and the reader rebuilds it from the base.
        claim.state.manifest = claim.parent if restorable else None

    def release(self) -> None:
        """The sync thread is done with the spare (after a sync, or after catching it up)."""
        with self._lock:
            self._sync_holds_spare = False

    def hold(self) -> bool:
        """The sync thread wants the spare while idle (to catch it up): False if it is claimed."""
        with self._lock:
            if self._claim is not None:
                return False
            self._sync_holds_spare = True
            return True

    def resume(self, served_version: int) -> None:
        """Once the spare has caught up: applies the objects that waited, if their version is
        still ahead and the spare holds their parent."""
        with self._lock:
            waiting, self._waiting = self._waiting, []
            if not waiting or self._claim is not None or waiting[0][0] <= served_version:
                return
            claim = self._try_claim(waiting[0][0], waiting[0][3].parent)
            if claim is None:
                if waiting[0][3].parent >= served_version:
                    self._waiting = waiting  # still ahead of the spare: a later resume
                return
            claim.running += len(waiting)
        self._start(claim, [(address, data, placement) for _, address, data, placement in waiting])

    def _start(self, claim: _Claim, objects: list[tuple[str, bytes | memoryview, ChunkPlacement]]) -> None:
        """Decodes `objects` (counted in claim.running already) on the pool."""
        for i, (address, data, placement) in enumerate(objects):
            try:
                self._pool.submit(self._apply, claim, address, data, placement)
            except RuntimeError:  # the agent is closing: nothing will wait for these
                with self._lock:
                    claim.running -= len(objects) - i
                    self._lock.notify_all()
                return


def _take_range(ranges: list[tuple[int, int]], start: int, stop: int) -> bool:
    """Adds [start, stop) to the sorted, disjoint `ranges` unless it overlaps one of them."""
    i = bisect.bisect_left(ranges, (start, stop))
    if i > 0 and ranges[i - 1][1] > start or i < len(ranges) and ranges[i][0] < stop:
        return False
    ranges.insert(i, (start, stop))
    return True


def _itemsize(tensor: TensorEntry) -> int:
    return dtype_by_name(tensor.dtype).itemsize
