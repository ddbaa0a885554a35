"""profiles: named, versioned training presets ("training shapes") the server resolves by name.

A profile fixes, for one model: where its weights come from (an HF-style directory, or an
architecture initialised from a seed), the parallel layout (ranks; torchrun starts that many),
precision, tensor and expert parallelism (tp, ep), how a MoE's frozen experts are held, optimizer-state CPU offload, activation
checkpointing, and the sampler deployment (engine type: "reference" in the server, or "vllm" with
the URL of a vLLM server the user runs, which `--vllm-url` may give instead; and whether it gets
merged weights or adapter-only versions). They ship as TOML files in `app/training/profiles/`;
`--profile NAME` (or `NAME@VERSION` to pin one) picks one, and a client may then pass the
profile's name as `base_model`.

A change to a profile's meaning is a new version, never an edit of the old one: a run started
on `demo-lm@1` keeps meaning the same thing. Every key of a profile file is checked when it loads
(weightsync.settings): a typo is a ConfigError naming the key, never a setting silently left at
its default.

Not here: applying the layout (serve.py, `weightsync.trainer.engine`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from pathlib import Path
from typing import Any

from weightsync.app.training.errors import NotFound
from weightsync.errors import ConfigError
from weightsync.models import ModelConfig
from weightsync.models.packed import PackFormat
from weightsync.settings import build_table, check_known_keys, check_required, check_type, toml_kind
from weightsync.trainer.config import MIXED_PRECISION

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PROFILE_DIR = Path(__file__).with_name("profiles")
ENGINES = ("reference", "vllm")
SAMPLER_WEIGHTS = ("merged", "adapter")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Profile:
    name: str
    version: int
    description: str
    model_dir: str | None
    """HF-style directory with the weights (and tokenizer); None: `architecture` from `init_seed`."""
    architecture: dict[str, Any] | None
    init_seed: int
    ranks: int
    mixed_precision: str
    cpu_offload: bool
    activation_checkpointing: bool
    sampler_engine: str
    sampler_weights: str
    tp: int = 1
    """Tensor parallelism of dense models (`--tp`): the ranks must be a multiple of it."""
    ep: int = 1
    """Expert parallelism of MoE models (`--ep`): the ranks must be a multiple of it."""
    frozen_experts: str | None = None
    """MoE models: the format their frozen routed experts are held in (`--frozen-experts`); None:
    fp32 master weights that train like the rest."""
    sampler_url: str | None = None
    """The vLLM server's base URL for sampler engine "vllm" (a deployment detail: `--vllm-url`
    gives or overrides it)."""

    def __post_init__(self) -> None:
        if self.model_dir is None and self.architecture is None:
            raise ValueError(f"profile {self.name}: [model] needs model_dir or architecture")
        if self.version < 1:
            raise ValueError(f"profile {self.name}: version must be >= 1, got {self.version}")
        if self.ranks < 1:
            raise ValueError(f"profile {self.name}: [parallel] ranks must be >= 1, got {self.ranks}")
        for name in ("tp", "ep"):
            degree = getattr(self, name)
            if degree < 1 or self.ranks % degree:
                raise ValueError(
                    f"profile {self.name}: [parallel] {name} must be >= 1 and divide ranks ({self.ranks}), got {degree}"
                )
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(
                f"profile {self.name}: [parallel] mixed_precision must be one of {list(MIXED_PRECISION)}, "
                f"got {self.mixed_precision!r}"
            )
        if self.frozen_experts is not None:
            try:
                PackFormat.parse(self.frozen_experts)
            except ValueError as e:
                raise ValueError(f"profile {self.name}: [parallel] frozen_experts: {e}") from None
        if self.sampler_engine not in ENGINES or self.sampler_weights not in SAMPLER_WEIGHTS:
            raise ValueError(
                f"profile {self.name}: [sampler] engine must be one of {ENGINES}, weights one of {SAMPLER_WEIGHTS}"
            )

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}"

    def materialise(self, root: str | Path) -> str:
        """The model directory: model_dir, or one written under `root` from the architecture and
        seed (once; later calls reuse it). Rank 0 only."""
        if self.model_dir is not None:
            return self.model_dir
        from weightsync.models import ModelConfig, build_model, save_pretrained

        directory = Path(root) / f"{self.name}-v{self.version}"
        if not (directory / "config.json").is_file():
            config = ModelConfig(**self.architecture)
            save_pretrained(directory, config, build_model(config, seed=self.init_seed).state_dict())
        return str(directory)


_TABLES: dict[str, dict[str, str]] = {
    "model": {"model_dir": "model_dir", "architecture": "architecture", "init_seed": "init_seed"},
    "parallel": {
        "ranks": "ranks",
        "mixed_precision": "mixed_precision",
        "cpu_offload": "cpu_offload",
        "activation_checkpointing": "activation_checkpointing",
        "tp": "tp",
        "ep": "ep",
        "frozen_experts": "frozen_experts",
    },
    "sampler": {"engine": "sampler_engine", "weights": "sampler_weights", "url": "sampler_url"},
}
"""A profile file's tables: {table: {key: the Profile field it sets}}."""
_DEFAULTS = {
    "description": "",
    "model_dir": None,
    "architecture": None,
    "init_seed": 0,
    "ranks": 1,
    "mixed_precision": "none",
    "cpu_offload": False,
    "activation_checkpointing": False,
    "sampler_engine": "reference",
    "sampler_weights": "merged",
}
_HOWTO = {
    "name": 'the profile\'s name, e.g. name = "demo-lm"',
    "version": "the profile's version, e.g. version = 1 (a change of meaning is a new version)",
}


