"""sampling: Tinker sampling clients, served by engines that weightsync agents keep in sync.

Each trained model publishes its sampler weights to the store as versions of its own store
model (`weightsync.trainer.commands.PublishWeights`). For every store model that someone samples from, a
`SyncedSampler` runs a weightsync agent (`weightsync.agents.AgentServer`, gRPC on 127.0.0.1)
with a reference engine: the publisher pushes each version to it, it verifies every byte and
swaps; the store is its safety net. A sampling client samples exactly the version it was made
for, and every response names that version: while the agent serves it, requests lease it from
the engine (they never see mixed weights); once the run has published newer versions, the
client's version is rebuilt from the store through the verifying Reader (a few are cached).
Sampling from a base model (no saved weights) uses a reference engine on the base directory,
version 0.

With `engine="vllm"` the agents' engine is a `VllmEngine` on a vLLM server the user runs, and
sample requests go to that server (vllm_sampling.py): one server serves one run's versions. A
sampling client then samples the version vLLM serves once it has reached the client's version,
which is the client's or, after the run has published newer ones, a newer one; every response is
tagged with the version vLLM reports for it. Base-model sampling stays on the reference engine
(vLLM holds the run's trained weights).

Generation supports what the SDK's SamplingParams carry: max_tokens, temperature, top_k,
top_p, seed, stop as token ids or strings (default: the tokenizer's EOS), num_samples, and
prompt logprobs. The logprobs reported for sampled tokens are those of the distribution they
were drawn from (after temperature, before top-k/top-p truncation).

Not here: publishing (`weightsync.trainer.commands`), the agent's verify/swap (weightsync.agents).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from weightsync.app.training.errors import NotSupported, TrainingError, UserInputError
from weightsync.app.training.wire import SampledSequence
from weightsync.models import CausalLM, KVCache, ModelConfig, load_config, rope_inv_freq, skeleton

log = logging.getLogger(__name__)


class SamplerUnavailable(TrainingError):
    """The engine did not reach the wanted version in time (a server-side condition: retry)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop_tokens: tuple[int, ...]
    stop_strings: tuple[str, ...]


def parse_sampling_params(
    doc: Any, *, eos_token_id: int | None, vocab_size: int, max_new_tokens: int
) -> SamplingParams:
    """The SDK's SamplingParams JSON, checked."""
    if not isinstance(doc, dict):
        raise UserInputError("sampling_params must be an object")
    max_tokens = doc.get("max_tokens")
    max_tokens = max_new_tokens if max_tokens is None else max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= max_new_tokens:
        raise UserInputError(
            f"sampling_params.max_tokens must be an integer in [1, {max_new_tokens}], got {max_tokens!r}"
        )
    temperature = float(doc.get("temperature", 1.0))
    if not (temperature == 0 or 1e-3 <= temperature <= 100):
        raise UserInputError(f"sampling_params.temperature must be 0 (greedy) or in [0.001, 100], got {temperature}")
    top_k, top_p = int(doc.get("top_k", -1)), float(doc.get("top_p", 1.0))
    if not 0 < top_p <= 1:
        raise UserInputError(f"sampling_params.top_p must be in (0, 1], got {top_p}")
    seed = doc.get("seed")
    stop = doc.get("stop")
    stop_tokens: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    if stop is None:
        stop_tokens = (eos_token_id,) if eos_token_id is not None else ()
    elif isinstance(stop, str):
        stop_strings = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop_strings = tuple(stop)
    elif isinstance(stop, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        if any(not 0 <= s < vocab_size for s in stop):
            raise UserInputError(f"sampling_params.stop token ids must be in [0, {vocab_size})")
        stop_tokens = tuple(stop)
    else:
        raise UserInputError("sampling_params.stop must be a string, a list of strings or a list of token ids")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=None if seed is None else int(seed),
        stop_tokens=stop_tokens,
        stop_strings=stop_strings,
    )


