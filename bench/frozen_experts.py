"""frozen_experts: what packing a MoE's frozen experts in 8 or 4 bits saves in memory, costs in
step time, and changes in the loss (parallel.frozen_experts, weightsync.models.packed).

One process (the training engine in a world of one, gloo) builds the same tiny-but-not-trivial
Qwen3-MoE (default: hidden 256, 2 layers, 16 experts, top-2, moe_intermediate 256) once per
expert format: unset (the fp32 master weights, what a LoRA run holds without the setting),
"bf16", "int8" and "int4" (one bf16 scale per `--group` input columns), each with the same LoRA
adapters (rank 8; attention, router and lm_head; experts frozen) from the same initial weights.
Then it runs `--steps` LoRA steps, every format on the same batch in turn, step by step, so load
swings hit every format alike:

- memory: the bytes of the expert parameters the engine holds (scales included), and their ratio
  to bf16 (goal: about 4x smaller at 4 bits);
- step time: forward/backward, clip and AdamW of each step, mean and median over the steps after
  `--warmup`, and their ratios to bf16 experts (on a shared machine the median is the figure to
  read: other tenants' bursts land in a few steps and swing the mean);
- published experts: whether what each packed engine publishes for its experts after the last
  step is, bit for bit, the dequantized packing of the initial weights (frozen: no delta bytes);
- loss: each format's loss at every step (data: sequences that follow a fixed random permutation
  of the vocabulary, which the adapters learn), max |loss - bf16's loss| over the steps and the
  final losses.

    python -m bench.frozen_experts [--steps 20] [--experts 16] [--group 128] [--mixed-precision none]
                                   [--device cpu|cuda]

Prints one JSON record (config, machine, load before/after, results). Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time

from harness.machine import describe_machine

FORMATS = ("unset", "bf16", "int8", "int4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--moe-intermediate", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the step times")
    parser.add_argument("--group", type=int, default=128, help="input columns per scale (int8, int4)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--mixed-precision", choices=("none", "bf16"), default="none")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu")
    args = parser.parse_args()

    import torch

    from harness.bits import bits_equal
    from weightsync.models import ModelConfig, build_model
    from weightsync.models.packed import PackFormat, dequantize, pack
    from weightsync.trainer.config import ParallelConfig
    from weightsync.trainer.engine import TrainingEngine
    from weightsync.trainer.lora import LoraSettings
    from weightsync.trainer.losses import LossSums
    from weightsync.trainer.optim import AdamWParams
    from weightsync.trainer.parallel import build_mesh, close_runtime, init_runtime

    if args.threads:
        torch.set_num_threads(args.threads)
    if "RANK" not in os.environ:  # a world of one on a free port, never a fixed one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    load_before = os.getloadavg()
    config = ModelConfig(
        model_type="qwen3_moe",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_intermediate,
        norm_topk_prob=True,
        max_position_embeddings=max(256, args.seq),
    )
    runtime = init_runtime(ParallelConfig(device=args.device))
    sync = torch.cuda.synchronize if runtime.device.type == "cuda" else (lambda: None)
    initial = build_model(config, seed=0).state_dict()
    lora = LoraSettings(rank=args.rank, seed=1)
    engines = {}
    for name in FORMATS:
        setting = None if name == "unset" else name if name == "bf16" else f"{name}:{args.group}"
        parallel = ParallelConfig(device=args.device, mixed_precision=args.mixed_precision, frozen_experts=setting)
        mesh = build_mesh(parallel, runtime)
        engines[name] = TrainingEngine.build(
            config, initial, mesh=mesh, parallel=parallel, device=runtime.device, lora=lora
        )

    # What each engine publishes for its experts: the bf16 values of the packed weights (checked
    # against packing the initial weights here on the CPU), and the same bits after every step.
    def published_experts(engine) -> dict:
        return {k: v.full_tensor().cpu() for k, v in engine.weights("merged").items() if ".experts." in k}

    expected = {}
    for name in FORMATS[1:]:
        fmt = PackFormat.parse(name if name == "bf16" else f"{name}:{args.group}")
        expected[name] = {k: dequantize(pack(initial[k], fmt), fmt) for k in published_experts(engines[name])}
    del initial

    memory = {}
    for name, engine in engines.items():
        held = [p.to_local() for n, p in engine.model.named_parameters() if ".experts." in n and not p.requires_grad]
        memory[name] = {"expert_bytes": sum(t.numel() * t.element_size() for t in held)}
    for name in FORMATS:
        memory[name]["bf16_over_this"] = memory["bf16"]["expert_bytes"] / memory[name]["expert_bytes"]

    # Sequences along a fixed random permutation of the vocabulary: learnable, same for every format.
    g = torch.Generator().manual_seed(0)
    successor = torch.randperm(args.vocab, generator=g)
    adamw = AdamWParams(lr=args.lr)
    times: dict[str, list[float]] = {name: [] for name in FORMATS}
    losses: dict[str, list[float]] = {name: [] for name in FORMATS}
    for step in range(args.steps):
        tokens = torch.empty(args.batch, args.seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=g)
        for t in range(args.seq):
            tokens[:, t + 1] = successor[tokens[:, t]]
        tokens = tokens.to(runtime.device)
        count = float(tokens[:, 1:].numel())
        order = FORMATS if step % 2 == 0 else FORMATS[::-1]  # ABBA: no format always runs first
        for name in order:
            engine = engines[name]
            start = time.perf_counter()
            _, result = engine.forward_backward(
                tokens[:, :-1], tokens[:, 1:], lambda lp: LossSums(-lp.sum(), {}), divisor=count
            )
            engine.clip_gradients(1.0)
            engine.optimizer_step(adamw)
            sync()
            elapsed = time.perf_counter() - start
            losses[name].append(float(result.loss.detach()) / count)
            if step >= args.warmup:
                times[name].append(elapsed)

    parity = {
        name: {
            "published_equal_packed_initial": all(
                bits_equal(v, expected[name][k]) for k, v in published_experts(engines[name]).items()
            )
        }
        for name in FORMATS[1:]
    }
    step_time = {
        name: {"mean_s": statistics.mean(values), "median_s": statistics.median(values)}
        for name, values in times.items()
    }
    for name in FORMATS:
        step_time[name]["mean_over_bf16"] = step_time[name]["mean_s"] / step_time["bf16"]["mean_s"]
        step_time[name]["median_over_bf16"] = step_time[name]["median_s"] / step_time["bf16"]["median_s"]
    loss = {
        name: {
            "final": values[-1],
            "max_abs_diff_vs_bf16": max(abs(a - b) for a, b in zip(values, losses["bf16"], strict=True)),
            "losses": values,
        }
        for name, values in losses.items()
    }
    record = {
        "benchmark": "frozen_experts",
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "config": {**vars(args), "expert_parameters": memory["bf16"]["expert_bytes"] // 2},
        "machine": describe_machine(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "results": {"memory": memory, "step_time": step_time, "loss": loss, "published_experts": parity},
    }
    print(json.dumps(record))
    close_runtime(runtime)


if __name__ == "__main__":
    main()
