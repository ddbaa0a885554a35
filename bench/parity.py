"""parity benchmark: what the numerical-parity probe costs, on the trainer and on the agent.

One process, one model (dense by default; `--moe` a Qwen3-MoE of the same active size):
- trainer: a `TrainingEngine` on a world of one (gloo) takes SFT steps (batch 8 x 128 tokens);
  beside each step it computes the version's probe (`weightsync.trainer.probe.version_probe`: 4
  prompts x 32 tokens, records of the published weights in bf16 and fp32, each tensor gathered
  whole, and the training forward's top-8 per position). Reported: the step time, the probe time,
  their ratio, and the probe's size in the manifest.
- agent: a `SyncAgent` with the reference engine (bf16, zero-copy) over a local store. Each
  trained version is published twice, into two stores: once without a probe, once with one
  (parity action "warn"), to two agents; publish() -> served is measured for both in the same run,
  alternating, so the machine's load falls on both alike. Reported: publish -> served median and
  p90 with and without the probe (the probe runs after the swap, on its own thread, so the two
  should be alike), and the probe's own time after the swap (its report's probe_s), with its
  figures (the reference engine in bf16 against the bf16 record: 0).

Prints one JSON record. Run from the repository root: `python -m bench.parity [--versions N] [--moe]`.
Not a test: it asserts no times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from harness.machine import describe_machine
from weightsync import __version__
from weightsync.agents.config import AgentConfig
from weightsync.agents.engines.reference import ReferenceEngine, ReferenceEngineConfig
from weightsync.agents.parity import ParityConfig
from weightsync.agents.sync import SyncAgent
from weightsync.models import ModelConfig, build_model
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.stores import LocalStore
from weightsync.trainer.config import ParallelConfig, PublishConfig
from weightsync.trainer.engine import TrainingEngine
from weightsync.trainer.losses import LossSums
from weightsync.trainer.optim import AdamWParams
from weightsync.trainer.parallel import build_mesh, init_runtime
from weightsync.trainer.probe import version_probe

DENSE = ModelConfig(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
)
MOE = ModelConfig(
    **{
        **{k: getattr(DENSE, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")},
        "num_key_value_heads": 4,
        "head_dim": 32,
        "intermediate_size": 768,
        "model_type": "qwen3_moe",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 384,
        "norm_topk_prob": True,
    }
)
WAIT_S = 600.0


def _agent(root: Path, name: str, store: LocalStore, arch: ModelConfig, parity: bool) -> SyncAgent:
    engine = ReferenceEngine(ReferenceEngineConfig(model=arch))
    config = AgentConfig(
        model="bench",
        cache_dir=str(root / name),
        name=name,
        store=store.uri,
        poll_interval_s=0.01,
        workers=1,
        parity=ParityConfig(enabled=parity, action="warn"),
    )
    agent = SyncAgent(config, engine, upstream=store)
    agent.start()
    return agent


def _stats(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    return {
        "median": statistics.median(values),
        "p90": values[min(len(values) - 1, int(0.9 * len(values)))],
        "max": values[-1],
    }


def run(arch: ModelConfig, versions: int) -> dict:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    parallel = ParallelConfig()
    runtime = init_runtime(parallel)
    mesh = build_mesh(parallel, runtime)
    engine = TrainingEngine.build(
        arch, build_model(arch, seed=0).state_dict(), mesh=mesh, parallel=parallel, device=runtime.device
    )
    publish_config = PublishConfig(store="unused")
    generator = torch.Generator().manual_seed(0)
    step_s, probe_s, probe_bytes = [], [], []
    served = {False: [], True: []}
    reports = []
    prompts = None
    with tempfile.TemporaryDirectory(prefix="bench-parity-") as tmp:
        root = Path(tmp)
        stores = {p: LocalStore(root / f"store-{p}") for p in (False, True)}
        agents = {p: _agent(root, f"agent-{p}", stores[p], arch, p) for p in (False, True)}
        publishers = {p: Publisher(stores[p], model="bench", config=PublisherConfig(workers=1)) for p in (False, True)}
        try:
            for version in range(1, versions + 1):
                ids = torch.randint(0, arch.vocab_size, (8, 129), generator=generator)
                t0 = time.perf_counter()
                engine.forward_backward(ids[:, :-1], ids[:, 1:], lambda lp: LossSums(-lp.mean(), {}))
                engine.optimizer_step(AdamWParams(lr=1e-5))
                step_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                probe = version_probe(engine, publish_config, prompts=prompts)
                prompts = probe.prompts  # the run's, chosen by the first version, for every later one
                probe_s.append(time.perf_counter() - t0)
                probe_bytes.append(len(json.dumps(probe.to_json())))
                # A world of one: each DTensor's local shard is the whole tensor.
                weights = {n: t.to_local().detach().clone() for n, t in engine.weights().items()}
                for with_probe in (False, True) if version % 2 else (True, False):
                    t0 = time.monotonic()
                    publishers[with_probe].publish(weights, step=version, probe=probe if with_probe else None)
                    if not agents[with_probe].wait_for_version(version, WAIT_S):
                        raise RuntimeError(f"v{version} was not served in {WAIT_S} s")
                    served[with_probe].append(time.monotonic() - t0)
                deadline = time.monotonic() + WAIT_S
                while (agents[True].status()["parity"] or {}).get("version") != version:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the probe of v{version} never reported")
                    time.sleep(0.01)
                reports.append(agents[True].status()["parity"])
        finally:
            for p in (False, True):
                publishers[p].close()
                agents[p].close()
    dist.destroy_process_group()
    # The first version is a full one with compile and warm-up costs: left out of the timings.
    steady = slice(1, None)
    return {
        "model": {
            "type": arch.model_type,
            "parameters": sum(t.numel() for t in build_model(arch).state_dict().values()),
        },
        "trainer": {
            "step_s": _stats(step_s[steady]),
            "probe_s": _stats(probe_s[steady]),
            "first_probe_s": probe_s[0],  # the run's prompts chosen (MoE: a pass over a pool, once)
            "probe_over_step": statistics.median(probe_s[steady]) / statistics.median(step_s[steady]),
            "probe_bytes": probe_bytes,
        },
        "agent": {
            "publish_to_served_s_without_probe": _stats(served[False][steady]),
            "publish_to_served_s_with_probe": _stats(served[True][steady]),
            "probe_after_swap_s": _stats([r["probe_s"] for r in reports[steady]]),
            **{
                f"{figure}_max": max((r[figure] for r in reports if r[figure] is not None), default=None)
                for figure in ("dlogprob_p50", "dlogprob_p90", "max_abs_dlogprob", "expert_mismatch", "gap_kl")
            },
            "actions": sorted({r["action"] for r in reports}),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", type=int, default=12, help="versions trained, probed and published")
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE (8 experts, top-2) instead of the dense model")
    parser.add_argument("--out", default=None, help="also write the JSON record to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    load_before = os.getloadavg()
    results = run(MOE if args.moe else DENSE, args.versions)
    record = {
        "bench": "parity",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "target": "publish -> served alike with and without the probe (warn); probe << a training step",
        "versions": {"weightsync": __version__, "python": platform.python_version(), "torch": torch.__version__},
        "hardware": describe_machine(),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "results": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2))
    sys.stdout.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