class Generator:
    """Token generation on a weights mapping (the engine's leased version), with a KV cache."""

    def __init__(self, config: ModelConfig, tokenizer: Any | None) -> None:
        self.config, self.tokenizer = config, tokenizer

    def _replica(self) -> CausalLM:
        """A weightless module to run `weights` through. One per call: functional_call swaps the
        module's parameters while it runs, so concurrent requests must not share one."""
        module = skeleton(self.config)
        module.inv_freq = rope_inv_freq(self.config)
        return module.eval()

    @torch.no_grad()
    def sample(
        self, weights: Any, prompt: Sequence[int], *, num_samples: int, params: SamplingParams, prompt_logprobs: bool
    ) -> tuple[list[SampledSequence], np.ndarray | None]:
        if params.stop_strings and self.tokenizer is None:
            raise UserInputError("stop strings need the model's tokenizer, which the base model directory lacks")
        weights = (
            {k: v.float() for k, v in weights.items()}
            if next(iter(weights.values())).dtype != torch.float32
            else weights
        )
        generator = torch.Generator()
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        module = self._replica()
        prompt_ids = torch.tensor([list(prompt)], dtype=torch.long)
        cache = KVCache(self.config.num_hidden_layers)
        logits = module(prompt_ids, cache=cache, weights=weights)
        prompt_lp = None
        if prompt_logprobs:
            lp = torch.log_softmax(logits[0, :-1].float(), dim=-1).gather(-1, prompt_ids[0, 1:, None])[:, 0]
            prompt_lp = np.concatenate([[np.nan], lp.numpy()]).astype(np.float32)
        # Every sample continues the same prompt: copy the prompt's cache once per row.
        cache.keys = [k.expand(num_samples, *k.shape[1:]).contiguous() for k in cache.keys]
        cache.values = [v.expand(num_samples, *v.shape[1:]).contiguous() for v in cache.values]
        next_logits = logits[:, -1, :].expand(num_samples, -1)
        rows: list[list[int]] = [[] for _ in range(num_samples)]
        row_lps: list[list[float]] = [[] for _ in range(num_samples)]
        done = [False] * num_samples
        stopped = [False] * num_samples
        for _ in range(params.max_tokens):
            tokens, token_lps = self._draw(next_logits, params, generator)
            for r in range(num_samples):
                if done[r]:
                    continue
                rows[r].append(int(tokens[r]))
                row_lps[r].append(float(token_lps[r]))
                if self._stops(rows[r], params):
                    done[r] = stopped[r] = True
            if all(done) or len(prompt) + len(rows[0]) >= self.config.max_position_embeddings:
                break
            next_logits = module(tokens[:, None], cache=cache, weights=weights)[:, -1, :]
        sequences = [
            SampledSequence(np.asarray(t, dtype=np.int64), np.asarray(lp, dtype=np.float32), s)
            for t, lp, s in zip(rows, row_lps, stopped, strict=True)
        ]
        return sequences, prompt_lp

    def _draw(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator):
        logits = logits.float()
        if params.temperature == 0:
            tokens = logits.argmax(dim=-1)
            return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
        scaled = logits / params.temperature
        logp = torch.log_softmax(scaled, dim=-1)
        truncated = scaled
        if params.top_k > 0:
            kth = scaled.topk(min(params.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
            truncated = truncated.masked_fill(truncated < kth, float("-inf"))
        if params.top_p < 1:
            sorted_logits, order = truncated.sort(dim=-1, descending=True)
            cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
            drop = cumulative - torch.softmax(sorted_logits, -1) > params.top_p
            truncated = truncated.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        tokens = torch.multinomial(torch.softmax(truncated, dim=-1), 1, generator=generator)[:, 0]
        return tokens, logp.gather(-1, tokens[:, None])[:, 0]

    def _stops(self, row: list[int], params: SamplingParams) -> bool:
        if row[-1] in params.stop_tokens:
            return True
        return bool(params.stop_strings) and stop_string_at(self.tokenizer, row, params.stop_strings)


def stop_string_at(tokenizer: Any, row: Sequence[int], stop_strings: Sequence[str]) -> bool:
    """Whether the text of the row's last tokens contains a stop string (checked after every token)."""
    text = tokenizer.decode(list(row[-16:]))
    return any(s in text for s in stop_strings)


@dataclasses.dataclass(frozen=True)
class SamplingSession:
    session_id: str
    base_model: str
    base_dir: str
    store_model: str | None
    """None: the base model's own weights."""
    version: int
    model_path: str | None
    adapter: bool = False
    """store_model holds adapter-only versions (a LoRA run sampled on vLLM with sampler weights
    "adapter"): vLLM serves them as the LoRA adapter named after the store model."""


ENGINES = ("reference", "vllm")


class SamplerHub:
    """The agents (one per store model) and base-model engines that sampling runs on."""

    def __init__(
        self,
        *,
        store_uri: str,
        cache_root: str | Path,
        wait_s: float = 300.0,
        max_snapshots: int = 2,
        engine: str = "reference",
        vllm_url: str | None = None,
        vllm_api_key: str | None = None,
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"sampler engine must be one of {ENGINES}, got {engine!r}")
        if engine == "vllm" and not vllm_url:
            raise ValueError(
                "the vllm sampler engine needs the vLLM server's URL (--vllm-url or the profile's [sampler] url)"
            )
        self.store_uri, self.cache_root, self.wait_s = store_uri, Path(cache_root), wait_s
        self.max_snapshots = max_snapshots
        self.engine, self.vllm_url, self.vllm_api_key = engine, vllm_url, vllm_api_key
        self._vllm_owner: str | None = None  # the store model whose versions the vLLM server serves
        self._vllm_sampler: Any = None
        if engine == "vllm":
            from weightsync.app.training.vllm_sampling import VllmSampler

            self._vllm_sampler = VllmSampler(vllm_url, api_key=vllm_api_key)
        self._snapshots: dict[tuple[str, int], Any] = {}  # older versions clients still sample, oldest first
        self._lock = threading.Lock()
        self._agents: dict[str, Any] = {}
        self._base_engines: dict[str, Any] = {}
        self._generators: dict[str, Generator] = {}
        self._builds: dict[Any, threading.Lock] = {}  # one per snapshot or generator being built

    def ensure_agent(self, store_model: str, base_dir: str, *, adapter: bool = False) -> str:
        """Starts the agent for `store_model` if there is none; returns its gRPC address (push
        target). `adapter`: the store model holds adapter-only versions (vLLM only)."""
        from weightsync.agents.config import AgentConfig
        from weightsync.agents.engines.reference import ReferenceEngine, ReferenceEngineConfig
        from weightsync.agents.server import AgentServer

        with self._lock:
            server = self._agents.get(store_model)
            if server is None:
                if self.engine == "vllm":
                    engine = self._attach_vllm(store_model, adapter)
                elif adapter:
                    raise NotSupported("the reference sampler engine serves merged weights, not adapter-only versions")
                else:
                    engine = ReferenceEngine(
                        ReferenceEngineConfig(model=load_config(base_dir), compute_dtype="float32")
                    )
                # drain: a request running at a swap finishes on the old version, so every
                # response comes from one version (vLLM's spans would otherwise mix two).
                config = AgentConfig(
                    model=store_model,
                    cache_dir=str(self.cache_root / store_model.replace("/", "_")),
                    name=f"sampler-{store_model}",
                    store=self.store_uri,
                    poll_interval_s=0.5,
                    push_wait_s=1.0,
                    workers=2,
                    swap_policy="drain",
                    weights_kind="adapter" if adapter else "model",
                )
                try:
                    server = AgentServer(config, engine=engine).start()
                except BaseException:
                    engine.close()
                    if self.engine == "vllm":
                        self._vllm_owner = None
                    raise
                self._agents[store_model] = server
            return server.address

    def _attach_vllm(self, store_model: str, adapter: bool) -> Any:
        """A VllmEngine on the configured server, which serves this store model from now on (under
        self._lock); adapter-only versions as the LoRA adapter named `store_model`."""
        from weightsync.agents.engines.vllm import VllmEngine, VllmEngineConfig
        from weightsync.app.training.vllm_sampling import GENERATE_ROUTE

        if self._vllm_owner is not None:
            raise NotSupported(
                f"the vLLM server at {self.vllm_url} already serves the sampler weights of "
                f"{self._vllm_owner}; one vLLM server serves one training run (start a vLLM server "
                "and a training server per run, or sample on the reference engine)"
            )
        engine = VllmEngine(
            VllmEngineConfig(
                url=self.vllm_url,
                api_key=self.vllm_api_key,
                start_timeout_s=30.0,
                lora_name=store_model if adapter else None,
            )
        )
        if GENERATE_ROUTE not in engine.routes:
            raise TrainingError(
                f"the vLLM server at {self.vllm_url} lacks {GENERATE_ROUTE}, which reports the "
                "weight version of every token: start it with --enable-scale-out"
            )
        self._vllm_owner = store_model
        return engine

    def sample(
        self,
        session: SamplingSession,
        prompt: Sequence[int],
        *,
        num_samples: int,
        params: SamplingParams,
        prompt_logprobs: bool,
    ) -> tuple[int, list[SampledSequence], np.ndarray | None]:
        """(the version that produced it, sequences, prompt logprobs)."""
        if session.store_model is not None and self.engine == "vllm":
            return self._sample_vllm(
                session, prompt, num_samples=num_samples, params=params, prompt_logprobs=prompt_logprobs
            )
        engine = self._engine(session)
        generator = self._generator(session.base_dir)
        with engine.lease() as served:
            if served.version == session.version:
                sequences, prompt_lp = generator.sample(
                    served.weights, prompt, num_samples=num_samples, params=params, prompt_logprobs=prompt_logprobs
                )
                return served.version, sequences, prompt_lp
        # The agent has moved on to a newer version: this client's snapshot is rebuilt from the
        # store (every chunk hash and the version digest checked, as the agent does).
        weights = self._snapshot(session)
        sequences, prompt_lp = generator.sample(
            weights, prompt, num_samples=num_samples, params=params, prompt_logprobs=prompt_logprobs
        )
        return session.version, sequences, prompt_lp

    def _sample_vllm(
        self,
        session: SamplingSession,
        prompt: Sequence[int],
        *,
        num_samples: int,
        params: SamplingParams,
        prompt_logprobs: bool,
    ) -> tuple[int, list[SampledSequence], np.ndarray | None]:
        self._synced_agent(session)  # vLLM serves the client's version or a newer one
        generator = self._generator(session.base_dir)
        version, sequences, prompt_lp = self._vllm_sampler.sample(
            prompt,
            num_samples=num_samples,
            params=params,
            prompt_logprobs=prompt_logprobs,
            context=generator.config.max_position_embeddings,
            tokenizer=generator.tokenizer,
            model=session.store_model if session.adapter else None,
        )
        if version < session.version:
            raise SamplerUnavailable(
                f"vLLM at {self.vllm_url} answered with v{version}, older than the sampling "
                f"client's v{session.version}: something else swapped its weights"
            )
        return version, sequences, prompt_lp

    def _snapshot(self, session: SamplingSession) -> Any:
        from weightsync.reader import Reader
        from weightsync.stores import open_store

        def read() -> Any:
            state = Reader(open_store(self.store_uri), model=session.store_model, workers=2).read(session.version)
            return {name: tensor.float() for name, tensor in state.state_dict().items()}

        weights = self._build_once(self._snapshots, (session.store_model, session.version), read)
        with self._lock:
            while len(self._snapshots) > self.max_snapshots:
                self._snapshots.pop(next(iter(self._snapshots)))
        return weights

    def _build_once(self, cache: dict, key: Any, build: Callable[[], Any]) -> Any:
        """cache[key], built by one thread while concurrent requests for the same key wait for it:
        building twice wastes a read of the store, and racing first imports (`transformers`, for
        the tokenizer) fails with ImportError in all but one thread."""
        with self._lock:
            if key in cache:
                return cache[key]
            build_lock = self._builds.setdefault(key, threading.Lock())
        with build_lock:
            with self._lock:
                if key in cache:
                    return cache[key]
            value = build()
            with self._lock:
                cache[key] = value
                self._builds.pop(key, None)
            return value

    def tokenizer_info(self, base_dir: str) -> tuple[Any | None, int | None]:
        generator = self._generator(base_dir)
        eos = getattr(generator.tokenizer, "eos_token_id", None) if generator.tokenizer is not None else None
        return generator.tokenizer, eos

    def _engine(self, session: SamplingSession) -> Any:
        if session.store_model is None:
            return self._base_engine(session.base_dir)
        return self._synced_agent(session).engine

    def _synced_agent(self, session: SamplingSession) -> Any:
        """The agent of the session's store model, once it serves the session's version or newer."""
        with self._lock:
            server = self._agents.get(session.store_model)
        if server is None:
            self.ensure_agent(session.store_model, session.base_dir, adapter=session.adapter)
            with self._lock:
                server = self._agents[session.store_model]
        if not server.agent.wait_for_version(session.version, self.wait_s):
            last_error = server.agent.status().get("last_error")
            raise SamplerUnavailable(
                f"the agent of {session.store_model} did not reach version {session.version} "
                f"within {self.wait_s:g} s (it serves {server.agent.served_version()}"
                + (f"; last error: {last_error}" if last_error else "")
                + ")"
            )
        return server

    def _base_engine(self, base_dir: str) -> Any:
        from weightsync.agents.engines.reference import ReferenceEngine, ReferenceEngineConfig

        with self._lock:
            engine = self._base_engines.get(base_dir)
            if engine is None:
                engine = ReferenceEngine(ReferenceEngineConfig(model_dir=base_dir, compute_dtype="float32"))
                self._base_engines[base_dir] = engine
            return engine

    def _generator(self, base_dir: str) -> Generator:
        return self._build_once(
            self._generators, base_dir, lambda: Generator(load_config(base_dir), _load_tokenizer(base_dir))
        )

    def close(self) -> None:
        with self._lock:
            agents, self._agents = list(self._agents.values()), {}
            engines, self._base_engines = list(self._base_engines.values()), {}
        for server in agents:
            server.stop()
        for engine in engines:
            engine.close()


def _load_tokenizer(base_dir: str) -> Any | None:
    if not (Path(base_dir) / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_dir)
