"""sglang_loader: weightsync's custom weight loader inside every SGLang TP worker.

Start SGLang with
`--custom-weight-loader weightsync.agents.engines.sglang_loader.load_delta`; SGLang imports it in
each tensor-parallel worker and calls it as `load_delta(model, named_tensors)` when
`POST /update_weights_from_tensor` names it as the `load_format` (its model runner:
`custom_loader(self.model, named_tensors)`), holding the model-update lock meanwhile (new
requests wait, the in-flight ones finished first: that is the swap's pause).

The one tensor the engine sends, `("weightsync.request", uint8 tensor)`, is a JSON request:

    {"op": "describe", "held": tag, "native": [patterns], "result": dir}
        after a full reload: build the placement plan (`placement.py`) of what this worker now
        holds (it holds version `held`) and write its summary
    {"op": "apply", "path": delta file, "result": dir, "expect": {rank: [old_sum, new_sum]}}
        stage the delta file (`delta_apply.py`: gather the old bits, the undo log), compare this
        rank's old- and new-bit sums with the agent's figures for it (a rank checks alone: the
        ranks cannot compare with each other before writing), then commit (scatter in place,
        read back); a mismatch writes nothing
    {"op": "undo", "expect_held": tag, "result": dir, "expect": {...}}
        the same with the undo log of the last apply

Each rank answers in `{result}/rank{tp_rank}.json` ({"ok": ..., "error": ..., sums, timings}). A
refused request writes nothing and returns normally (an exception would reach SGLang's scheduler):
the engine reads the ranks' answers, and where some ranks committed and others refused, undoes
the committed ones and reloads in full. Layers that are not plain copies are loaded whole through
the model's own `load_weights`.

Like the vLLM extension, this runs in an inference image with torch, xxhash and safetensors only.
Not here: the engine that sends requests (`sglang.py`), the plan and applier.
"""

from __future__ import annotations

import json
import os
import time
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch

from weightsync.agents.engines import placement as pl
from weightsync.agents.engines.delta_apply import DeltaApplier, DeltaRefused

LOADER = f"{__name__}.load_delta"
"""What --custom-weight-loader and the request's load_format name."""
REQUEST_NAME = "weightsync.request"

_APPLIERS: dict[int, DeltaApplier] = {}  # id(model) -> its applier (one model per worker process)


def load_delta(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang's custom loader entry point (module docstring)."""
    request = read_request(named_tensors)
    rank = pl.tp_rank_size(model)[0]
    result = Path(request["result"]) / f"rank{rank}.json"
    started = time.perf_counter()
    try:
        answer = _run(model, request, rank)
        answer["ok"] = True
    except DeltaRefused as e:
        answer = {"ok": False, "error": str(e)}
    except Exception as e:  # never into SGLang's scheduler: the agent reads the answer and reloads whole
        applier = _APPLIERS.get(id(model))
        if applier is not None:
            applier.discard()
        answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    answer["loader_s"] = time.perf_counter() - started
    tmp = result.with_suffix(".tmp")
    tmp.write_text(json.dumps(answer))
    os.replace(tmp, result)


def read_request(named_tensors: list[tuple[str, Any]]) -> dict:
    """The JSON request in the one tensor the engine sent."""
    if len(named_tensors) != 1 or named_tensors[0][0] != REQUEST_NAME:
        names = [name for name, _ in named_tensors][:3]
        raise DeltaRefused(f"weightsync's loader takes one {REQUEST_NAME!r} tensor, got {names}")
    data = named_tensors[0][1].detach().cpu().contiguous().view(torch.uint8)
    return json.loads(bytes(data.tolist()).decode())


def request_tensor(request: dict) -> torch.Tensor:
    """The uint8 tensor carrying `request` (what the engine pickles into the payload)."""
    return torch.tensor(list(json.dumps(request).encode()), dtype=torch.uint8)


def _run(model: torch.nn.Module, request: dict, rank: int) -> dict:
    applier = _APPLIERS.setdefault(id(model), DeltaApplier())
    op = request.get("op")
    if op == "describe":
        native = list(request.get("native") or ())
        plan = pl.build_plan(
            model,
            {},
            exclude=lambda module: next((f"native_reload lists {p!r}" for p in native if fnmatch(module, p)), ""),
        )
        applier.reset(request["held"], plan)
        return {"summary": plan.summary()}
    if op == "apply":
        staged = applier.stage(request["path"])
    elif op == "undo":
        staged = applier.stage_undo(request["expect_held"])
    else:
        raise DeltaRefused(f"unknown op {op!r}")
    want = (request.get("expect") or {}).get(str(rank))
    got = [int(staged["old_sum"]), int(staged["new_sum"])]
    if want is None or [int(x) for x in want] != got:
        applier.discard()
        which = "old" if want is None or int(want[0]) != got[0] else "new"
        raise DeltaRefused(
            f"rank {rank}: the {which}-bit sum is {got[0 if which == 'old' else 1]}, the agent's "
            f"{None if want is None else want[0 if which == 'old' else 1]}: "
            + ("this worker's state diverged" if which == "old" else "the delta was damaged on its way")
        )
    committed = applier.commit(native_reload=model.load_weights)
    if not committed["landed"]:
        applier.stage_undo(applier.held)
        applier.commit()
        raise DeltaRefused(f"rank {rank}: the written bits did not read back; the undo log was written back")
    return {"held": applier.held, **staged, **committed}
