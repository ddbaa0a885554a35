"""signals: what a sync agent tells its operator about what it serves, and how each is made true.

    verify(...)          `status --verify`: the agent's copy of the served version re-hashed
                         against its digest and, where the engine can report a digest of what it
                         holds (`Engine.verify_held`), the engine's own check against that copy;
                         says in words what was hashed
    engine_state(engine) what the engine serves now (`Engine.state`), as status reports it
    HealthCheck          why the agent is not healthy ("" when it serves a version and its
                         engine serves that version): the gRPC health service's answer
                         (server.py), the `agent/serving` metric, and a WARNING when waiting cannot
                         help (no store, a store without the model, every version broken, an engine
                         that serves nothing), at once and every NOTHING_SERVED_WARN_S after

Not here: the sync itself (`sync.py`), the gRPC health service and its watch thread (`server.py`),
how each engine digests or probes (agents/engines/).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from weightsync.errors import WeightsyncError
from weightsync.versions import latest_version, list_models

if TYPE_CHECKING:
    from weightsync.agents.buffers import Buffers
    from weightsync.agents.engines.base import Engine
    from weightsync.agents.state import AgentState
    from weightsync.metrics import Metrics
    from weightsync.reader import WeightsState
    from weightsync.stores import Store

log = logging.getLogger(__name__)

NOTHING_SERVED_WARN_S = 60.0
"""While an agent serves nothing and waiting cannot change that, it says why this often."""


def served_copy(state: AgentState, buffers: Buffers) -> tuple[int, str, WeightsState | None]:
    """(version, digest, the agent's buffer of it) of what is served now, read together."""
    with state.cond:
        return state.served_version, state.served_digest, buffers.served


def verify(state: AgentState, buffers: Buffers, engine: Engine, timeout_s: float = 5.0) -> dict[str, Any]:
    """{"ok", "hashed" (what was hashed, in words), "error", "digest" (the version digest the
    agent's copy re-hashes to; "" when there was none to hash)}. A copying engine's one buffer is
    rewritten during a sync: this waits up to `timeout_s` for the sync to end."""
    copying = not engine.zero_copy
    lock = buffers.rewrite_lock
    if copying and not lock.acquire(timeout=max(0.0, timeout_s)):
        version = state.served_version
        error = f"a sync is rewriting the agent's copy of v{version}; ask again once it is done"
        return {"ok": False, "hashed": "nothing", "error": error, "digest": ""}
    try:
        for _attempt in range(2):  # zero-copy: a swap between the reads moves the served version on
            version, digest, copy = served_copy(state, buffers)
            result = _verify_copy(buffers, engine, version, digest, copy)
            if state.served_version == version:
                break
        return result
    finally:
        if copying:
            lock.release()


def _verify_copy(
    buffers: Buffers, engine: Engine, version: int, digest: str, copy: WeightsState | None
) -> dict[str, Any]:
    if version == 0:
        return {"ok": False, "hashed": "nothing", "error": "no version is served yet", "digest": ""}
    named = f"the agent's copy of v{version}"
    rehashed = buffers.digest_of(copy)
    if not rehashed:
        error = f"{named} is not available: a failed sync left it invalid and it could not be read again"
        return {"ok": False, "hashed": "nothing", "error": error, "digest": ""}
    held = engine.verify_held(version, copy.state_dict())
    if held is None:
        hashed = f"{named} (the {engine.name} engine cannot report what it holds)"
    else:
        hashed = f"{held.hashed}, compared with {named}"
    if rehashed != digest:
        error = f"{named} hashes to {rehashed}, v{version} is {digest}"
        return {"ok": False, "hashed": hashed, "error": error, "digest": rehashed}
    if held is not None and not held.ok:
        return {"ok": False, "hashed": hashed, "error": held.error, "digest": rehashed}
    return {"ok": True, "hashed": hashed, "error": "", "digest": rehashed}


def engine_state(engine: Engine) -> dict[str, Any]:
    """`engine.state()` as status reports it (the state by its proto enum name)."""
    state = engine.state()
    return {"state": state.state.upper(), "version": state.version or 0, "reason": state.reason}


class HealthCheck:
    """Why an agent is not healthy, logged (rate-limited) when waiting cannot help."""

    def __init__(
        self, state: AgentState, engine: Engine, *, upstream: Store | None, model: str, name: str, metrics: Metrics
    ) -> None:
        self.state = state
        self.engine = engine
        self.upstream = upstream
        self.model = model
        self.name = name
        self.metrics = metrics
        self._next_warning = 0.0  # monotonic

    def check(self) -> str:
        """The reason the agent is not healthy, "" when it is; sets `agent/serving` and warns."""
        reason, warn = self.reason()
        self.metrics.set("agent/serving", 0 if reason else 1)
        now = time.monotonic()
        if not reason:
            self._next_warning = 0.0  # a later spell of serving nothing is warned about at once
        elif warn and now >= self._next_warning:
            self._next_warning = now + NOTHING_SERVED_WARN_S
            log.warning("%s: serving nothing: %s", self.name, reason)
        return reason

    def reason(self) -> tuple[str, bool]:
        """(why the agent is not healthy or "", whether to warn about it: not while a first
        version is on its way)."""
        state, engine = self.state, self.engine
        version = state.served_version
        if version:
            engine_state = engine.state()
            # The engine serves the version being swapped in before the commit names it (swap.py).
            if engine_state.serving and engine_state.version in (version, state.swapping):
                return "", False
            if engine_state.serving:
                return f"the {engine.name} engine serves v{engine_state.version}, the agent v{version}", True
            return f"the {engine.name} engine is {engine_state.state}: {engine_state.reason}", True
        if state.refusal:  # the refuse rule: no version that passed the parity probe (swap.py)
            return state.refusal, True
        broken = state.broken.to_json(time.monotonic())
        if broken:
            newest = broken[0]
            return f"v{newest['version']} failed {newest['failures']} time(s), the last with {newest['error']}", True
        newest = state.newest_known()
        if newest:
            return f"no version served yet: syncing v{newest}", False
        store = self.upstream
        if store is None:
            return "no version has been pushed yet and no store is configured (store) to fetch one from", True
        try:
            latest = latest_version(store, self.model)
            models = [] if latest is not None else list_models(store)
        except WeightsyncError as e:
            return f"the store {store.uri} cannot be read: {e}", True
        if latest is not None:
            return f"no version served yet: syncing v{latest} from {store.uri}", False
        if models:
            shown = ", ".join(models[:10]) + (", ..." if len(models) > 10 else "")
            return (
                f"the store {store.uri} has no versions of model {self.model!r}; it holds {shown} "
                "(the agent's model must name one of them, or the trainer has not published yet)"
            ), True
        return (
            f"the store {store.uri} holds no models at all (is its URI right? a directory that does "
            "not exist reads as an empty store), nothing was published there yet and nothing has been pushed"
        ), True
