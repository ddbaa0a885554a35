"""checkpoints: realistic successive bf16 checkpoints for the codec benchmarks.

Trains the project's decoder (`weightsync.models.CausalLM` as a Llama: Hugging Face tensor names,
untied head) the way an RL trainer does — fp32 master weights, AdamW with warm moments — and takes the bf16 cast of every
parameter after each optimizer step. What makes these pairs realistic for a delta codec is not
the model's quality but the update statistics: a step at lr 1e-6..1e-5 moves each fp32 master
weight by a tiny amount, and only the weights whose move crosses a bf16 rounding boundary change
their bf16 bit pattern, almost always by exactly one ULP. `series_stats` measures exactly that.

The data is synthetic: token sequences from a fixed sparse Markov chain (each token has a few
likely successors), so the loss is learnable and the gradients have structure, like a real
fine-tuning signal, instead of the near-uniform gradients that random tokens give.

`make_lm_series` does the same for the project's own model (`weightsync.models.CausalLM`) at about
0.1 / 0.5 / 1 GiB of bf16 (`LM_ARCHITECTURES`), writing each checkpoint to the cache as it is made,
for the transfer benchmarks (`bench/sync_latency.py`), whose agents serve those checkpoints.

Not here: the trainer (`trainer/`), any compression (see
`bench/baselines.py` and `weightsync.format.codecs`), and checkpoint *files* beyond the optional cache.
Nothing here is imported by `weightsync`.

Run `python -m bench.checkpoints` from the repository root to train the default series and print
the changed fractions per lr.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from weightsync.models import CausalLM, ModelConfig, build_model, num_parameters

logger = logging.getLogger(__name__)

# Bump when anything that changes the produced tensors changes (model code, data, training
# loop), so stale caches are never reused.
_CACHE_FORMAT = 1  # still 1: weightsync.models trains bit-identical series to the decoder this file had


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Everything that determines a checkpoint series; its hash keys the on-disk cache.

    The defaults give a ~31M-parameter model (8.4M of it the untied embedding and lm_head) whose
    training step takes well under a second on 2 CPU cores, and changed fractions per lr close to
    what full-size RL runs show (see `series_stats`).
    """

    # -- model (a Llama, see model_config(); head_dim = hidden_size // num_heads) --
    vocab_size: int = 8192
    hidden_size: int = 512
    intermediate_size: int = 1536  # SwiGLU width
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 2  # GQA: each k/v head serves num_heads // num_kv_heads query heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    # Normal init of every Linear and the embedding, as HF Llama does (its default is 0.02).
    # The changed fraction per step scales roughly with 1/init_std; 0.015 puts the defaults in the
    # ranges measured on real RL runs (lr 1e-6 / 3e-6 / 1e-5 -> ~1.4 / 3.4 / 8.9 % changed).
    init_std: float = 0.015

    # -- data --
    seed: int = 0  # seeds the init, the Markov chain and the batch sampler
    batch_size: int = 4
    seq_len: int = 128
    markov_branching: int = 4  # likely successors per token; fewer = more learnable

    # -- optimizer (AdamW on fp32 master weights) --
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01  # applied to matrices only, not to norm weights
    grad_clip: float | None = 1.0  # max global grad norm; None disables clipping

    # -- schedule --
    warmup_lr: float = 1e-4
    warmup_steps: int = 20  # at warmup_lr, so that Adam's moments are warm before the lrs below
    lrs: tuple[float, ...] = (1e-6, 3e-6, 1e-5)
    steps_per_lr: int = 3  # each lr's list has steps_per_lr + 1 checkpoints

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("head_dim must be even for RoPE")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.steps_per_lr < 1:
            raise ValueError("steps_per_lr must be >= 1 (a series needs at least 2 checkpoints)")
        if not self.lrs or len(set(self.lrs)) != len(self.lrs):
            raise ValueError("lrs must be non-empty and distinct")
        if not 1 <= self.markov_branching <= self.vocab_size:
            raise ValueError("markov_branching must be in [1, vocab_size]")

    def cache_key(self) -> str:
        blob = json.dumps({"format": _CACHE_FORMAT, "config": dataclasses.asdict(self)}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:20]

    def model_config(self) -> ModelConfig:
        """The decoder these fields describe: a Llama (no q/k norms, no biases) with an untied head."""
        return ModelConfig(
            model_type="llama",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=max(2048, self.seq_len),
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            initializer_range=self.init_std,
        )


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