def parse_profile(doc: dict[str, Any], *, where: str) -> Profile:
    """A Profile from a profile file's document; ConfigError naming the key for an unknown key (with
    "did you mean"), a missing name or version, a value of the wrong type or one Profile refuses
    (weightsync.settings, the reader of every TOML config)."""
    check_known_keys(doc, {"name", "version", "description", *_TABLES}, where=where, section="")
    check_required(doc, ["name", "version"], where=where, section="", howto=_HOWTO)
    hints = typing.get_type_hints(Profile)
    fields: dict[str, Any] = {**_DEFAULTS}
    for key in ("name", "version", "description"):
        if key in doc:
            check_type(doc[key], hints[key], where=where, name=key)
            fields[key] = doc[key]
    for table, keys in _TABLES.items():
        section = f"[{table}]"
        values = doc.get(table, {})
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: {section} must be a table, got {values!r} ({toml_kind(values)})")
        check_known_keys(values, keys, where=where, section=section)
        for key, value in values.items():
            check_type(value, hints[keys[key]], where=where, name=f"{section} {key}")
            fields[keys[key]] = value
    if fields["architecture"] is not None:  # checked now, not when a run first builds the model
        build_table(ModelConfig, fields["architecture"], where=where, section="[model] architecture")
    try:
        return Profile(**fields)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def load_profiles(directory: str | Path | None = None) -> dict[str, Profile]:
    """Every profile in `directory` (default: the shipped ones, PROFILE_DIR), by `name@version`."""
    profiles = {}
    for path in sorted(Path(directory or PROFILE_DIR).glob("*.toml")):
        try:
            doc = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read training profile {path}: {e}") from None
        profile = parse_profile(doc, where=f"training profile {path}")
        profiles[profile.key] = profile
    return profiles


def resolve_profile(spec: str, *, model_dir: str | None = None, directory: str | Path | None = None) -> Profile:
    """`name` (its newest version) or `name@version`; `model_dir` overrides where the weights are."""
    profiles = load_profiles(directory)
    name, _, version = spec.partition("@")
    matches = [p for p in profiles.values() if p.name == name and (not version or str(p.version) == version)]
    if not matches:
        raise NotFound(f"no training profile {spec!r}; known: {sorted(profiles)}")
    profile = max(matches, key=lambda p: p.version)
    if model_dir is not None:
        profile = dataclasses.replace(profile, model_dir=model_dir)
    return profile


def describe(profile: Profile) -> str:
    return json.dumps(dataclasses.asdict(profile), sort_keys=True)
