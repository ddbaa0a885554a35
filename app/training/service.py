"""service: what each Tinker route does. The facade over sessions, runs, the executor and sampling.

Routes that start work (create_model, forward_backward, optim_step, save_weights,
load_weights, save_weights_for_sampler, asample) answer at once with a request id and run
later; the result is fetched through `retrieve_future` (futures.py). Training requests of one
model run in seq_id order (ordering.py) on one executor thread (executor.py), which sends each as
a command to every rank (`weightsync.trainer.commands`). A request is validated before it is
queued: a bad one fails its future as a *user* error, consumes its seq_id, and never reaches the
model.

Checkpoints (save_state: a DCP checkpoint of model and optimizer) live under the model's run
directory with a `run.json` that says how to rebuild the model (runs.py), so a restarted server
can recreate a model from any saved state (`load_weights` with a session id: the SDK's
`create_training_client_from_state[_with_optimizer]`).

Not here: sessions and their expiry (sessions.py), the run directory (runs.py), the executor
(executor.py), saving sampler weights and sampling sessions (sampler_weights.py), HTTP and status
codes (http.py), the bodies' encoding and checks (wire.py), the model and its training
(`weightsync.trainer`: commands.py runs each request on the training engine).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import math
import threading
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from weightsync.app.training.errors import NotFound, NotSupported, SessionFinished, UserInputError
from weightsync.app.training.executor import Executor
from weightsync.app.training.futures import FutureTable, Outcome
from weightsync.app.training.ordering import SeqIdOrder
from weightsync.app.training.runs import ModelRecord, Runs, check_name
from weightsync.app.training.sampler_weights import SamplerWeights, SamplingSessions
from weightsync.app.training.sampling import SamplerHub, parse_sampling_params
from weightsync.app.training.sessions import Sessions, session_of
from weightsync.app.training.wire import (
    ForwardBackwardBatch,
    check_inputs,
    decode_lora_config,
    decode_model_input_json,
    encode_forward_backward_output,
    encode_sample_response,
    loss_spec,
    resolve_config,
)
from weightsync.models import load_config
from weightsync.trainer import commands
from weightsync.trainer.lora import LoraSettings
from weightsync.trainer.optim import AdamWParams

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """How the service behaves (the model layout comes from the profile the worker was built with)."""

    state_dir: str
    """Checkpoints (DCP) and run descriptions live here; survives restarts."""
    long_poll_s: float = 10.0
    """How long retrieve_future waits for a result before answering try_again."""
    gap_timeout_s: float = 120.0
    """How long a request may wait for a missing earlier seq_id before it fails."""
    session_timeout_s: float = 600.0
    """A session with no heartbeat, no request and no job of its own for this long is finished as
    expired and its models are unloaded: its client died without closing it (the SDK beats every 10 s)."""
    max_context_tokens: int = 4096
    """Longest model_input accepted in one datum."""
    known_models: tuple[str, ...] = ()
    """Base model directories advertised by get_server_capabilities (any directory can be used)."""
    model_aliases: tuple[tuple[str, str], ...] = ()
    """(name, directory) pairs: a base_model of that name means that directory (profiles)."""
    store: str | None = None
    """Where save_weights_for_sampler publishes (a store URI, `weightsync.stores`); default file://<state_dir>/store."""
    max_sample_tokens: int = 1024
    """Largest max_tokens a sampling request may ask for."""
    sampling_threads: int = 2
    """Sampling requests generating at once (beside training, which runs on its own thread)."""
    sampler_engine: str = "reference"
    """What sampling clients of saved weights run on: "reference" (an engine in this process) or
    "vllm" (the vLLM server at `vllm_url`, kept in sync by an agent this server attaches)."""
    vllm_url: str | None = None
    """The vLLM server's base URL for sampler_engine "vllm" (its API key: $VLLM_API_KEY)."""
    frozen_experts: str | None = None
    """How the trainer holds MoE models' routed experts (`--frozen-experts`, parallel.frozen_experts;
    None: fp32 master weights). Each MoE run's run.json records it, and a checkpoint is loaded only
    on a server that holds the experts the same way (its DCP tensors are the packed ones)."""
    sampler_weights: str = "merged"
    """What a LoRA run's sampling clients run on: "merged" (W + scale·B·A, a delta of the whole
    model each save) or "adapter" (adapter-only versions, which vLLM serves as a LoRA adapter on the
    base model: sampler_engine "vllm" only). Full fine-tuning runs always sync whole weights."""

    @property
    def store_uri(self) -> str:
        return self.store or f"file://{Path(self.state_dir).resolve() / 'store'}"

    def __post_init__(self) -> None:
        if (
            self.long_poll_s <= 0
            or self.gap_timeout_s <= 0
            or self.session_timeout_s <= 0
            or self.max_context_tokens < 1
        ):
            raise ValueError("long_poll_s, gap_timeout_s and session_timeout_s must be > 0 and max_context_tokens >= 1")
        if self.sampler_engine == "vllm" and not self.vllm_url:
            raise ValueError("sampler_engine 'vllm' needs vllm_url, the vLLM server's base URL")
        if self.sampler_weights not in ("merged", "adapter"):
            raise ValueError(f"sampler_weights must be 'merged' or 'adapter', got {self.sampler_weights!r}")
        if self.sampler_weights == "adapter" and self.sampler_engine != "vllm":
            raise ValueError(
                "sampler_weights 'adapter' needs sampler_engine 'vllm': the reference engine serves merged weights"
            )


