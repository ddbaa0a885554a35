"""delta_apply: a worker's side of an in-place delta swap — stage, commit, undo, audit.

One `DeltaApplier` per inference worker (vLLM worker extension, SGLang custom weight loader). It
holds the worker's `Plan` (placement.py), the tag of the version the worker holds, at most one
staged swap and the undo log of the last committed one. States and transitions:

    held(v)   --stage(file v->w)-->  staged(v->w)     off the pause: positions resolved through the
                                                      plan, the OLD bits gathered (the undo log),
                                                      owned old-bit sum returned; unpacked copies
                                                      patched and their kernel handles rebuilt on
                                                      a background thread
    staged    --discard-->           held(v)          copies put back from the undo log
    staged    --commit-->            held(w)          under the pause: live targets scattered
                                                      (index_copy_: addresses never move), handles
                                                      rebound, dense layers reloaded natively, the
                                                      written bits read back: owned new-bit sum
    held(w)   --stage_undo-->        staged(w->v)     the undo log as a delta (nothing crosses)
    any       --reset(tag)-->        held(tag)        after a full reload

A stage names the version it expects the worker to hold: a worker that holds another (a restarted
server, a full reload by someone else) refuses, and the engine reloads in full.

The audit recomputes the owned sum from memory, in bounded steps between swaps (a cursor over the
owned placements); a commit adds the change of elements the current pass already covered, so a
pass spanning swaps still ends on the sum of the version held at its end.

Imports torch and the standard library (and this package's torch-only modules): runs in workers.
Not here: the plan (`placement.py`), the file (`delta_file.py`), the mix (`position_digest.py`),
pausing and deciding (the engines).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from weightsync.agents.engines import placement as pl
from weightsync.agents.engines.delta_file import read_delta_file
from weightsync.agents.engines.position_digest import add, element_bits, fold, mix, position_sum, tensor_id

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

HandleBuilder = Callable[[torch.nn.Module, torch.Tensor], Any]
"""(module, its new unpacked weight) -> the module's new kernel handle (vLLM CPU: `cpu_linear`)."""
NativeReload = Callable[[list[tuple[str, torch.Tensor]]], None]
"""Reloads whole HF tensors through the engine's own loader (layers that are not plain copies)."""


class DeltaRefused(ValueError):
    """The worker cannot take this delta in place (it holds another version, or no plan)."""


@dataclasses.dataclass
class _Writes:
    """The staged writes into one target: flat indices, new and old bits (int views)."""

    index: torch.Tensor
    new: torch.Tensor
    old: torch.Tensor


@dataclasses.dataclass
class _Owned:
    """Changed elements of one owned placement: what the sums and the audit need."""

    order: int  # the placement's index in the audit's order
    tid: int
    key: str  # target
    positions: torch.Tensor  # HF flat positions
    index: torch.Tensor  # target flat indices
    rows: torch.Tensor  # box rows of the positions (the audit's cursor unit)
    old: torch.Tensor  # bits before the swap (int64, zero-extended)
    new: torch.Tensor  # bits after it
    change: torch.Tensor  # mix(new) - mix(old) per element (int64, wrapping): the audit's adjustment


@dataclasses.dataclass
class _Staged:
    parent: str
    version: str
    writes: dict[str, _Writes]
    owned: list[_Owned]
    dense: list[tuple[str, torch.Tensor]]
    old_sum: int = 0
    new_sum: int = 0
    handles: dict[int, Any] = dataclasses.field(default_factory=dict)
    modules: dict[int, torch.nn.Module] = dataclasses.field(default_factory=dict)
    builder: threading.Thread | None = None
    error: BaseException | None = None
    build_s: float = 0.0
    copies_landed: bool = True  # the unpacked copies read back as staged (checked at stage)


