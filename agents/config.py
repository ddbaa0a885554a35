"""config: everything a sync agent is told — from a TOML file, then command-line overrides.

    [agent]
    name = "us-east-1a"            # shown in ledgers, logs and metrics
    region = "us-east"
    model = "qwen3-0.6b-grpo"
    listen = "0.0.0.0:7070"
    store = "s3://bucket/weights"  # where versions are committed: the catch-up path
    cache_dir = "/var/lib/weightsync/agent"
    peers = ["10.0.0.2:7070"]      # downstream agents this one relays to
    token_file = "/etc/weightsync/token"
    metrics_port = 9400            # Prometheus /metrics, bound on metrics_host (default 127.0.0.1)
    metrics_host = "0.0.0.0"
    swap_policy = "in_flight"      # drain (default) | in_flight | abort: see docs/agents.md
    trusted_keys = ["/etc/weightsync/publisher.pub"]
    require_signatures = true

    [agent.engine]                 # the inference engine beside the agent (agents/engines/)
    type = "reference"             # one of engines.engine_types(); the other keys are its options
    model_dir = "/models/qwen3-0.6b"
    port = 8000

    [agent.parity]                 # the numerical-parity probe after each swap (agents/parity.py)
    action = "alert"               # warn (default) | alert | refuse
    max_abs_dlogprob = 0.25

    [agent.tls]                    # this agent's server side; [agent.client_tls] for its peers
    cert = "agent.pem"
    key = "agent.key"

Every key is checked when the file is loaded (`load_agent_config`), those of [agent.engine]
against the engine's own config class (`engines.parse_engine_config`): unknown keys, missing
settings, wrong types and bad sub-tables raise ConfigError naming the key and the fix
(weightsync/settings.py), and the swap policy becomes a `SwapPolicy` here, once. A reference
engine given neither `model` nor `model_dir` takes the architecture from the config.json that
the model's latest version carries in `store` (`engines.complete_from_store`): an agent can
start from the store alone.

Not here: what the agent does with it (`sync.py`, `server.py`), what an engine's options mean
(its module in agents/engines/).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from weightsync.agents.engines import complete_from_store, engine_config_class, parse_engine_config
from weightsync.agents.engines.swap_policy import SwapPolicy
from weightsync.agents.parity import ParityConfig
from weightsync.cpus import usable_cpus
from weightsync.errors import ConfigError
from weightsync.format.layout import check_model_name
from weightsync.listen import is_host, split_listen
from weightsync.settings import build_table, check_known_keys, check_required, check_type, toml_kind
from weightsync.transport.rpc import TlsConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentConfig:
    model: str
    """The model this agent serves (one agent, one model)."""
    cache_dir: str
    """Local, crash-safe cache: received objects and manifests (a store of its own) and the last
    served version, from which a restarted agent serves again before anything else."""
    name: str = dataclasses.field(default_factory=socket.gethostname)
    region: str = "default"
    listen: str = "127.0.0.1:0"
    """host:port of the gRPC server (port 0: any free port, reported by the running agent)."""
    health_listen: str | None = None
    """host:port of a second, plaintext gRPC server that serves only the standard health service:
    for probes that speak neither TLS nor tokens (Kubernetes `grpc` probes). None: health is
    served on `listen` alone (behind its TLS; the token guard lets health checks through)."""
    store: str | None = None
    """URI of the store versions are committed to (any form `weightsync.stores.open_store` takes): where missing, late or
    corrupt objects come from, and how a lagging or new agent catches up. None: push only."""
    peers: tuple[str, ...] = ()
    """Downstream agents (host:port) this agent relays every version to as it arrives."""
    engine: dict[str, Any] = dataclasses.field(default_factory=lambda: {"type": "reference"})
    """The inference engine: {"type": ..., options...} (agents/engines/, open_engine)."""
    tls: TlsConfig | None = None
    """Server TLS (cert/key; ca + require_client_cert for mTLS). None: plaintext (loopback only!)."""
    client_tls: TlsConfig | None = None
    """TLS for calls to peers (ca to verify them; cert/key when they require mTLS)."""
    token: str | None = None
    """Bearer token callers must present and this agent presents to its peers. Prefer
    token_file or $WEIGHTSYNC_TOKEN over putting it in a config file."""
    token_file: str | None = None
    trusted_keys: tuple[str, ...] = ()
    """Public keys (PEM) whose manifest signatures this agent accepts."""
    require_signatures: bool = False
    """Refuse versions without a valid signature by one of trusted_keys."""
    poll_interval_s: float = 5.0
    """How often the store is checked for newer versions (the safety net when pushes stop)."""
    push_wait_s: float = 2.0
    """How long objects of an offered version may stay missing with no push progress before
    they are fetched from the store."""
    max_pending_bytes: int = 16 * 1024**3
    """Bound on pushed object bytes not yet used by a served version (a rogue or broken sender
    cannot fill the disk); beyond it pushes are refused with RESOURCE_EXHAUSTED."""
    cache_keep_versions: int = 2
    """Versions kept in the cache beyond the ones in use (their chains are kept too)."""
    cache_grace_s: float = 600.0
    """Unreferenced cached objects younger than this are kept (a version still arriving)."""
    relay_buffer_bytes: int = 512 * 1024 * 1024
    """Object bytes held per downstream peer for relaying; beyond it the peer fetches from the store."""
    max_hops: int = 16
    """Offers relayed more often than this are refused: a relay loop in the peer config."""
    workers: int = dataclasses.field(default_factory=usable_cpus)
    """Threads that decode and verify chunks; default: the CPUs this process may use (weightsync.cpus)."""
    apply_early: bool = True
    """Apply pushed chunks as they arrive, before their version's offer, into the spare buffer
    (zero-copy engines; the manifest still decides what counts: agents/early_apply.py). Off:
    every chunk is applied after the offer."""
    metrics_port: int | None = None
    """Serve Prometheus /metrics on this port (0: any free port); None: off."""
    metrics_host: str = "127.0.0.1"
    """The address /metrics binds (with metrics_port): loopback, for a Prometheus on this host only;
    "0.0.0.0" (or "::") for one that scrapes the pod or host from outside, as the Kubernetes and
    systemd examples in deploy/ do."""
    ledger_size: int = 64
    """Versions remembered in the status ledger."""
    weights_kind: str = "model"
    """What this agent's engine serves: "model" (whole weights) or "adapter" (LoRA adapters only).
    A version whose manifest says another kind (producer.weights_kind; absent = "model") is refused."""
    swap_policy: SwapPolicy = SwapPolicy.DRAIN
    """How requests running at a swap meet the new version (docs/agents.md, "Swap policies"):
    "drain" (each response comes from one version; sync latency is bounded by the longest
    request), "in_flight" (running requests go on with the new weights from their next token;
    responses say which versions made which tokens), "abort" (running requests are cut and
    retried on the new version). A string is parsed into the enum here; the engine must
    implement it (`Engine.swap_policies`)."""

    parity: ParityConfig = dataclasses.field(default_factory=ParityConfig)
    """The numerical-parity probe run after each swap of a version that carries one, and what a
    breach of its thresholds does: warn, alert or refuse (roll back). See agents/parity.py."""

    def __post_init__(self) -> None:
        check_model_name(self.model)
        object.__setattr__(self, "peers", tuple(self.peers))
        object.__setattr__(self, "trusted_keys", tuple(self.trusted_keys))
        if self.require_signatures and not self.trusted_keys:
            raise ValueError("require_signatures needs trusted_keys: the publisher public keys (PEM) to accept")
        for name in ("poll_interval_s", "push_wait_s", "cache_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_pending_bytes < 0 or self.cache_keep_versions < 1 or self.max_hops < 1 or self.workers < 1:
            raise ValueError("max_pending_bytes >= 0, cache_keep_versions >= 1, max_hops >= 1, workers >= 1 needed")
        if self.weights_kind not in ("model", "adapter"):
            raise ValueError(f'weights_kind must be "model" or "adapter", got {self.weights_kind!r}')
        try:
            object.__setattr__(self, "swap_policy", SwapPolicy.parse(self.swap_policy))
        except ValueError:
            raise ValueError(
                f"swap_policy must be one of {SwapPolicy.names()}, got {self.swap_policy!r}: "
                'e.g. swap_policy = "in_flight"'
            ) from None
        for name in ("listen", "health_listen"):
            value = getattr(self, name)
            if value is not None:
                split_listen(value, name)
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be a port in 0..65535 (0: any free port), got {self.metrics_port}")
        if not is_host(self.metrics_host):
            raise ValueError(
                f"metrics_host must be an address or host name without a port, got {self.metrics_host!r}: e.g. "
                'metrics_host = "0.0.0.0" with metrics_port = 9400'
            )

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir)


def load_agent_config(
    path: str | os.PathLike | None = None,
    *,
    engine_flags: Mapping[str, tuple[str, Any]] | None = None,
    **overrides: Any,
) -> AgentConfig:
    """The [agent] table of a TOML file (if given), with `overrides` (None values ignored) on top.

    `engine_flags` are command-line flags that set [agent.engine] options: {flag: (option, value)}
    ("type" for --engine; value None: not given). Given ones are applied on top of the file's
    [agent.engine] table, each refused with a reason where it cannot apply: --engine naming
    another type than the file's, a flag for an option the engine does not have.

    Every key is checked before the agent starts: unknown keys, wrong types, a bad engine or tls
    table and missing required settings raise ConfigError naming the key and the fix (a typo
    must not fall back to a default, nor a string surface as a TypeError deep in the agent).
    """
    where = f"agent config {path}" if path is not None else "agent settings"
    doc: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                document = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read agent config {path}: {e}") from None
        others = sorted(set(document) - {"agent"})
        if others:
            raise ConfigError(
                f"{where}: unknown top-level table(s) or key(s) {others}; the agent reads only "
                "[agent] (and its [agent.engine], [agent.parity], [agent.tls], [agent.client_tls] sub-tables)"
            )
        if not isinstance(document.get("agent"), dict):
            raise ConfigError(
                f"{where}: no [agent] table; start the file with [agent] and model = ..., cache_dir = ... under it"
            )
        doc = dict(document["agent"])
    doc.update({k: v for k, v in overrides.items() if v is not None})
    if engine_flags and any(value is not None for _, value in engine_flags.values()):
        doc["engine"] = _apply_engine_flags(where, doc.get("engine"), engine_flags)
    return parse_agent_config(doc, where=where)


def _apply_engine_flags(where: str, table: Any, flags: Mapping[str, tuple[str, Any]]) -> dict[str, Any]:
    """The [agent.engine] table (None: not in the file) with the given flags' options on top."""
    merged = dict(_check_engine_table(where, table)) if table is not None else {}
    given = {flag: (option, value) for flag, (option, value) in flags.items() if value is not None}
    for flag, (option, value) in given.items():
        if option != "type":
            continue
        if merged.get("type", value) != value:
            raise ConfigError(
                f"{flag} {value} contradicts [agent.engine] type = {merged['type']!r} in {where}: the file's "
                f"engine options are that engine's; drop {flag}, or change the file's [agent.engine] table"
            )
        merged["type"] = value
    type_name = merged.setdefault("type", "reference")
    try:
        options = {f.name for f in dataclasses.fields(engine_config_class(type_name))}
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    for flag, (option, value) in given.items():
        if option == "type":
            continue
        if option not in options:
            takes = sorted(f for f, (o, _) in flags.items() if o in options and o != "type")
            raise ConfigError(
                f"{flag}: the {type_name} engine has no {option} option; its flags are {takes or 'none'}, "
                f"its other options go in the [agent.engine] table of a --config file"
            )
        merged[option] = value
    return merged