class MarkovTokens:
    """Batches of token sequences from a fixed, seeded sparse Markov chain.

    Each token has `markov_branching` successors with skewed probabilities, so a model can
    learn the chain and its gradients concentrate on the rows/features that matter — closer to a
    real fine-tuning signal than uniform random tokens.
    """

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        chain_gen = torch.Generator().manual_seed(config.seed + 1)
        v, k = config.vocab_size, config.markov_branching
        self.successors = torch.randint(0, v, (v, k), generator=chain_gen)
        weights = torch.rand(v, k, generator=chain_gen) ** 2 + 0.05  # skewed, never zero
        self.probs = weights / weights.sum(dim=1, keepdim=True)
        self.generator = torch.Generator().manual_seed(config.seed + 2)

    def get_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    def next_batch(self) -> torch.Tensor:
        """(batch_size, seq_len + 1) int64 tokens; inputs are [:, :-1], targets [:, 1:]."""
        b, t = self.config.batch_size, self.config.seq_len + 1
        out = torch.empty(b, t, dtype=torch.long)
        out[:, 0] = torch.randint(0, self.config.vocab_size, (b,), generator=self.generator)
        for j in range(1, t):
            prev = out[:, j - 1]
            choice = torch.multinomial(self.probs[prev], 1, generator=self.generator).squeeze(1)
            out[:, j] = self.successors[prev, choice]
        return out


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def _make_optimizer(model: nn.Module, config: CheckpointConfig, lr: float) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=config.betas,
        eps=config.eps,
        # The single-tensor path keeps the arithmetic identical across runs/platforms we use.
        foreach=False,
    )


def _train_step(model: CausalLM, opt: torch.optim.Optimizer, data: MarkovTokens, config: CheckpointConfig) -> float:
    batch = data.next_batch()
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if config.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    opt.step()
    return loss.item()


