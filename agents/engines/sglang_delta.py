"""sglang_delta: the sglang engine's in-place delta swaps, through SGLang's custom weight loader.

SGLang has no worker extension and no per-worker RPC; what reaches every TP worker is
`POST /update_weights_from_tensor` with a `load_format` naming a loader listed in the server's
`--custom-weight-loader`, which SGLang imports and calls with its model (`sglang_loader.py`). Each
call holds SGLang's model-update lock: new requests wait, running ones finish first (drain), so the
pause is the loader's stage and commit, O(changed elements), with no kernel repack on GPUs. Steps:

    describe  after every full swap: each rank plans what it holds (`placement.py`), writes the
              summary; the engine checks that every element is owned once (`delta_handoff.py`)
    decide    a plan, the served version is the delta's parent, the budget -> else the full path
    file      the changed positions and new bits on tmpfs (handoff_dir), named in the request with
              each rank's expected old- and new-bit sums (a rank checks alone before writing)
    apply     update_weights_from_tensor (weight_version set on success): each rank stages,
              compares its sums, commits, reads back, and answers in a result file
    confirm   every rank applied -> served. A rank that refused (its old bits diverged) wrote
              nothing: the ranks that committed are undone, the version label is set back, and the
              version goes in whole

`undo(version)` sends op "undo": each rank writes its undo log back (the parity probe's refuse).
After a delta swap the snapshot directory's `current` is older than what is served: a failed full
reload (where SGLang falls back to `current`) leaves the engine serving nothing it can name.

Not here: the full path (`sglang.py`), the loader in the workers (`sglang_loader.py`).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from weightsync.agents.engines.base import SwapReport
from weightsync.agents.engines.delta_handoff import (
    Plans,
    check_plans,
    delta_misfit,
    expected_sums,
    tag,
    write_delta,
)
from weightsync.agents.engines.sglang_loader import LOADER, REQUEST_NAME, request_tensor
from weightsync.agents.engines.swap_policy import SwapPolicy
from weightsync.errors import LayoutError, WeightsyncError

if TYPE_CHECKING:
    from weightsync.agents.engines.sglang import SGLangEngine

logger = logging.getLogger(__name__)


class FullPath(WeightsyncError):
    """This version goes in whole; the message says why."""


class SGLangDeltas:
    """The sglang engine's in-place state: the ranks' plans and the last delta swap's undo."""

    def __init__(self, engine: SGLangEngine) -> None:
        self.engine = engine
        self.config = engine.config
        self.plans: Plans | None = None
        self.served_digest = ""
        self.undo_of: tuple[int, int, str] | None = None
        self.last_swap: dict = {}
        self.patched = False
        """The served weights were patched in place since the last full load: the snapshot `current`
        is older than what is served."""
        self._applied_sums: dict[int, tuple[str, str]] = {}
        """Per rank, (old-bit sum, new-bit sum) of the last delta it applied: what its undo finds."""

    def after_full_load(self, version: int, digest: str, weights: Mapping[str, torch.Tensor]) -> None:
        """Each rank plans the freshly loaded version (op describe)."""
        self.plans, self.served_digest, self.undo_of, self.patched = None, digest, None, False
        if not self.config.custom_weight_loader:
            return
        try:
            answers = self._call(
                {"op": "describe", "held": tag(version, digest), "native": list(self.config.native_reload)}
            )
            self.plans = check_plans([a["summary"] for a in answers], {n: tuple(t.shape) for n, t in weights.items()})
        except (WeightsyncError, LayoutError) as e:
            logger.warning("sglang %s: no in-place delta swaps until the next full load: %s", self.config.url, e)

    def refusal(self, delta) -> str:
        engine = self.engine
        if not self.config.custom_weight_loader:
            return "the server has no weightsync --custom-weight-loader (custom_weight_loader = false)"
        if self.plans is None:
            return "the workers have no placement plan (a restarted server, or no full load through weightsync yet)"
        return delta_misfit(delta, engine._served, self.served_digest, self.config.delta_max_changed_fraction)

    def swap(
        self, version: int, delta, weights: Mapping[str, torch.Tensor], digest: str, policy: SwapPolicy, started: float
    ) -> SwapReport:
        plans = self.plans
        parent = delta.parent
        held = tag(parent.version, parent.digest)
        handoff = Path(tempfile.mkdtemp(prefix=f"weightsync-v{version}-{os.getpid()}-", dir=self._handoff_dir()))
        try:
            nbytes, dense = write_delta(
                handoff / "delta.safetensors", delta, weights, plans, parent=held, version=tag(version, digest)
            )
            expect = {str(r): [str(s) for s in expected_sums(delta, plans, rank=r)] for r in range(len(plans.ranks))}
            request = {"op": "apply", "path": str(handoff / "delta.safetensors"), "expect": expect}
            # From here some ranks may hold the delta (one that fails to answer, say): `current` on
            # disk no longer names what is served, should the full reload that follows fail.
            self.patched = True
            pause_s, answers = self._timed_call(request, handoff, version, policy)
        finally:
            shutil.rmtree(handoff, ignore_errors=True)
        refused = [a for a in answers if not a.get("ok")]
        if refused:
            self._undo_partial(answers, version, digest, parent.version)
            raise FullPath(f"a rank refused the delta: {refused[0].get('error')}; reloaded in full")
        self.served_digest = digest
        self.undo_of = (version, parent.version, parent.digest) if not dense else None
        native = tuple(
            f"{m}: {e['reason']}" for m, e in sorted(plans.native.items()) if set(e["hf_names"]) & set(dense)
        )
        self.last_swap = {
            "file_bytes": nbytes,
            "changed": delta.changed,
            "elements": delta.elements,
            "pause_s": pause_s,
        }
        logger.info(
            "sglang %s serves v%d in place: %d of %d elements, %.2f MB file, pause %.1f ms",
            self.config.url,
            version,
            delta.changed,
            delta.elements,
            nbytes / 1e6,
            1000 * pause_s,
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
        if self.undo_of is None or self.undo_of[0] != version or self.engine._served != version:
            return None
        started = time.perf_counter()
        _, parent, parent_digest = self.undo_of
        handoff = Path(tempfile.mkdtemp(prefix=f"weightsync-undo-{os.getpid()}-", dir=self._handoff_dir()))
        try:
            expect = {str(r): self._undo_sums(r) for r in range(len(self.plans.ranks))}
            request = {"op": "undo", "expect_held": tag(version, self.served_digest), "expect": expect}
            pause_s, answers = self._timed_call(request, handoff, parent, policy)
        finally:
            shutil.rmtree(handoff, ignore_errors=True)
        if not all(a.get("ok") for a in answers):
            logger.error("sglang %s: undo of v%d refused: %s", self.config.url, version, answers)
            self.engine._served = None
            return None
        self.served_digest, self.undo_of = parent_digest, None
        return SwapReport(version=parent, pause_s=pause_s, total_s=time.perf_counter() - started, path="delta")

    # ------------------------------------------------------------------ internals

    def _undo_sums(self, rank: int) -> list[str]:
        """The sums a rank's undo must find: what the last apply wrote (new) back to what it held."""
        old, new = self._applied_sums[rank]
        return [new, old]

    def _timed_call(self, request: dict, handoff: Path, label: int, policy: SwapPolicy) -> tuple[float, list[dict]]:
        abort = policy is SwapPolicy.ABORT or self.config.drain == "abort"
        started = time.perf_counter()
        if abort:
            reply = self.engine._call("POST", "/pause_generation", {"mode": "abort"}, self.config.request_timeout_s)
            if reply.status != 200:
                raise FullPath(f"pausing SGLang failed ({reply.status}); nothing changed")
        try:
            answers = self._call(request, handoff=handoff, weight_version=str(label))
        finally:
            if abort:
                reply = self.engine._call("POST", "/continue_generation", {}, self.config.request_timeout_s)
                if reply.status != 200:  # said, not raised: the weights are in, only the resume failed
                    logger.error(
                        "sglang %s: continue_generation failed (%s %s): the server may stay paused",
                        self.config.url,
                        reply.status,
                        reply.problem or reply.text[:200],
                    )
        if all(a.get("ok") for a in answers) and request["op"] == "apply":
            self._applied_sums = {r: (a["old_sum"], a["new_sum"]) for r, a in enumerate(answers)}
        return time.perf_counter() - started, answers

    def _call(self, request: dict, *, handoff: Path | None = None, weight_version: str | None = None) -> list[dict]:
        """One update_weights_from_tensor naming weightsync's loader; each rank's answer."""
        own = handoff is None
        results = handoff or Path(
            tempfile.mkdtemp(prefix=f"weightsync-describe-{os.getpid()}-", dir=self._handoff_dir())
        )
        try:
            request = {**request, "result": str(results)}
            payload = base64.b64encode(pickle.dumps([(REQUEST_NAME, request_tensor(request))])).decode()
            ranks = len(self.plans.ranks) if self.plans is not None else self.config.tp_size
            body = {
                "serialized_named_tensors": [payload] * ranks,
                "load_format": LOADER,
                "flush_cache": True,
                "abort_all_requests": False,
            }
            if weight_version is not None:
                body["weight_version"] = weight_version
            reply = self.engine._call("POST", "/update_weights_from_tensor", body, self.config.reload_timeout_s)
            if reply.status != 200:
                raise FullPath(f"SGLang refused weightsync's loader ({reply.status}: {reply.text[:300]})")
            answers = []
            for rank in range(ranks):
                path = results / f"rank{rank}.json"
                if not path.exists():
                    raise FullPath(f"rank {rank} did not answer (is {LOADER} in --custom-weight-loader?)")
                answers.append(json.loads(path.read_text()))
            return answers
        finally:
            if own:
                shutil.rmtree(results, ignore_errors=True)

    def _undo_partial(self, answers: list[dict], version: int, digest: str, parent: int) -> None:
        """Some ranks committed, others refused: the committed ones go back, the label too."""
        if any(a.get("ok") for a in answers):
            expect = {str(r): [a["new_sum"], a["old_sum"]] for r, a in enumerate(answers) if a.get("ok")}
            try:
                self._call({"op": "undo", "expect_held": tag(version, digest), "expect": expect})
            except WeightsyncError as e:
                logger.error("sglang %s: undoing the ranks that took v%d failed: %s", self.config.url, version, e)
        self.engine._call("POST", "/update_weight_version", {"new_version": str(parent)}, self.config.request_timeout_s)

    def _handoff_dir(self) -> str:
        return self.config.handoff_dir or ("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())