_HOWTO_REQUIRED = {
    "model": 'the model this agent serves, e.g. model = "qwen3-0.6b-grpo" (or --model)',
    "cache_dir": 'the agent\'s local cache directory, e.g. cache_dir = "/var/lib/weightsync/agent" (or --cache-dir)',
}


def parse_agent_config(doc: dict[str, Any], *, where: str = "agent settings") -> AgentConfig:
    """Builds an AgentConfig from the [agent] table of a parsed document; ConfigError if it is unusable."""
    doc = dict(doc)
    check_known_keys(doc, {f.name for f in dataclasses.fields(AgentConfig)}, where=where, section="[agent]")
    check_required(doc, _HOWTO_REQUIRED, where=where, section="[agent]", howto=_HOWTO_REQUIRED)
    hints = typing.get_type_hints(AgentConfig)
    for key, value in doc.items():
        if key not in ("engine", "tls", "client_tls", "parity"):
            check_type(value, hints[key], where=where, name=f"[agent] {key}")
    doc["engine"] = _check_engine_table(where, doc.get("engine", {"type": "reference"}))
    for key in ("tls", "client_tls"):
        if key in doc and not isinstance(doc[key], TlsConfig):
            doc[key] = build_table(TlsConfig, _table(where, key, doc[key]), where=where, section=f"[agent.{key}]")
    if "parity" in doc and not isinstance(doc["parity"], ParityConfig):
        doc["parity"] = build_table(ParityConfig, doc["parity"], where=where, section="[agent.parity]")
    try:
        config = AgentConfig(**doc)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    # What the engine leaves out and the store can tell (the reference engine's architecture).
    if config.store is not None:
        engine = complete_from_store(config.engine, store=config.store, model=config.model, where=where)
        if engine != config.engine:
            config = dataclasses.replace(config, engine=engine)
    # Last: the engine's module imports torch (seconds), worth it only for an otherwise good file.
    parse_engine_config(config.engine, where=where)
    return config


def _check_engine_table(where: str, table: Any) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ConfigError(
            f"{where}: [agent] engine must be a table, got {table!r} ({toml_kind(table)}); write "
            '[agent.engine] with type = "reference" (or another engine type) and its options'
        )
    return dict(table)


def _table(where: str, key: str, table: Any) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ConfigError(
            f"{where}: [agent] {key} must be a table, got {table!r} ({toml_kind(table)}); write "
            f'[agent.{key}] with cert = "agent.pem" and key = "agent.key" (ca = ... for mTLS)'
        )
    return table
