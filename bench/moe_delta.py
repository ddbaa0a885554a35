"""moe_delta: how big a real GRPO step's delta is for a Mixture-of-Experts model, against the dense
model of the same active size.

Both models are trained by the project's one training engine (`weightsync.trainer.engine.
TrainingEngine`, FSDP2 on a world of one gloo process, fp32 master weights, AdamW) with its GRPO
loss (`weightsync.trainer.losses.grpo_loss`), on-policy: each step's completions are sampled from
the current weights (a plain copy of the model, temperature 1), rewarded (the share of even
token ids: any verifiable reward does), and their advantages normalised per group. After every
step the bf16 weights are published (`weightsync.publisher.Publisher`, the defaults: `ctx` codec,
packs) to a local store, and the delta is measured from its manifest and from the bf16 bits.

    python -m bench.moe_delta [--experts 8] [--top-k 2] [--lr 1e-6] [--steps 3]

The MoE is a tiny Qwen3-MoE (`--experts` experts of width `--moe-intermediate`, top-k routing);
the dense model has the same hidden size, layers and attention, and an MLP of width top_k x
moe_intermediate: what one token computes is the same in both. Step 1 runs on a fresh AdamW
(its first update is +-lr on every weight with a gradient); the later steps on warm moments, as
in a long run. Per expert it reports the tokens routed to it in the step (prompt positions
included, which carry no loss) and how many of its bf16 elements changed.

Writes bench/results/moe-delta-<cores>cpu-<arch>-<date>.{json,md} and prints the record as one
JSON line. Takes about a minute on 2 cores. Not here: the codec itself (bench/codec.py).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import socket
import tempfile
import time
from pathlib import Path

import torch

from bench.output import write_results

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")
GROUPS = ("experts", "router", "attention", "dense mlp", "embedding + head", "norms")


def group_of(name: str) -> str:
    if _EXPERT.match(name):
        return "experts"
    if name.endswith(".mlp.gate.weight"):
        return "router"
    if ".self_attn." in name and not name.endswith("norm.weight"):
        return "attention"
    if ".mlp." in name:
        return "dense mlp"
    if "embed_tokens" in name or name.startswith("lm_head"):
        return "embedding + head"
    return "norms"


def architectures(args: argparse.Namespace) -> dict:
    from weightsync.models import ModelConfig

    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return {
        "moe": ModelConfig(
            model_type="qwen3_moe",
            intermediate_size=args.top_k * args.moe_intermediate,
            num_experts=args.experts,
            num_experts_per_tok=args.top_k,
            moe_intermediate_size=args.moe_intermediate,
            norm_topk_prob=True,
            **common,
        ),
        "dense": ModelConfig(model_type="qwen3", intermediate_size=args.top_k * args.moe_intermediate, **common),
    }


def rollouts(policy, args: argparse.Namespace, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One GRPO batch sampled from `policy` (a plain fp32 model): inputs, targets, per-token loss
    weights and sampler log-probs (on the completion only), advantages per sequence."""
    prompts = torch.randint(0, args.vocab, (args.prompts, args.prompt_tokens), generator=generator)
    prompts = prompts.repeat_interleave(args.group_size, dim=0)
    completion, sampled_logprobs = policy.generate(
        prompts, max_new_tokens=args.completion_tokens, temperature=1.0, generator=generator
    )
    sequences = torch.cat([prompts, completion], dim=1)
    rewards = (completion % 2 == 0).float().mean(dim=1).view(args.prompts, args.group_size)
    advantages = (rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(dim=1, keepdim=True) + 1e-6)
    targets = sequences[:, 1:]
    weights = torch.zeros(targets.shape)
    weights[:, args.prompt_tokens - 1 :] = 1.0
    sampler = torch.zeros(targets.shape)
    sampler[:, args.prompt_tokens - 1 :] = sampled_logprobs
    return {
        "inputs": sequences[:, :-1],
        "targets": targets,
        "weights": weights,
        "sampler_logprobs": sampler,
        "advantages": advantages.flatten(),
    }


def tokens_per_expert(policy, inputs: torch.Tensor, top_k: int) -> list[list[int]]:
    """[layer][expert]: the tokens (times top-k slots) the router sends to each expert."""
    logits: list[torch.Tensor] = []
    with torch.no_grad():
        policy(inputs, router_logits=logits)
    return [
        torch.bincount(torch.topk(t, top_k, dim=-1).indices.flatten(), minlength=t.shape[-1]).tolist() for t in logits
    ]


