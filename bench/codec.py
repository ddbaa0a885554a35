"""codec benchmark: our delta format against what users would otherwise use, same bytes, same run.

For each lr (1e-6, 3e-6, 1e-5) it takes successive bf16 checkpoints of a small Llama-like model
trained with AdamW on fp32 master weights (`bench/checkpoints.py`) and, for every consecutive
pair, reports:

- the changed fraction and the order-0 entropy bound 16/H0 of the XOR symbols;
- our ratio: raw model bytes over what a delta version stores (chunk objects + manifest),
  measured by publishing the pair through `Publisher` into a local store, its ratio to the
  bound, and the stored bits per changed element;
- the same for the previous codecs alone (`sparse`/`xor`, codec ctx off), in the same run;
- the device diff (`weightsync.format.codecs.diff`, codec ctx's per-element pass in torch) on CPU tensors;
- codec throughput on 1 and 2 threads: encode (XOR, scan, zstd, hashes) and decode+apply
  (object hash, decode, XOR into the parent, raw hash; unchanged ranges hashed too), per byte of
  bf16 model;
- end-to-end `Publisher.publish` and `Reader.advance` throughput on a store in /dev/shm;
- baselines on the same pair: zstd of the full checkpoint, zipnn full and delta, xdelta3 and
  `zstd --patch-from` (installed on demand; skipped with a note if they cannot be).

Prints one JSON record to stdout and writes it, with a markdown table, to bench/results/.
Run from the repository root: `python -m bench.codec [--quick]`. Not a test: it asserts no times.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.baselines import checkpoint_bytes, checkpoint_u16, ensure_tools, entropy_bound, run_baselines
from bench.checkpoints import CheckpointConfig, make_checkpoint_series, pair_stats
from bench.output import write_results
from harness.machine import describe_machine
from weightsync import __version__
from weightsync.format import codecs
from weightsync.format.chunk import apply_chunk, encode_chunk, object_hash
from weightsync.format.codecs import DEFAULT_ZSTD_LEVEL
from weightsync.format.codecs.choice import CodecChoice
from weightsync.format.codecs.diff import diff_ranges
from weightsync.format.hashing import xxh3_hex
from weightsync.format.tensors import Snapshot, take_snapshot, to_tensor
from weightsync.format.write_format import WriteFormat
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.reader import Reader
from weightsync.stores import LocalStore

log = logging.getLogger("bench.codec")
ROOT = Path(__file__).resolve().parent.parent
CHUNK_BYTES = PublisherConfig().chunk_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    repeats: int = 3
    """Timed repetitions per measurement; the median is reported."""
    threads: tuple[int, ...] = (1, 2)
    baseline_pairs: int = 1
    """Pairs per lr that also run the (slow) external baselines."""
    patch_levels: tuple[int, ...] = (3, 19)
    """zstd --patch-from levels; 19 is what its docs recommend and takes ~80 s per pair here."""
    zstd_level: int = DEFAULT_ZSTD_LEVEL


# ------------------------------------------------------------------------------- our codec


def _chunks(snapshot: Snapshot) -> list[tuple[str, int, int]]:
    out = []
    for name, t in snapshot.items():
        per_chunk = CHUNK_BYTES // t.dtype.itemsize
        count = t.nbytes // t.dtype.itemsize
        out += [(name, s, min(s + per_chunk, count)) for s in range(0, count, per_chunk)]
    return out


def _encode_all(
    new: Snapshot, old: Snapshot | None, threads: int, level: int, choice: CodecChoice | None = None
) -> list[tuple]:
    """Every chunk of `new` encoded against `old` (full chunks when old is None), delta codecs
    chosen under `choice` (default: any)."""

    def one(item):
        name, start, stop = item
        t = new[name]
        size = t.dtype.itemsize
        parent = None if old is None else old[name].data[start * size : stop * size]
        codec_id, raw, obj, _ = encode_chunk(t.data[start * size : stop * size], parent, t.dtype, level, choice=choice)
        return name, start, stop, codec_id, raw, obj, None if obj is None else object_hash(obj)

    with cf.ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, _chunks(new)))


def _decode_all(encoded: list[tuple], buffers: dict[str, np.ndarray], new: Snapshot, threads: int) -> None:
    def one(item):
        name, start, stop, codec_id, raw, obj, obj_hash = item
        size = new[name].dtype.itemsize
        out = buffers[name][start * size : stop * size]
        if obj is None:  # unchanged: a reader still verifies the range
            if xxh3_hex(out) != raw:
                raise AssertionError("unchanged range differs")
            return
        if object_hash(obj) != obj_hash:
            raise AssertionError("object hash")
        apply_chunk(obj, out, new[name].dtype, raw, codec_id)

    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, encoded))


def _median_time(fn, repeats: int, setup=None) -> float:
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_ours(old_sd: dict, new_sd: dict, config: BenchConfig, *, ctx: bool = True, rans: bool = True) -> dict:
    """Ratio and throughput of the codecs as the publisher chooses them, for comparison in the same
    run: `ctx=False`, the codecs before codec ctx (sparse/xor); `rans=False`, before codec rans."""
    highest = codecs.CODEC_SPARSE if not ctx else codecs.CODEC_CTX if not rans else codecs.CODEC_RANS
    return _measure_ours(old_sd, new_sd, config, WriteFormat(highest_codec=highest))


def _measure_ours(old_sd: dict, new_sd: dict, config: BenchConfig, write_format: WriteFormat) -> dict:
    choice = CodecChoice(highest_codec=write_format.highest_codec)
    old, new = take_snapshot(old_sd), take_snapshot(new_sd)
    raw_bytes = sum(t.nbytes for t in new.values())
    result: dict = {"raw_bytes": raw_bytes}

    # Ratio: what the store really holds for the delta version (objects + manifest).
    with tempfile.TemporaryDirectory(dir=_fast_tmp()) as tmp:
        store = LocalStore(tmp, fsync=False)
        pconf = PublisherConfig(zstd_level=config.zstd_level, parent_from_store=False, write_format=write_format)
        with Publisher(store, model="bench", config=pconf) as publisher:
            full = publisher.publish(old_sd).result()
            delta = publisher.publish(new_sd).result()
        codecs: dict[str, int] = {}
        for t in delta.manifest.tensors:
            for c in t.chunks:
                codecs[c.codec] = codecs.get(c.codec, 0) + 1
        result.update(
            stored_bytes=delta.stored_bytes,
            manifest_bytes=delta.manifest_bytes,
            ratio=delta.ratio,
            bits_per_changed=8 * (delta.stored_bytes + delta.manifest_bytes) / max(1, delta.changed_elements),
            chunk_codecs=codecs,
            full_ratio=full.ratio,
        )

    encoded = _encode_all(new, old, 1, config.zstd_level, choice)
    buffers = {name: np.empty_like(t.data) for name, t in old.items()}

    def reset():
        for name, t in old.items():
            np.copyto(buffers[name], t.data)

    for threads in config.threads:
        enc_s = _median_time(lambda t=threads: _encode_all(new, old, t, config.zstd_level, choice), config.repeats)
        dec_s = _median_time(lambda t=threads: _decode_all(encoded, buffers, new, t), config.repeats, setup=reset)
        for name, t in new.items():  # the decode really rebuilt the new checkpoint
            if not np.array_equal(buffers[name], t.data):
                raise AssertionError(f"decode of {name} is not bit-exact")
        result[f"encode_GBps_{threads}t"] = raw_bytes / enc_s / 1e9
        result[f"decode_apply_GBps_{threads}t"] = raw_bytes / dec_s / 1e9
        result.update(_measure_end_to_end(old_sd, new_sd, threads, config, raw_bytes, write_format))
        # Full versions (the first one, and every rebase): no parent.
        full_s = _median_time(lambda t=threads: _encode_all(new, None, t, config.zstd_level), config.repeats)
        full = _encode_all(new, None, threads, config.zstd_level)
        full_dec_s = _median_time(lambda t=threads, f=full: _decode_all(f, buffers, new, t), config.repeats)
        result[f"full_encode_GBps_{threads}t"] = raw_bytes / full_s / 1e9
        result[f"full_decode_GBps_{threads}t"] = raw_bytes / full_dec_s / 1e9
    return result


def measure_device_diff(old: Snapshot, new: Snapshot, repeats: int) -> dict:
    """`weightsync.format.codecs.diff.diff_ranges` over every tensor (its chunks together, as the publisher's
    device_diff does), on CPU tensors, 1 thread (`bench.device_diff` measures it on a GPU). GB/s
    of bf16 model bytes; also checks its payloads decode to the new bytes."""
    items = _chunks(new)
    raw_bytes = sum(t.nbytes for t in new.values())
    ranges: dict[str, list[tuple[int, int]]] = {}
    for name, start, stop in items:
        ranges.setdefault(name, []).append((start, stop))

    def views(name, start, stop):
        t, size = new[name], new[name].dtype.itemsize
        a = to_tensor(t.data[start * size : stop * size], t.dtype, (stop - start,))
        b = to_tensor(old[name].data[start * size : stop * size], t.dtype, (stop - start,))
        return a, b, t.dtype

    def run():
        found = {}
        for name, chunks in ranges.items():
            new_t, old_t, dtype = views(name, 0, chunks[-1][1])
            found.update({(name, start): c for start, c in diff_ranges(new_t, old_t, chunks, dtype).items()})
        return [found[name, start] for name, start, _ in items]

    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = _median_time(run, repeats)
    finally:
        torch.set_num_threads(torch_threads)
    for item, changes in zip(items, run(), strict=True):  # identical to what the host path encodes
        a, b, dtype = views(*item)
        codec_id, raw, obj, _ = encode_chunk(
            a.reshape(-1).view(torch.uint8).numpy(), b.reshape(-1).view(torch.uint8).numpy(), dtype, 1, changes=changes
        )
        if obj is not None:
            out = b.clone()
            apply_chunk(obj, out.reshape(-1).view(torch.uint8).numpy(), dtype, raw, codec_id)
            if not torch.equal(out.view(torch.uint8), a.view(torch.uint8)):
                raise AssertionError(f"device diff of {item} does not round-trip")
    return {"device_diff_cpu_GBps_1t": raw_bytes / seconds / 1e9}


def _measure_end_to_end(
    old_sd: dict, new_sd: dict, threads: int, config: BenchConfig, raw_bytes: int, write_format: WriteFormat
) -> dict:
    """Publisher (snapshot + encode + write) and Reader.advance on a store in memory."""
    publish_s, encode_s, advance_s = [], [], []
    for _ in range(config.repeats):
        with tempfile.TemporaryDirectory(dir=_fast_tmp()) as tmp:
            store = LocalStore(tmp, fsync=False)
            pconf = PublisherConfig(
                workers=threads, zstd_level=config.zstd_level, parent_from_store=False, write_format=write_format
            )
            with Publisher(store, model="bench", config=pconf) as publisher:
                publisher.publish(old_sd).result()
                r = publisher.publish(new_sd).result()
            publish_s.append(r.total_s)
            encode_s.append(r.encode_s)
            reader = Reader(store, model="bench", workers=threads)
            state = reader.read(1)
            t0 = time.perf_counter()
            reader.advance(state, 2)
            advance_s.append(time.perf_counter() - t0)
    return {
        f"publish_GBps_{threads}t": raw_bytes / statistics.median(publish_s) / 1e9,
        f"publish_encode_upload_GBps_{threads}t": raw_bytes / statistics.median(encode_s) / 1e9,
        f"reader_advance_GBps_{threads}t": raw_bytes / statistics.median(advance_s) / 1e9,
    }


def _fast_tmp() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


# ----------------------------------------------------------------------------------- driver


def run(config: BenchConfig, checkpoints: CheckpointConfig, cache_dir: Path) -> dict:
    load_before = os.getloadavg()
    tools = ensure_tools()
    t0 = time.perf_counter()
    series = make_checkpoint_series(checkpoints, cache_dir=cache_dir)
    series_s = time.perf_counter() - t0
    pairs = []
    for lr, states in series.items():
        for i in range(len(states) - 1):
            old_sd, new_sd = states[i], states[i + 1]
            stats = pair_stats(old_sd, new_sd)
            bound = entropy_bound(checkpoint_u16(old_sd), checkpoint_u16(new_sd))
            log.info("lr %g pair %d: %.2f %% changed, bound %.1fx", lr, i, 100 * stats.changed_fraction, bound)
            ours = measure_ours(old_sd, new_sd, config)
            ours.update(measure_device_diff(take_snapshot(old_sd), take_snapshot(new_sd), config.repeats))
            v1 = measure_ours(old_sd, new_sd, dataclasses.replace(config, threads=(2,)), ctx=False)
            ctx_only = measure_ours(old_sd, new_sd, dataclasses.replace(config, threads=(2,)), rans=False)
            log.info(
                "lr %g pair %d: ratio %.1fx (%.2f of the bound), codecs before ctx %.1fx",
                lr,
                i,
                ours["ratio"],
                ours["ratio"] / bound,
                v1["ratio"],
            )
            record = {
                "lr": lr,
                "pair": i,
                "changed_fraction": stats.changed_fraction,
                "one_ulp_fraction": stats.one_ulp_fraction,
                "entropy_bound": bound,
                "ours": ours,
                "ours_vs_bound": ours["ratio"] / bound,
                "v1": {
                    k: v
                    for k, v in v1.items()
                    if k in ("ratio", "bits_per_changed", "chunk_codecs") or k.endswith("_2t")
                },
                "v1_vs_bound": v1["ratio"] / bound,
                "ctx_only": {
                    k: v
                    for k, v in ctx_only.items()
                    if k in ("ratio", "bits_per_changed", "chunk_codecs") or k.endswith("_2t")
                },
                "ctx_only_vs_bound": ctx_only["ratio"] / bound,
            }
            if i < config.baseline_pairs:
                results, skipped = run_baselines(
                    checkpoint_bytes(old_sd),
                    checkpoint_bytes(new_sd),
                    tools=tools,
                    patch_levels=config.patch_levels,
                    zstd_level=3,  # stock zstd, as users run it
                )
                record["baselines"] = [r.as_dict() for r in results]
                record["skipped"] = skipped
                xdelta = [r for r in results if r.name.startswith("xdelta3")]
                if xdelta:
                    record["ours_vs_xdelta3"] = ours["ratio"] / max(r.ratio for r in xdelta)
            pairs.append(record)
    return {
        "bench": "codec",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {**dataclasses.asdict(config), "chunk_bytes": CHUNK_BYTES},
        "checkpoints": {
            **dataclasses.asdict(checkpoints),
            "parameters": sum(t.numel() for t in next(iter(series.values()))[0].values()),
        },
        "versions": _versions(),
        "hardware": describe_machine(),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "series_s": series_s,
        "tools": tools,
        "pairs": pairs,
        "summary": _summary(pairs),
    }


def _summary(pairs: list[dict]) -> dict:
    by_lr: dict[str, dict] = {}
    for lr in sorted({p["lr"] for p in pairs}):
        rows = [p for p in pairs if p["lr"] == lr]
        keys = [k for k in rows[0]["ours"] if k.endswith("t") and "GBps" in k]
        entry = {
            "changed_fraction": statistics.mean(p["changed_fraction"] for p in rows),
            "entropy_bound": statistics.mean(p["entropy_bound"] for p in rows),
            "ratio": statistics.mean(p["ours"]["ratio"] for p in rows),
            "ratio_vs_bound": statistics.mean(p["ours_vs_bound"] for p in rows),
            "min_ratio_vs_bound": min(p["ours_vs_bound"] for p in rows),
            "bits_per_changed": statistics.mean(p["ours"]["bits_per_changed"] for p in rows),
            "v1_ratio": statistics.mean(p["v1"]["ratio"] for p in rows),
            "v1_ratio_vs_bound": statistics.mean(p["v1_vs_bound"] for p in rows),
            "v1_bits_per_changed": statistics.mean(p["v1"]["bits_per_changed"] for p in rows),
            **{f"v1_{k}": statistics.mean(p["v1"][k] for p in rows) for k in rows[0]["v1"] if k.endswith("_2t")},
            "ctx_only_ratio_vs_bound": statistics.mean(p["ctx_only_vs_bound"] for p in rows),
            **{
                f"ctx_only_{k}": statistics.mean(p["ctx_only"][k] for p in rows)
                for k in rows[0]["ctx_only"]
                if k.endswith("_2t")
            },
            **{k: statistics.mean(p["ours"][k] for p in rows) for k in keys},
        }
        with_x = [p["ours_vs_xdelta3"] for p in rows if "ours_vs_xdelta3" in p]
        if with_x:
            entry["ratio_vs_xdelta3"] = statistics.mean(with_x)
        by_lr[f"{lr:g}"] = entry
    return by_lr


def _versions() -> dict:
    import xxhash
    import zstandard

    return {
        "weightsync": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "zstandard": zstandard.__version__,
        "xxhash": xxhash.VERSION,
    }


def markdown(record: dict) -> str:
    s = record["summary"]
    hw = record["hardware"]
    lines = [
        f"# codec benchmark — {record['date']}",
        "",
        f"{hw['cores']} cores ({hw['cpu']}), load avg before {record['load_avg_before'][0]:.2f}, "
        f"after {record['load_avg_after'][0]:.2f}; model {record['checkpoints']['parameters'] / 1e6:.1f}M params bf16, "
        f"chunks {record['config']['chunk_bytes'] >> 20} MiB, zstd level {record['config']['zstd_level']}.",
        "",
        "## Ours, mean over the per-step pairs of each lr",
        "",
        "Ratio counts chunk objects (headers included) and the manifest. *Bound*: the order-0 entropy "
        "bound 16/H0 of the XOR symbols. *Before ctx*: the same publisher with codec ctx off (sparse/xor).",
        "",
        "| lr | changed | entropy bound | our ratio | ratio / bound (min) | bits / changed | before ctx: ratio, / bound, bits / changed | ratio / xdelta3 | encode 1t | encode 2t | decode+apply 1t | decode+apply 2t | publish 2t | reader 2t | device diff on CPU, 1t |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lr, e in s.items():
        lines.append(
            f"| {lr} | {100 * e['changed_fraction']:.2f} % | {e['entropy_bound']:.1f}x | {e['ratio']:.1f}x | "
            f"{e['ratio_vs_bound']:.2f} ({e['min_ratio_vs_bound']:.2f}) | {e['bits_per_changed']:.2f} | "
            f"{e['v1_ratio']:.1f}x, {e['v1_ratio_vs_bound']:.2f}, {e['v1_bits_per_changed']:.2f} | "
            f"{e.get('ratio_vs_xdelta3', float('nan')):.1f} | "
            f"{e.get('encode_GBps_1t', 0):.2f} GB/s | {e.get('encode_GBps_2t', 0):.2f} GB/s | "
            f"{e.get('decode_apply_GBps_1t', 0):.2f} GB/s | {e.get('decode_apply_GBps_2t', 0):.2f} GB/s | "
            f"{e.get('publish_GBps_2t', 0):.2f} GB/s | {e.get('reader_advance_GBps_2t', 0):.2f} GB/s | "
            f"{e.get('device_diff_cpu_GBps_1t', 0):.2f} GB/s |"
        )
    lines += [
        "",
        "Before ctx (sparse/xor only), 2 threads: "
        + "; ".join(
            f"lr {lr}: encode {e.get('v1_encode_GBps_2t', 0):.2f} GB/s, decode+apply "
            f"{e.get('v1_decode_apply_GBps_2t', 0):.2f} GB/s"
            for lr, e in s.items()
        )
        + ".",
    ]
    lines += [
        "",
        "Before rans (ctx where it applies, as the last release wrote), 2 threads: "
        + "; ".join(
            f"lr {lr}: ratio / bound {e.get('ctx_only_ratio_vs_bound', 0):.2f}, encode "
            f"{e.get('ctx_only_encode_GBps_2t', 0):.2f} GB/s, decode+apply {e.get('ctx_only_decode_apply_GBps_2t', 0):.2f}"
            " GB/s"
            for lr, e in s.items()
        )
        + ".",
    ]
    first = record["pairs"][0]["ours"]
    lines += [
        "",
        f"Full versions (first version and rebases): ratio {first['full_ratio']:.2f}x, encode "
        f"{first.get('full_encode_GBps_1t', 0):.2f} / {first.get('full_encode_GBps_2t', 0):.2f} GB/s, "
        f"decode {first.get('full_decode_GBps_1t', 0):.2f} / {first.get('full_decode_GBps_2t', 0):.2f} GB/s "
        "on 1 / 2 threads.",
    ]
    lines += [
        "",
        "## Baselines on the same pairs (first pair of each lr)",
        "",
        "| lr | tool | ratio | encode s | decode s |",
        "|---|---|---|---|---|",
    ]
    for p in record["pairs"]:
        if "baselines" not in p:
            continue
        lines.append(
            f"| {p['lr']:g} | **weightsync (rans/ctx)** | **{p['ours']['ratio']:.1f}x** | "
            f"{p['ours']['raw_bytes'] / 1e9 / p['ours']['encode_GBps_1t']:.3f} (1t) | "
            f"{p['ours']['raw_bytes'] / 1e9 / p['ours']['decode_apply_GBps_1t']:.3f} (1t) |"
        )
        lines.append(
            f"| {p['lr']:g} | weightsync before rans (ctx) | {p['ctx_only']['ratio']:.1f}x | "
            f"{p['ours']['raw_bytes'] / 1e9 / p['ctx_only']['encode_GBps_2t']:.3f} (2t) | "
            f"{p['ours']['raw_bytes'] / 1e9 / p['ctx_only']['decode_apply_GBps_2t']:.3f} (2t) |"
        )
        lines.append(
            f"| {p['lr']:g} | weightsync before ctx (sparse/xor) | {p['v1']['ratio']:.1f}x | "
            f"{p['ours']['raw_bytes'] / 1e9 / p['v1']['encode_GBps_2t']:.3f} (2t) | "
            f"{p['ours']['raw_bytes'] / 1e9 / p['v1']['decode_apply_GBps_2t']:.3f} (2t) |"
        )
        for b in p["baselines"]:
            lines.append(
                f"| {p['lr']:g} | {b['name']} | {b['ratio']:.2f}x | {b['encode_s']:.3f} | {b['decode_s']:.3f} |"
            )
        for note in p.get("skipped", []):
            lines.append(f"| {p['lr']:g} | {note} | | | |")
    lines += [
        "",
        "Throughput is raw bf16 model bytes per second. Ratio is raw bytes over stored bytes "
        "(chunk objects + manifest for ours). Reproduce: `python -m bench.codec`.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="skip zstd --patch-from -19 (80 s a pair) and repeat once")
    parser.add_argument("--cache-dir", default=str(ROOT / "bench" / ".cache"), help="checkpoint series cache")
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--steps-per-lr", type=int, default=CheckpointConfig().steps_per_lr)
    parser.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=list(CheckpointConfig().lrs),
        help="learning rates of the series (the cache key includes them)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    config = BenchConfig(repeats=1, patch_levels=(3,)) if args.quick else BenchConfig()
    record = run(config, CheckpointConfig(steps_per_lr=args.steps_per_lr, lrs=tuple(args.lrs)), Path(args.cache_dir))
    stem = f"codec-{record['hardware']['cores']}cpu-{record['hardware']['machine']}-{record['date'][:10]}"
    write_results(Path(args.out_dir) / stem, record, markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