def bf16_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint an RL trainer would ship: the bf16 cast of every parameter, HF names."""
    # .to(bfloat16) already allocates a fresh tensor, so the result never aliases the fp32 master.
    return {name: p.detach().to(torch.bfloat16).contiguous() for name, p in model.named_parameters()}


def _train_series(config: CheckpointConfig) -> dict[float, list[dict[str, torch.Tensor]]]:
    t0 = time.perf_counter()
    model = build_model(config.model_config(), seed=config.seed)
    data = MarkovTokens(config)
    opt = _make_optimizer(model, config, config.warmup_lr)
    loss = float("nan")
    for _ in range(config.warmup_steps):
        loss = _train_step(model, opt, data, config)
    logger.info(
        "warm-up: %d steps at lr %g, loss %.3f, %.1fs (%d params)",
        config.warmup_steps,
        config.warmup_lr,
        loss,
        time.perf_counter() - t0,
        num_parameters(config.model_config()),
    )

    # Each lr restarts from the same warmed-up weights, moments and batch stream, so the lrs
    # differ only in the lr. Deep copies are needed because Optimizer.load_state_dict keeps
    # (and then mutates in place) tensors that already have the right dtype/device.
    model_snapshot = copy.deepcopy(model.state_dict())
    opt_snapshot = copy.deepcopy(opt.state_dict())
    data_snapshot = data.get_state()

    series: dict[float, list[dict[str, torch.Tensor]]] = {}
    for lr in config.lrs:
        t1 = time.perf_counter()
        model.load_state_dict(model_snapshot)
        opt = _make_optimizer(model, config, lr)
        opt.load_state_dict(copy.deepcopy(opt_snapshot))
        for group in opt.param_groups:
            group["lr"] = lr
        data.set_state(data_snapshot)
        checkpoints = [bf16_state_dict(model)]
        for _ in range(config.steps_per_lr):
            loss = _train_step(model, opt, data, config)
            checkpoints.append(bf16_state_dict(model))
        series[lr] = checkpoints
        logger.info("lr %g: %d steps, loss %.3f, %.1fs", lr, config.steps_per_lr, loss, time.perf_counter() - t1)
    return series


# --------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------


def _cache_load(path: Path, config: CheckpointConfig) -> dict[float, list[dict[str, torch.Tensor]]] | None:
    from safetensors.torch import load_file

    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest["config"] != json.loads(json.dumps(dataclasses.asdict(config))):
            logger.warning("cache %s holds another config (hash collision?); retraining", path)
            return None
        names = manifest["names"]
        series = {}
        for lr, files in zip(config.lrs, manifest["files"], strict=True):
            checkpoints = []
            for file in files:
                tensors = load_file(path / file)
                # safetensors stores tensors sorted; restore the model's (HF) parameter order.
                checkpoints.append({name: tensors[name] for name in names})
            series[lr] = checkpoints
        return series
    except (OSError, KeyError, ValueError) as exc:
        logger.warning("unreadable cache %s (%s); retraining", path, exc)
        return None


def _cache_store(path: Path, config: CheckpointConfig, series: dict[float, list[dict[str, torch.Tensor]]]) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    # Write into a private temp dir and rename it into place: a reader never sees half a cache,
    # and two concurrent bench runs do not corrupt each other (the loser's copy is dropped).
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
    try:
        files = []
        names: list[str] = []
        for i, lr in enumerate(config.lrs):
            lr_files = []
            for j, sd in enumerate(series[lr]):
                names = list(sd)
                file = f"lr{i}_{lr:g}_ckpt{j}.safetensors"
                save_file(sd, tmp / file)
                lr_files.append(file)
            files.append(lr_files)
        manifest = {"config": dataclasses.asdict(config), "names": names, "files": files}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        try:
            os.rename(tmp, path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # someone else stored it first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def make_checkpoint_series(
    config: CheckpointConfig, *, cache_dir: str | os.PathLike[str] | None = None
) -> dict[float, list[dict[str, torch.Tensor]]]:
    """For each lr, a list of >= 2 successive bf16 state dicts (HF names, contiguous CPU tensors, cloned).

    `series[lr][0]` is the warmed-up model (the same for every lr); `series[lr][j + 1]` is one
    AdamW step at `lr` after `series[lr][j]`. Dict order is the model's parameter order.

    With `cache_dir`, the series is read from `cache_dir/<config hash>/` if present, else
    trained and stored there as safetensors files. The cache is keyed by the config only (not by
    torch version or thread count, which may change the last bits of training but not the
    statistics the benchmarks care about).
    """
    if cache_dir is not None:
        path = Path(cache_dir) / config.cache_key()
        cached = _cache_load(path, config)
        if cached is not None:
            logger.info("checkpoint series from cache %s", path)
            return cached
    series = _train_series(config)
    if cache_dir is not None:
        _cache_store(path, config, series)
        logger.info("checkpoint series cached in %s", path)
    return series


# --------------------------------------------------------------------------------------------
# Series of the project's model (weightsync.models.CausalLM), streamed to disk
# --------------------------------------------------------------------------------------------

# Bump when anything that changes the tensors of an LM series changes (independent of _CACHE_FORMAT).
_LM_CACHE_FORMAT = 1

# Qwen3-style architectures of about 0.1 / 0.5 / 1 GiB of bf16 weights (54M / 269M / 545M parameters),
# untied head, 32k vocabulary: the embedding/head share of a small real LLM.
LM_ARCHITECTURES = {
    0.1: {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 7,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    },
    0.5: {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 18,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    },
    1.0: {
        "hidden_size": 1536,
        "intermediate_size": 4096,
        "num_hidden_layers": 18,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    },
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMSeriesConfig:
    """A series of bf16 checkpoints of `weightsync.models.CausalLM` (HF names, servable by the agents'
    reference engine), trained like `CheckpointConfig` but sized for transfer benchmarks.

    Large models train slowly on a CPU (a 545M model: ~10 s and ~9 GB per step), so the lrs run
    one after another from the same warm model instead of each from a copy of the warm-up state
    (a copy of the weights and moments would cost 3x the model in memory): lr i starts where
    lr i-1 ended. Adam's moments stay warm throughout, which is what sets the changed fractions.
    """

    model: ModelConfig
    seed: int = 0
    batch_size: int = 2
    seq_len: int = 64
    markov_branching: int = 4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float | None = 1.0
    warmup_lr: float = 1e-4
    warmup_steps: int = 6
    lrs: tuple[float, ...] = (1e-6, 3e-6, 1e-5)
    steps_per_lr: int = 3  # base + 3 deltas per lr: two to reach the agents' steady state, one to measure

    @property
    def vocab_size(self) -> int:  # what MarkovTokens reads
        return self.model.vocab_size

    def cache_key(self) -> str:
        blob = json.dumps({"format": _LM_CACHE_FORMAT, "config": dataclasses.asdict(self)}, sort_keys=True).encode()
        return "lm-" + hashlib.sha256(blob).hexdigest()[:20]


def lm_series_config(size_gib: float, **overrides) -> LMSeriesConfig:
    """The series config of one of the LM_ARCHITECTURES sizes."""
    if size_gib not in LM_ARCHITECTURES:
        raise ValueError(f"no architecture for {size_gib} GiB; known sizes: {sorted(LM_ARCHITECTURES)}")
    arch = ModelConfig(model_type="qwen3", vocab_size=32000, initializer_range=0.015, **LM_ARCHITECTURES[size_gib])
    return LMSeriesConfig(model=arch, **overrides)


@dataclasses.dataclass(frozen=True)
class LMSeries:
    """A cached series: `files[i][j]` is checkpoint j of lr `config.lrs[i]` (a safetensors file)."""

    config: LMSeriesConfig
    path: Path
    files: tuple[tuple[str, ...], ...]
    names: tuple[str, ...]

    def file(self, lr: float, j: int) -> Path:
        return self.path / self.files[self.config.lrs.index(lr)][j]

    def load(self, lr: float, j: int, *, resident: bool = False) -> dict[str, torch.Tensor]:
        """Checkpoint j of `lr` as bf16 tensors in the model's parameter order.

        The tensors map the file's pages until first read. `resident`: copies in memory, as a
        trainer's weights are, for benchmarks that time reading them (faulting the pages in made
        publish()'s copy of 1 GiB take 0.13-0.15 CPU-s instead of 0.07 on the 2-core machine)."""
        from safetensors.torch import load_file

        tensors = load_file(self.file(lr, j))
        return {name: tensors[name].clone() if resident else tensors[name] for name in self.names}


