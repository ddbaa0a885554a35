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
    trusted_keys = ["/etc/weightsync/publisher.pub"]
    require_signatures = true

    [agent.engine]                 # the inference engine beside the agent (agents/engine.py)
    type = "reference"
    port = 8000

    [agent.tls]                    # this agent's server side; [agent.client_tls] for its peers
    cert = "agent.pem"
    key = "agent.key"

Not here: what the agent does with it (`sync.py`, `server.py`).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from pathlib import Path
from typing import Any

from weightsync.layout import check_model_name
from weightsync.rpc import TlsConfig

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
    store: str | None = None
    """URI of the store versions are committed to (file://, s3://): where missing, late or
    corrupt objects come from, and how a lagging or new agent catches up. None: push only."""
    peers: tuple[str, ...] = ()
    """Downstream agents (host:port) this agent relays every version to as it arrives."""
    engine: dict[str, Any] = dataclasses.field(default_factory=lambda: {"type": "reference"})
    """The inference engine: {"type": ..., options...} (agents/engine.py, open_engine)."""
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
    workers: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 2)
    """Threads that decode and verify chunks."""
    metrics_port: int | None = None
    """Serve Prometheus /metrics on this port (0: any free port); None: off."""
    ledger_size: int = 64
    """Versions remembered in the status ledger."""

    def __post_init__(self) -> None:
        check_model_name(self.model)
        object.__setattr__(self, "peers", tuple(self.peers))
        object.__setattr__(self, "trusted_keys", tuple(self.trusted_keys))
        if "type" not in self.engine:
            raise ValueError('engine needs a "type", e.g. {"type": "reference"}')
        if self.require_signatures and not self.trusted_keys:
            raise ValueError("require_signatures needs trusted_keys: the publisher public keys (PEM) to accept")
        for name in ("poll_interval_s", "push_wait_s", "cache_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_pending_bytes < 0 or self.cache_keep_versions < 1 or self.max_hops < 1 or self.workers < 1:
            raise ValueError("max_pending_bytes >= 0, cache_keep_versions >= 1, max_hops >= 1, workers >= 1 needed")
        if ":" not in self.listen:
            raise ValueError(f"listen must be host:port, got {self.listen!r}")

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir)


def load_agent_config(path: str | os.PathLike | None = None, **overrides: Any) -> AgentConfig:
    """The [agent] table of a TOML file (if given), with `overrides` (None values ignored) on top."""
    doc: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                doc = dict(tomllib.load(f).get("agent", {}))
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"cannot read agent config {path}: {e}") from None
    doc.update({k: v for k, v in overrides.items() if v is not None})
    for key in ("tls", "client_tls"):
        if isinstance(doc.get(key), dict):
            doc[key] = TlsConfig(**doc[key])
    known = {f.name for f in dataclasses.fields(AgentConfig)}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ValueError(f"unknown agent settings {unknown}; known: {sorted(known)}")
    return AgentConfig(**doc)
