"""commit_latency: publish() -> committed for a small delta, per stage, with and without packs.

    .venv/bin/python -m bench.commit_latency                   # 0.1 GiB, lr 1e-6, local + S3 (moto)
    .venv/bin/python -m bench.commit_latency --stores local --versions 6

The publisher alone (no agents, no push): the fixed cost a version pays in the store. Each store
gets a base and `--versions - 1` deltas of the real checkpoints `bench.sync_latency` uses
(`bench.checkpoints.make_lm_series`, 4 MiB chunks), published twice in the same run, the two
publishers taking turns version by version: as users get it (deltas in packs) and, as the
baseline, with `pack_bytes=0` (one store object per changed chunk, what every version cost
before packs). Per version it records the commit time and its
stages (snapshot = the caller's wait; encode = encode + uploads, from the version's start, so it
overlaps the snapshot; manifest = the commit write) and the store objects written.

Writes bench/results/commit-latency-<cores>cpu-<arch>-<date>.{json,md} and prints the record.
Not a test; `bench.sync_latency` measures the whole path to the agents.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from bench.output import write_results
from bench.sync_latency import CACHE, RESULTS, Moto, _fake_aws_env, trainer_heap_frozen

log = logging.getLogger("bench.commit_latency")


MODES = (("packs", None), ("one object per chunk", 0))  # None: PublisherConfig's default pack_bytes


def _record(result) -> dict:
    return {
        "version": result.version,
        "kind": result.manifest.kind,
        "commit_s": result.total_s,
        "snapshot_s": result.snapshot_s,
        "encode_upload_s": result.encode_s,
        "manifest_s": result.commit_s,
        "store_objects": len(result.manifest.objects()),
        "stored_bytes": result.stored_bytes + result.manifest_bytes,
    }


def _cells(kind: str, series, args, scratch: Path) -> list[dict]:
    """The store `kind` published with packs and with one object per chunk (the baseline); the two
    publishers take turns version by version, so both see the same machine load."""
    from weightsync.publisher import Publisher, PublisherConfig
    from weightsync.stores import LocalStore
    from weightsync.stores.s3 import S3Store

    motos, publishers = [], []
    try:
        for _, pack_bytes in MODES:
            if kind == "s3":
                motos.append(Moto(scratch / f"moto-{pack_bytes}.log"))
                store = S3Store(motos[-1].bucket, "commit", endpoint_url=f"http://{motos[-1].address}")
            else:
                store = LocalStore(Path(tempfile.mkdtemp(dir=scratch)))
            config = PublisherConfig(chunk_bytes=4 * 1024**2)
            if pack_bytes is not None:
                config = PublisherConfig(chunk_bytes=4 * 1024**2, pack_bytes=pack_bytes)
            publishers.append(Publisher(store, model="bench-commit", config=config))
        versions: list[list[dict]] = [[] for _ in MODES]
        with trainer_heap_frozen():
            for j in range(args.versions):
                # In memory, as a trainer's weights are (a loaded file's pages would fault in during
                # the first publisher's copy only).
                state = series.load(args.lr, j % (series.config.steps_per_lr + 1), resident=True)
                for publisher, out in zip(publishers, versions, strict=True):
                    out.append(_record(publisher.publish(state).result()))
    finally:
        for publisher in publishers:
            publisher.close()
        for moto in motos:
            moto.close()
    cells = []
    for (mode, _), out in zip(MODES, versions, strict=True):
        deltas = [v for v in out if v["kind"] == "delta"]
        cells.append(
            {
                "store": kind,
                "mode": mode,
                "versions": out,
                "delta_commit_s_median": statistics.median(v["commit_s"] for v in deltas) if deltas else None,
                "delta_store_objects": [v["store_objects"] for v in deltas],
            }
        )
        log.info(
            "%s, %s: delta commits %s s, objects %s",
            kind,
            mode,
            [round(v["commit_s"], 3) for v in deltas],
            cells[-1]["delta_store_objects"],
        )
    return cells


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=0.1, help="model size in GiB of bf16")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--versions", type=int, default=4, help="a base and this many minus one deltas")
    parser.add_argument("--stores", default="local,s3")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    _fake_aws_env()

    from bench.checkpoints import lm_series_config, make_lm_series
    from harness.machine import describe_machine

    series = make_lm_series(lm_series_config(args.size), cache_dir=CACHE)
    record = {
        "bench": "commit_latency",
        "date": datetime.date.today().isoformat(),
        "config": {"size_gib": args.size, "lr": args.lr, "versions": args.versions, "chunk_bytes": 4 * 1024**2},
        "hardware": describe_machine(),
        "load_avg_start": list(os.getloadavg()),
        "cells": [],
    }
    scratch = Path(tempfile.mkdtemp(prefix="ws-bench-commit-"))
    try:
        record["cells"] = [cell for kind in args.stores.split(",") for cell in _cells(kind, series, args, scratch)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    record["load_avg_end"] = list(os.getloadavg())
    load = (
        f"{args.size:g} GiB, lr {args.lr:g}, 4 MiB chunks; load average {record['load_avg_start'][0]:.1f} -> "
        f"{record['load_avg_end'][0]:.1f} on {record['hardware']['cores']} cores."
    )
    lines = [
        f"# commit latency: publish() -> committed, {record['date']}",
        "",
        load,
        "",
        "| store | mode | delta commits s | median s | objects per delta | snapshot s | encode s | manifest s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell in record["cells"]:
        deltas = [v for v in cell["versions"] if v["kind"] == "delta"]
        last = deltas[-1] if deltas else cell["versions"][-1]
        commits = ", ".join(f"{v['commit_s']:.3f}" for v in deltas)
        lines.append(
            f"| {cell['store']} | {cell['mode']} | {commits} | "
            f"{cell['delta_commit_s_median'] or 0:.3f} | {cell['delta_store_objects']} | "
            f"{last['snapshot_s']:.3f} | {last['encode_upload_s']:.3f} | {last['manifest_s']:.3f} |"
        )
    lines += [
        "",
        (
            "snapshot, encode and manifest are the last delta's stages; encode runs from the version's start "
            "and overlaps the snapshot, so they add up to more than the commit."
        ),
        "",
    ]
    cores, arch = record["hardware"]["cores"], record["hardware"]["machine"]
    write_results(RESULTS / f"commit-latency-{cores}cpu-{arch}-{record['date']}", record, "\n".join(lines))
    return record


if __name__ == "__main__":
    main()
