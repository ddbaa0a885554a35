"""wire: the Tinker protocol's bodies <-> plain data; the only module that knows the schema.

forward_backward requests and the results of forward_backward and sampling travel as protobuf,
with the schema the SDK wheel ships (`tinker.proto.tinker_public_pb2`, imported from the
pinned `tinker` package so that server and client can never disagree on it); everything else
is JSON. A request that is not what the schema allows is a `UserInputError` naming the field,
and so is one that does not fit what it names: a loss's inputs and config (against the
training engine's table of losses), a `lora_config` (against the base model).

Not here: what the tensors mean to a loss (`weightsync.trainer.losses`), the other checks
against the model (service.py).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from weightsync.app.training.errors import NotSupported, UserInputError
from weightsync.errors import ConfigError
from weightsync.models import ModelConfig
from weightsync.trainer.data import Datum
from weightsync.trainer.lora import LoraSettings, check_fits
from weightsync.trainer.losses import LOSSES, LossSpec

_NUMPY_OF_PROTO_DTYPE = {1: np.float32, 2: np.int64, 3: np.int32}  # DTYPE_FLOAT32, INT64, INT32


def _pb():
    # Imported lazily: `weightsync serve-training --help` and the CLI must not need the SDK.
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@dataclasses.dataclass(frozen=True)
class ForwardBackwardBatch:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


# ------------------------------------------------------------------------------ requests


def decode_forward_backward(body: bytes) -> ForwardBackwardBatch:
    """A forward_backward protobuf body (already decompressed) as plain arrays."""
    pb = _pb()
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # protobuf raises DecodeError, sometimes others on garbage
        raise UserInputError(f"forward_backward body is not a ForwardBackwardRequest protobuf: {e}") from e
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    data = [_decode_datum(i, d) for i, d in enumerate(msg.data)]
    return ForwardBackwardBatch(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def _decode_datum(index: int, msg: Any) -> Datum:
    tokens = decode_model_input_chunks([(c.WhichOneof("chunk"), c) for c in msg.model_input], f"data[{index}]")
    inputs = {
        name: _decode_tensor(t, f"data[{index}].loss_fn_inputs[{name!r}]") for name, t in msg.loss_fn_inputs.items()
    }
    return Datum(tokens, inputs)


def decode_model_input_chunks(chunks: Sequence[tuple[str | None, Any]], where: str) -> np.ndarray:
    parts = []
    for i, (kind, chunk) in enumerate(chunks):
        if kind != "encoded_text":
            raise NotSupported(
                f"{where}.model_input chunk {i} is {kind!r}: this server trains text models only "
                "(encoded_text chunks); image and audio inputs are not supported"
            )
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise UserInputError(f"{where}.model_input chunk {i}: token bytes are not int32 ({len(raw)} bytes)")
        parts.append(np.frombuffer(raw, dtype=np.int32).astype(np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _decode_tensor(msg: Any, where: str) -> np.ndarray:
    dtype = _NUMPY_OF_PROTO_DTYPE.get(msg.dtype)
    if dtype is None:
        raise UserInputError(f"{where}: unsupported dtype {msg.dtype} (float32 or int64)")
    shape = [int(s) for s in msg.shape]
    if msg.WhichOneof("encoding") == "sparse_csr":
        return _decode_csr(msg.sparse_csr, dtype, shape, where)
    raw = msg.dense
    if len(raw) % np.dtype(dtype).itemsize:
        raise UserInputError(f"{where}: {len(raw)} bytes is not a whole number of {np.dtype(dtype).name}")
    flat = np.frombuffer(raw, dtype=dtype)
    if shape:
        if int(np.prod(shape)) != flat.size:
            raise UserInputError(
                f"{where}: shape {shape} needs {int(np.prod(shape))} elements, the data has {flat.size}"
            )
        return flat.reshape(shape).astype(np.float32 if dtype == np.float32 else np.int64)
    return flat.astype(np.float32 if dtype == np.float32 else np.int64)


def _decode_csr(csr: Any, dtype: Any, shape: list[int], where: str) -> np.ndarray:
    if len(shape) != 2:
        raise UserInputError(f"{where}: a sparse CSR tensor needs a 2-D shape, got {shape}")
    values = np.frombuffer(csr.values, dtype=dtype)
    crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
    col = np.frombuffer(csr.col_indices, dtype=np.int64)
    rows, cols = shape
    if (
        crow.size != rows + 1
        or col.size != values.size
        or (crow.size and crow[-1] != values.size)
        or (col.size and (col.min() < 0 or col.max() >= cols))
        or np.any(np.diff(crow) < 0)
    ):
        raise UserInputError(f"{where}: inconsistent sparse CSR indices for shape {shape}")
    dense = np.zeros(shape, dtype=dtype)
    for r in range(rows):
        dense[r, col[crow[r] : crow[r + 1]]] = values[crow[r] : crow[r + 1]]
    return dense


def decode_model_input_json(doc: Any, where: str) -> np.ndarray:
    """A JSON ModelInput ({"chunks": [{"type": "encoded_text", "tokens": [...]}, ...]}) as int64 tokens."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("chunks"), list):
        raise UserInputError(f"{where} must be a ModelInput object with a 'chunks' list")
    parts = []
    for i, chunk in enumerate(doc["chunks"]):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, Mapping) else None
        if kind != "encoded_text":
            raise NotSupported(f"{where}.chunks[{i}] is {kind!r}: only encoded_text chunks are supported")
        tokens = chunk.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise UserInputError(f"{where}.chunks[{i}].tokens must be a list of integers")
        parts.append(np.asarray(tokens, dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


# ------------------------------------------------------------------------------ checks

_NAMED_BY_SDK_ONLY = ("dro", "gspo", "stable_reinforce", "custom")


def loss_spec(name: str) -> LossSpec:
    """The loss called `name`; NotSupported for SDK names without a public definition here,
    UserInputError for names the SDK does not know either."""
    if name in LOSSES:
        return LOSSES[name]
    if name in _NAMED_BY_SDK_ONLY:
        raise NotSupported(f"loss function {name!r} is not supported by this server; supported: {sorted(LOSSES)}")
    raise UserInputError(f"unknown loss function {name!r}; supported: {sorted(LOSSES)}")


def resolve_config(spec: LossSpec, name: str, config: Mapping[str, float | str]) -> dict[str, float]:
    """loss_fn_config with the loss's defaults filled in (every key it takes, as floats)."""
    unknown = sorted(set(config) - set(spec.config_defaults))
    if unknown:
        raise UserInputError(
            f"loss_fn_config keys {unknown} are not understood by {name!r}; "
            f"it takes {sorted(spec.config_defaults) or 'none'}"
        )
    resolved = dict(spec.config_defaults)
    for key, value in config.items():
        if isinstance(value, str):
            raise UserInputError(f"loss_fn_config[{key!r}] must be a number, got the string {value!r}")
        resolved[key] = float(value)
    if "clip_low_threshold" in resolved and not 0 <= resolved["clip_low_threshold"] <= resolved["clip_high_threshold"]:
        raise UserInputError(f"{name}: need 0 <= clip_low_threshold <= clip_high_threshold, got {resolved}")
    return resolved


def check_inputs(
    spec: LossSpec, name: str, index: int, tokens: np.ndarray, inputs: Mapping[str, np.ndarray], vocab_size: int
) -> None:
    """Raises UserInputError unless the datum carries exactly the inputs `name` needs, each of
    shape (len(model_input),), with target tokens inside the vocabulary."""
    where = f"data[{index}]"
    missing = [k for k in spec.required if k not in inputs]
    allowed = set(spec.required) | {"weights"}
    unknown = sorted(set(inputs) - allowed)
    if missing or unknown:
        raise UserInputError(
            f"{where}.loss_fn_inputs: {name!r} needs {list(spec.required)}"
            + (f"; missing {missing}" if missing else "")
            + (f"; unknown {unknown}" if unknown else "")
        )
    length = tokens.shape[0]
    if length == 0:
        raise UserInputError(f"{where}.model_input is empty")
    for key, value in inputs.items():
        if value.shape != (length,):
            raise UserInputError(
                f"{where}.loss_fn_inputs[{key!r}] has shape {list(value.shape)}; it must be "
                f"[{length}], one value per model_input token"
            )
        if key != "target_tokens" and not np.all(np.isfinite(value)):
            raise UserInputError(f"{where}.loss_fn_inputs[{key!r}] holds NaN or infinity")
    for what, ids in (("model_input", tokens), ("loss_fn_inputs['target_tokens']", inputs["target_tokens"])):
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise UserInputError(f"{where}.{what} has token ids outside [0, {vocab_size}) (the model's vocabulary)")


def decode_lora_config(doc: Mapping[str, Any] | None, model: ModelConfig) -> LoraSettings | None:
    """create_model's lora_config for a base model of `model`'s architecture: None for full
    fine-tuning (no config, or rank 0)."""
    doc = dict(doc or {})
    rank = doc.get("rank", 0) or 0
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise UserInputError(f"lora_config.rank must be an integer >= 0 (0 = full fine-tuning), got {rank!r}")
    if rank == 0:
        return None
    try:
        settings = LoraSettings(
            rank=rank,
            train_attn=bool(doc.get("train_attn", True)),
            train_mlp=bool(doc.get("train_mlp", True)),
            train_unembed=bool(doc.get("train_unembed", True)),
            # The SDK documents seed=None as a random initialisation. Drawn here, on rank 0, the
            # seed travels with the command, so every rank builds the same adapters.
            seed=doc["seed"] if doc.get("seed") is not None else secrets.randbits(31),
        )
        check_fits(model, settings)
    except ConfigError as e:  # the settings the request asked for: the caller's to fix
        raise UserInputError(f"lora_config: {e}") from e
    return settings


# ------------------------------------------------------------------------------ results


def encode_forward_backward_output(outputs: Sequence[Mapping[str, np.ndarray]], metrics: Mapping[str, float]) -> bytes:
    """Per-datum 1-D float32 arrays (e.g. {"logprobs": ...}) and metrics as ForwardBackwardOutput."""
    pb = _pb()
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    if outputs:
        record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
        for name in outputs[0]:
            arrays = [np.ascontiguousarray(o[name], dtype=np.float32).reshape(-1) for o in outputs]
            offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
            offsets[1:] = np.cumsum([a.nbytes for a in arrays])
            field = record.fields[name]
            field.data = b"".join(a.tobytes() for a in arrays)
            field.offsets = offsets.tobytes()
            field.dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


@dataclasses.dataclass(frozen=True)
class SampledSequence:
    tokens: np.ndarray  # int
    logprobs: np.ndarray  # float32, one per token
    stopped: bool  # True: a stop token/string ended it; False: max_tokens did


def encode_sample_response(sequences: Sequence[SampledSequence], prompt_logprobs: np.ndarray | None) -> bytes:
    pb = _pb()
    msg = pb.SampleResponse()
    for seq in sequences:
        msg.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if seq.stopped else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes(),
        )
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