class TrainingService:
    """The domain side of the routes; thread-safe (HTTP handler threads call it concurrently)."""

    def __init__(self, config: ServiceConfig, commander: commands.Commander) -> None:
        self.config = config
        self.commander = commander
        self.futures = FutureTable()
        self.state_dir = Path(config.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.models: dict[str, ModelRecord] = {}
        self.sessions = Sessions()
        self.runs = Runs(self.state_dir)
        self.executor = Executor(self.futures, self.sessions)
        self.samplers = SamplerHub(
            store_uri=config.store_uri,
            cache_root=self.state_dir / "sampler-agents",
            engine=config.sampler_engine,
            vllm_url=config.vllm_url,
        )
        self.sampling_sessions = SamplingSessions()
        self.sampler_weights = SamplerWeights(
            commander,
            self.samplers,
            self.sampling_sessions,
            self.runs,
            store_uri=config.store_uri,
            serve_adapters=config.sampler_weights == "adapter",
        )
        self._sampling_pool = cf.ThreadPoolExecutor(config.sampling_threads, thread_name_prefix="sampling")
        self._closed = threading.Event()
        threading.Thread(target=self._expire, name="expiry", daemon=True).start()

    # ------------------------------------------------------------------ sessions, info

    def create_session(self, body: Mapping[str, Any]) -> dict[str, Any]:
        session_id = f"s{uuid.uuid4().hex[:16]}"
        self.sessions.check_open(session_id)  # marks it seen: its expiry counts from now
        return {"type": "create_session", "session_id": session_id}

    def heartbeat(self, body: Mapping[str, Any]) -> dict[str, Any]:
        if isinstance(body.get("session_id"), str):
            self.sessions.check_open(body["session_id"])
        return {"type": "session_heartbeat"}

    def finish_session(self, session_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """`ServiceClient.close(status)`: the session ends; its heartbeats, new models and requests
        to its models are refused from now on, and its models are unloaded from every rank once
        the requests queued before the finish have run. Their saved checkpoints and samplers stay
        usable. A second finish changes nothing (the first reason stays). Unknown ids are accepted:
        a server restarted from its state directory has forgotten its sessions, and a client
        closing after the restart must not fail."""
        reason = body.get("reason") or {}
        status = reason.get("type") if isinstance(reason, Mapping) else None
        if status not in ("success", "errored", "interrupted"):
            raise UserInputError(f"finish reason must be success, errored or interrupted, got {status!r}")
        self._finish(session_id, status, body.get("detail"))
        return {"type": "finish_session", "session_id": session_id}

    def _finish(self, session_id: str, status: str, detail: Any) -> bool:
        """Finishes the session and, the first time, queues the unload of its models; whether this
        was the first time."""
        first = self.sessions.finish(session_id, status, detail)
        if first:  # on the executor, after every job queued so far (a last save_state, say)
            self.executor.enqueue(self.futures.create("unload"), lambda: self._unload_session(session_id))
        return first

    def _unload_session(self, session_id: str) -> Outcome:
        with self._lock:
            records = [r for model_id, r in self.models.items() if session_of(model_id) == session_id]
        for record in records:
            self.commander.run(commands.Unload(record.model_id))
            with self._lock:
                self.models.pop(record.model_id, None)
            record.order.fail_all(SessionFinished(f"session {session_id} was finished before this request's turn came"))
            log.info("model %s unloaded: its session finished", record.model_id)
        return Outcome(json={"type": "unload", "session_id": session_id, "model_ids": [r.model_id for r in records]})

    def health(self) -> dict[str, Any]:
        with self._lock:
            return {"status": "ok", "loaded_models": sorted(self.models)}

    def capabilities(self) -> dict[str, Any]:
        models = []
        for directory in self.config.known_models + tuple(name for name, _ in self.config.model_aliases):
            try:
                context = load_config(dict(self.config.model_aliases).get(directory, directory)).max_position_embeddings
            except ValueError:
                continue
            models.append(
                {"model_name": directory, "max_context_length": context, "trainable": True, "sampleable": True}
            )
        return {"supported_models": models}

    def get_info(self, body: Mapping[str, Any]) -> dict[str, Any]:
        record = self._model(_field(body, "model_id", str))
        rank = record.lora.rank if record.lora is not None else 0
        return {
            "type": "get_info",
            "model_id": record.model_id,
            "model_data": {
                "arch": record.model_type,
                "model_name": record.base_model,
                "tokenizer_id": record.base_model,
            },
            "is_lora": rank > 0,
            "lora_rank": rank or None,
            "model_name": record.base_model,
        }

    # ------------------------------------------------------------------ models

    def create_model(self, body: Mapping[str, Any]) -> dict[str, Any]:
        session_id = _field(body, "session_id", str)
        self.sessions.check_open(session_id)
        model_seq_id = _field(body, "model_seq_id", int)
        base_model = _field(body, "base_model", str)
        base_dir = self._resolve_base_model(base_model)
        lora = decode_lora_config(body.get("lora_config"), load_config(base_dir))
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise NotSupported(f"optimizer {optimizer!r} is not supported; this server trains with AdamW ('adamw')")
        model_id = f"{session_id}:train:{model_seq_id}"
        request_id = self.futures.create("create_model")
        self.executor.enqueue(request_id, lambda: self._create_model(model_id, base_model, base_dir, lora), session_id)
        return {"request_id": request_id, "model_id": model_id}

    def _resolve_base_model(self, base_model: str) -> str:
        aliases = dict(self.config.model_aliases)
        path = Path(aliases.get(base_model, base_model)).expanduser()
        if not (path / "config.json").is_file():
            raise UserInputError(
                f"base_model {base_model!r} is not an HF-style model directory on the server "
                "(config.json + safetensors + tokenizer)"
            )
        return str(path.resolve())

    def _create_model(self, model_id: str, base_model: str, base_dir: str, lora: LoraSettings | None) -> Outcome:
        # Checked again on the executor: a finish accepted after the request was queued has
        # unloaded the session's models already, and would not see this one.
        self.sessions.check_open(session_of(model_id))
        with self._lock:
            if model_id in self.models:
                raise UserInputError(f"model {model_id} already exists (model_seq_id reused in this session)")
        info = self.commander.run(commands.CreateModel(model_id, base_dir, lora))
        record = ModelRecord(
            model_id,
            base_model,
            base_dir,
            lora,
            info["vocab_size"],
            info["model_type"],
            SeqIdOrder(first=1, gap_timeout_s=self.config.gap_timeout_s, on_expired=self._expired),
        )
        with self._lock:
            self.models[model_id] = record
        self.runs.write_run(record, frozen_experts=self._frozen_experts(base_dir))
        return Outcome(json={"type": "create_model", "model_id": model_id})

    def _frozen_experts(self, base_dir: str) -> str | None:
        """How this server holds the routed experts of a model of `base_dir` (None: dense, or fp32)."""
        return self.config.frozen_experts if load_config(base_dir).is_moe else None

    def _check_experts_held_alike(self, run: Mapping[str, Any], path: str) -> None:
        """A MoE checkpoint holds its experts as the server that saved it did (packed or not):
        refuse, with the fix, to load it on a server that holds them otherwise."""
        saved = run.get("frozen_experts")
        if saved is None and self.config.frozen_experts is None:
            return
        here = self._frozen_experts(run["base_dir"])
        if saved != here:
            raise UserInputError(
                f"{path} was saved by a server that holds the MoE experts as {saved or 'fp32 master weights'}, "
                f"this one holds them as {here or 'fp32 master weights'}: load it on a server started "
                + (f"with --frozen-experts {saved}" if saved else "without --frozen-experts")
            )

    def _model(self, model_id: str) -> ModelRecord:
        self.sessions.check_open(session_of(model_id))
        with self._lock:
            record = self.models.get(model_id)
        if record is None:
            raise NotFound(f"unknown model {model_id!r}: create it with create_model (or load_weights) first")
        return record

    # ------------------------------------------------------------------ training requests

    def forward_backward(self, batch: ForwardBackwardBatch) -> dict[str, Any]:
        record = self._model(batch.model_id)
        request_id = self.futures.create("fwdbwd")
        try:
            command = self._check_forward_backward(record, batch)
        except (UserInputError, NotFound) as e:  # NotFound: a loss the SDK names that is not served here
            error = e
            request_id = self._submit_ordered(record, batch.seq_id, request_id, lambda: _raise(error))
        else:
            request_id = self._submit_ordered(
                record, batch.seq_id, request_id, lambda: self._run_forward_backward(command)
            )
        return {"request_id": request_id, "model_id": record.model_id}

    def _check_forward_backward(self, record: ModelRecord, batch: ForwardBackwardBatch) -> commands.ForwardBackward:
        spec = loss_spec(batch.loss_fn)
        config = resolve_config(spec, batch.loss_fn, batch.loss_config)
        if not batch.data:
            raise UserInputError("forward_backward needs at least one datum")
        for i, datum in enumerate(batch.data):
            if len(datum.tokens) > self.config.max_context_tokens:
                raise UserInputError(
                    f"data[{i}] has {len(datum.tokens)} tokens, over this server's limit of "
                    f"{self.config.max_context_tokens}"
                )
            check_inputs(spec, batch.loss_fn, i, datum.tokens, datum.inputs, record.vocab_size)
        return commands.ForwardBackward(record.model_id, batch.loss_fn, config, batch.data, batch.forward_only)

    def _run_forward_backward(self, command: commands.ForwardBackward) -> Outcome:
        outputs, metrics = self.commander.run(command)
        return Outcome(proto=encode_forward_backward_output(outputs, metrics))

    def optim_step(self, body: Mapping[str, Any]) -> dict[str, Any]:
        record = self._model(_field(body, "model_id", str))
        seq_id = _field(body, "seq_id", int)
        params = body.get("adam_params")
        request_id = self.futures.create("optim")
        try:
            if not isinstance(params, Mapping):
                kind = (
                    (body.get("optimizer_params") or {}).get("type")
                    if isinstance(body.get("optimizer_params"), Mapping)
                    else None
                )
                raise UserInputError(f"optim_step needs adam_params (this server trains with AdamW); got {kind!r}")
            adamw = AdamWParams(
                lr=_number(params, "learning_rate", 1e-4, low=0.0),
                betas=(
                    _number(params, "beta1", 0.9, low=0.0, below=1.0),
                    _number(params, "beta2", 0.95, low=0.0, below=1.0),
                ),
                eps=_number(params, "eps", 1e-12, low=0.0),
                weight_decay=_number(params, "weight_decay", 0.0, low=0.0),
            )
            command = commands.OptimStep(record.model_id, adamw, _number(params, "grad_clip_norm", 0.0, low=0.0))
        except UserInputError as e:
            error = e
            request_id = self._submit_ordered(record, seq_id, request_id, lambda: _raise(error))
        else:
            request_id = self._submit_ordered(
                record,
                seq_id,
                request_id,
                lambda: Outcome(json={"type": "optim_step", "metrics": self.commander.run(command)}),
            )
        return {"request_id": request_id, "model_id": record.model_id}

    # ------------------------------------------------------------------ checkpoints (DCP)

    def save_state(self, body: Mapping[str, Any]) -> dict[str, Any]:
        record = self._model(_field(body, "model_id", str))
        seq_id = _field(body, "seq_id", int)
        request_id = self.futures.create("save")
        try:
            name = check_name(body.get("path") or f"state-{seq_id:06d}", "checkpoint")
        except UserInputError as e:
            error = e
            request_id = self._submit_ordered(record, seq_id, request_id, lambda: _raise(error))
            return {"request_id": request_id, "model_id": record.model_id}
        path, directory = self.runs.checkpoint(record.model_id, name)

        def save() -> Outcome:
            self.commander.run(commands.SaveState(record.model_id, str(directory)))
            return Outcome(json={"type": "save_weights", "path": path})

        request_id = self._submit_ordered(record, seq_id, request_id, save)
        return {"request_id": request_id, "model_id": record.model_id}

    def load_state(self, body: Mapping[str, Any]) -> dict[str, Any]:
        path = _field(body, "path", str)
        with_optimizer = bool(body.get("optimizer", False))
        source_run, directory = self.runs.saved_checkpoint(path)
        if body.get("session_id") is not None:
            # Create-via-load: this request creates the model (the SDK's create_training_client_from_state*).
            session_id = _field(body, "session_id", str)
            self.sessions.check_open(session_id)
            model_id = f"{session_id}:train:{_field(body, 'model_seq_id', int)}"
            run = self.runs.read_run(source_run)
            self._check_experts_held_alike(run, path)
            base_model = body.get("base_model") or run["base_model"]
            if base_model != run["base_model"]:
                raise UserInputError(f"base_model {base_model!r} differs from the checkpoint's {run['base_model']!r}")
            request_id = self.futures.create("load")

            def create_and_load() -> Outcome:
                lora = LoraSettings(**run["lora"]) if run.get("lora") else None
                self._create_model(model_id, run["base_model"], run["base_dir"], lora)
                try:
                    self.commander.run(commands.LoadState(model_id, str(directory), with_optimizer))
                except BaseException:  # no half-made model: a retry with the same id must work
                    self.commander.run(commands.Unload(model_id))
                    with self._lock:
                        self.models.pop(model_id, None)
                    raise
                return Outcome(json={"type": "load_weights", "path": path, "model_id": model_id})

            self.executor.enqueue(request_id, create_and_load, session_id)
            return {"request_id": request_id, "model_id": model_id}
        record = self._model(_field(body, "model_id", str))
        seq_id = _field(body, "seq_id", int)
        request_id = self.futures.create("load")

        def load() -> Outcome:
            self._check_experts_held_alike(self.runs.read_run(source_run), path)
            self.commander.run(commands.LoadState(record.model_id, str(directory), with_optimizer))
            return Outcome(json={"type": "load_weights", "path": path, "model_id": record.model_id})

        request_id = self._submit_ordered(record, seq_id, request_id, load)
        return {"request_id": request_id, "model_id": record.model_id}

    def list_checkpoints(self, model_id: str) -> dict[str, Any]:
        return {"checkpoints": self.runs.list_checkpoints(model_id)}

    # ------------------------------------------------------------------ sampler weights, sampling

    def save_weights_for_sampler(self, body: Mapping[str, Any]) -> dict[str, Any]:
        record = self._model(_field(body, "model_id", str))
        seq_id = _field(body, "seq_id", int)
        name = body.get("path")
        request_id = self.futures.create("save_sampler")
        try:
            name = None if name is None else check_name(name, "sampler weights")
        except UserInputError as e:
            error = e
            request_id = self._submit_ordered(record, seq_id, request_id, lambda: _raise(error))
            return {"request_id": request_id, "model_id": record.model_id}
        request_id = self._submit_ordered(record, seq_id, request_id, lambda: self.sampler_weights.save(record, name))
        return {"request_id": request_id, "model_id": record.model_id}

    def create_sampling_session(self, body: Mapping[str, Any]) -> dict[str, Any]:
        model_path = body.get("model_path")
        if model_path is not None:
            model_id, meta = self.runs.read_sampler(model_path)
            session = self.sampling_sessions.open_saved(meta, self.runs.read_run(model_id)["base_dir"], model_path)
        else:
            base_model = _field(body, "base_model", str)
            session = self.sampling_sessions.open(base_model, self._resolve_base_model(base_model), None, 0, None)
        return {"type": "create_sampling_session", "sampling_session_id": session}

    def get_sampler(self, sampler_id: str) -> dict[str, Any]:
        session = self.sampling_sessions.get(sampler_id)
        return {
            "sampler_id": session.session_id,
            "base_model": session.base_model,
            "model_path": session.model_path,
            "weight_version": session.version,
        }

    def sample(self, body: Mapping[str, Any]) -> dict[str, Any]:
        if body.get("sampling_session_id") is None:
            raise UserInputError("asample needs a sampling_session_id (create a sampling client first)")
        session = self.sampling_sessions.get(_field(body, "sampling_session_id", str))
        num_samples = body.get("num_samples", 1)
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or not 1 <= num_samples <= 128:
            raise UserInputError(f"num_samples must be an integer in [1, 128], got {num_samples!r}")
        for unsupported in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(unsupported):
                raise NotSupported(f"{unsupported} is not supported by this server")
        if body.get("target_prompt_logprobs") is not None or body.get("prompt_logprobs_last_n") is not None:
            raise NotSupported("target_prompt_logprobs and prompt_logprobs_last_n are not supported by this server")
        prompt = decode_model_input_json(body.get("prompt"), "prompt")
        config = load_config(session.base_dir)
        if len(prompt) == 0 or prompt.min() < 0 or prompt.max() >= config.vocab_size:
            raise UserInputError(f"prompt must be non-empty with token ids in [0, {config.vocab_size})")
        if len(prompt) >= config.max_position_embeddings:
            raise UserInputError(
                f"prompt has {len(prompt)} tokens; the model's context is {config.max_position_embeddings}"
            )
        _, eos = self.samplers.tokenizer_info(session.base_dir)
        params = parse_sampling_params(
            body.get("sampling_params"),
            eos_token_id=eos,
            vocab_size=config.vocab_size,
            max_new_tokens=self.config.max_sample_tokens,
        )
        want_prompt_logprobs = bool(body.get("prompt_logprobs"))
        request_id = self.futures.create("sample")

        def run() -> None:
            try:
                version, sequences, prompt_lp = self.samplers.sample(
                    session,
                    prompt.tolist(),
                    num_samples=num_samples,
                    params=params,
                    prompt_logprobs=want_prompt_logprobs,
                )
            except Exception as e:
                if not isinstance(e, UserInputError):
                    log.exception("sampling request %s failed", request_id)
                self.futures.fail(request_id, e)
                return
            self.futures.resolve(
                request_id, Outcome(proto=encode_sample_response(sequences, prompt_lp), weight_version=version)
            )

        self._sampling_pool.submit(run)
        return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}-{i}" for i in range(num_samples)]}

    # ------------------------------------------------------------------ futures, execution

    def retrieve(self, body: Mapping[str, Any]) -> Outcome | dict[str, Any]:
        request_id = _field(body, "request_id", str)
        outcome = self.futures.wait(request_id, self.config.long_poll_s)
        if outcome is None:
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        return outcome

    def _submit_ordered(self, record: ModelRecord, seq_id: int, request_id: str, job: Callable[[], Outcome]) -> str:
        """Queues `job` in its model's seq_id order; the request id to answer with."""
        return self.executor.submit_ordered(
            record.order,
            seq_id,
            request_id,
            self._while_loaded(record, job),
            session_id=session_of(record.model_id),
            model_id=record.model_id,
        )

    def _while_loaded(self, record: ModelRecord, job: Callable[[], Outcome]) -> Callable[[], Outcome]:
        """`job`, refused if its model was unloaded before it ran: a request accepted just before
        its session finished, queued behind the unload."""

        def run() -> Outcome:
            with self._lock:
                loaded = self.models.get(record.model_id) is record
            if not loaded:
                self.sessions.check_open(session_of(record.model_id))
                raise NotFound(f"model {record.model_id} is no longer loaded")
            return job()

        return run

    def _expired(self, seq_id: int, request_id: str, error: Exception) -> None:
        log.warning("%s", error)
        self.futures.fail(request_id, error)

    def _expire(self) -> None:
        """Fails requests waiting too long for a missing seq_id, and finishes sessions whose
        client went silent."""
        every = min(1.0, self.config.gap_timeout_s / 4, self.config.session_timeout_s / 4)
        while not self._closed.wait(every):
            with self._lock:
                records = list(self.models.values())
            for record in records:
                record.order.expire()
            for session_id in self.sessions.silent(self.config.session_timeout_s):
                detail = f"no heartbeat or request for {self.config.session_timeout_s:g} s"
                if self._finish(session_id, "expired", detail):
                    log.warning("session %s expired: %s; its models are unloaded", session_id, detail)

    def close(self) -> None:
        self._closed.set()
        self.executor.close()
        self._sampling_pool.shutdown(wait=True, cancel_futures=True)
        self.commander.close()
        self.samplers.close()


def _raise(error: Exception) -> Outcome:
    raise error


def _field(body: Mapping[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise UserInputError(f"field {name!r} must be {'an integer' if kind is int else 'a string'}, got {value!r}")
    return value


def _number(params: Mapping[str, Any], name: str, default: float, *, low: float, below: float | None = None) -> float:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserInputError(f"adam_params.{name} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value) or not value >= low or (below is not None and not value < below):
        bound = f"in [{low}, {below})" if below is not None else f">= {low}"
        raise UserInputError(f"adam_params.{name} must be {bound}, got {value}")
    return value
