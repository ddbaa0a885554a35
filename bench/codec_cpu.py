"""codec_cpu: codecs rans/ctx against the codecs before them (sparse/xor), per core, in CPU time.

`bench.codec` measures wall-clock throughput, which a shared, loaded machine distorts; this
measures the CPU time of the calling thread (`time.thread_time`) to encode every chunk of a
checkpoint pair (`encode_chunk`) and to decode+apply every object (`apply_chunk`, hashes
included), one thread, best of 3, alternating the two configurations on the same bytes.

Then the same on 2 threads (chunk-parallel, as the publisher and the reader run them), in wall
time, best of 3, with `cpu_per_wall`: process CPU seconds per wall second, ~2 when both threads
really ran at once (the kernels release the GIL), lower on a loaded machine, where the 2-thread
wall figures mean little (compare `load_avg_*`).
Prints one JSON record. Run from the repository root: `python -m bench.codec_cpu`.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import time
from pathlib import Path

import torch

from bench.checkpoints import CheckpointConfig, make_checkpoint_series
from weightsync.format.chunk import apply_chunk, encode_chunk
from weightsync.format.codecs import CODEC_SPARSE
from weightsync.format.codecs.choice import CodecChoice
from weightsync.format.dtypes import dtype_by_name

ROOT = Path(__file__).resolve().parent.parent
CHUNK_BYTES = 4 << 20


def main() -> None:
    series = make_checkpoint_series(CheckpointConfig(lrs=(1e-6, 3e-6)), cache_dir=ROOT / "bench" / ".cache")
    bf16 = dtype_by_name("bfloat16")
    record: dict = {"bench": "codec_cpu", "load_avg_before": os.getloadavg()}
    for lr, states in series.items():
        old_sd, new_sd = states[0], states[1]
        items = []
        for name in old_sd:
            o = old_sd[name].reshape(-1).view(torch.uint8).numpy()
            x = new_sd[name].reshape(-1).view(torch.uint8).numpy()
            items += [(o[i : i + CHUNK_BYTES], x[i : i + CHUNK_BYTES]) for i in range(0, len(o), CHUNK_BYTES)]
        raw = sum(len(x) for _, x in items)
        for label, choice in (("rans/ctx", CodecChoice()), ("sparse/xor", CodecChoice(highest_codec=CODEC_SPARSE))):
            encode_s = decode_s = float("inf")
            for _ in range(3):
                t = time.thread_time()
                objects = [encode_chunk(x, o, bf16, 1, choice=choice) for o, x in items]
                encode_s = min(encode_s, time.thread_time() - t)
                buffers = [o.copy() for o, _ in items]
                t = time.thread_time()
                for (codec_id, raw_hex, obj, _), buf in zip(objects, buffers, strict=True):
                    if obj is not None:
                        apply_chunk(obj, buf, bf16, raw_hex, codec_id)
                decode_s = min(decode_s, time.thread_time() - t)
            record[f"{lr:g} {label}"] = {
                "encode_GBps_per_core": raw / encode_s / 1e9,
                "decode_apply_GBps_per_core": raw / decode_s / 1e9,
                **_two_threads(items, objects, raw, choice),
            }
    record["load_avg_after"] = os.getloadavg()
    print(json.dumps(record, indent=1))


def _two_threads(items: list, objects: list, raw: int, choice: CodecChoice) -> dict:
    """Encode and decode+apply of every chunk on a pool of 2 threads: wall GB/s and CPU per wall."""
    bf16 = dtype_by_name("bfloat16")
    out = {}
    with cf.ThreadPoolExecutor(2) as pool:
        for what in ("encode", "decode_apply"):
            best_wall, cpu_per_wall = float("inf"), 0.0
            for _ in range(3):
                if what == "encode":
                    work, args = (lambda item: encode_chunk(item[1], item[0], bf16, 1, choice=choice)), items
                else:
                    buffers = [o.copy() for o, _ in items]

                    def work(pair):
                        (codec_id, raw_hex, obj, _), buf = pair
                        if obj is not None:
                            apply_chunk(obj, buf, bf16, raw_hex, codec_id)

                    args = list(zip(objects, buffers, strict=True))
                cpu, wall = time.process_time(), time.perf_counter()
                list(pool.map(work, args))
                wall = time.perf_counter() - wall
                if wall < best_wall:
                    best_wall, cpu_per_wall = wall, (time.process_time() - cpu) / wall
            out[f"{what}_GBps_2_threads_wall"] = raw / best_wall / 1e9
            out[f"{what}_2_threads_cpu_per_wall"] = cpu_per_wall
    return out


if __name__ == "__main__":
    main()