class DeltaApplier:
    """See the module docstring. `build_handle` rebuilds a module's kernel handle from its new
    unpacked weight (None: no kernel keeps handles, as on GPUs)."""

    def __init__(self, build_handle: HandleBuilder | None = None) -> None:
        self.build_handle = build_handle
        self.plan: pl.Plan | None = None
        self.held = ""
        self._staged: _Staged | None = None
        self._undo: _Staged | None = None
        self._owned: list[pl.Placement] = []
        self._order: dict[int, int] = {}
        self._audit_pass = ""
        self._audit_at = (0, 0)  # (owned placement, box row) the running pass has reached
        self._audit_sum = 0
        self._audit_done: int | None = None  # the finished pass's sum
        self._job: threading.Thread | None = None  # a `begin` stage running in the background
        self._job_result: dict[str, Any] | None = None
        self._job_error: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle

    def reset(self, held: str, plan: pl.Plan | None) -> None:
        """After a full reload: the worker holds `held`; `plan` (None: no in-place swaps)."""
        self.discard()
        self.held, self._undo, self.plan = held, None, plan
        self._owned = [p for places in (plan.placements.values() if plan else ()) for p in places if p.owned]
        self._order = {id(p): i for i, p in enumerate(self._owned)}
        self._audit_pass, self._audit_at, self._audit_sum, self._audit_done = "", (0, 0), 0, None

    def begin(self, stage: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Runs `stage` (`self.stage(path)` or `self.stage_undo(tag)`) and the handle rebuild on a
        background thread: an RPC of vLLM's worker runs inside its engine loop, so one that
        staged in place would stall generation for as long. `status()` says when it is done."""
        self._join()
        self._job_result, self._job_error = None, None

        def run() -> None:
            try:
                result = stage()
                staged = self._staged
                if staged is not None and staged.builder is not None:
                    staged.builder.join()
                self._job_result = result
            except BaseException as e:  # reported by status()
                self._job_error = e

        self._job = threading.Thread(target=run, name="weightsync-stage", daemon=True)
        self._job.start()
        return {"started": True}

    def status(self) -> dict[str, Any]:
        """What the worker holds and stages; once a `begin` job is done, its result ("old_sum",
        "new_sum", ...) or "error"."""
        staged = self._staged
        running = self._job is not None and self._job.is_alive()
        building = staged is not None and staged.builder is not None and staged.builder.is_alive()
        error = self._job_error or (staged.error if staged is not None else None)
        answer = {
            "held": self.held,
            "planned": self.plan is not None,
            "staged": staged.version if staged is not None else "",
            "ready": not running and (staged is not None and not building or error is not None),
            "error": repr(error) if error is not None else "",
            "handles_s": staged.build_s if staged is not None else 0.0,
            "undo": self._undo.version if self._undo is not None else "",
        }
        if not running and self._job_result is not None:
            answer.update(self._job_result)
        return answer

    def _join(self) -> None:
        if self._job is not None:
            self._job.join()

    # ------------------------------------------------------------------ stage / commit / discard

    def stage(self, path: str) -> dict[str, Any]:
        """Stages the delta file at `path` (the module docstring's `stage`)."""
        started = time.perf_counter()
        self.discard()
        if self.plan is None:
            raise DeltaRefused("this worker has no placement plan (no full load through weightsync since it started)")
        delta = read_delta_file(path)
        if delta.parent != self.held:
            raise DeltaRefused(f"this worker holds {self.held or 'an unknown version'}, the delta is on {delta.parent}")
        read = time.perf_counter()
        parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        owned, dense = [], []
        for entry in delta.entries:
            if entry.dense is not None:
                dense.append((entry.name, entry.dense))
                continue
            places = self.plan.placements.get(entry.name)
            if places is None:
                raise DeltaRefused(f"{entry.name} has no placement here; the engine must send it whole")
            tid, values = tensor_id(entry.name), entry.values.reshape(-1)
            for place in places:
                view = self._view(place.target)
                if self.plan.targets[place.target].dtype != entry.dtype:
                    raise DeltaRefused(
                        f"{entry.name} is {entry.dtype}, this worker holds it as {self.plan.targets[place.target].dtype}"
                    )
                inside, index = pl.locate(place, entry.positions, self.plan.perms)
                if index.numel() == 0:
                    continue
                parts.setdefault(place.target, []).append((index, values[inside].view(view.dtype)))
                if place.owned:
                    positions = entry.positions[inside]
                    rows = positions // _inner(place) - place.box[0][0]
                    old, new = element_bits(view[index]), element_bits(values[inside])
                    owned.append(_owned(self._order[id(place)], tid, place.target, positions, index, rows, old, new))
        staged = _Staged(delta.parent, delta.version, {}, owned, dense)
        for key, pieces in parts.items():
            index = torch.cat([i for i, _ in pieces])
            staged.writes[key] = _Writes(index, torch.cat([v for _, v in pieces]), self._view(key)[index].clone())
        return {
            **self._stage(staged, owned),
            "dense": [name for name, _ in dense],
            "timings_s": {"read": read - started, "stage": time.perf_counter() - read},
        }

    def stage_undo(self, expect: str) -> dict[str, Any]:
        """Stages the inverse of the last commit (which made `expect` held), from the undo log."""
        self.discard()
        undo = self._undo
        if undo is None or undo.version != expect or self.held != expect:
            raise DeltaRefused(f"no undo log for {expect} (this worker holds {self.held or 'an unknown version'})")
        if undo.dense:
            raise DeltaRefused("the last swap reloaded layers natively: their old weights are not kept")
        writes = {key: _Writes(w.index, w.old, self._view(key)[w.index].clone()) for key, w in undo.writes.items()}
        owned = [
            _owned(o.order, o.tid, o.key, o.positions, o.index, o.rows, element_bits(self._view(o.key)[o.index]), o.old)
            for o in undo.owned
        ]
        return self._stage(_Staged(undo.version, undo.parent, writes, owned, []), owned)

    def _stage(self, staged: _Staged, owned: list[_Owned]) -> dict[str, Any]:
        """Makes `staged` the one staged version (its sums over `owned`, the copies patched and
        handles built); the sums and count the agent checks."""
        staged.old_sum, staged.new_sum = _sums(owned)
        self._staged = staged
        self._patch_copies_and_build(staged)
        return {
            "old_sum": str(staged.old_sum),
            "new_sum": str(staged.new_sum),
            "changed": sum(w.index.numel() for w in staged.writes.values()),
        }

    def commit(self, native_reload: NativeReload | None = None) -> dict[str, Any]:
        """Makes the staged version the held one (under the engine's pause): scatters, rebinds,
        reloads native layers, and reads every element written into live targets back against the
        staged bits ("landed"; the unpacked copies were written and read back at stage); the sums
        were taken at stage, so nothing is hashed here."""
        self._join()
        staged = self._staged
        if staged is None:
            raise DeltaRefused("nothing is staged")
        started = time.perf_counter()
        if staged.builder is not None:
            staged.builder.join()
        if staged.error is not None:
            raise RuntimeError(f"rebuilding kernel handles failed: {staged.error!r}") from staged.error
        waited = time.perf_counter()
        for key, w in staged.writes.items():
            if self.plan.live[key]:
                self._view(key).index_copy_(0, w.index, w.new)
        for handle_id, module in staged.modules.items():
            module.cpu_linear = staged.handles[handle_id]
        if staged.dense:
            if native_reload is None:
                raise DeltaRefused("this engine cannot reload layers natively")
            native_reload(staged.dense)
        written = time.perf_counter()
        landed = staged.copies_landed and all(
            torch.equal(self._view(key)[w.index], w.new) for key, w in staged.writes.items() if self.plan.live[key]
        )
        self._adjust_audit(staged)
        self.held, self._staged, self._undo = staged.version, None, staged
        return {
            "landed": landed,
            "timings_s": {
                "wait_handles": waited - started,
                "write": written - waited,
                "read_back": time.perf_counter() - written,
            },
        }

    def discard(self) -> None:
        """Drops a staged swap: unpacked copies get their old bits back, new handles are dropped."""
        if self._job is not threading.current_thread():
            self._join()
        staged, self._staged = self._staged, None
        if staged is None:
            return
        if staged.builder is not None:
            staged.builder.join()
        for key, w in staged.writes.items():
            if not self.plan.live[key]:
                self._view(key).index_copy_(0, w.index, w.old)

    # ------------------------------------------------------------------ audit and faults

    def audit_step(self, max_elements: int, pass_id: str = "") -> dict[str, Any]:
        """Sums up to about `max_elements` more owned elements of pass `pass_id` from memory;
        {"done": True, "sum"} once the pass has covered every owned placement (and again on later
        calls for the same pass); a new `pass_id` starts a new pass."""
        if self._staged is not None:
            return {"busy": True}
        if self.plan is None:
            return {"done": True, "sum": None}
        if pass_id != self._audit_pass:
            self._audit_pass, self._audit_at, self._audit_sum, self._audit_done = pass_id, (0, 0), 0, None
        if self._audit_done is not None:
            return {"done": True, "sum": str(self._audit_done)}
        index, row = self._audit_at
        budget = max(1, int(max_elements))
        while index < len(self._owned) and budget > 0:
            place = self._owned[index]
            rows = place.box[0][1]
            per_row = max(1, place.numel // max(1, rows))
            take = min(rows - row, max(1, budget // per_row))
            hf_index, local = pl.box_indices(place, row, take)
            bits = element_bits(self._gather(place, local))
            self._audit_sum = add(self._audit_sum, position_sum(tensor_id(place.hf_name), hf_index, bits))
            budget -= take * per_row
            row += take
            if row >= rows:
                index, row = index + 1, 0
        self._audit_at = (index, row)
        if index < len(self._owned):
            return {"done": False}
        self._audit_done = self._audit_sum
        return {"done": True, "sum": str(self._audit_done)}

    def poke(self, hf_name: str, position: int, bits: int) -> dict[str, Any]:
        """Writes one element's bits where this worker holds it (fault drills and tests: what a
        memory error would do); returns the bits it replaced, or {"held": False}."""
        for place in (self.plan.placements.get(hf_name) or []) if self.plan else []:
            _, index = pl.locate(place, torch.tensor([int(position)]), self.plan.perms)
            if index.numel():
                view = self._view(place.target)
                old = int(element_bits(view[index]).item())
                view[index] = torch.tensor([int(bits)], dtype=torch.int64).to(view.dtype)
                return {"held": True, "old": old}
        return {"held": False}

    # ------------------------------------------------------------------ internals

    def _view(self, key: str) -> torch.Tensor:
        target = self.plan.targets[key]
        return target.view(_INT[target.element_size()])

    def _gather(self, place: pl.Placement, local: torch.Tensor) -> torch.Tensor:
        if place.perm is not None:
            local = self.plan.perms[place.perm][local] + place.perm_base
        return self.plan.targets[place.target][local]

    def _patch_copies_and_build(self, staged: _Staged) -> None:
        """Unpacked copies get the new bits now (nothing serves from them); the kernel handles
        built from them are rebuilt on a background thread while the worker keeps serving. A
        live target's handles (a tied lm_head's) are built from a patched clone: the live tensor
        itself changes only under the pause."""
        jobs = []
        for key, w in staged.writes.items():
            if not self.plan.live[key]:
                self._view(key).index_copy_(0, w.index, w.new)
                staged.copies_landed &= torch.equal(self._view(key)[w.index], w.new)
            for module in self.plan.handles.get(key, ()):
                staged.modules[id(module)] = module
                jobs.append((module, key, w))
        if not jobs:
            return
        if self.build_handle is None:
            raise DeltaRefused("kernel handles need rebuilding but this worker has no handle builder")
        build_handle, plan = self.build_handle, self.plan

        def build() -> None:
            started = time.perf_counter()
            try:
                for module, key, w in jobs:
                    weight = plan.targets[key]
                    if plan.live[key]:
                        weight = weight.clone()
                        weight.view(w.new.dtype).index_copy_(0, w.index, w.new)
                    staged.handles[id(module)] = build_handle(module, weight.view(plan.shapes[key]))
            except BaseException as e:  # reported by status() and commit()
                staged.error = e
            staged.build_s = time.perf_counter() - started

        staged.builder = threading.Thread(target=build, name="weightsync-handles", daemon=True)
        staged.builder.start()

    def _adjust_audit(self, staged: _Staged) -> None:
        """Elements the running audit pass already summed changed: their change goes into it (a
        finished pass's sum too: it is what the engine compares once every rank has finished)."""
        at_index, at_row = (len(self._owned), 0) if self._audit_done is not None else self._audit_at
        for owned in staged.owned:
            if owned.order > at_index:
                continue
            change = owned.change if owned.order < at_index else owned.change[owned.rows < at_row]
            self._audit_sum = add(self._audit_sum, fold(change.sum()))
        if self._audit_done is not None:
            self._audit_done = self._audit_sum


def _inner(place: pl.Placement) -> int:
    n = 1
    for size in place.hf_shape[1:]:
        n *= size
    return n


def _owned(order, tid, key, positions, index, rows, old, new) -> _Owned:
    """An owned placement's changed elements, with their mixes' change taken now (off the pause)."""
    return _Owned(
        order, tid, key, positions, index, rows, old, new, mix(tid, positions, new) - mix(tid, positions, old)
    )


def _sums(owned: list[_Owned]) -> tuple[int, int]:
    """(sum over the old bits, over the new bits) of the owned changed elements."""
    old = add(*(position_sum(o.tid, o.positions, o.old) for o in owned))
    return old, add(old, *(fold(o.change.sum()) for o in owned))
