"""device_diff: GB/s of codec ctx's device scan (`weightsync.format.codecs.diff`) where the weights live.

A bf16 model of `--gib` GiB, as tensors of `--tensor-mib` MiB cut into `--chunk-mib` chunks, and
its next step: `--changed` of the elements moved by one ULP up or down (what lr 1e-6 does,
FACTS.md). Times the diff of the whole model against its parent on the device (CUDA when there is
one, else CPU; `--device` to pick), the changed elements' fields copied to the host included, and
reports GB/s of bf16 model bytes, two ways in the same run (and, on CUDA, the whole-tensor diff's
peak device memory above the two models it reads):

- `whole_tensor`: what the publisher does (`DeviceParent`): `diff_ranges` per tensor, every
  chunk of it in the same kernels and one copy to the host;
- `per_chunk` (the baseline): `diff_chunk` per chunk, kernels and a host copy per chunk (what the
  publisher did before).

Then checks, on a few chunks, that the device's fields equal the host scan's
(`changes.scan_changes`), and reports what crossed to the host against what the host scan would
have had to copy (the whole model twice: new and parent).

With `--publish N`, then publishes the model and N next steps (each moving another `--changed`
of the elements) through two publishers on local stores, taking turns version by version: one
with `device_diff` (the changes found on the device) and one without (the host scans the
snapshot), and reports each one's delta commit times and stages.

    python -m bench.device_diff [--gib 1] [--tensor-mib 64] [--chunk-mib 4] [--changed 0.013] [--device cuda]
                                [--publish 4]

Prints one JSON record. Not a test: it asserts no times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from weightsync.format.codecs import changes as change_model
from weightsync.format.codecs import diff
from weightsync.format.codecs.diff import diff_chunk, diff_ranges
from weightsync.format.dtypes import dtype_by_name

FIELDS = ("positions", "classes", "ranks", "old_bits", "new_bits", "class_counts")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeat: int) -> tuple[list[float], object]:
    fn()  # warm-up (kernels, allocator)
    times, result = [], None
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        result = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--tensor-mib", type=float, default=64.0, help="size of each tensor of the model")
    parser.add_argument("--chunk-mib", type=float, default=4.0)
    parser.add_argument("--changed", type=float, default=0.013)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--publish",
        type=int,
        default=0,
        metavar="N",
        help="then publish the model and N next steps, with and without device_diff",
    )
    parser.add_argument(
        "--slab-elements",
        type=int,
        default=0,
        help="elements diffed together (weightsync.format.codecs.diff.SLAB_ELEMENTS; 0: the default)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.slab_elements:
        diff.SLAB_ELEMENTS[device.type] = args.slab_elements
    bf16 = dtype_by_name("bfloat16")
    count = int(args.gib * 2**30) // 2
    per_tensor = int(args.tensor_mib * 2**20) // 2
    per_chunk = int(args.chunk_mib * 2**20) // 2
    gen = torch.Generator(device=device).manual_seed(0)
    old = (torch.randn(count, generator=gen, device=device) * 0.02).to(torch.bfloat16)
    bits = old.view(torch.int16).clone()
    moved = torch.rand(count, generator=gen, device=device) < args.changed
    step = torch.where(torch.rand(count, generator=gen, device=device) < 0.5, 1, -1).to(torch.int16)
    bits[moved] += step[moved]  # one ULP in magnitude, either way (sign-magnitude bits)
    del moved, step
    new = bits.view(torch.bfloat16)
    tensors = [(s, min(s + per_tensor, count)) for s in range(0, count, per_tensor)]

    def chunks_of(start: int, stop: int) -> list[tuple[int, int]]:
        return [(s, min(s + per_chunk, stop - start)) for s in range(0, stop - start, per_chunk)]

    def whole_tensor():
        return [diff_ranges(new[a:b], old[a:b], chunks_of(a, b), bf16) for a, b in tensors]

    def per_chunk_baseline():
        return [
            diff_chunk(new[a + s : a + e], old[a + s : a + e], bf16) for a, b in tensors for s, e in chunks_of(a, b)
        ]

    if device.type == "cuda":  # what the diff needs beyond the two models it reads
        torch.cuda.synchronize(device)
        resident = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    whole_s, found = _timed(whole_tensor, device, args.repeat)
    scratch_peak = torch.cuda.max_memory_allocated(device) - resident if device.type == "cuda" else None
    chunk_s, _ = _timed(per_chunk_baseline, device, args.repeat)
    changed = sum(len(c.positions) for per_tensor_found in found for c in per_tensor_found.values())

    # The device's fields are the host scan's, on the first, a middle and the last chunk.
    agree = True
    flat = [(a, s, e) for a, b in tensors for s, e in chunks_of(a, b)]
    for ti, s, e in (flat[0], flat[len(flat) // 2], flat[-1]):
        dev = found[[a for a, _ in tensors].index(ti)][s]
        n_np, o_np = (t[ti + s : ti + e].view(torch.int16).cpu().numpy().view(np.uint16) for t in (new, old))
        host = change_model.scan_changes(n_np, o_np, "bfloat16", 2, int((n_np != o_np).sum()))
        agree &= all(np.array_equal(getattr(dev, f), getattr(host, f)) for f in FIELDS)
        agree &= dev.class_base == host.class_base
    model_bytes = count * 2
    record = {
        "bench": "device_diff",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "slab_elements": diff.slab_elements(device),
        "model_gib": args.gib,
        "tensor_mib": args.tensor_mib,
        "tensors": len(tensors),
        "chunk_mib": args.chunk_mib,
        "chunks": len(flat),
        "changed_fraction": changed / count,
        "whole_tensor_seconds": whole_s,
        "whole_tensor_gb_per_s": model_bytes / min(whole_s) / 1e9,
        "per_chunk_seconds": chunk_s,
        "per_chunk_gb_per_s": model_bytes / min(chunk_s) / 1e9,
        "speedup": min(chunk_s) / min(whole_s),
        "whole_tensor_scratch_peak_bytes": scratch_peak,  # CUDA only: the peak above the resident models
        "host_bytes_device_path": changed * 5 * 8,  # position, class, rank, old and new bits: 8 bytes each
        "host_bytes_host_scan": 2 * model_bytes,
        "fields_equal_host_scan": bool(agree),
    }
    if args.publish:
        del found
        record["publish"] = _publish(bits, tensors, args.publish, args.changed, per_chunk * 2, gen)
    print(json.dumps(record, indent=2))


def _publish(
    bits: torch.Tensor,
    tensors: list[tuple[int, int]],
    steps: int,
    changed: float,
    chunk_bytes: int,
    gen: torch.Generator,
) -> dict:
    """Publishes the model in `bits` and `steps` next steps of it (moving `changed` of its
    elements by one ULP each time, in place, as a trainer's step does) through two publishers,
    with and without device_diff, taking turns so both see the same machine; per mode, the
    delta commits' seconds and stages."""
    from weightsync.publisher import Publisher, PublisherConfig
    from weightsync.stores import LocalStore

    weights = bits.view(torch.bfloat16)
    state = {f"layer{i}.weight": weights[a:b] for i, (a, b) in enumerate(tensors)}
    modes = {"device_diff": True, "host_scan": False}
    records: dict[str, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="ws-device-diff-") as scratch:
        publishers = {
            mode: Publisher(
                LocalStore(Path(scratch) / mode),
                model="bench-device-diff",
                config=PublisherConfig(chunk_bytes=chunk_bytes, device_diff=on),
            )
            for mode, on in modes.items()
        }
        try:
            for step in range(steps + 1):
                if step:
                    moved = torch.rand(bits.numel(), generator=gen, device=bits.device) < changed
                    bits[moved] += torch.where(
                        torch.rand(int(moved.sum()), generator=gen, device=bits.device) < 0.5, 1, -1
                    ).to(torch.int16)
                    del moved
                for mode, publisher in publishers.items():
                    result = publisher.publish(state).result()
                    records[mode].append(
                        {
                            "version": result.version,
                            "kind": result.manifest.kind,
                            "commit_s": result.total_s,
                            "snapshot_s": result.snapshot_s,
                            "encode_upload_s": result.encode_s,
                            "manifest_s": result.commit_s,
                            "stored_bytes": result.stored_bytes,
                        }
                    )
        finally:
            for publisher in publishers.values():
                publisher.close()
    out = {
        "stored_bytes_equal": [v["stored_bytes"] for v in records["device_diff"]]
        == [v["stored_bytes"] for v in records["host_scan"]]
    }  # the same chunks, found either way
    for mode, versions in records.items():
        deltas = [v for v in versions if v["kind"] == "delta"]
        out[mode] = {
            "versions": versions,
            "delta_commit_s_median": statistics.median(v["commit_s"] for v in deltas) if deltas else None,
        }
    return out


if __name__ == "__main__":
    main()
