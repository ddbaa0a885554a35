"""losses: the loss functions the Tinker SDK names, over one datum's per-token log-probs.

Each is a *sum* over tokens (Tinker's convention: the caller's weights or advantages carry any
normalisation), with the public definitions (ratio r_t = exp(logp_t - sampler_logp_t), A_t the
per-token advantage):

    cross_entropy        -sum_t w_t * logp_t                                 inputs: target_tokens, weights
    importance_sampling  -sum_t r_t * A_t                                    inputs: target_tokens, logprobs, advantages
    ppo                  -sum_t min(r_t * A_t, clip(r_t, lo, hi) * A_t)      (+ loss_fn_config clip_low_threshold,
    cispo                -sum_t sg(clip(r_t, lo, hi)) * logp_t * A_t          clip_high_threshold: 0.8 / 1.2)

`forward_backward_custom` needs nothing here: the SDK runs the user's loss on the client and
sends its gradient back as cross_entropy weights.

Not here: the forward pass (worker.py), decoding the inputs (wire.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np
import torch

from weightsync.app.training.errors import NotSupported, UserInputError

_MAX_LOG_RATIO = 20.0  # beyond this the token is clipped anyway; keeps exp() finite on corrupt inputs


@dataclasses.dataclass(frozen=True)
class LossSpec:
    required: tuple[str, ...]
    config_defaults: Mapping[str, float]
    fn: Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]
    """(logprobs (T,), inputs, config) -> per-token loss (T,); the datum's loss is its sum."""


def _cross_entropy(logprobs, inputs, config):
    return -logprobs * inputs["weights"]


def _ratio(logprobs, inputs):
    return torch.exp((logprobs - inputs["logprobs"]).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))


def _importance_sampling(logprobs, inputs, config):
    return -_ratio(logprobs, inputs) * inputs["advantages"]


def _ppo(logprobs, inputs, config):
    ratio, adv = _ratio(logprobs, inputs), inputs["advantages"]
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * adv, clipped * adv)


def _cispo(logprobs, inputs, config):
    ratio = _ratio(logprobs, inputs).clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -ratio.detach() * logprobs * inputs["advantages"]


_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(("target_tokens", "weights"), {}, _cross_entropy),
    "importance_sampling": LossSpec(("target_tokens", "logprobs", "advantages"), {}, _importance_sampling),
    "ppo": LossSpec(("target_tokens", "logprobs", "advantages"), _CLIP, _ppo),
    "cispo": LossSpec(("target_tokens", "logprobs", "advantages"), _CLIP, _cispo),
}
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
