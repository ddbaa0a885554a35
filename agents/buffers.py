"""buffers: a sync agent's weight buffers, the one served and the one the next version is built in.

Zero-copy engines serve the agent's very tensors, so the agent double-buffers: the next version
is built in the spare (once no request runs on it any more: under the drain swap policy the
longest request decides when, under in_flight and abort the next token step) and the two trade
places at the swap; while idle, the spare is brought up to the served version so the next version costs one
delta. Copying engines keep their own copy, so one buffer is rewritten in place (under
`rewrite_lock`, which `status --verify` waits for; a failed sync puts the served version back:
apply.py). Either way about one or two models, never a copy per version of a chain.

States of the spare (zero-copy): none (before the second swap) -> behind (it was served as an
older version) -> caught up (a copy of the served version, made while idle) -> staging (rewritten
for the next version) -> served (swapped in; the old served buffer becomes the spare).

Not here: applying versions (`apply.py`, the Reader), deciding what to build (`plan.py`), the engine.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import numpy as np

from weightsync.agents.engines.base import Engine
from weightsync.agents.engines.swap_policy import SwapPolicy
from weightsync.errors import ResourceExhausted
from weightsync.format.hashing import xxh3_hex
from weightsync.format.manifest import compute_digest
from weightsync.format.regions import read_region
from weightsync.reader import WeightsState

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 120.0  # how long a buffer may stay in use by requests before a sync gives up
STALL_LOG_S = 5.0  # a wait for requests longer than this is logged as it happens, with its reason


class Buffers:
    """The served buffer and (zero-copy engines) the spare. The hand-over (`swapped`) happens under
    the agent state's lock, so that the served version and its buffer are read together."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.served: WeightsState | None = None
        self.spare: WeightsState | None = None
        # The version the spare's memory was last served as: what the engine must have stopped
        # using before we write into it (its content may have moved on: see catch_up_spare).
        self.spare_served_as = 0
        self.rewrite_lock = threading.Lock()
        """Copying engines: held by a sync, which rewrites the one buffer in place (and puts it back
        when the sync fails), and by whoever hashes that buffer, so that no hash reads it half-written."""

    def staging(self, name: str, policy: SwapPolicy) -> tuple[WeightsState, float]:
        """The buffer the next version is built in: the spare (zero-copy engines still serve the
        current one), or the served one (copying engines keep their own copy); and the seconds
        spent waiting for requests to leave it. Under the drain swap policy that wait lasts as
        long as the longest request that started on the spare's version; under in_flight and
        abort, one token step."""
        if not self.engine.zero_copy:
            return self.served or WeightsState(manifest=None, buffers={}), 0.0
        spare = self.spare
        if spare is None:
            return WeightsState(manifest=None, buffers={}), 0.0
        started = time.monotonic()
        if not self.engine.wait_unused(self.spare_served_as, STALL_LOG_S):
            log.warning(
                "%s: waiting for requests still running on v%d to finish before the next version can be "
                "built in its buffer (swap_policy %s; in_flight would move them to the new version at "
                "their next token)",
                name,
                self.spare_served_as,
                policy,
            )
            if not self.engine.wait_unused(self.spare_served_as, DRAIN_TIMEOUT_S - STALL_LOG_S):
                raise ResourceExhausted(f"requests still run on v{self.spare_served_as} after {DRAIN_TIMEOUT_S} s")
        return spare, time.monotonic() - started

    def swapped(self, staging: WeightsState, previous_version: int) -> None:
        """After the engine swapped `staging` in (call under the agent state's lock): it is the served buffer."""
        if self.engine.zero_copy:
            self.spare, self.served = self.served, staging
            self.spare_served_as = previous_version
        else:
            self.served = staging

    def versions(self) -> set[int]:
        """Versions the buffers hold: the cache must keep what brings them forward by deltas."""
        return {s.manifest.version for s in (self.served, self.spare) if s is not None and s.manifest is not None}

    def catch_up_spare(self) -> None:
        """While idle, brings the spare buffer (zero-copy engines: the one swapped out, a version
        behind, or left invalid by a failed sync) up to the served version, so that the next
        version costs one delta on the critical path instead of two or a whole base.

        It copies the served bytes rather than applying the deltas again. A memcpy costs about a
        tenth of decoding them (0.1 GiB: 10 ms against 0.12 CPU-seconds on this project's 2-core
        machine), and this runs while the next version is being published and pushed, on cores
        that its encode and receive may share. The copied bytes were verified when they were
        applied, and the next version's apply hashes every byte of its target, changed or not.
        Skipped while requests still run on the spare's memory."""
        spare, served = self.spare, self.served
        if spare is None or served is None or served.manifest is None:
            return
        if spare.manifest is not None and (spare.manifest.version, spare.manifest.digest) == (
            served.manifest.version,
            served.manifest.digest,
        ):
            return
        if not self.engine.wait_unused(self.spare_served_as, 0.2):
            return
        spare.manifest = None  # invalid while it is rewritten
        # Each tensor's memory is reused when its size still fits (as the Reader does for a base).
        old, spare.buffers = spare.buffers, {}
        for k, b in served.buffers.items():
            buf = old.pop(k, None)
            spare.buffers[k] = buf if buf is not None and buf.nbytes == b.nbytes else np.empty_like(b)
            np.copyto(spare.buffers[k], b)
        old.clear()
        spare.manifest = served.manifest

    def digest_of(self, state: WeightsState | None) -> str:
        """The version digest recomputed from a buffer's bytes (every chunk range of its manifest
        re-hashed): equal to the manifest's digest iff they are the published bytes; "" for no
        buffer or an invalid one. The caller keeps the buffer from being rewritten meanwhile
        (copying engines: `rewrite_lock`)."""
        manifest = state.manifest if state is not None else None
        if manifest is None:
            return ""
        buffers = dict(state.buffers)
        if any(tensor.name not in buffers for tensor in manifest.tensors):
            return ""  # zero-copy: swapped out and being rebuilt meanwhile (the caller asks again)
        rehashed = []
        for tensor in manifest.tensors:
            data = buffers[tensor.name]
            chunks = tuple(dataclasses.replace(c, raw=xxh3_hex(read_region(data, tensor, c))) for c in tensor.chunks)
            rehashed.append(dataclasses.replace(tensor, chunks=chunks))
        return compute_digest(rehashed)
