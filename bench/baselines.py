"""baselines: what a user would otherwise use to ship a new checkpoint, measured on the same bytes.

Every baseline takes raw checkpoint bytes and returns a `BaselineResult` (size, ratio, encode and
decode wall time), after checking that decoding gives back the input byte for byte:

- `zstd_full`: the whole new checkpoint through zstd (python `zstandard`); no delta at all.
- `zipnn_full` / `zipnn_delta`: the `zipnn` package (byte grouping + entropy coding tuned for
  bf16), on the new checkpoint alone and in its delta mode against the old one.
- `xdelta3_delta`: the `xdelta3` CLI (VCDIFF) with the old checkpoint as source.
- `zstd_patch_from`: the `zstd` CLI's `--patch-from=OLD` diff mode.
- `entropy_bound`: not a tool but the yardstick: 16 / H0 of the per-element XOR symbols, the best
  ratio any coder that treats XOR symbols independently (order-0) can reach.

**Input bytes.** `checkpoint_bytes(state_dict)` is the concatenation of each tensor's raw bf16
bytes in the dict's order (for `bench.checkpoints`, the model's HF parameter order), with no
header. We chose headerless bytes over a safetensors file so that every baseline sees exactly the
weights (a header would add the same few KiB to each) and so that 2-byte elements stay 2-byte
aligned, which zipnn's byte grouping assumes.

The CLI baselines write `old`/`new` to temp files first (not timed) and time the subprocess, so
their times include process start-up and file I/O from the page cache, as a user would see.

Not here: weightsync's own codec (`weightsync.format.codecs`), the benchmark driver and report, and any
checkpoint generation (`bench/checkpoints.py`). `ensure_tools` may run `apt-get`/`pip`; nothing
else here installs anything.

Run `python -m bench.baselines` from the repository root for a smoke run on the default
checkpoint series.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
import xxhash
import zstandard

logger = logging.getLogger(__name__)

TOOLS = ("zstd", "xdelta3", "zipnn")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BaselineResult:
    """One baseline on one checkpoint pair; `dataclasses.asdict` gives the report's dict."""

    name: str  # tool and settings, e.g. "zstd-patch-from-19"
    raw_bytes: int  # len(new)
    bytes: int  # encoded size
    ratio: float  # raw_bytes / bytes
    encode_s: float
    decode_s: float

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _result(name: str, raw: int, size: int, encode_s: float, decode_s: float) -> BaselineResult:
    return BaselineResult(
        name=name,
        raw_bytes=raw,
        bytes=size,
        ratio=raw / size if size else math.inf,
        encode_s=encode_s,
        decode_s=decode_s,
    )


def _check_roundtrip(name: str, decoded: bytes | bytearray | memoryview, expected: bytes) -> None:
    # A baseline that does not round-trip is a broken measurement, never a result to report.
    if len(decoded) != len(expected) or bytes(decoded) != expected:
        raise AssertionError(f"{name}: decoded output differs from the input ({len(decoded)} vs {len(expected)} bytes)")


# --------------------------------------------------------------------------------------------
# Input bytes
# --------------------------------------------------------------------------------------------


def checkpoint_bytes(state_dict: Mapping[str, torch.Tensor]) -> bytes:
    """Raw bytes of every tensor, concatenated in dict order, no header (see module docstring)."""
    parts = []
    for t in state_dict.values():
        t = t.detach().contiguous().cpu()
        # view as uint8 handles every dtype, including bf16 which numpy has no type for.
        parts.append(t.view(-1).view(torch.uint8).numpy().tobytes())
    return b"".join(parts)


def checkpoint_u16(state_dict: Mapping[str, torch.Tensor]) -> np.ndarray:
    """Bit patterns of a 2-byte-dtype checkpoint as one uint16 array, in dict order."""
    return np.frombuffer(checkpoint_bytes(state_dict), dtype=np.uint16)


# --------------------------------------------------------------------------------------------
# Entropy bound
# --------------------------------------------------------------------------------------------


