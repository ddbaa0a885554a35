"""parity faults benchmark: the wrong-engine suite on real checkpoints — what each wrong engine
shows on a trained model, against the default thresholds.

For each version given, read from a store (e.g. a `weightsync demo` run's), the probe a trainer
would publish for it (records of the published bf16 weights in bf16 and fp32, prompts chosen as the
trainer chooses them; the training top-k from the same weights in fp32: a store holds no master
weights), then each wrong engine of harness/wrong_engines.py that applies to the architecture
swaps the version in and answers the probe. Reported per case: the figures, each alarm figure over
its default threshold, and whether it breaches; for MoE also without the routing figure (what an
engine that hides its routing, like vLLM, would show).

Prints one JSON record (and writes it to --out). Run from the repository root, e.g. on a demo's
output: `python -m bench.parity_faults --store /tmp/demo/store --model demo-lm --versions 30,140
--architecture '{"model_type": "qwen3", ...}'` (the demo writes its architecture into
trainer.toml). Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

from harness.fake_trainer import choose_prompts, trainer_probe
from harness.machine import describe_machine
from harness.wrong_engines import CASES, wrong_engine
from weightsync.agents.parity import ParityConfig, judge, thresholds
from weightsync.agents.parity_figures import compare
from weightsync.models import ModelConfig
from weightsync.reader import Reader
from weightsync.stores import open_store


def run_case(case: str, arch: ModelConfig, version: int, weights: dict, digest: str, probe) -> dict:
    engine = wrong_engine(case, arch)
    try:
        engine.swap(version, weights, digest=digest)
        answer = engine.prompt_logprobs([list(p) for p in probe.prompts], top_k=probe.training.k)
    finally:
        engine.close()
    dtype = answer.compute_dtype or probe.compute_dtypes[0]
    figures = compare(probe, dtype, answer.logprobs, answer.experts, answer.top_ids, answer.top_logprobs)
    config = ParityConfig()
    limits = thresholds(config, probe)
    ratios = {
        name: getattr(figures, name) / limit
        for name, limit in limits.items()
        if limit and getattr(figures, name) is not None
    }
    logprobs_only = {k: v for k, v in ratios.items() if k != "expert_mismatch"}
    return {
        **dataclasses.asdict(figures),
        "breaches": list(judge(config, figures, probe)),
        "margins": ratios,
        "breaches_without_routing": bool(not figures.recorded or max(logprobs_only.values(), default=0) > 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--versions", required=True, help="comma-separated versions")
    parser.add_argument("--architecture", required=True, help="the model's architecture as JSON (HF config fields)")
    parser.add_argument("--out", default=None, help="also write the JSON record to this file")
    args = parser.parse_args(argv)
    arch = ModelConfig(**json.loads(args.architecture))
    reader = Reader(open_store(args.store), model=args.model)
    results = {}
    for version in (int(v) for v in args.versions.split(",")):
        state = reader.read(version)
        weights = state.state_dict()
        prompts = choose_prompts(weights, arch)
        probe = trainer_probe(weights, arch, prompts)
        cases = [case for case, archs in CASES if ("moe" if arch.is_moe else "dense") in archs]
        results[version] = {
            case: run_case(case, arch, version, weights, state.manifest.digest, probe) for case in cases
        }
    record = {
        "bench": "parity_faults",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "store": args.store,
        "model": args.model,
        "architecture": dataclasses.asdict(arch),
        "hardware": describe_machine(),
        "thresholds": dataclasses.asdict(ParityConfig()),
        "results": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2, default=str))
    sys.stdout.write(json.dumps(record, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
