"""config: the trainer's settings, read from TOML into frozen, validated dataclasses.

Two halves, kept apart as torchtitan does: `ParallelConfig` (how the job is laid out on
devices: mesh degrees, backend, mixed precision, offload, activation checkpointing) and
`TrainConfig` (what it computes: model, optimizer, schedule, data, loss, guard, checkpoints,
publishing). A file looks like `trainer/configs/sft_tiny.toml`:

    [parallel]              # ParallelConfig
    [train]                 # TrainConfig scalars (steps, seed, ...)
    [train.model]           # ModelSpec: an HF init dir, or architecture fields of ModelConfig
    [train.optimizer] [train.schedule] [train.data] [train.loss]
    [train.guard] [train.checkpoint] [train.publish] [train.publish.publisher]

Every key is checked by weightsync.settings, the reader of every TOML config: an unknown key is an
error with "did you mean" (a typo must not silently fall back to a default), a value of the wrong
TOML type or one a class refuses is a ConfigError naming the setting and the value (`weightsync
train` exits 2 on it, before any rank starts). `--set a.b=v` overrides apply to the parsed
document before validation, with TOML value syntax.

Not here: anything that needs torch.distributed or a device (that is `parallel.py`), and
checks that need the world size (the trainer makes those when it builds the mesh).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from weightsync.errors import ConfigError
from weightsync.format.probe import COMPUTE_DTYPES as PROBE_COMPUTE_DTYPES
from weightsync.listen import is_host
from weightsync.models import ModelConfig
from weightsync.models.packed import PackFormat
from weightsync.publisher import PublisherConfig
from weightsync.settings import build_table, check_known_keys, check_required, check_type

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
MIXED_PRECISION = ("none", "bf16")
LOSS_KINDS = ("sft", "grpo")
DECAYS = ("constant", "linear", "cosine")
SOURCE_TYPES = ("arithmetic", "reverse", "jsonl", "rollouts")
GUARD_ACTIONS = ("skip", "rollback")
GUARD_WATCH = ("loss", "loss/nll", "grad_norm")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How ranks and devices are laid out; turned into a DeviceMesh once, by `parallel.py`."""

    dp_replicate: int = 1
    """Replica groups (HSDP: each group holds a whole sharded copy). 1 = plain FSDP."""
    dp_shard: int = -1
    """Ranks one copy of the model is sharded over; -1 = world size / (dp_replicate x tp x ep)."""
    tp: int = 1
    """Tensor parallelism (dense models): each attention and MLP weight split over this many ranks,
    which see the same batch; FSDP2 shards over dp_shard. dp_shard x tp = world size."""
    ep: int = 1
    """Expert parallelism (MoE models): the experts partitioned over this many ranks, tokens
    dispatched to them by all_to_all; every rank sees its own batch. dp_shard x ep = world size."""
    backend: str = "auto"
    """Process-group backend: "auto" (NCCL for CUDA tensors plus gloo for CPU ones when CUDA is
    available, else gloo), "gloo" or "nccl"."""
    device: str = "auto"
    """"auto" (cuda:LOCAL_RANK when CUDA is available, else cpu), "cpu" or "cuda"."""
    mixed_precision: str = "none"
    """"bf16": parameters are all-gathered and computed in bf16, gradients reduced in fp32, the
    master weights and optimizer state stay fp32. "none": fp32 compute (faster on CPUs that
    lack bf16 hardware)."""
    cpu_offload: bool = False
    """FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer state live in host
    memory and the optimizer steps there; only all-gathered layers occupy the device."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them."""
    reshard_after_forward: bool = True
    """Free all-gathered layer weights after forward (ZeRO-3); False keeps them until backward."""
    frozen_experts: str | None = None
    """How a MoE model's routed experts are held when they do not train: "int4" or "int8" (packed,
    one bf16 scale per 128 input columns; "int4:64" for groups of 64), or "bf16"; dequantized on
    the fly (weightsync.models.packed). Setting it freezes the experts (a LoRA run freezes them
    anyway; in full fine-tuning the rest of the model still trains). Unset (the default): experts
    are fp32 master weights like the rest. Dense models ignore it."""

    def __post_init__(self) -> None:
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("device", self.device, DEVICES)
        _check_choice("mixed_precision", self.mixed_precision, MIXED_PRECISION)
        if self.frozen_experts is not None:
            try:
                PackFormat.parse(self.frozen_experts)
            except ValueError as e:
                raise ValueError(f"frozen_experts: {e}") from None
        if self.dp_replicate < 1:
            raise ValueError(f"dp_replicate must be >= 1, got {self.dp_replicate}")
        if self.dp_shard != -1 and self.dp_shard < 1:
            raise ValueError(f"dp_shard must be >= 1, or -1 for all remaining ranks; got {self.dp_shard}")
        for name in ("tp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (1: off), got {value!r}")
        if self.tp > 1 and self.ep > 1:
            raise ValueError("tp and ep cannot both be > 1: tp is for dense models, ep for MoE")
        if (self.tp > 1 or self.ep > 1) and self.dp_replicate > 1:
            raise ValueError("tp and ep need dp_replicate = 1 (HSDP with them is not built)")
        if self.ep > 1 and self.frozen_experts is not None:
            raise ValueError("frozen_experts with ep > 1 is not built: unset one of them")
        if self.backend == "nccl" and self.device == "cpu":
            raise ValueError("backend 'nccl' needs CUDA devices; use backend 'gloo' (or 'auto') with device 'cpu'")

    def mesh_shape(self, world_size: int) -> tuple[int, int]:
        """(dp_replicate, dp_shard) for `world_size` ranks; raises ValueError if they do not fit."""
        model_parallel = self.tp * self.ep
        shard = self.dp_shard if self.dp_shard != -1 else world_size // (self.dp_replicate * model_parallel)
        if shard < 1 or self.dp_replicate * shard * model_parallel != world_size:
            raise ValueError(
                f"parallel.dp_replicate ({self.dp_replicate}) x parallel.dp_shard ({self.dp_shard}) x parallel.tp "
                f"({self.tp}) x parallel.ep ({self.ep}) must equal the world size ({world_size}); set dp_shard = -1 "
                "to use every rank"
            )
        return self.dp_replicate, shard


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The model to train: an HF-style directory as initial weights, or an architecture
    initialised from `init_seed` (the same weights whatever the world size)."""

    init_dir: str | None = None
    """HF-style directory (config.json + safetensors) whose weights start the run."""
    architecture: ModelConfig | None = None
    """Architecture for a freshly initialised model (the ModelConfig fields of [train.model])."""
    init_seed: int = 0
    """Seed of the fresh initialisation (ignored with init_dir)."""

    def __post_init__(self) -> None:
        if (self.init_dir is None) == (self.architecture is None):
            raise ValueError(
                '[train.model] needs exactly one of: init_dir = "HF dir", or architecture fields '
                "(hidden_size, num_hidden_layers, ...)"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW on the fp32 master weights."""

    lr: float = 3e-4
    """Peak learning rate (reached at the end of warm-up)."""
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {list(self.betas)}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        _at_least("weight_decay", self.weight_decay, 0)
        _at_least("max_grad_norm", self.max_grad_norm, 0, meaning="0 disables clipping")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """Learning rate per step: linear warm-up from 0, then a decay to min_lr_ratio * lr."""

    warmup_steps: int = 0
    decay: str = "constant"
    """"constant", "linear" or "cosine" from the end of warm-up to train.steps."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of the peak (for linear and cosine decay)."""

    def __post_init__(self) -> None:
        _check_choice("decay", self.decay, DECAYS)
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where examples come from and how many make one optimizer step."""

    source: str = "arithmetic"
    """"arithmetic" (synthetic a+b=c SFT), "reverse" (synthetic string reversal SFT), "jsonl"
    (token ids and loss weights per line, see data.JsonlSource) or "rollouts" (GRPO examples from a
    rollout queue; only the RL job, weightsync.app.demo.rl, builds that one)."""
    path: str | None = None
    """The JSONL file, for source = "jsonl"."""
    global_batch_size: int = 8
    """Examples per optimizer step, over all data-parallel ranks and micro-batches."""
    micro_batch_size: int = 4
    """Examples per forward/backward on one rank; global_batch_size / (dp ranks x micro_batch_size)
    micro-batches are accumulated per step (gradient sync only on the last one)."""
    max_seq_len: int = 256
    """Longer examples are refused (not truncated: a cut response would train on a lie)."""
    pad_multiple: int = 8
    """Micro-batches are padded to the longest example rounded up to this many tokens."""
    seed: int = 0
    """Seed of the synthetic tasks and of the JSONL shuffle."""
    shuffle: bool = True
    """JSONL: visit lines in a fresh seeded permutation each epoch."""

    def __post_init__(self) -> None:
        _check_choice("source", self.source, SOURCE_TYPES)
        if self.source == "jsonl" and not self.path:
            raise ValueError('source = "jsonl" needs path, the JSONL file: path = "data/train.jsonl"')
        _at_least("global_batch_size", self.global_batch_size, 1)
        _at_least("micro_batch_size", self.micro_batch_size, 1)
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        _at_least("max_seq_len", self.max_seq_len, 2)
        _at_least("pad_multiple", self.pad_multiple, 1)

    def grad_accum_steps(self, dp_size: int) -> int:
        """Micro-batches per step on each rank; raises ValueError if the batch does not split evenly."""
        per_step = self.micro_batch_size * dp_size
        if self.global_batch_size % per_step:
            raise ValueError(
                f"train.data.global_batch_size ({self.global_batch_size}) must be a multiple of micro_batch_size "
                f"({self.micro_batch_size}) x data-parallel ranks ({dp_size})"
            )
        return self.global_batch_size // per_step


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The objective: SFT cross-entropy, or a GRPO-style clipped policy gradient."""

    kind: str = "sft"
    """"sft": token cross-entropy weighted by loss weights. "grpo": importance-weighted, clipped
    policy gradient with per-sequence advantages and the sampler's log-probs."""
    clip_low: float = 0.2
    """GRPO: the ratio is clipped to [1 - clip_low, 1 + clip_high]."""
    clip_high: float = 0.28
    """GRPO: upper clip; above clip_low ("clip-higher") keeps exploration on rare tokens."""
    dual_clip: float = 3.0
    """GRPO: for negative advantages the per-token loss is capped at dual_clip * |A| (a very
    stale or unlikely sample cannot blow the step up); 0 disables it. Must be > 1."""
    kl_coef: float = 0.0
    """GRPO: weight of the k3 KL estimate to a frozen reference (the initial weights); 0 = no
    reference model is built."""

    def __post_init__(self) -> None:
        _check_choice("kind", self.kind, LOSS_KINDS)
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        _at_least("clip_high", self.clip_high, 0)
        if self.dual_clip and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (or 0 to disable), got {self.dual_clip}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.kind == "sft" and self.kl_coef:
            raise ValueError(f'kl_coef ({self.kl_coef}) applies to kind = "grpo" only; remove it or set kind = "grpo"')


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """The loss-spike / NaN guard (see guard.py)."""

    enabled: bool = True
    spike_factor: float = 3.0
    """A step whose loss exceeds spike_factor x the median of recent accepted losses is a spike."""
    window: int = 32
    """Accepted steps the median is taken over."""
    min_history: int = 8
    """Spikes are only judged once this many steps were accepted (non-finite values always are)."""
    action: str = "rollback"
    """"skip": drop every bad step. "rollback": drop it, and after `rollback_after` bad steps in
    a row restore the last checkpoint (model, optimizer) and go on with fresh data."""
    rollback_after: int = 3
    watch: str = "loss"
    """The metric judged for spikes: "loss" (SFT), "loss/nll" (GRPO: the likelihood of the
    sampled tokens; a policy-gradient loss hovers around 0), or "grad_norm"."""

    def __post_init__(self) -> None:
        _check_choice("action", self.action, GUARD_ACTIONS)
        _check_choice("watch", self.watch, GUARD_WATCH)
        if self.spike_factor <= 1:
            raise ValueError(f"spike_factor must be > 1, got {self.spike_factor}")
        for name in ("window", "min_history", "rollback_after"):
            _at_least(name, getattr(self, name), 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """DCP checkpoints of model, optimizer, data position, RNG and step (see checkpoint.py)."""

    dir: str | None = None
    """Directory on storage every rank can reach; None disables checkpoints (and rollback)."""
    every_steps: int = 100
    """Save after every this many steps, and after the last one."""
    keep_last: int = 2
    """Older checkpoints are deleted once a newer one is complete."""
    resume: bool = True
    """Start from the newest complete checkpoint in `dir` when there is one."""

    def __post_init__(self) -> None:
        _at_least("every_steps", self.every_steps, 1)
        _at_least("keep_last", self.keep_last, 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublishConfig:
    """Publishing the weights from the loop (see publish.py)."""

    store: str | None = None
    """Store URI (any form `weightsync.stores.open_store` takes); None disables publishing."""
    model: str = "model"
    """Model name in the store."""
    every_steps: int = 1
    """Publish after every this many steps (and after the last one)."""
    commit_timeout_s: float = 600.0
    """How long rank 0 waits for every rank's part of a version (and the others for its
    commit) before that version fails; training goes on either way."""
    publisher: PublisherConfig = dataclasses.field(default_factory=PublisherConfig)
    """Settings of weightsync.publisher.Publisher ([train.publish.publisher] table)."""
    push: tuple[str, ...] = ()
    """Sync agents (host:port) every rank pushes its objects to as they are encoded, and offers
    each committed version to: one leader per region (weightsync.transport.push). Empty: store only."""
    push_token_file: str | None = None
    """Bearer token the agents require (or $WEIGHTSYNC_TOKEN)."""
    push_ca: str | None = None
    """CA certificate (PEM) of TLS agents; None: plaintext (loopback only)."""
    signing_key: str | None = None
    """Ed25519 private key (PEM, `weightsync keygen`): rank 0 signs every manifest with it."""
    metrics_port: int | None = None
    """Rank 0 serves the publisher's Prometheus metrics (weightsync_publish_*, weightsync_push_*) on
    this port (0: any free port); None: off."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics port binds: "0.0.0.0" for a Prometheus on another host."""
    log_path: str | None = None
    """Rank 0 appends one JSON line per committed version (version, step, when publish() was
    called, time to commit, bytes): what `weightsync demo` reports from."""
    probe_prompts: int = 4
    """Prompts of the numerical-parity probe each version carries (agents compare what their
    engine computes for them with the trainer's: agents/parity.py, trainer/probe.py); 0: no probe.
    MoE models may get up to as many again, so that every router chooses every expert."""
    probe_tokens: int = 32
    """Tokens per probe prompt: distinct seeded token ids, the same prompts for every version."""
    probe_dtypes: tuple[str, ...] = ("bfloat16", "float32")
    """Compute dtypes the probe records the published weights in: an engine is held to the record
    of the dtype it computes in (vLLM and the reference engine: bfloat16 by default), and one that
    does not say to the first."""
    probe_top_k: int = 8
    """Most likely next tokens per probe position the training forward records, for the
    training/inference gap figure (docs/agents.md, "Parity probe"); 0: no gap figure."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "push", tuple(self.push))
        if self.every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {self.every_steps}")
        if not self.commit_timeout_s > 0:
            raise ValueError(f"commit_timeout_s must be > 0, got {self.commit_timeout_s}")
        object.__setattr__(self, "probe_dtypes", tuple(self.probe_dtypes))
        if self.probe_prompts < 0 or self.probe_tokens < 2 or self.probe_top_k < 0:
            raise ValueError(
                f"probe_prompts must be >= 0 (0: no probe), probe_tokens >= 2 and probe_top_k >= 0 "
                f"(0: no gap figure), got {self.probe_prompts}, {self.probe_tokens} and {self.probe_top_k}"
            )
        if (
            not self.probe_dtypes
            or len(set(self.probe_dtypes)) != len(self.probe_dtypes)
            or not set(self.probe_dtypes) <= set(PROBE_COMPUTE_DTYPES)
        ):
            raise ValueError(
                f"probe_dtypes must list distinct compute dtypes of {list(PROBE_COMPUTE_DTYPES)}, the "
                f'engines\' first, e.g. ["bfloat16", "float32"]; got {list(self.probe_dtypes)}'
            )
        if not is_host(self.metrics_host):
            raise ValueError(
                f"metrics_host must be an address or host name without a port, got "
                f'{self.metrics_host!r}: e.g. metrics_host = "0.0.0.0" with metrics_port = 9401'
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What the job computes."""

    steps: int = 100
    """Optimizer steps of the run (a resumed run continues to this total)."""
    seed: int = 0
    """Seeds torch's RNG on every rank (offset by rank), for anything stochastic in the step."""
    log_every: int = 1
    """Print the metrics line every this many steps (rank 0)."""
    metrics_path: str | None = None
    """Also append every step's metrics as JSON lines to this file (rank 0)."""
    model: ModelSpec
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    guard: GuardConfig = dataclasses.field(default_factory=GuardConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    publish: PublishConfig = dataclasses.field(default_factory=PublishConfig)

    def __post_init__(self) -> None:
        _at_least("steps", self.steps, 1)
        _at_least("log_every", self.log_every, 1)
        if self.schedule.warmup_steps > self.steps:
            raise ValueError(
                f"schedule.warmup_steps ({self.schedule.warmup_steps}) is longer than the run (steps = {self.steps})"
            )
        if self.data.source in ("arithmetic", "reverse") and self.loss.kind != "sft":
            raise ValueError(
                f"the synthetic source {self.data.source!r} makes SFT examples (no advantages); use "
                'loss.kind = "sft", or a jsonl/rollout source for GRPO'
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobConfig:
    """One training job: parallelism and training settings."""

    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    train: TrainConfig

    def __post_init__(self) -> None:
        architecture = self.train.model.architecture
        if self.parallel.frozen_experts is None or architecture is None or not architecture.is_moe:
            return
        fmt = PackFormat.parse(self.parallel.frozen_experts)  # checked here, not in every rank's first step
        for name, columns in (
            ("hidden_size", architecture.hidden_size),
            ("moe_intermediate_size", architecture.moe_intermediate_size),
        ):
            try:
                fmt.check_fits(columns, f"[train.model] {name}")
            except ValueError as e:
                raise ValueError(f"[parallel] frozen_experts = {self.parallel.frozen_experts!r}: {e}") from None


# ------------------------------------------------------------------------------- loading

_HOWTO = {
    "train": 'add a [train] table, and a [train.model] table: init_dir = "HF dir" or architecture fields',
    "model": 'add a [train.model] table: init_dir = "HF dir", or architecture fields (hidden_size, '
    "num_hidden_layers, ...)",
}


def load_job_config(path: str | os.PathLike, overrides: Iterable[str] = ()) -> JobConfig:
    """Reads a TOML file, applies `--set key.path=value` overrides, validates; ConfigError naming
    the setting and the fix for anything wrong."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read trainer config {path}: {e}") from None
    for override in overrides:
        apply_override(doc, override)
    return parse_job_config(doc, where=f"trainer config {path}")


def apply_override(doc: dict, override: str) -> None:
    """Sets `a.b.c=value` in a parsed TOML document; value in TOML syntax (bare words are strings)."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {override!r} must look like section.key=value, e.g. --set train.steps=10")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word such as cpu or /tmp/dir
    *parents, leaf = key.strip().split(".")
    node = doc
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {override!r}: {part!r} is not a table")
    node[leaf] = value


def parse_job_config(doc: Mapping[str, Any], *, where: str = "trainer settings") -> JobConfig:
    """Builds a JobConfig from a parsed TOML document, every key checked (weightsync.settings:
    unknown keys with "did you mean", TOML types, each class's own checks); ConfigError naming
    the setting. Relative paths in it (init_dir, data path, checkpoint dir, metrics path, store)
    are relative to the working directory."""
    doc = dict(doc)
    check_known_keys(doc, {"parallel", "train"}, where=where, section="")
    check_required(doc, ["train"], where=where, section="", howto=_HOWTO)
    train = doc["train"]
    if isinstance(train, Mapping):
        check_required(train, ["model"], where=where, section="[train]", howto=_HOWTO)
        if isinstance(train["model"], Mapping):
            doc["train"] = {**train, "model": parse_model_spec(train["model"], where=where)}
    return build_table(JobConfig, doc, where=where, section="")


def parse_model_spec(table: Mapping[str, Any], *, where: str = "trainer settings") -> ModelSpec:
    """[train.model]: init_dir and init_seed beside the fields of ModelConfig (the architecture)."""
    section = "[train.model]"
    own = {"init_dir", "init_seed"}
    check_known_keys(table, own | {f.name for f in dataclasses.fields(ModelConfig)}, where=where, section=section)
    hints = typing.get_type_hints(ModelSpec)
    for key in own & set(table):
        check_type(table[key], hints[key], where=where, name=f"{section} {key}")
    fields = {k: v for k, v in table.items() if k not in own}
    architecture = build_table(ModelConfig, fields, where=where, section=section) if fields else None
    try:
        return ModelSpec(init_dir=table.get("init_dir"), architecture=architecture, init_seed=table.get("init_seed", 0))
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def _at_least(name: str, value: float, lowest: float, *, meaning: str = "") -> None:
    if not value >= lowest:
        raise ValueError(f"{name} must be >= {lowest}{f' ({meaning})' if meaning else ''}, got {value}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
