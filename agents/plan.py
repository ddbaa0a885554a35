"""plan: the "planned" stage. What it takes to build the target version, decided before any byte moves.

    buffer   the buffer the target is built in (`Buffers.staging`: the spare of a zero-copy
             engine once no request runs on it, else the one buffer), with the chunks pushed
             early into it taken over (`EarlyApply.take`)
    chain    the target's chain, base first, from accepted manifests, the cache or the store
             (checked: signatures, bases that agree, layouts a delta may have)
    fit      the engine asked whether it would take the target's layout (`check_fit`): a
             version it would refuse fails here, before a byte is fetched or written, so a
             copying engine's buffer (the agent's copy of what it serves) is never touched
    path     the deltas after the buffer's version when that version is on the chain, else the
             base and all its deltas

Not here: bringing the path's objects in (`gather.py`), applying it (`apply.py`).
"""

from __future__ import annotations

import dataclasses
import time

from weightsync.agents.buffers import Buffers
from weightsync.agents.cache import AgentCache
from weightsync.agents.config import AgentConfig
from weightsync.agents.early_apply import EarlyApply, Taken
from weightsync.agents.engines.base import Engine, manifest_layout
from weightsync.agents.state import AgentState, Known
from weightsync.errors import FormatError, IntegrityError, LayoutError, WeightsyncError
from weightsync.format.manifest import KIND_FULL
from weightsync.reader import WeightsState, check_delta_layout
from weightsync.stores import Store
from weightsync.transport.signing import Verifier
from weightsync.versions import read_manifest_bytes, read_signature


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one sync builds its target (see the module docstring)."""

    target: Known
    chain: tuple[Known, ...]
    """The target's chain, base first."""
    start: int
    """chain[start:] is applied: the versions after the one the buffer holds."""
    staging: WeightsState
    early: Taken
    drain_s: float
    """Seconds spent waiting for requests to leave the staging buffer."""

    @property
    def version(self) -> int:
        return self.target.manifest.version

    @property
    def path(self) -> tuple[Known, ...]:
        return self.chain[self.start :]

    def describe(self) -> str:
        """The path as the ledger says it: "deltas 4->6" or "base 1 + 5 deltas"."""
        if self.start:
            return f"deltas {self.chain[self.start - 1].manifest.version}->{self.version}"
        return f"base {self.chain[0].manifest.version} + {len(self.chain) - 1} deltas"


class Planner:
    """Plans syncs for one agent (see the module docstring)."""

    def __init__(
        self,
        config: AgentConfig,
        state: AgentState,
        cache: AgentCache,
        buffers: Buffers,
        early: EarlyApply,
        engine: Engine,
        *,
        upstream: Store | None = None,
        verifier: Verifier | None = None,
    ) -> None:
        self.config = config
        self.state = state
        self.cache = cache
        self.buffers = buffers
        self.early = early
        self.engine = engine
        self.upstream = upstream
        self.verifier = verifier

    def plan(self, target: Known) -> Plan:
        """The plan for `target`. Raises IntegrityError or FormatError when its chain cannot be
        resolved, LayoutError when the engine would refuse it, ResourceExhausted when requests
        keep the staging buffer busy too long. The caller releases the early apply after."""
        staging, drain_s = self.buffers.staging(self.config.name, self.config.swap_policy)
        early = self.early.take(staging, target.manifest)  # chunks applied as they arrived
        chain = self._chain(target)
        version = target.manifest.version
        try:
            self.engine.check_fit(manifest_layout(target.manifest.layout))
        except LayoutError as e:
            raise LayoutError(f"v{version} does not fit what the {self.engine.name} engine serves: {e}") from e
        start = 0
        if staging.manifest is not None:
            for i, known in enumerate(chain):
                if (known.manifest.version, known.manifest.digest) == (
                    staging.manifest.version,
                    staging.manifest.digest,
                ):
                    start = i + 1
        return Plan(target, tuple(chain), start, staging, early, drain_s)

    def _chain(self, target: Known) -> list[Known]:
        """The target's chain, base first."""
        chain = [target]
        while chain[-1].manifest.kind != KIND_FULL:
            parent = chain[-1].manifest.parent
            chain.append(self.find_manifest(parent))
            if chain[-1].manifest.base != chain[-2].manifest.base:
                raise FormatError(f"v{chain[-2].manifest.version} and its parent v{parent} disagree on their base")
            # Said before the engine's check_fit, which would name only the tensor that differs.
            check_delta_layout(self.config.model, chain[-1].manifest, chain[-2].manifest)
        chain.reverse()
        return chain

    def find_manifest(self, version: int, *, cached: bool = True) -> Known:
        """An accepted manifest, else the cache's (unless not `cached`), else the store's, checked."""
        with self.state.cond:
            known = self.state.known.get(version)
        if known is not None:
            return known
        for store in (self.cache.store if cached else None, self.upstream):
            if store is None:
                continue
            try:
                manifest, data = read_manifest_bytes(store, self.config.model, version)
            except WeightsyncError:
                continue
            if store is self.upstream and self.verifier is not None:
                signature = read_signature(store, self.config.model, version, data)
                if signature or self.config.require_signatures:
                    self.verifier.verify(data, signature)
            return Known(manifest, data, None, "store", 0, time.monotonic(), False)
        raise IntegrityError(f"v{version}, needed to reach a newer version, is neither cached nor in the store")

    def good_copy(self, version: int) -> bytes | None:
        """The manifest of `version` as accepted or as the store has it (checked), never the
        cache's own copy: what a damaged cached one is put back from."""
        try:
            return self.find_manifest(version, cached=False).data
        except WeightsyncError:
            return None