def entropy_bound(old_u16: np.ndarray, new_u16: np.ndarray) -> float:
    """Order-0 entropy bound on the ratio: itemsize bits / H0 of the XOR symbols.

    The XOR of each element's bit patterns is one symbol; H0 is the empirical entropy of the
    symbol histogram (all 2**bits symbols, 0 included), in bits per symbol. Works for any
    unsigned or signed integer dtype (uint16 for bf16; uint8/uint32/uint64 too). Returns inf when
    every symbol is equal (H0 == 0, e.g. identical checkpoints).
    """
    old = np.asarray(old_u16)
    new = np.asarray(new_u16)
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"shape/dtype mismatch: {old.shape} {old.dtype} vs {new.shape} {new.dtype}")
    if old.dtype.kind not in "ui":
        raise TypeError(f"expected integer bit patterns, got {old.dtype}")
    unsigned = np.dtype(f"u{old.dtype.itemsize}")
    xor = np.bitwise_xor(old.view(unsigned), new.view(unsigned)).ravel()
    if xor.size == 0:
        return math.inf
    if old.dtype.itemsize <= 2:
        counts = np.bincount(xor, minlength=1 << (8 * old.dtype.itemsize))
    else:
        counts = np.unique(xor, return_counts=True)[1]
    p = counts[counts > 0].astype(np.float64) / xor.size
    h0 = float(-(p * np.log2(p)).sum())
    # Rounding can leave a tiny positive (or -0.0) H0 for a single-symbol histogram.
    if h0 <= 1e-12:
        return math.inf
    return 8 * old.dtype.itemsize / h0


# --------------------------------------------------------------------------------------------
# In-process baselines
# --------------------------------------------------------------------------------------------


def zstd_full(new: bytes, level: int = 3, *, threads: int = 0) -> BaselineResult:
    """zstd of the full new checkpoint (python `zstandard`); `threads=0` is single-threaded."""
    cctx = zstandard.ZstdCompressor(level=level, threads=threads)
    t0 = time.perf_counter()
    blob = cctx.compress(new)
    t1 = time.perf_counter()
    # Frames from compress() carry the content size, so decompress() needs no max_output_size.
    out = zstandard.ZstdDecompressor().decompress(blob)
    t2 = time.perf_counter()
    _check_roundtrip("zstd_full", out, new)
    return _result(f"zstd-full-{level}", len(new), len(blob), t1 - t0, t2 - t1)


def _zipnn():
    import zipnn  # imported lazily: optional dependency (extra "bench")

    return zipnn


def zipnn_full(new: bytes, *, threads: int = 0) -> BaselineResult:
    """zipnn on the new checkpoint alone (bf16 byte grouping + its entropy coder, method AUTO).

    `threads=0` lets zipnn choose (it uses min(cpu count, 16)).
    """
    zipnn = _zipnn()
    codec = zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=threads)
    # zipnn 0.5.4's C core reorders the bits of its input buffer in place, even of an immutable
    # `bytes` object; hand it a private copy (untimed) so `new` stays intact for the check and
    # for the other baselines.
    scratch = bytearray(new)
    t0 = time.perf_counter()
    blob = codec.compress(scratch)
    t1 = time.perf_counter()
    size = len(blob)
    out = zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=threads).decompress(blob)
    t2 = time.perf_counter()
    _check_roundtrip("zipnn_full", out, new)
    return _result("zipnn-full", len(new), size, t1 - t0, t2 - t1)


