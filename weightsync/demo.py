"""demo: the whole publish → store → follow loop on one machine, on embedded defaults.

A small causal language model trains with AdamW on fp32 master weights; after every step the
publisher snapshots its bf16 weights and publishes a version in the background (the step waits
only for the snapshot). A follower — what a sync agent does beside an inference server —
advances its own copy of the weights version by version from the store, verifying every hash,
and the demo checks bit for bit (`torch.equal`) that it holds exactly what the trainer
published. It ends with a table per version and writes it as JSON.

Not here: the FSDP2 trainer, gRPC agents and hot swap (their own modules); this demo grows
into the full asynchronous RL loop as they land.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import torch
from torch import nn

from weightsync.publisher import Publisher, PublisherConfig, PublishResult
from weightsync.reader import Reader, WeightsState
from weightsync.store import open_store

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    store: str = "file://weightsync-demo/store"
    """Where versions go; the default is a directory under the current one."""
    model: str = "demo-lm"
    steps: int = 12
    """Optimizer steps, each published as one version."""
    warmup_steps: int = 5
    """Unpublished steps at `warmup_lr` first, so Adam's moments are warm like in a real run."""
    lr: float = 3e-6
    warmup_lr: float = 1e-4
    dim: int = 512
    layers: int = 4
    vocab: int = 256
    seq_len: int = 64
    batch: int = 16
    seed: int = 0
    rebase_every: int = 8
    out: str = "weightsync-demo/summary.json"

    def __post_init__(self) -> None:
        if self.steps < 1 or self.warmup_steps < 0:
            raise ValueError("steps must be >= 1 and warmup_steps >= 0")


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)
        self.mix = nn.Linear(dim, dim, bias=False)  # causal token mixing via a cumulative mean

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        counts = torch.arange(1, x.shape[1] + 1, device=x.device).view(1, -1, 1)
        x = x + self.mix(h.cumsum(dim=1) / counts)
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """A small causal LM, enough to make realistic successive bf16 checkpoints."""

    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _batch(generator: torch.Generator, config: DemoConfig) -> torch.Tensor:
    # Sequences counting up from a random start (mod vocab): learnable, so gradients are real.
    start = torch.randint(0, config.vocab, (config.batch, 1), generator=generator)
    return (start + torch.arange(config.seq_len + 1)) % config.vocab


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def _bf16_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().to(torch.bfloat16) for name, p in model.state_dict().items()}


def run_demo(config: DemoConfig, *, echo=print) -> dict:
    """Runs the demo; returns the summary (also written to `config.out`)."""
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    model = TinyLM(config.vocab, config.dim, config.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.warmup_lr, betas=(0.9, 0.95), weight_decay=0.0)
    n_params = sum(p.numel() for p in model.parameters())
    store = open_store(config.store)
    echo(f"weightsync demo: {n_params / 1e6:.1f}M-parameter model, store {store.uri}, model {config.model!r}")

    for _ in range(config.warmup_steps):
        _train_step(model, optimizer, _batch(generator, config))
    for group in optimizer.param_groups:
        group["lr"] = config.lr

    publisher_config = PublisherConfig(rebase_every=config.rebase_every, parent_from_store=False)
    reader = Reader(store, model=config.model)
    follower = WeightsState(manifest=None, buffers={})
    rows = []
    header = f"{'version':>7} {'step':>4} {'kind':>5} {'changed':>8} {'stored':>10} {'ratio':>7} {'publish':>8} {'follow':>7} {'bit-exact':>9}"
    echo(header)
    with Publisher(store, model=config.model, config=publisher_config) as publisher:
        for step in range(1, config.steps + 1):
            loss = _train_step(model, optimizer, _batch(generator, config))
            published = _bf16_state(model)
            result: PublishResult = publisher.publish(model.state_dict(), step=step).result()
            t0 = time.perf_counter()
            reader.advance(follower, result.version)
            follow_s = time.perf_counter() - t0
            served = follower.state_dict()
            exact = served.keys() == published.keys() and all(torch.equal(served[k], published[k]) for k in published)
            row = {
                "version": result.version,
                "step": step,
                "loss": round(loss, 4),
                "kind": result.manifest.kind,
                "changed_fraction": result.changed_elements / max(1, result.total_elements),
                "raw_bytes": result.raw_bytes,
                "stored_bytes": result.stored_bytes + result.manifest_bytes,
                "ratio": result.ratio,
                "publish_s": result.total_s,
                "follow_s": follow_s,
                "bit_exact": exact,
            }
            rows.append(row)
            echo(
                f"{row['version']:>7} {step:>4} {row['kind']:>5} {100 * row['changed_fraction']:>7.2f}% "
                f"{row['stored_bytes'] / 1e3:>8.1f}kB {row['ratio']:>6.1f}x {row['publish_s']:>7.3f}s "
                f"{follow_s:>6.3f}s {'yes' if exact else 'NO':>9}"
            )
            if not exact:
                raise AssertionError(f"follower's weights differ from the trainer's at version {result.version}")
    deltas = [r for r in rows if r["kind"] == "delta"]
    summary = {
        "config": dataclasses.asdict(config),
        "parameters": n_params,
        "versions": rows,
        "all_bit_exact": all(r["bit_exact"] for r in rows),
        "mean_delta_ratio": sum(r["ratio"] for r in deltas) / len(deltas) if deltas else None,
    }
    out = Path(config.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    if deltas:
        echo(f"{len(rows)} versions, all bit-exact; deltas {summary['mean_delta_ratio']:.0f}x smaller than the "
             f"model on average. Summary: {out}")
    return summary
