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

Unknown keys are errors (a typo must not silently fall back to a default). `--set a.b=v`
overrides apply to the parsed document before validation, with TOML value syntax.

Not here: anything that needs torch.distributed or a device (that is `parallel.py`), and
checks that need the world size (the trainer makes those when it builds the mesh).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from weightsync.format.probe import COMPUTE_DTYPES as PROBE_COMPUTE_DTYPES
from weightsync.listen import is_host
from weightsync.models import ModelConfig
from weightsync.models.packed import PackFormat
from weightsync.publisher import PublisherConfig

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
    """Ranks one copy of the model is sharded over; -1 = world size / dp_replicate."""
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
        _check_choice("parallel.backend", self.backend, BACKENDS)
        _check_choice("parallel.device", self.device, DEVICES)
        _check_choice("parallel.mixed_precision", self.mixed_precision, MIXED_PRECISION)
        if self.frozen_experts is not None:
            try:
                PackFormat.parse(self.frozen_experts)
            except ValueError as e:
                raise ValueError(f"parallel.frozen_experts: {e}") from None
        if self.dp_replicate < 1:
            raise ValueError(f"parallel.dp_replicate must be >= 1, got {self.dp_replicate}")
        if self.dp_shard != -1 and self.dp_shard < 1:
            raise ValueError(f"parallel.dp_shard must be >= 1, or -1 for all remaining ranks; got {self.dp_shard}")
        if self.backend == "nccl" and self.device == "cpu":
            raise ValueError(
                "parallel.backend 'nccl' needs CUDA devices; use backend 'gloo' (or 'auto') with device 'cpu'"
            )

    def mesh_shape(self, world_size: int) -> tuple[int, int]:
        """(dp_replicate, dp_shard) for `world_size` ranks; raises ValueError if they do not fit."""
        shard = self.dp_shard if self.dp_shard != -1 else world_size // self.dp_replicate
        if shard < 1 or self.dp_replicate * shard != world_size:
            raise ValueError(
                f"parallel.dp_replicate ({self.dp_replicate}) x parallel.dp_shard ({self.dp_shard}) must equal the "
                f"world size ({world_size}); set dp_shard = -1 to use every rank"
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
            raise ValueError(f"train.optimizer.lr must be a positive number, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"train.optimizer.betas must be two numbers in [0, 1), got {self.betas}")
        if self.eps <= 0 or self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ValueError("train.optimizer: eps must be > 0, weight_decay and max_grad_norm >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """Learning rate per step: linear warm-up from 0, then a decay to min_lr_ratio * lr."""

    warmup_steps: int = 0
    decay: str = "constant"
    """"constant", "linear" or "cosine" from the end of warm-up to train.steps."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of the peak (for linear and cosine decay)."""

    def __post_init__(self) -> None:
        _check_choice("train.schedule.decay", self.decay, DECAYS)
        if self.warmup_steps < 0:
            raise ValueError(f"train.schedule.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.schedule.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


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
        _check_choice("train.data.source", self.source, SOURCE_TYPES)
        if self.source == "jsonl" and not self.path:
            raise ValueError('train.data.source = "jsonl" needs train.data.path')
        if self.global_batch_size < 1 or self.micro_batch_size < 1:
            raise ValueError("train.data.global_batch_size and micro_batch_size must be >= 1")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"train.data.global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        if self.max_seq_len < 2 or self.pad_multiple < 1:
            raise ValueError("train.data.max_seq_len must be >= 2 and pad_multiple >= 1")

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
        _check_choice("train.loss.kind", self.kind, LOSS_KINDS)
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            raise ValueError("train.loss.clip_low must be in [0, 1) and clip_high >= 0")
        if self.dual_clip and self.dual_clip <= 1:
            raise ValueError(f"train.loss.dual_clip must be > 1 (or 0 to disable), got {self.dual_clip}")
        if self.kl_coef < 0:
            raise ValueError(f"train.loss.kl_coef must be >= 0, got {self.kl_coef}")
        if self.kind == "sft" and self.kl_coef:
            raise ValueError('train.loss.kl_coef applies to kind = "grpo" only; remove it or set kind = "grpo"')


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
        _check_choice("train.guard.action", self.action, GUARD_ACTIONS)
        _check_choice("train.guard.watch", self.watch, GUARD_WATCH)
        if self.spike_factor <= 1:
            raise ValueError(f"train.guard.spike_factor must be > 1, got {self.spike_factor}")
        if self.window < 1 or self.min_history < 1 or self.rollback_after < 1:
            raise ValueError("train.guard.window, min_history and rollback_after must be >= 1")


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
        if self.every_steps < 1 or self.keep_last < 1:
            raise ValueError("train.checkpoint.every_steps and keep_last must be >= 1")


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
            raise ValueError(f"train.publish.every_steps must be >= 1, got {self.every_steps}")
        if not self.commit_timeout_s > 0:
            raise ValueError(f"train.publish.commit_timeout_s must be > 0, got {self.commit_timeout_s}")
        object.__setattr__(self, "probe_dtypes", tuple(self.probe_dtypes))
        if self.probe_prompts < 0 or self.probe_tokens < 2 or self.probe_top_k < 0:
            raise ValueError(
                f"train.publish.probe_prompts must be >= 0 (0: no probe), probe_tokens >= 2 and probe_top_k >= 0 "
                f"(0: no gap figure), got {self.probe_prompts}, {self.probe_tokens} and {self.probe_top_k}"
            )
        if (
            not self.probe_dtypes
            or len(set(self.probe_dtypes)) != len(self.probe_dtypes)
            or not set(self.probe_dtypes) <= set(PROBE_COMPUTE_DTYPES)
        ):
            raise ValueError(
                f"train.publish.probe_dtypes must list distinct compute dtypes of {list(PROBE_COMPUTE_DTYPES)}, the "
                f'engines\' first, e.g. ["bfloat16", "float32"]; got {list(self.probe_dtypes)}'
            )
        if not is_host(self.metrics_host):
            raise ValueError(
                f"train.publish.metrics_host must be an address or host name without a port, got "
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
        if self.steps < 1 or self.log_every < 1:
            raise ValueError("train.steps and train.log_every must be >= 1")
        if self.schedule.warmup_steps > self.steps:
            raise ValueError(
                f"train.schedule.warmup_steps ({self.schedule.warmup_steps}) is longer than the run "
                f"(train.steps = {self.steps})"
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


# ------------------------------------------------------------------------------- loading


def load_job_config(path: str | os.PathLike, overrides: Iterable[str] = ()) -> JobConfig:
    """Reads a TOML file, applies `--set key.path=value` overrides, validates."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"cannot read trainer config {path}: {e}") from e
    for override in overrides:
        apply_override(doc, override)
    return parse_job_config(doc)


def apply_override(doc: dict, override: str) -> None:
    """Sets `a.b.c=value` in a parsed TOML document; value in TOML syntax (bare words are strings)."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override {override!r} must look like section.key=value, e.g. train.steps=10")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word such as cpu or /tmp/dir
    *parents, leaf = key.strip().split(".")
    node = doc
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {override!r}: {part!r} is not a table")
    node[leaf] = value


def parse_job_config(doc: Mapping[str, Any]) -> JobConfig:
    """Builds a JobConfig from a parsed TOML document. Relative paths in it (init_dir, data
    path, checkpoint dir, metrics path, store) are relative to the working directory."""
    doc = dict(doc)
    _refuse_unknown("the config file", doc, {"parallel", "train"})
    if "train" not in doc:
        raise ValueError("the config needs a [train] table (and [train.model])")
    train = dict(doc["train"])
    sections = {
        "optimizer": OptimizerConfig,
        "schedule": ScheduleConfig,
        "data": DataConfig,
        "loss": LossConfig,
        "guard": GuardConfig,
        "checkpoint": CheckpointConfig,
    }
    kwargs: dict[str, Any] = {}
    for name, cls in sections.items():
        if name in train:
            kwargs[name] = _build(f"[train.{name}]", cls, train.pop(name))
    if "model" not in train:
        raise ValueError('the config needs a [train.model] table: init_dir = "HF dir" or architecture fields')
    kwargs["model"] = _build_model_spec(train.pop("model"))
    if "publish" in train:
        publish = dict(train.pop("publish"))
        publisher = _build("[train.publish.publisher]", PublisherConfig, publish.pop("publisher", {}))
        kwargs["publish"] = _build("[train.publish]", PublishConfig, {**publish, "publisher": publisher})
    return JobConfig(
        parallel=_build("[parallel]", ParallelConfig, doc.get("parallel", {})),
        train=_build("[train]", TrainConfig, {**train, **kwargs}),
    )


def _build_model_spec(table: Mapping[str, Any]) -> ModelSpec:
    table = dict(table)
    init_dir = table.pop("init_dir", None)
    init_seed = table.pop("init_seed", 0)
    architecture = None
    if table:
        names = {f.name for f in dataclasses.fields(ModelConfig)}
        _refuse_unknown("[train.model]", table, names | {"init_dir", "init_seed"})
        try:
            architecture = ModelConfig(**table)
        except (TypeError, ValueError) as e:
            raise ValueError(f"[train.model]: {e}") from e
    return ModelSpec(init_dir=init_dir, architecture=architecture, init_seed=init_seed)


def _build(where: str, cls: type, table: Any) -> Any:
    if isinstance(table, cls):
        return table
    if not isinstance(table, Mapping):
        raise ValueError(f"{where} must be a table, got {type(table).__name__}")
    _refuse_unknown(where, table, {f.name for f in dataclasses.fields(cls)})
    hints = typing.get_type_hints(cls)
    for key, value in table.items():
        _check_type(f"{where} {key}", value, hints[key])
    try:
        return cls(**table)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def _check_type(where: str, value: Any, hint: Any) -> None:
    """TOML gives ints, floats, strings, bools, lists, tables; catch a string where a number
    belongs here instead of as a TypeError deep in the trainer."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for kind in allowed:
        origin = typing.get_origin(kind) or kind
        if kind is type(None) and value is None:
            return
        if origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return
        if origin is int and isinstance(value, int) and not isinstance(value, bool):
            return
        if origin is tuple and isinstance(value, (list, tuple)):
            return
        if origin in (bool, str) and type(value) is origin:
            return
        if origin not in (float, int, tuple, bool, str, type(None)):
            return  # nested dataclasses were built already
    names = " or ".join(getattr(k, "__name__", str(k)) for k in allowed)
    raise ValueError(f"{where} must be {names}, got {value!r}")


def _refuse_unknown(where: str, table: Mapping[str, Any], known: set[str]) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid keys: {sorted(known)}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
