"""device_diff: GB/s of codec ctx's device scan (`weightsync.diff.diff_chunk`) where the weights live.

A bf16 model of `--gib` GiB in `--chunk-mib` chunks, and its next step: `--changed` of the
elements moved by one ULP up or down (what lr 1e-6 does, FACTS.md). Times the diff of every chunk
against its parent on the device (CUDA when there is one, else CPU; `--device` to pick), the
changed elements' fields copied to the host included, and reports GB/s of bf16 model bytes. Then
checks, on a few chunks, that the device's fields equal the host scan's (`ctx_codec.scan_changes`)
and that the host copy would have had to move: the whole model twice (new and parent) for the
host scan, against the changed elements' bytes here.

    python -m bench.device_diff [--gib 1] [--chunk-mib 4] [--changed 0.013] [--device cuda]

Prints one JSON record. Not a test: it asserts no times.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from weightsync import ctx_codec
from weightsync.diff import diff_chunk
from weightsync.dtypes import dtype_by_name


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--chunk-mib", type=float, default=4.0)
    parser.add_argument("--changed", type=float, default=0.013)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    bf16 = dtype_by_name("bfloat16")
    count = int(args.gib * 2**30) // 2
    per_chunk = int(args.chunk_mib * 2**20) // 2
    gen = torch.Generator(device=device).manual_seed(0)
    old = (torch.randn(count, generator=gen, device=device) * 0.02).to(torch.bfloat16)
    bits = old.view(torch.int16).clone()
    moved = torch.rand(count, generator=gen, device=device) < args.changed
    step = torch.where(torch.rand(count, generator=gen, device=device) < 0.5, 1, -1).to(torch.int16)
    bits[moved] += step[moved]  # one ULP in magnitude, either way (sign-magnitude bits)
    new = bits.view(torch.bfloat16)
    ranges = [(s, min(s + per_chunk, count)) for s in range(0, count, per_chunk)]

    diff_chunk(new[: ranges[0][1]], old[: ranges[0][1]], bf16)  # warm-up (kernels, allocator)
    times, changed = [], 0
    for _ in range(args.repeat):
        _sync(device)
        t0 = time.perf_counter()
        changed = sum(len(diff_chunk(new[s:e], old[s:e], bf16).positions) for s, e in ranges)
        _sync(device)
        times.append(time.perf_counter() - t0)

    # The device's fields are the host scan's, on the first, a middle and the last chunk.
    agree = True
    for s, e in (ranges[0], ranges[len(ranges) // 2], ranges[-1]):
        dev = diff_chunk(new[s:e], old[s:e], bf16)
        n_np, o_np = (t[s:e].view(torch.int16).cpu().numpy().view(np.uint16) for t in (new, old))
        host = ctx_codec.scan_changes(n_np, o_np, "bfloat16", 2, int((n_np != o_np).sum()))
        agree &= all(np.array_equal(getattr(dev, f), getattr(host, f))
                     for f in ("positions", "classes", "ranks", "old_bits", "new_bits", "class_counts"))
        agree &= dev.class_base == host.class_base
    model_bytes = count * 2
    best = min(times)
    record = {
        "bench": "device_diff", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "model_gib": args.gib, "chunk_mib": args.chunk_mib, "chunks": len(ranges),
        "changed_fraction": changed / count, "seconds": times, "gb_per_s": model_bytes / best / 1e9,
        "host_bytes_device_path": changed * (8 * 3 + 8 * 2),  # positions, classes, ranks + old/new bits as int64
        "host_bytes_host_scan": 2 * model_bytes, "fields_equal_host_scan": bool(agree),
    }
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