def make_lm_series(config: LMSeriesConfig, *, cache_dir: str | os.PathLike[str]) -> LMSeries:
    """The series from `cache_dir/<key>/`, trained and written there first if absent. Each checkpoint
    is written as soon as it exists, so memory holds the training state and one bf16 copy only."""
    path = Path(cache_dir) / config.cache_key()
    series = _lm_series_open(path, config)
    if series is None:
        _lm_series_train(config, path)
        series = _lm_series_open(path, config)
        if series is None:
            raise RuntimeError(f"the LM series just written to {path} cannot be read back")
    return series


def _lm_series_open(path: Path, config: LMSeriesConfig) -> LMSeries | None:
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        if manifest["config"] != json.loads(json.dumps(dataclasses.asdict(config))):
            return None
        files = tuple(tuple(f) for f in manifest["files"])
        if not all((path / f).is_file() for fs in files for f in fs):
            return None
        return LMSeries(config, path, files, tuple(manifest["names"]))
    except (OSError, KeyError, ValueError):
        return None


def _lm_series_train(config: LMSeriesConfig, path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
    try:
        t0 = time.perf_counter()
        model = build_model(config.model, seed=config.seed)
        data = MarkovTokens(config)  # type: ignore[arg-type]  # reads only fields both configs have
        opt = _make_optimizer(model, config, config.warmup_lr)  # type: ignore[arg-type]
        loss = float("nan")
        for _ in range(config.warmup_steps):
            loss = _train_step(model, opt, data, config)  # type: ignore[arg-type]
        logger.info(
            "LM warm-up: %d steps, loss %.3f, %.1fs (%d params)",
            config.warmup_steps,
            loss,
            time.perf_counter() - t0,
            num_parameters(config.model),
        )
        files = []
        names = [name for name, _ in model.named_parameters()]
        for i, lr in enumerate(config.lrs):
            t1 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr
            lr_files = []
            for j in range(config.steps_per_lr + 1):
                if j:
                    loss = _train_step(model, opt, data, config)  # type: ignore[arg-type]
                file = f"lr{i}_{lr:g}_ckpt{j}.safetensors"
                save_file(bf16_state_dict(model), tmp / file)
                lr_files.append(file)
            files.append(lr_files)
            logger.info("LM lr %g: %d steps, loss %.3f, %.1fs", lr, config.steps_per_lr, loss, time.perf_counter() - t1)
        manifest = {"config": dataclasses.asdict(config), "names": names, "files": files}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        try:
            os.rename(tmp, path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # a concurrent run stored it first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --------------------------------------------------------------------------------------------
# Realism statistics
# --------------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> np.ndarray:
    if t.dtype != torch.bfloat16:
        raise TypeError(f"expected bfloat16, got {t.dtype}")
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).ravel()


def _ordered(bits: np.ndarray) -> np.ndarray:
    # Sign-magnitude bit patterns to integers that are monotonic in the float value, so that
    # the ULP distance between two bf16 values is a plain difference (+0 and -0 both map to 0).
    mag = (bits & 0x7FFF).astype(np.int32)
    return np.where(bits & 0x8000, -mag, mag)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PairStats:
    """How two successive bf16 checkpoints differ."""

    elements: int
    changed: int
    one_ulp: int  # changed elements that moved by exactly one bf16 ULP

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements if self.elements else 0.0

    @property
    def one_ulp_fraction(self) -> float:
        return self.one_ulp / self.changed if self.changed else math.nan


def pair_stats(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> PairStats:
    if old.keys() != new.keys():
        raise ValueError("checkpoints have different tensor names")
    elements = changed = one_ulp = 0
    for name, a in old.items():
        a_bits, b_bits = _bits(a), _bits(new[name])
        diff = a_bits != b_bits
        elements += a_bits.size
        n = int(diff.sum())
        if n:
            changed += n
            dist = np.abs(_ordered(a_bits[diff]) - _ordered(b_bits[diff]))
            one_ulp += int((dist == 1).sum())
    return PairStats(elements=elements, changed=changed, one_ulp=one_ulp)


def series_stats(series: dict[float, list[dict[str, torch.Tensor]]]) -> dict[float, list[PairStats]]:
    """For each lr, the stats of every consecutive pair."""
    return {lr: [pair_stats(a, b) for a, b in itertools.pairwise(cks)] for lr, cks in series.items()}


def format_stats(stats: dict[float, list[PairStats]]) -> str:
    lines = []
    for lr, pairs in stats.items():
        fracs = ", ".join(f"{p.changed_fraction:.2%}" for p in pairs)
        changed = sum(p.changed for p in pairs)
        one = sum(p.one_ulp for p in pairs)
        lines.append(f"lr {lr:g}: changed per step [{fracs}]; {one / max(changed, 1):.1%} of changes are exactly 1 ULP")
    return "\n".join(lines)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=None, help="reuse/store the series here (e.g. bench/.cache)")
    parser.add_argument("--lm-size", type=float, help="train the CausalLM series of this size (GiB) instead")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.lm_size is not None:
        lm = make_lm_series(lm_series_config(args.lm_size), cache_dir=args.cache_dir or "bench/.cache")
        for lr in lm.config.lrs:
            old, new = lm.load(lr, lm.config.steps_per_lr - 1), lm.load(lr, lm.config.steps_per_lr)
            print(f"lr {lr:g}: last pair {pair_stats(old, new).changed_fraction:.2%} changed ({lm.path})")
        return
    config = CheckpointConfig()
    t0 = time.perf_counter()
    series = make_checkpoint_series(config, cache_dir=args.cache_dir)
    print(f"{num_parameters(config.model_config()) / 1e6:.1f}M params; series in {time.perf_counter() - t0:.1f}s")
    print(format_stats(series_stats(series)))


if __name__ == "__main__":
    main()
