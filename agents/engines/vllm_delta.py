"""vllm_delta: the vllm engine's in-place delta swaps, their undo, and the background audit.

A delta swap (`VllmEngine.swap_delta`), in order (a failure at any step is handled as the last
column says; "full" means the engine reloads the whole version instead, and reports why):

    decide   the workers hold a plan and the served version is the delta's    -> full
             parent; the delta changes at most delta_max_changed_fraction
             of the elements
    file     the changed positions and new bits (whole tensors for layers     -> nothing changed:
             reloaded natively) go to one small file on tmpfs                     raise
    stage    POST /collective_rpc weightsync_delta_stage (still serving): each -> full (discarded)
             worker gathers the old bits at the changed positions (the undo
             log) and sums them over its owned elements; patches the unpacked
             copies of repacked linears and rebuilds their kernel handles on a
             thread (weightsync_delta_status says when they are done)
    check    the ranks' sums over the staged new bits add up to the agent's   -> nothing changed:
             sum over the published ones                                         raise
             the ranks' old-bit sums add up to the agent's sum over the old   -> full (discarded):
             bits of the version it believes is served                          the workers' state
                                                                                diverged, logged
    pause    /pause?mode=M by the swap policy (only the scatter is inside)    -> nothing changed: raise
    commit   weightsync_delta_commit: live parameters scattered (index_copy_,  -> unknown: stay paused,
             addresses never move), handles rebound, native layers reloaded      unhealthy, raise
    verify   every written element reads back as the staged bits (whose sum   -> the undo log is
             was checked above: no hashing inside the pause)                      written back, the
                                                                                 previous version
                                                                                 resumes, raise
    commit   reset the prefix cache (running requests' KV recomputed), set the weight version, resume

`undo(version)` stages the workers' undo log as a delta (nothing crosses the network) and commits
it the same way: what the agent asks when the parity probe refuses a version. The audit thread sums
what the workers hold, `audit_step_elements` at a time at most `audit_elements_per_s`, and compares
the ranks' total with D(v) of the served version (computed by the agent once per full swap, then
moved by each delta's sums): a mismatch pauses the server and makes the engine unhealthy, as a
failed swap does; the next swap then reloads everything.

Not here: the full-path swap and HTTP plumbing (`vllm.py`), the file and sums (`delta_handoff.py`),
the workers' side (`vllm_worker.py`, `delta_apply.py`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from weightsync.agents.engines.base import SwapReport
from weightsync.agents.engines.delta_handoff import (
    Plans,
    check_plans,
    delta_misfit,
    expected_sums,
    tag,
    version_sum,
    write_delta,
)
from weightsync.agents.engines.position_digest import add, sub
from weightsync.agents.engines.swap_policy import SwapPolicy
from weightsync.errors import IntegrityError, LayoutError, WeightsyncError

if TYPE_CHECKING:
    from weightsync.agents.engines.vllm import VllmEngine

logger = logging.getLogger(__name__)
_READY_POLL_S = 0.005
_READY_POLL_MAX_S = 0.05


class _Background:
    """A call on a thread of its own; `result()` waits and returns it (or raises its error)."""

    def __init__(self, fn, *args, **kwargs) -> None:
        self._value, self._error = None, None

        def run() -> None:
            try:
                self._value = fn(*args, **kwargs)
            except BaseException as e:  # raised again by result()
                self._error = e

        self._thread = threading.Thread(target=run, name="weightsync-vllm-delta", daemon=True)
        self._thread.start()

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class FullPath(WeightsyncError):
    """This version goes in whole; the message says why (the report's path_reason)."""


class VllmDeltas:
    """The engine's in-place state: the workers' plans, D(v) of the served version, the undo log's
    version, the audit. Every method runs under the engine's lock (the audit takes it per step)."""

    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine
        self.config = engine.config
        self.plans: Plans | None = None
        self.version_sum: int | None = None
        self.undo_of: tuple[int, int, str, int, int] | None = None
        """(version, its parent, the parent's digest, old-bit sum, new-bit sum) of the last delta swap."""
        self.last_audit: dict = {}
        self.last_swap: dict = {}
        """Figures of the last delta swap: file bytes, changed elements, stage and handle-rebuild
        seconds (the slowest worker's), pause, commit."""
        self._passes = itertools.count(1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if engine.delta_swaps and self.config.audit_interval_s > 0:
            self._thread = threading.Thread(target=self._audit_loop, name="weightsync-vllm-audit", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()  # a pass under way finishes; a closed engine's server is not paused (_audit_failed)

    # ------------------------------------------------------------------ after a full swap

    def after_full_load(self, weights: Mapping[str, torch.Tensor]) -> None:
        """The workers hold a freshly loaded, verified version: read their plans and D(v)."""
        self.plans, self.version_sum, self.undo_of = None, None, None
        if not self.engine.delta_swaps:
            return
        try:
            plans = check_plans(self.engine.rpc("weightsync_plan"), {n: tuple(t.shape) for n, t in weights.items()})
        except (WeightsyncError, LayoutError) as e:
            logger.warning("vllm %s: no in-place delta swaps until the next full load: %s", self.config.url, e)
            return
        for module, entry in sorted(plans.native.items()):
            logger.info(
                "vllm %s: layer %s is reloaded natively in delta swaps: %s", self.config.url, module, entry["reason"]
            )
        self.plans, self.version_sum = plans, version_sum(weights, plans)

    # ------------------------------------------------------------------ delta swap

    def refusal(self, delta) -> str:
        """Why this delta must go in whole ("" when it may go in place)."""
        engine = self.engine
        if not self.engine.delta_swaps:
            return "delta swaps are off (delta_swaps = false, or a LoRA engine)"
        if not engine._healthy:
            return f"the engine is unhealthy ({engine._last_error}): everything is reloaded"
        if self.plans is None:
            return "the workers have no placement plan (a restarted server, or no full load through weightsync yet)"
        return delta_misfit(delta, engine._served, engine._served_digest, self.config.delta_max_changed_fraction)

    def swap(
        self, version: int, delta, weights: Mapping[str, torch.Tensor], digest: str, policy: SwapPolicy, started: float
    ) -> SwapReport:
        """The module docstring's delta swap; FullPath when it must go in whole (nothing served
        changed then)."""
        engine, plans = self.engine, self.plans
        parent = delta.parent
        path = engine._handoff_dir / f"weightsync-v{version}-{os.getpid()}-{time.monotonic_ns()}.delta.safetensors"
        self.last_swap = {"version": version, "changed": delta.changed, "elements": delta.elements}
        try:
            nbytes, dense = write_delta(
                path, delta, weights, plans, parent=tag(parent.version, parent.digest), version=tag(version, digest)
            )
            self.last_swap["file_bytes"] = nbytes
            self.last_swap["file_s"] = time.perf_counter() - started
            # The agent's sums while the workers stage (another process): off the critical path.
            sums = _Background(expected_sums, delta, plans)
            old_got, new_got = self._stage("weightsync_delta_stage", str(path))
            old_want, new_want = sums.result()
            if new_got != new_want:
                engine.rpc("weightsync_delta_discard")
                raise IntegrityError(
                    f"v{version}: the bits staged in the workers sum to {new_got}, the published ones to "
                    f"{new_want}; the delta was damaged between the agent and the workers (nothing changed)"
                )
            if old_got != old_want:
                engine.rpc("weightsync_delta_discard")
                logger.error(
                    "vllm %s: the workers' old bits sum to %d, the agent's v%d to %d: their state diverged",
                    self.config.url,
                    old_got,
                    parent.version,
                    old_want,
                )
                raise FullPath(
                    f"old-bit sum mismatch: the workers' bits at the changed positions are not v{parent.version}'s "
                    "(their state diverged); reloaded in full"
                )
            staged = time.perf_counter()
            pause_s, timings = self._commit(version, policy, undo_tag=tag(version, digest), parent=parent.version)
        finally:
            path.unlink(missing_ok=True)
        engine._served, engine._served_digest = version, digest
        self.last_swap.update(
            pause_s=pause_s, commit_s=timings.get("commit", 0.0), total_s=time.perf_counter() - started
        )
        if self.version_sum is not None:
            self.version_sum = add(sub(self.version_sum, old_want), new_want)
        self.undo_of = (version, parent.version, parent.digest, old_want, new_want) if not dense else None
        native = tuple(
            f"{m}: {e['reason']}" for m, e in sorted(plans.native.items()) if set(e["hf_names"]) & set(dense)
        )
        for line in native:
            logger.warning("vllm %s: v%d reloaded %s natively", self.config.url, version, line)
        logger.info(
            "vllm %s serves v%d in place: %d of %d elements, %.2f MB file; pause %.1f ms (commit %.1f ms); "
            "staged %.2f s, swap %.2f s",
            self.config.url,
            version,
            delta.changed,
            delta.elements,
            nbytes / 1e6,
            1000 * pause_s,
            1000 * timings.get("commit", 0.0),
            staged - started,
            time.perf_counter() - started,
        )
        return SwapReport(
            version=version,
            pause_s=pause_s,
            total_s=time.perf_counter() - started,
            path="delta",
            native_layers=native,
            delta_bytes=nbytes,
        )

    def undo(self, version: int, policy: SwapPolicy) -> SwapReport | None:
        """The version before `version` back from the workers' undo log; None without one."""
        engine, started = self.engine, time.perf_counter()
        if self.undo_of is None or self.undo_of[0] != version or engine._served != version or not engine._healthy:
            return None
        _, parent, parent_digest, old_sum, new_sum = self.undo_of
        try:
            old_got, new_got = self._stage("weightsync_delta_undo", tag(version, engine._served_digest))
        except FullPath as e:
            logger.warning("vllm %s: no undo of v%d: %s", self.config.url, version, e)
            return None
        if (old_got, new_got) != (new_sum, old_sum):
            engine.rpc("weightsync_delta_discard")
            logger.error("vllm %s: v%d's bits changed since it was swapped in; no undo", self.config.url, version)
            return None
        pause_s, _ = self._commit(parent, policy, undo_tag=None)
        engine._served, engine._served_digest = parent, parent_digest
        self.undo_of = None
        if self.version_sum is not None:
            self.version_sum = add(sub(self.version_sum, new_sum), old_sum)
        logger.warning("vllm %s: v%d undone in place, v%d serves again", self.config.url, version, parent)
        return SwapReport(version=parent, pause_s=pause_s, total_s=time.perf_counter() - started, path="delta")

    def _stage(self, method: str, arg: str) -> tuple[int, int]:
        started = time.perf_counter()
        sums = self._stage_and_wait(method, arg)
        self.last_swap["stage_s"] = time.perf_counter() - started
        return sums

    def _stage_and_wait(self, method: str, arg: str) -> tuple[int, int]:
        """Starts the stage on every worker and polls until each is done (their threads stage and
        rebuild handles while the server serves; a poll is a short RPC between engine steps, at a
        growing interval); the ranks' sums over the old bits they gathered and the new bits they
        staged. FullPath when a worker refuses."""
        engine = self.engine
        try:
            engine.rpc(method, arg, timeout_s=self.config.load_timeout_s)
            deadline = time.monotonic() + self.config.load_timeout_s
            interval = _READY_POLL_S
            while True:
                status = engine.rpc("weightsync_delta_status")
                errors = [s["error"] for s in status if s.get("error")]
                if errors:
                    raise WeightsyncError(f"a worker could not stage the delta: {errors[0]}")
                if all(s.get("ready") for s in status):
                    break
                if time.monotonic() > deadline:
                    raise WeightsyncError(f"the workers did not stage the delta in {self.config.load_timeout_s} s")
                time.sleep(interval)
                interval = min(2 * interval, _READY_POLL_MAX_S)
        except WeightsyncError as e:
            try:
                engine.rpc("weightsync_delta_discard")
            except WeightsyncError:
                pass
            raise FullPath(f"the workers could not stage the delta: {e}") from e
        self.last_swap["handles_s"] = max(s.get("handles_s", 0.0) for s in status)
        self.last_swap["worker_stage_s"] = max(s.get("timings_s", {}).get("stage", 0.0) for s in status)
        return add(*(int(s["old_sum"]) for s in status)), add(*(int(s["new_sum"]) for s in status))

    def _commit(self, version: int, policy: SwapPolicy, *, undo_tag: str | None, parent: int | None = None) -> tuple:
        """Pause, commit, check that every written element reads back as staged (writing the undo
        log back otherwise), reset the prefix cache, set the version, resume: (pause seconds,
        timings). The staged bits' sum was checked before the pause: nothing is hashed in it."""
        engine = self.engine
        mode = engine._pause_mode(policy)
        t_pause = time.perf_counter()
        engine._swaps_begun += 1
        try:
            engine._post(f"/pause?mode={mode}", timeout_s=self.config.drain_timeout_s)
            paused = time.perf_counter()
            # Inside the pause the engine loop runs only utility calls, in the order they arrive:
            # the prefix-cache reset and the version label go with the commit, not after it.
            calls = [
                _Background(engine.rpc, "weightsync_delta_commit", timeout_s=self.config.load_timeout_s),
                _Background(engine._post, "/reset_prefix_cache?reset_running_requests=true"),
            ]
            if "/update_weight_version" in engine.routes:
                calls.append(_Background(engine._post, "/update_weight_version", {"new_version": str(version)}))
            try:
                results = calls[0].result()
                for call in calls[1:]:
                    call.result()
            except BaseException as e:
                engine._mark_unhealthy(f"v{version} failed while committing a delta: {e}")
                raise
            if not all(r.get("landed") for r in results):
                if undo_tag is None:  # an undo that does not verify: nothing known is left to serve
                    engine._mark_unhealthy(f"undoing to v{version}: the bits written back do not read back")
                    raise IntegrityError(f"undoing to v{version}: the bits written back do not read back")
                self._write_back(version, undo_tag, parent)
                raise IntegrityError(
                    f"v{version}: the bits the workers wrote do not read back as staged; the undo log was "
                    "written back and the previous version serves"
                )
            try:
                engine._post("/resume")
            except BaseException as e:
                engine._mark_unhealthy(f"v{version}: {e}")
                raise
            resumed = time.perf_counter()
            engine._pause_split = {"wait_s": paused - t_pause, "hold_s": resumed - paused}
        finally:
            engine._swaps_ended = engine._swaps_begun
        commit_s = max((r.get("timings_s", {}).get("write", 0.0) for r in results), default=0.0)
        return resumed - t_pause, {"drain": paused - t_pause, "commit": commit_s}

    def _write_back(self, version: int, undo_tag: str, parent: int | None) -> None:
        """Still paused after a commit whose bits do not verify: the undo log goes back, the label
        to the parent, then resume."""
        engine = self.engine
        try:
            engine.rpc("weightsync_delta_undo", undo_tag, timeout_s=self.config.load_timeout_s)
            results = engine.rpc("weightsync_delta_commit", timeout_s=self.config.load_timeout_s)
            if not all(r.get("landed") for r in results):  # stays paused: nothing verified to serve
                raise IntegrityError("the undo's bits do not read back either")
            engine._post("/reset_prefix_cache?reset_running_requests=true")
            if parent is not None and "/update_weight_version" in engine.routes:
                engine._post("/update_weight_version", {"new_version": str(parent)})
            engine._post("/resume")
        except WeightsyncError as e:
            engine._mark_unhealthy(f"v{version} did not verify and its undo failed: {e}")

    # ------------------------------------------------------------------ audit

    def audit(self, *, rate_elements_per_s: float | None, locked: bool = False) -> dict:
        """One audit pass over every worker; {"ok": bool|None, ...}. ok None: nothing to compare
        (no plan, no D(v), unhealthy). A mismatch pauses the server and makes the engine unhealthy."""
        pass_id = f"p{next(self._passes)}"
        step = self.config.audit_step_elements
        while True:
            context = contextlib.nullcontext() if locked else self.engine._lock
            with context:
                if self.plans is None or self.version_sum is None or not self.engine._healthy or self.engine._closed:
                    return {"ok": None}
                results = self.engine.rpc("weightsync_audit", str(step), pass_id, timeout_s=self.config.load_timeout_s)
                if any(r.get("busy") for r in results):
                    return {"ok": None}
                if all(r.get("done") for r in results):
                    if any(r.get("sum") is None for r in results):
                        return {"ok": None}
                    held = add(*(int(r["sum"]) for r in results))
                    result = {"ok": held == self.version_sum, "held": held, "expected": self.version_sum}
                    result["version"] = self.engine._served
                    self.last_audit = result
                    if not result["ok"]:
                        self._audit_failed(result)
                    return result
            if rate_elements_per_s:
                self._stop.wait(step / rate_elements_per_s)

    def _audit_failed(self, result: dict) -> None:
        engine = self.engine
        reason = (
            f"the audit found the workers' v{result['version']} summing to {result['held']}, the agent's to "
            f"{result['expected']}: a worker's weights changed outside a swap"
        )
        try:
            engine._post("/pause?mode=keep", timeout_s=self.config.drain_timeout_s)
        except WeightsyncError as e:
            reason += f" (and pausing the server failed: {e})"
        engine._mark_unhealthy(reason)

    def _audit_loop(self) -> None:
        while not self._stop.wait(self.config.audit_interval_s):
            try:
                self.audit(rate_elements_per_s=self.config.audit_elements_per_s)
            except WeightsyncError as e:
                logger.warning("vllm %s: audit pass failed: %s", self.config.url, e)
            except Exception:  # a malformed answer must not end the audits
                logger.exception("vllm %s: audit pass failed", self.config.url)
