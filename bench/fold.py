"""fold: what a lagging reader gains by applying several deltas folded instead of as a chain.

Publishes the 0.1 GiB benchmark series (base + 3 deltas of `bench.checkpoints.make_lm_series`, the
codecs as the publisher picks them: `ctx` at these change rates) to a local store, then times a
reader that holds the base and must reach the last version: the chain (each delta over the whole
model in turn) against the folded route (range by range, `weightsync/format/codecs/fold.py`), alternating, in
the same run. Both end bit-identical to the published checkpoint, which is checked.

    python -m bench.fold [--size 0.1] [--lr 1e-6] [--repeats 5]

Writes bench/results/fold-<cores>cpu-<arch>-<date>.{json,md} and prints the record as one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.output import write_results
from weightsync.format.codecs.fold import CHAIN, FOLDED
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.reader import Reader
from weightsync.stores import LocalStore

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODEL = "bench/fold"


def run(size: float, lr: float, repeats: int) -> dict:
    from bench.checkpoints import lm_series_config, make_lm_series

    series = make_lm_series(lm_series_config(size), cache_dir=ROOT / "bench" / ".cache")
    steps = series.config.steps_per_lr
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        store = LocalStore(tmp, fsync=False)
        with Publisher(store, model=MODEL, config=PublisherConfig(parent_from_store=False)) as publisher:
            results = [publisher.publish(series.load(lr, j)).result() for j in range(steps + 1)]
        target = results[-1].version
        reader = Reader(store, model=MODEL)
        base = reader.read(1)
        want = reader.read(target)
        times: dict[str, list[float]] = {CHAIN: [], FOLDED: []}
        state = reader.read(1)
        for _ in range(repeats):
            for fold in (False, True):
                for name, buf in base.buffers.items():  # back to the base, in the same memory
                    np.copyto(state.buffers[name], buf)
                state.manifest = base.manifest
                t0 = time.perf_counter()
                route = reader.advance_route(state, target, fold=fold)
                times[route.kind].append(time.perf_counter() - t0)
                if route.kind != (FOLDED if fold else CHAIN):
                    raise AssertionError(f"expected the {'folded' if fold else 'chain'} route: {route.describe()}")
                for name, buf in want.buffers.items():
                    if not np.array_equal(state.buffers[name], buf):
                        raise AssertionError(f"{route.kind} route: {name} differs from the published bytes")
    codecs = sorted({c.codec for r in results[1:] for t in r.manifest.tensors for c in t.chunks})
    chain_s, folded_s = (statistics.median(times[k]) for k in (CHAIN, FOLDED))
    return {
        "bench": "fold",
        "size_gib": size,
        "lr": lr,
        "deltas": steps,
        "codecs": codecs,
        "raw_bytes": results[-1].raw_bytes,
        "repeats": repeats,
        "chain_s": chain_s,
        "folded_s": folded_s,
        "speedup": chain_s / folded_s,
        "chain_all_s": times[CHAIN],
        "folded_all_s": times[FOLDED],
        "load_avg_end": list(os.getloadavg()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=0.1, help="model size in GiB (bench.checkpoints sizes)")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    from harness.machine import describe_machine

    hardware = describe_machine()
    record = {
        "date": datetime.date.today().isoformat(),
        "hardware": hardware,
        "load_avg_start": list(os.getloadavg()),
        **run(args.size, args.lr, args.repeats),
    }
    text = (
        f"# fold: a reader {record['deltas']} deltas behind, {record['date']}\n\n"
        f"{args.size:g} GiB, lr {args.lr:g}, codecs {', '.join(record['codecs'])}; "
        f"{hardware['cores']} cores, load average {record['load_avg_start'][0]:.1f} -> "
        f"{record['load_avg_end'][0]:.1f}.\n\n"
        "| route | median s | all runs s |\n|---|---|---|\n"
        f"| chain | {record['chain_s']:.3f} | {', '.join(f'{t:.3f}' for t in record['chain_all_s'])} |\n"
        f"| folded | {record['folded_s']:.3f} | {', '.join(f'{t:.3f}' for t in record['folded_all_s'])} |\n\n"
        f"Folded is **{record['speedup']:.2f}x** the chain's speed; both end bit-identical to the published "
        "version.\n"
    )
    write_results(RESULTS / f"fold-{hardware['cores']}cpu-{hardware['machine']}-{record['date']}", record, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
