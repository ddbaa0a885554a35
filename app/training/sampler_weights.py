"""sampler_weights: save_weights_for_sampler, and the sampling sessions that sample what it saved.

Saving sampler weights is four steps, in this order:

    agent      the agent that keeps sampling engines in sync with the run's store model is
               started (once per store model, `SamplerHub.ensure_agent`): it is the push target
    publish    the trainer publishes the run's weights as a new version of its store model
               ("full" for full fine-tuning, "merged" W + scale·B·A for LoRA) and pushes it to
               the agent; a LoRA run also publishes its adapter-only version to a store model of
               its own, pushed instead when the run is sampled as an adapter (sampler_weights
               "adapter", on vLLM)
    record     sampler.json under the run (`runs.py`) says where the version lives
    session    unless the client named the weights, a sampling session on that version

A sampling session is the (store model, version) a sampling client samples, made here from saved
weights or from a base model (version 0) and looked up by `service.py` for each sample request.

Not here: the publish itself (`weightsync.trainer.commands.PublishWeights`), sampling
(`sampling.py`), the run directory's layout (`runs.py`).
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

from weightsync.app.training.errors import NotFound
from weightsync.app.training.futures import Outcome
from weightsync.app.training.runs import ModelRecord, Runs
from weightsync.app.training.sampling import SamplerHub, SamplingSession
from weightsync.trainer import commands


def store_model_name(model_id: str) -> str:
    """The store's name for a training run's sampler versions (store names allow no ':')."""
    return "tinker-" + model_id.replace(":", "-")


class SamplingSessions:
    """The sampling sessions of one service, by id; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[str, SamplingSession] = {}

    def open(
        self,
        base_model: str,
        base_dir: str,
        store_model: str | None,
        version: int,
        model_path: str | None,
        *,
        adapter: bool = False,
    ) -> str:
        session_id = f"sampler-{uuid.uuid4().hex[:16]}"
        with self._lock:
            self._sessions[session_id] = SamplingSession(
                session_id, base_model, base_dir, store_model, version, model_path, adapter
            )
        return session_id

    def open_saved(self, meta: dict[str, Any], base_dir: str, model_path: str) -> str:
        """A session on saved sampler weights (their sampler.json)."""
        if meta.get("serves") == "adapter":
            return self.open(
                meta["base_model"],
                base_dir,
                meta["adapter_store_model"],
                int(meta["adapter_version"]),
                model_path,
                adapter=True,
            )
        return self.open(meta["base_model"], base_dir, meta["store_model"], int(meta["version"]), model_path)

    def get(self, session_id: str) -> SamplingSession:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"unknown sampling session {session_id!r}")
        return session


class SamplerWeights:
    """Saves a run's weights for sampling (see the module docstring)."""

    def __init__(
        self,
        commander: commands.Commander,
        samplers: SamplerHub,
        sessions: SamplingSessions,
        runs: Runs,
        *,
        store_uri: str,
        serve_adapters: bool,
    ) -> None:
        self.commander = commander
        self.samplers = samplers
        self.sessions = sessions
        self.runs = runs
        self.store_uri = store_uri
        self.serve_adapters = serve_adapters
        """LoRA runs are sampled as adapters (sampler_weights "adapter"), not as merged weights."""

    def save(self, record: ModelRecord, name: str | None) -> Outcome:
        """The four steps (module docstring); runs on the service's executor, in seq_id order."""
        store_model = store_model_name(record.model_id)
        adapter_model = store_model + "-adapter"
        serve_adapter = record.lora is not None and self.serve_adapters
        address = self.samplers.ensure_agent(
            adapter_model if serve_adapter else store_model, record.base_dir, adapter=serve_adapter
        )
        kind = "full" if record.lora is None else "merged"
        version = self._publish(record, store_model, kind, push_to=() if serve_adapter else (address,))
        meta: dict[str, Any] = {
            "store": self.store_uri,
            "store_model": store_model,
            "version": version,
            "base_model": record.base_model,
            "kind": kind,
        }
        if record.lora is not None:  # engines that serve adapters sync this store model instead
            adapter_version = self._publish(
                record, adapter_model, "adapter", push_to=(address,) if serve_adapter else ()
            )
            meta |= {
                "adapter_store_model": adapter_model,
                "adapter_version": adapter_version,
                "serves": "adapter" if serve_adapter else "merged",
            }
        path = self.runs.write_sampler(record.model_id, name or f"sampler-v{version:06d}", meta)
        if name is not None:
            return Outcome(json={"type": "save_weights_for_sampler", "path": path})
        session = self.sessions.open_saved(meta, record.base_dir, path)
        return Outcome(json={"type": "save_weights_for_sampler", "path": path, "sampling_session_id": session})

    def _publish(self, record: ModelRecord, store_model: str, kind: str, *, push_to: tuple[str, ...]) -> int:
        result = self.commander.run(
            commands.PublishWeights(record.model_id, self.store_uri, store_model, push_to, kind)
        )
        return int(result["version"])