def zipnn_delta(old: bytes, new: bytes, *, threads: int = 0) -> BaselineResult:
    """zipnn's own delta mode: `ZipNN(delta_compressed_type="byte")`, `compress(new, delta_second_data=old)`.

    In zipnn 0.5.x that mode XORs the two byte buffers (numpy) and compresses the XOR with the
    same bf16 pipeline as `zipnn_full` (byte grouping, then Huffman/zstd per 256 KiB chunk);
    decompression decodes and XORs with `old` again. Its constructor docstring still says "NOT
    IMPLEMENTED YET", but compress()/decompress() implement exactly this (read from the installed
    source), and the changelog lists "Delta compression support in python -> save Xor between two
    models and compress them". The XOR is inside the timed region, as it is part of the tool.
    """
    if len(old) != len(new):
        raise ValueError("zipnn's delta mode needs equal-length inputs")
    zipnn = _zipnn()

    def make():
        return zipnn.ZipNN(
            input_format="byte", bytearray_dtype="bfloat16", delta_compressed_type="byte", threads=threads
        )

    # Private copies for the same in-place reason as in zipnn_full (delta mode XORs into a new
    # buffer first, but we do not rely on that).
    new_copy, old_copy = bytearray(new), bytearray(old)
    t0 = time.perf_counter()
    blob = make().compress(new_copy, delta_second_data=old_copy)
    t1 = time.perf_counter()
    size = len(blob)
    out = make().decompress(blob, delta_second_data=old_copy)
    t2 = time.perf_counter()
    _check_roundtrip("zipnn_delta", out, new)
    return _result("zipnn-delta", len(new), size, t1 - t0, t2 - t1)


# --------------------------------------------------------------------------------------------
# CLI baselines
# --------------------------------------------------------------------------------------------


def _run_timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.decode(errors='replace')[-2000:]}"
        )
    return elapsed


def _cli_delta(
    name: str,
    old: bytes,
    new: bytes,
    encode_argv: Callable[[Path, Path, Path], list[str]],
    decode_argv: Callable[[Path, Path, Path], list[str]],
    tmp_dir: str | os.PathLike[str] | None,
) -> BaselineResult:
    with tempfile.TemporaryDirectory(prefix="ws-bench-", dir=tmp_dir) as d:
        old_p, new_p, patch_p, out_p = (Path(d) / n for n in ("old.bin", "new.bin", "patch", "decoded.bin"))
        old_p.write_bytes(old)
        new_p.write_bytes(new)
        encode_s = _run_timed(encode_argv(old_p, new_p, patch_p))
        decode_s = _run_timed(decode_argv(old_p, patch_p, out_p))
        _check_roundtrip(name, out_p.read_bytes(), new)
        return _result(name, len(new), patch_p.stat().st_size, encode_s, decode_s)


def xdelta3_delta(
    old: bytes,
    new: bytes,
    *,
    level: int = 9,
    secondary: str | None = None,
    tmp_dir: str | os.PathLike[str] | None = None,
) -> BaselineResult:
    """`xdelta3 -e -s OLD NEW PATCH` / `xdelta3 -d -s OLD PATCH OUT`, level 0-9 (9 = best).

    The source window (`-B`) is raised to cover the whole old file (xdelta3's default is 64 MiB),
    so large checkpoints are matched against all of `old`. `secondary` is `-S` (None: xdelta3's
    default; "lzma", "djw", "fgk" or "none").
    """
    if not 0 <= level <= 9:
        raise ValueError("xdelta3 levels are 0-9")
    # xdelta3 wants a power-of-two source window; it refuses more than 2 GiB.
    src_win = 1 << max(24, (max(len(old), 1) - 1).bit_length())
    if src_win > 1 << 31:
        raise ValueError("xdelta3's source window is at most 2 GiB")
    extra = ["-S", secondary] if secondary else []
    name = f"xdelta3-{level}" + (f"-{secondary}" if secondary else "")
    return _cli_delta(
        name,
        old,
        new,
        lambda o, n, p: [
            "xdelta3",
            "-e",
            "-f",
            "-q",
            f"-{level}",
            "-B",
            str(src_win),
            *extra,
            "-s",
            str(o),
            str(n),
            str(p),
        ],
        lambda o, p, out: ["xdelta3", "-d", "-f", "-q", "-B", str(src_win), "-s", str(o), str(p), str(out)],
        tmp_dir,
    )