def bf16_changes(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """name -> (bf16 elements whose bits changed, elements)."""
    return {
        name: (int((old[name].bfloat16().view(torch.int16) != t.bfloat16().view(torch.int16)).sum()), t.numel())
        for name, t in new.items()
    }


def train_and_publish(kind: str, config, args: argparse.Namespace, store_dir: str, parallel, runtime) -> dict:
    """`args.steps` GRPO steps of `config` on the engine, each published; what each delta holds."""
    from weightsync.models import build_model
    from weightsync.publisher import Publisher, PublisherConfig
    from weightsync.stores import LocalStore
    from weightsync.trainer.engine import TrainingEngine
    from weightsync.trainer.losses import grpo_loss
    from weightsync.trainer.optim import AdamWParams
    from weightsync.trainer.parallel import build_mesh

    initial = build_model(config, seed=args.seed).state_dict()
    mesh = build_mesh(parallel, runtime)
    engine = TrainingEngine.build(config, initial, mesh=mesh, parallel=parallel, device=runtime.device)
    policy = build_model(config, seed=args.seed).eval()
    adamw = AdamWParams(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    store = LocalStore(store_dir, fsync=False)
    steps = []
    with Publisher(store, model=f"bench/{kind}", config=PublisherConfig(parent_from_store=False)) as publisher:
        before = weights(engine)
        full = publisher.publish(before, step=0).result()
        for step in range(1, args.steps + 1):
            batch = rollouts(policy, args, generator)
            routed = tokens_per_expert(policy, batch["inputs"], config.num_experts_per_tok) if config.is_moe else []
            t0 = time.perf_counter()
            engine.forward_backward(
                batch["inputs"],
                batch["targets"],
                lambda lp, b=batch: grpo_loss(
                    lp, b["sampler_logprobs"], b["advantages"], b["weights"], clip_low=0.2, clip_high=0.28
                ),
                divisor=float(batch["weights"].sum()),
            )
            engine.optimizer_step(adamw)
            step_s = time.perf_counter() - t0
            after = weights(engine)
            result = publisher.publish(after, step=step).result()
            steps.append(describe_delta(step, before, after, result, routed, step_s))
            policy.load_state_dict(after)
            before = after
    return {
        "parameters": sum(t.numel() for t in before.values()),
        "active_parameters": active_parameters(config, before),
        "full_stored_bytes": full.stored_bytes + full.manifest_bytes,
        "raw_bytes": full.raw_bytes,
        "steps": steps,
    }


def weights(engine) -> dict[str, torch.Tensor]:
    """The engine's fp32 weights, copied: on a world of one, the gathered state dict shares
    memory with the parameters, and the next step would change the "before" of a delta."""
    return {name: t.detach().clone() for name, t in engine.full_state_dict().items()}


def active_parameters(config, state: dict[str, torch.Tensor]) -> int:
    """Parameters one token goes through: all but the experts it is not routed to."""
    total = sum(t.numel() for t in state.values())
    if not config.is_moe:
        return total
    experts = sum(t.numel() for n, t in state.items() if _EXPERT.match(n))
    return total - experts + experts * config.num_experts_per_tok // config.num_experts


def describe_delta(step: int, before: dict, after: dict, result, routed: list[list[int]], step_s: float) -> dict:
    manifest = result.manifest
    changes = bf16_changes(before, after)
    stored = {t.name: sum(c.size for c in t.chunks if c.object is not None) for t in manifest.tensors}
    groups = {}
    for group in GROUPS:
        names = [n for n in changes if group_of(n) == group]
        if names:
            groups[group] = {
                "stored_bytes": sum(stored[n] for n in names),
                "raw_bytes": 2 * sum(changes[n][1] for n in names),
                "changed_fraction": sum(changes[n][0] for n in names) / sum(changes[n][1] for n in names),
            }
    record = {
        "step": step,
        "kind": manifest.kind,
        "stored_bytes": result.stored_bytes + result.manifest_bytes,
        "chunk_bytes": result.stored_bytes,
        "manifest_bytes": result.manifest_bytes,
        "ratio": result.ratio,
        "changed_fraction": sum(c for c, _ in changes.values()) / sum(n for _, n in changes.values()),
        "codecs": sorted({c.codec for t in manifest.tensors for c in t.chunks}),
        "train_step_s": step_s,
        "groups": groups,
    }
    if routed:
        per_expert: dict[tuple[int, int], list[int]] = {}
        for name, (changed, _) in changes.items():
            if match := _EXPERT.match(name):
                per_expert.setdefault((int(match.group(1)), int(match.group(2))), []).append(changed)
        experts = [
            {"layer": layer, "expert": e, "tokens": routed[layer][e], "changed_elements": sum(c)}
            for (layer, e), c in sorted(per_expert.items())
        ]
        record["experts"] = experts
        record["experts_changed"] = sum(1 for e in experts if e["changed_elements"])
        record["experts_total"] = len(experts)
        record["experts_without_tokens"] = sum(1 for e in experts if not e["tokens"])
    return record


def markdown(record: dict) -> str:
    a, hw = record["args"], record["hardware"]
    lines = [
        f"# moe_delta: a GRPO step's delta, MoE vs dense of the same active size, {record['date']}",
        "",
        f"Qwen3-MoE: {a['experts']} experts, top-{a['top_k']}, expert width {a['moe_intermediate']}; dense: MLP width "
        f"{a['top_k'] * a['moe_intermediate']}; both hidden {a['hidden']}, {a['layers']} layers, vocab {a['vocab']}. "
        f"AdamW lr {a['lr']:g}, fp32 master weights, bf16 published; {a['prompts']} prompts x {a['group_size']} "
        f"completions of {a['completion_tokens']} tokens per step. {hw['cores']} cores, load average "
        f"{record['load_avg_start'][0]:.1f} -> {record['load_avg_end'][0]:.1f}.",
        "",
        "| model | parameters (active) | step | bf16 elements changed | stored delta bytes (chunks + manifest) "
        "| full version bytes | delta / full | raw / delta | experts changed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in ("moe", "dense"):
        m = record[kind]
        for s in m["steps"]:
            experts = f"{s['experts_changed']} / {s['experts_total']}" if "experts_total" in s else "—"
            lines.append(
                f"| {kind} | {m['parameters'] / 1e6:.2f}M ({m['active_parameters'] / 1e6:.2f}M) | {s['step']} "
                f"| {100 * s['changed_fraction']:.2f} % | {s['stored_bytes']:,} ({s['chunk_bytes']:,} + "
                f"{s['manifest_bytes']:,}) | {m['full_stored_bytes']:,} "
                f"| {s['stored_bytes'] / m['full_stored_bytes']:.4f} | {s['ratio']:.1f}x | {experts} |"
            )
    lines += [
        "",
        "Per part of the model, last step (chunk bytes; the manifest is not counted here):",
        "",
        "| model | part | bf16 changed | stored bytes | raw / stored |",
    ]
    lines.append("|---|---|---|---|---|")
    for kind in ("moe", "dense"):
        for group, g in record[kind]["steps"][-1]["groups"].items():
            ratio = f"{g['raw_bytes'] / g['stored_bytes']:.1f}x" if g["stored_bytes"] else "—"
            lines.append(
                f"| {kind} | {group} | {100 * g['changed_fraction']:.2f} % | {g['stored_bytes']:,} | {ratio} |"
            )
    first = record["moe"]["steps"][0]
    tokens = sorted(e["tokens"] for e in first["experts"])
    lines += [
        "",
        f"Step 1 routed {tokens[0]}-{tokens[-1]} tokens (x top-k slots) to each of the {len(tokens)} experts "
        f"({first['experts_without_tokens']} got none).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--moe-intermediate", type=int, default=128, help="each expert's MLP width")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps, each published (step 1: fresh AdamW)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--completion-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="", help="appended to the results file name")
    args = parser.parse_args(argv)
    from harness.machine import describe_machine
    from weightsync.trainer.config import ParallelConfig
    from weightsync.trainer.parallel import close_runtime, exit_worker, init_runtime

    with socket.socket() as s:  # a world of one, on a port nobody else's run holds
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    parallel = ParallelConfig(device="cpu", backend="gloo")
    runtime = init_runtime(parallel)
    torch.manual_seed(args.seed)
    hardware = describe_machine()
    record = {
        "benchmark": "moe_delta",
        "date": datetime.date.today().isoformat(),
        "args": vars(args),
        "hardware": hardware,
        "load_avg_start": list(os.getloadavg()),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for kind, config in architectures(args).items():
            record[kind] = train_and_publish(kind, config, args, os.path.join(tmp, kind), parallel, runtime)
    record["load_avg_end"] = list(os.getloadavg())
    moe, dense = record["moe"]["steps"][-1], record["dense"]["steps"][-1]
    record["summary"] = {
        "moe_ratio": moe["ratio"],
        "dense_ratio": dense["ratio"],
        "moe_stored_bytes": moe["stored_bytes"],
        "dense_stored_bytes": dense["stored_bytes"],
    }
    name = f"moe-delta-{hardware['cores']}cpu-{hardware['machine']}-{record['date']}{args.tag}"
    write_results(RESULTS / name, record, markdown(record))
    close_runtime(runtime)
    exit_worker(0)  # FSDP2's gloo threads can abort a normal interpreter exit (trainer/parallel.py)


if __name__ == "__main__":
    raise SystemExit(main())
