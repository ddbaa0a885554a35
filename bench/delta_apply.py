"""delta_apply benchmark: the in-place swap's mechanism against a full copy of the same tensors, torch only.

A 7B-shaped fused layout (Qwen2.5-7B: hidden 3584, 28 heads of 128, 4 kv heads, MLP 18944, vocabulary
152064) in bf16, as one tensor-parallel rank holds it (harness/vllm_layout.py): the embedding, one
decoder layer's `qkv_proj` and `gate_up_proj` (and `o_proj`, `down_proj`). A version changes 1.5 %
of the elements by one ULP. Timed, in the same run, on the device given (CPU, or CUDA where there
is one):

- in place: plan-resolve (each changed HF position to its fused target index), gather of the old
  bits (the undo log), scatter of the new ones (`index_copy_`), and the position digest of both
  (old-bit and new-bit sums); then the same through `DeltaApplier` (delta file read + stage +
  commit), as a worker runs it;
- full copy: every target tensor overwritten from a tensor of the new version in the same layout
  (the least any full reload does).

Bytes: the delta file (what crosses tmpfs, or PCIe to a GPU) against the model's. The whole 7B
does not fit this benchmark's machines in the CPU figure: `--layers` decoder layers (default 1) and
the embedding are timed; per-layer figures scale linearly. Prints one JSON record and writes
bench/results/delta-apply-*.{json,md}. `python -m bench.delta_apply [--device cuda] [--quick]`.
Not a test: it asserts no times.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.output import write_results
from harness import vllm_layout as vl
from harness.machine import describe_machine
from weightsync.agents.engines import placement as pl
from weightsync.agents.engines.delta_apply import DeltaApplier
from weightsync.agents.engines.delta_file import TensorChanges, write_delta_file
from weightsync.agents.engines.position_digest import element_bits, position_sum, tensor_id

RESULTS = Path(__file__).parent / "results"
QWEN_7B = vl.Dims(
    vocab=152064, padded_vocab=152064, hidden=3584, head=128, heads=28, kv_heads=4, inter=18944, experts=0, tied=False
)
QUICK = vl.Dims(
    vocab=4096, padded_vocab=4096, hidden=512, head=64, heads=8, kv_heads=2, inter=1536, experts=0, tied=False
)
FRACTION = 0.015
INT = {2: torch.int16, 4: torch.int32}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.delta_apply", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a small layout (a smoke run)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="results file base name (default: by machine and date)")
    args = parser.parse_args()
    dims = QUICK if args.quick else QWEN_7B
    record = run(dims, torch.device(args.device), args.repeats)
    record.update(machine={**describe_machine(), "load": os.getloadavg()}, date=datetime.date.today().isoformat())
    base = RESULTS / (args.out or f"delta-apply-{args.device}-{platform.machine()}-{record['date']}")
    write_results(base, record, markdown(record))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(dims: vl.Dims, device: torch.device, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    shapes = vl.hf_shapes(dims)
    hf = {n: torch.randn(s, generator=generator).to(torch.bfloat16) for n, s in shapes.items()}
    model = vl.LayerModel(dims)
    vl.load(model, hf, dims)
    model.to(device)
    plan = pl.build_plan(model, {})
    elements = sum(t.numel() for t in hf.values())
    model_bytes = 2 * elements
    changes = []
    for name, t in hf.items():  # 1.5 % of each tensor, one ULP up
        flat = t.reshape(-1)
        positions = torch.unique(
            torch.randint(flat.numel(), (max(1, int(FRACTION * flat.numel())),), generator=generator)
        )
        values = (flat[positions].view(torch.int16) + 1).view(torch.bfloat16)
        changes.append(
            TensorChanges(name=name, dtype=t.dtype, shape=tuple(t.shape), positions=positions, values=values)
        )
    changed = sum(c.changed for c in changes)
    on_device = [(c, c.positions.to(device), c.values.to(device)) for c in changes]

    def mechanism() -> dict[str, float]:
        """Resolve, gather, scatter, digest, each timed alone; the scatter writes the new bits and
        a second scatter puts the old ones back, so every repeat starts from the same state."""
        t = {"resolve": 0.0, "gather": 0.0, "scatter": 0.0, "digest": 0.0}
        undo = []
        for change, positions, values in on_device:
            for place in plan.placements[change.name]:
                synchronize(device)
                t0 = time.perf_counter()
                inside, index = pl.locate(place, positions, plan.perms)
                synchronize(device)
                t1 = time.perf_counter()
                view = plan.targets[place.target].view(torch.int16)
                old = view[index]
                synchronize(device)
                t2 = time.perf_counter()
                new = values[inside].view(torch.int16)
                view.index_copy_(0, index, new)
                synchronize(device)
                t3 = time.perf_counter()
                tid, hf_positions = tensor_id(change.name), positions[inside]
                position_sum(tid, hf_positions, element_bits(old))
                position_sum(tid, hf_positions, element_bits(new))
                synchronize(device)
                t4 = time.perf_counter()
                t["resolve"] += t1 - t0
                t["gather"] += t2 - t1
                t["scatter"] += t3 - t2
                t["digest"] += t4 - t3
                undo.append((view, index, old))
        for view, index, old in undo:
            view.index_copy_(0, index, old)
        t["total"] = sum(t.values())
        return t

    # The same new version laid out as the targets hold it: what a full copy writes.
    fused = {key: target.clone() for key, target in plan.targets.items()}
    for change, positions, values in on_device:
        for place in plan.placements[change.name]:
            inside, index = pl.locate(place, positions, plan.perms)
            fused[place.target].view(torch.int16).index_copy_(0, index, values[inside].view(torch.int16))

    def full_copy() -> float:
        synchronize(device)
        t0 = time.perf_counter()
        for key, target in plan.targets.items():
            target.copy_(fused[key])
        synchronize(device)
        return time.perf_counter() - t0

    mechanism()  # warm-up (allocator, kernels)
    runs = [mechanism() for _ in range(repeats)]
    copies = [full_copy() for _ in range(repeats)]
    vl.load(model.cpu(), hf, dims) if device.type == "cpu" else None

    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        path = Path(tmp) / "delta.safetensors"
        t0 = time.perf_counter()
        file_bytes = write_delta_file(path, changes, parent="v1", version="v2")
        write_s = time.perf_counter() - t0
        applier_runs = []
        model = vl.LayerModel(dims)
        vl.load(model, hf, dims)
        applier = DeltaApplier()
        applier.reset("v1", pl.build_plan(model, {}))
        for _ in range(repeats):
            t0 = time.perf_counter()
            applier.stage(str(path))
            t1 = time.perf_counter()
            applier.commit()
            t2 = time.perf_counter()
            applier.stage_undo("v2")
            applier.commit()
            applier_runs.append({"stage": t1 - t0, "commit": t2 - t1})

    def med(key: str, rows: list[dict]) -> float:
        return statistics.median(r[key] for r in rows)

    mechanism_s = {k: med(k, runs) for k in runs[0]}
    return {
        "device": str(device),
        "layout": {"dims": vars(dims), "tensors": len(shapes), "elements": elements, "model_bytes": model_bytes},
        "changed": changed,
        "changed_fraction": changed / elements,
        "threads": torch.get_num_threads(),
        "mechanism_s": mechanism_s,
        "full_copy_s": statistics.median(copies),
        "speedup_vs_full_copy": statistics.median(copies) / mechanism_s["total"],
        "applier_s": {k: med(k, applier_runs) for k in applier_runs[0]},
        "delta_file": {"bytes": file_bytes, "x_model": file_bytes / model_bytes, "write_s": write_s},
    }


def markdown(r: dict) -> str:
    m, d = r["mechanism_s"], r["layout"]["dims"]
    return "\n".join(
        [
            f"# In-place delta mechanism — {r['machine']['cpu']}, {r['device']}, {r['date']}",
            "",
            f"Layout: Qwen2.5-7B-shaped (hidden {d['hidden']}, qkv {d['heads']}+2x{d['kv_heads']} heads of {d['head']}, "
            f"MLP {d['inter']}, vocabulary {d['vocab']}): the embedding and one decoder layer, "
            f"{r['layout']['elements'] / 1e6:.0f}M bf16 elements ({r['layout']['model_bytes'] / 1e9:.2f} GB); "
            f"{100 * r['changed_fraction']:.2f} % changed. {r['threads']} torch threads, load {r['machine']['load'][0]:.1f}.",
            "",
            "| step | ms |",
            "|---|---|",
            *(f"| {k} | {1000 * v:.1f} |" for k, v in m.items()),
            f"| full copy of the same tensors | {1000 * r['full_copy_s']:.1f} |",
            "",
            f"In place (resolve + gather + scatter + digest) vs full copy: **{r['speedup_vs_full_copy']:.2f}x**. "
            f"Through DeltaApplier: stage {1000 * r['applier_s']['stage']:.0f} ms (file read included), commit "
            f"{1000 * r['applier_s']['commit']:.0f} ms. Delta file {r['delta_file']['bytes'] / 1e6:.1f} MB = "
            f"{100 * r['delta_file']['x_model']:.1f} % of the model's bytes (what would cross PCIe), written in "
            f"{1000 * r['delta_file']['write_s']:.0f} ms.",
            "",
        ]
    )


if __name__ == "__main__":
    main()
