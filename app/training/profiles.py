"""profiles: named, versioned training presets ("training shapes") the server resolves by name.

A profile fixes, for one model: where its weights come from (an HF-style directory, or an
architecture initialised from a seed), the parallel layout (ranks; torchrun starts that many),
precision, how a MoE's frozen experts are held, optimizer-state CPU offload, activation
checkpointing, and the sampler deployment (engine type: "reference" in the server, or "vllm" with
the URL of a vLLM server the user runs, which `--vllm-url` may give instead; and whether it gets
merged weights or adapter-only versions). They ship as TOML files in `app/training/profiles/`;
`--profile NAME` (or `NAME@VERSION` to pin one) picks one, and a client may then pass the
profile's name as `base_model`.

A change to a profile's meaning is a new version, never an edit of the old one: a run started
on `demo-lm@1` keeps meaning the same thing.

Not here: applying the layout (serve.py, `weightsync.trainer.engine`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from weightsync.app.training.errors import NotFound

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
    frozen_experts: str | None = None
    """MoE models: the format their frozen routed experts are held in (`--frozen-experts`); None:
    fp32 master weights that train like the rest."""
    sampler_url: str | None = None
    """The vLLM server's base URL for sampler engine "vllm" (a deployment detail: `--vllm-url`
    gives or overrides it)."""

    def __post_init__(self) -> None:
        if self.model_dir is None and self.architecture is None:
            raise ValueError(f"profile {self.name}: [model] needs model_dir or architecture")
        if self.ranks < 1 or self.version < 1:
            raise ValueError(f"profile {self.name}: ranks and version must be >= 1")
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


def parse_profile(doc: dict[str, Any], *, where: str) -> Profile:
    model, parallel, sampler = doc.get("model", {}), doc.get("parallel", {}), doc.get("sampler", {})
    try:
        return Profile(
            name=doc["name"],
            version=int(doc["version"]),
            description=doc.get("description", ""),
            model_dir=model.get("model_dir"),
            architecture=model.get("architecture"),
            init_seed=int(model.get("init_seed", 0)),
            ranks=int(parallel.get("ranks", 1)),
            mixed_precision=parallel.get("mixed_precision", "none"),
            cpu_offload=bool(parallel.get("cpu_offload")),
            activation_checkpointing=bool(parallel.get("activation_checkpointing")),
            frozen_experts=parallel.get("frozen_experts"),
            sampler_engine=sampler.get("engine", "reference"),
            sampler_weights=sampler.get("weights", "merged"),
            sampler_url=sampler.get("url"),
        )
    except KeyError as e:
        raise ValueError(f"{where}: missing {e}") from None


def load_profiles(directory: str | Path = PROFILE_DIR) -> dict[str, Profile]:
    """Every profile in `directory`, by `name@version`."""
    profiles = {}
    for path in sorted(Path(directory).glob("*.toml")):
        profile = parse_profile(tomllib.loads(path.read_text()), where=str(path))
        profiles[profile.key] = profile
    return profiles


def resolve_profile(spec: str, *, model_dir: str | None = None, directory: str | Path = PROFILE_DIR) -> Profile:
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
