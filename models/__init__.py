"""models: the model definitions the project's trainer trains and its reference server serves: one
decoder (`decoder.py`), dense or Mixture-of-Experts (`moe.py`), with Hugging Face names.

Installed as `weightsync.models`. The library (`weightsync/`) never imports it: weights travel as
named tensors, whatever model made them.

Not here: versions, stores, sync (`weightsync/`), training (`trainer/`), serving (`agents/`).
"""

from weightsync.models.decoder import (
    CONFIG_NAME,
    ByteTokenizer,
    CausalLM,
    KVCache,
    ModelConfig,
    as_model_config,
    build_model,
    load_config,
    load_pretrained,
    num_parameters,
    rope_inv_freq,
    save_pretrained,
    skeleton,
    token_logprobs,
)
from weightsync.models.moe import SparseMoeBlock, load_balancing_loss

__all__ = [
    "CONFIG_NAME",
    "ByteTokenizer",
    "CausalLM",
    "KVCache",
    "SparseMoeBlock",
    "ModelConfig",
    "as_model_config",
    "build_model",
    "load_balancing_loss",
    "load_config",
    "load_pretrained",
    "num_parameters",
    "rope_inv_freq",
    "save_pretrained",
    "skeleton",
    "token_logprobs",
]