def zstd_patch_from(
    old: bytes,
    new: bytes,
    *,
    level: int = 19,
    single_thread: bool = False,
    tmp_dir: str | os.PathLike[str] | None = None,
) -> BaselineResult:
    """`zstd --patch-from=OLD --long=31 -LEVEL NEW` and `zstd -d --patch-from=OLD --long=31`.

    `--long=31` on both sides: patch-from needs a window covering the whole reference, and the
    decoder refuses windows over 128 MiB unless told the same limit (2 GiB here, which also caps
    the reference size). zstd's docs suggest high levels (19) for best patches; level 3 is the
    fast point. Levels above 19 get `--ultra`. `single_thread` passes `--single-thread`, which the
    docs say improves patch-from ratio at the cost of speed.
    """
    if len(old) > 1 << 31:
        raise ValueError("zstd --patch-from references are limited to 2 GiB here (--long=31)")
    lvl = ["--ultra", f"-{level}"] if level > 19 else [f"-{level}"]
    threads = ["--single-thread"] if single_thread else []
    name = f"zstd-patch-from-{level}" + ("-st" if single_thread else "")
    return _cli_delta(
        name,
        old,
        new,
        lambda o, n, p: ["zstd", "-q", "-f", *lvl, *threads, "--long=31", f"--patch-from={o}", str(n), "-o", str(p)],
        lambda o, p, out: ["zstd", "-d", "-q", "-f", "--long=31", f"--patch-from={o}", str(p), "-o", str(out)],
        tmp_dir,
    )


# --------------------------------------------------------------------------------------------
# Tool availability
# --------------------------------------------------------------------------------------------

_apt_updated = False


def _zipnn_importable() -> bool:
    if importlib.util.find_spec("zipnn") is None:
        return False
    try:
        importlib.import_module("zipnn")  # also loads its compiled zipnn_core
    except (ImportError, OSError) as exc:  # a broken build is as good as missing
        logger.warning("zipnn is installed but does not import: %s", exc)
        return False
    return True


def _available() -> dict[str, bool]:
    return {
        "zstd": shutil.which("zstd") is not None,
        "xdelta3": shutil.which("xdelta3") is not None,
        "zipnn": _zipnn_importable(),
    }


def _quiet_run(argv: list[str], timeout: float) -> bool:
    logger.info("running: %s", " ".join(argv))
    try:
        proc = subprocess.run(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            check=False,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.warning("%s: %s", argv[0], exc)
        return False
    if proc.returncode != 0:
        logger.warning(
            "%s failed (%d): %s", " ".join(argv), proc.returncode, proc.stdout.decode(errors="replace")[-1500:]
        )
    return proc.returncode == 0


def ensure_tools(*, install: bool = True) -> dict[str, bool]:
    """Which baselines' tools are available ({"zstd", "xdelta3", "zipnn"} -> bool).

    With `install`, tries to install what is missing: `apt-get install -y xdelta3 zstd` (after
    one `apt-get update` per process; only as root), and `pip install --no-deps zipnn` into this
    interpreter. `--no-deps` because zipnn's requirements (numpy, safetensors, torch) are already
    weightsync's, and letting pip resolve `torch` could replace the pinned CPU build. zipnn ships
    as an sdist with a C extension, so it needs a C compiler. Never raises: a tool that cannot be
    installed is reported False and its baselines are skipped.
    """
    global _apt_updated
    have = _available()
    if not install or all(have.values()):
        return have
    apt_pkgs = [t for t in ("xdelta3", "zstd") if not have[t]]
    if apt_pkgs:
        if shutil.which("apt-get") is None or os.geteuid() != 0:
            logger.warning("cannot apt-get install %s (no apt-get, or not root)", " ".join(apt_pkgs))
        else:
            if not _apt_updated:
                _apt_updated = _quiet_run(["apt-get", "update"], timeout=600)
            _quiet_run(["apt-get", "install", "-y", "--no-install-recommends", *apt_pkgs], timeout=900)
    if not have["zipnn"]:
        _quiet_run([sys.executable, "-m", "pip", "install", "--no-deps", "zipnn>=0.5"], timeout=900)
        importlib.invalidate_caches()
    have = _available()
    for tool, ok in have.items():
        if not ok:
            logger.warning("%s unavailable; its baselines will be skipped", tool)
    return have


def run_baselines(
    old: bytes,
    new: bytes,
    *,
    tools: Mapping[str, bool] | None = None,
    patch_levels: tuple[int, ...] = (3, 19),
    xdelta_levels: tuple[int, ...] = (9,),
    zstd_level: int = 3,
    tmp_dir: str | os.PathLike[str] | None = None,
) -> tuple[list[BaselineResult], list[str]]:
    """Every baseline whose tool is available; returns (results, skipped lines saying why)."""
    if tools is None:
        tools = ensure_tools()
    runs: list[tuple[str, str, Callable[[], BaselineResult]]] = [
        ("zstandard", f"zstd-full-{zstd_level}", lambda: zstd_full(new, zstd_level)),
        ("zipnn", "zipnn-full", lambda: zipnn_full(new)),
        ("zipnn", "zipnn-delta", lambda: zipnn_delta(old, new)),
    ]
    for lvl in xdelta_levels:
        runs.append(("xdelta3", f"xdelta3-{lvl}", lambda lvl=lvl: xdelta3_delta(old, new, level=lvl, tmp_dir=tmp_dir)))
    for lvl in patch_levels:
        runs.append(
            ("zstd", f"zstd-patch-from-{lvl}", lambda lvl=lvl: zstd_patch_from(old, new, level=lvl, tmp_dir=tmp_dir))
        )
    # A tool that scribbles on its input (zipnn does, see zipnn_full) would silently skew every
    # baseline after it; fail loudly instead.
    digests = (xxhash.xxh3_128_digest(old), xxhash.xxh3_128_digest(new))
    results, skipped = [], []
    for tool, name, fn in runs:
        if not tools.get(tool, True):
            skipped.append(f"{name}: skipped ({tool} is not available and could not be installed)")
            continue
        logger.info("baseline %s ...", name)
        results.append(fn())
        if (xxhash.xxh3_128_digest(old), xxhash.xxh3_128_digest(new)) != digests:
            raise AssertionError(f"baseline {name} modified its input buffers")
    return results, skipped


def format_results(results: list[BaselineResult]) -> str:
    lines = [f"{'baseline':<24} {'bytes':>12} {'ratio':>8} {'encode_s':>9} {'decode_s':>9}"]
    for r in results:
        lines.append(f"{r.name:<24} {r.bytes:>12,} {r.ratio:>8.2f} {r.encode_s:>9.3f} {r.decode_s:>9.3f}")
    return "\n".join(lines)


def main() -> None:
    import argparse

    from bench.checkpoints import CheckpointConfig, make_checkpoint_series, series_stats

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default="bench/.cache", help="checkpoint cache ('' to disable)")
    parser.add_argument("--lr", type=float, default=1e-6, help="which lr's first pair to compress")
    parser.add_argument("--no-install", action="store_true", help="do not try to install missing tools")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    tools = ensure_tools(install=not args.no_install)
    config = CheckpointConfig()
    t0 = time.perf_counter()
    series = make_checkpoint_series(config, cache_dir=args.cache_dir or None)
    print(f"checkpoint series in {time.perf_counter() - t0:.1f}s")
    for lr, pairs in series_stats(series).items():
        print(f"lr {lr:g}: changed {', '.join(f'{p.changed_fraction:.2%}' for p in pairs)}")
    old_sd, new_sd = series[args.lr][0], series[args.lr][1]
    old, new = checkpoint_bytes(old_sd), checkpoint_bytes(new_sd)
    print(f"pair at lr {args.lr:g}: {len(new):,} bytes; tools {tools}")
    results, skipped = run_baselines(old, new, tools=tools)
    print(format_results(results))
    for line in skipped:
        print(line)
    print(f"order-0 entropy bound (16/H0 of XOR): {entropy_bound(checkpoint_u16(old_sd), checkpoint_u16(new_sd)):.2f}")


if __name__ == "__main__":
    main()
