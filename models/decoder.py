"""decoder: a Llama / Qwen2 / Qwen3-style decoder in plain PyTorch, dense or Mixture-of-Experts,
with Hugging Face tensor names.

The one model definition the project shares: the trainer (`weightsync.trainer`) trains it and
the reference inference server (`weightsync.agents`) serves it, and its checkpoints load in HF
tooling and inference engines (`config.json` + safetensors, the names of `LlamaForCausalLM`,
`Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `Qwen2MoeForCausalLM` and `Qwen3MoeForCausalLM`). RMSNorm,
RoPE (HF's half-split layout), grouped-query attention, SwiGLU, optional tied embeddings, optional
q/k/v bias (Qwen2) and q/k norms (Qwen3); MoE layers (`moe.py`) where `num_experts` says so.

The module is an architecture; the weights can be handed in per call (`forward(..., weights=)`,
via `torch.func.functional_call`) so that a server can swap a whole dict of tensors atomically
and each request runs on exactly one version. `generate` keeps a KV cache.

Not here: training (`trainer/`), sharding, anything about versions or stores.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from weightsync.models.moe import SparseMoeBlock, SwiGLU, is_sparse_layer

CONFIG_NAME = "config.json"
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_QKV_BIAS = {"qwen2", "qwen2_moe"}
_QK_NORM = {"qwen3", "qwen3_moe"}
_MOE = {"qwen2_moe", "qwen3_moe"}
_MOE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "shared_expert_intermediate_size",
    "router_aux_loss_coef",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The architecture, with the field names of an HF `config.json`."""

    model_type: str = "qwen3"
    """"llama", "qwen2" (q/k/v bias), "qwen3" (per-head RMSNorm on q and k), or their MoE forms
    "qwen2_moe" and "qwen3_moe" (which need num_experts)."""
    vocab_size: int = 256
    hidden_size: int = 256
    intermediate_size: int = 768
    """SwiGLU width."""
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    """Grouped-query attention: each k/v head serves num_attention_heads // num_key_value_heads."""
    head_dim: int | None = None
    """Per-head width; None (resolved at construction) means hidden_size // num_attention_heads."""
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    """The output projection reuses embed_tokens.weight (no lm_head.weight tensor)."""
    initializer_range: float = 0.02
    num_experts: int = 0
    """Experts per MoE layer; 0: a dense model (MoE model types need >= 1)."""
    num_experts_per_tok: int = 2
    """Top-k: the experts each token goes through."""
    moe_intermediate_size: int = 768
    """Each expert's SwiGLU width."""
    norm_topk_prob: bool = False
    """Renormalise the top-k router probabilities to sum to 1 (HF's default: no; Qwen3-30B-A3B: yes)."""
    decoder_sparse_step: int = 1
    """Every this many layers is a MoE layer (1: all of them), except those in mlp_only_layers."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers that keep a dense MLP (of intermediate_size)."""
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE's shared expert, which every token goes through (0: none, as in Qwen3-MoE)."""
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss the trainer adds (models.moe.load_balancing_loss)."""

    KEY_NOTES: ClassVar[dict[str, str]] = {
        key: f"{key} is the trainer's setting ([train.model]: {what}), not the architecture's; remove it here "
        "(an engine's weights come from its agent: the store or pushes)"
        for key, what in (("init_seed", "the seed of its first weights"), ("init_dir", "where its first weights are"))
    }
    """Keys a config table of the architecture often carries by mistake (a pasted [train.model]):
    what weightsync.settings says of them instead of "unknown key"."""

    def __post_init__(self) -> None:
        if self.model_type not in _ARCHITECTURES:
            raise ValueError(f"model_type must be one of {sorted(_ARCHITECTURES)}, got {self.model_type!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError("hidden_size must be a multiple of num_attention_heads (or set head_dim)")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if self.model_type in _MOE:
            if self.num_experts < 1:
                raise ValueError(f"model_type {self.model_type!r} needs num_experts >= 1")
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), got {self.num_experts_per_tok}"
                )
            for name in ("moe_intermediate_size", "decoder_sparse_step"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
            if self.shared_expert_intermediate_size < 0:
                raise ValueError("shared_expert_intermediate_size must be >= 0 (0: no shared expert)")
            if self.shared_expert_intermediate_size and self.model_type != "qwen2_moe":
                raise ValueError("a shared expert is Qwen2-MoE's: use model_type 'qwen2_moe'")
        elif self.num_experts:
            raise ValueError(f"num_experts is for the MoE model types {sorted(_MOE)}, not {self.model_type!r}")

    @property
    def is_moe(self) -> bool:
        return self.model_type in _MOE

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` document HF transformers and inference engines read."""
        doc = dataclasses.asdict(self)
        if self.is_moe:
            doc["mlp_only_layers"] = list(self.mlp_only_layers)
        else:  # a dense model's config.json stays what it always was
            for name in _MOE_FIELDS:
                del doc[name]
        doc.update(
            architectures=[_ARCHITECTURES[self.model_type]],
            torch_dtype="bfloat16",
            hidden_act="silu",
            attention_bias=self.model_type in _QKV_BIAS,
        )
        if self.model_type == "qwen2_moe":
            doc["qkv_bias"] = True  # what transformers 5's Qwen2-MoE reads
        return doc

    @classmethod
    def from_hf(cls, doc: Mapping[str, Any]) -> ModelConfig:
        """From an HF `config.json` document; fields this model does not use are ignored."""
        model_type = doc.get("model_type", "llama")
        if model_type not in _ARCHITECTURES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(_ARCHITECTURES)}")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in doc.items() if k in names}
        kwargs.setdefault("num_key_value_heads", doc.get("num_attention_heads", 1))
        if model_type == "qwen2_moe" and doc.get("qkv_bias", True) is not True:
            raise ValueError("a Qwen2-MoE without q/k/v biases (qkv_bias: false) is not supported")
        if "num_experts" not in kwargs and "num_local_experts" in doc:  # transformers 5 writes this name
            kwargs["num_experts"] = doc["num_local_experts"]
        # transformers >= 5 writes rope_theta inside rope_parameters, not at the top level.
        rope = doc.get("rope_parameters")
        if "rope_theta" not in kwargs and isinstance(rope, Mapping) and "rope_theta" in rope:
            kwargs["rope_theta"] = float(rope["rope_theta"])
        return cls(**kwargs)


def as_model_config(value: ModelConfig | Mapping[str, Any] | None, what: str = "model") -> ModelConfig | None:
    """A ModelConfig from a ModelConfig, a dict of its fields (a config file's table) or None;
    ValueError naming `what` for anything else."""
    if value is None or isinstance(value, ModelConfig):
        return value
    if isinstance(value, Mapping):
        try:
            return ModelConfig(**value)
        except TypeError as e:
            raise ValueError(f"{what}: {e}; use the field names of weightsync.models.ModelConfig") from None
    raise ValueError(f"{what} must be a ModelConfig or a dict of its fields, got {type(value).__name__}")


def rope_inv_freq(config: ModelConfig, device: str | torch.device = "cpu") -> torch.Tensor:
    """RoPE inverse frequencies (HF's default rotary embedding, no scaling), fp32. Models built
    on the meta device (FSDP, the reference server's replicas) recompute them with this."""
    d = config.head_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))


def rotary_cos_sin(
    inv_freq: torch.Tensor, past: int, length: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin (length, head_dim) for positions past..past+length-1, computed in fp32
    on inv_freq's device and cast to the activations' dtype."""
    positions = torch.arange(past, past + length, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def output_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The output projection of the final-norm hidden states, in their dtype, returned as fp32."""
    return F.linear(hidden, weight).float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as HF does, then cast back: bf16 variance loses too much precision.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # HF's layout: halves, not interleaved pairs
    return torch.cat((-x2, x1), dim=-1)


class KVCache:
    """Keys and values of the positions seen so far, per layer (for incremental decoding)."""

    def __init__(self, layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers

    def length(self, layer: int = 0) -> int:
        """Positions cached for `layer` (layers are filled in order during a forward pass)."""
        keys = self.keys[layer]
        return 0 if keys is None else keys.shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat((self.keys[layer], k), dim=2)
            v = torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        bias = c.model_type in _QKV_BIAS
        self.q_proj = nn.Linear(c.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, c.hidden_size, bias=False)
        if c.model_type in _QK_NORM:
            self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        # Head counts from the projections' outputs, not the config: under tensor parallelism each
        # rank's q/k/v projections hold a slice of the heads (trainer/parallel.py, apply_tp).
        q = self.q_proj(x).view(b, t, -1, self.head_dim)
        k = self.k_proj(x).view(b, t, -1, self.head_dim)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        past = 0
        if cache is not None:
            past = cache.length(self.layer)
            k, v = cache.update(self.layer, k, v)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if past == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # new queries see every cached position and the causal part of their own block
            mask = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(diagonal=past)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, layer)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SparseMoeBlock(c) if is_sparse_layer(c, layer) else SwiGLU(c.hidden_size, c.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None,
        router_logits: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, router_logits) if isinstance(self.mlp, SparseMoeBlock) else self.mlp(h))


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class CausalLM(nn.Module):
    """The causal LM; `state_dict()` names match HF's `*ForCausalLM` for the config's model_type."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)  # not a weight: not published

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """HF's initialisation: normal(0, initializer_range) for matrices, zero biases, unit norms."""
        std = self.config.initializer_range
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    module.weight.normal_(0.0, std, generator=generator)
                    if getattr(module, "bias", None) is not None:
                        module.bias.zero_()
                elif isinstance(module, RMSNorm):
                    module.weight.fill_(1.0)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The output projection: lm_head as a module (so tensor parallelism and LoRA can wrap
        it), or the tied embedding matrix."""
        if self.config.tie_word_embeddings:
            return F.linear(x, self.model.embed_tokens.weight)
        return self.lm_head(x)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        cache: KVCache | None = None,
        weights: Mapping[str, torch.Tensor] | None = None,
        router_logits: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits (batch, tokens, vocab) in fp32. `weights`: run on these tensors instead of the
        module's own (names as in `state_dict()`); the module's parameters are not touched.
        `router_logits`: a list that gets each MoE layer's router logits, in layer order (for
        `models.moe.load_balancing_loss`). Not through FSDP2 with gradients on: its pre-forward
        rebuilds each sharded layer's arguments, so only the first MoE layer appends to the
        caller's list; hook the routers there instead (trainer/engine.py)."""
        if weights is not None:
            kwargs = {"cache": cache, "router_logits": router_logits}
            return torch.func.functional_call(self, dict(weights), (input_ids,), kwargs, strict=False)
        past = 0 if cache is None else cache.length()
        x = self.model.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(self.inv_freq.to(input_ids.device), past, input_ids.shape[1], x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache, router_logits)
        return self.project(self.model.norm(x)).float()

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        stop_token: int | None = None,
        generator: torch.Generator | None = None,
        weights: Mapping[str, torch.Tensor] | None = None,
        next_weights: Callable[[int], Mapping[str, torch.Tensor] | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples continuations of a batch of equal-length prompts.

        Returns (new tokens, their log-probabilities under the sampling distribution at
        temperature 1, i.e. what a policy-gradient loss needs), each (batch, <= max_new_tokens).
        Rows that produced `stop_token` keep emitting it. temperature 0 is greedy.

        `next_weights(i)`, when given, is called between token steps, before new token i (i >= 1);
        weights it returns serve from token i on. The KV cache, computed with the old weights,
        is then dropped and the whole prefix (prompt and the i tokens so far) run again with the
        new ones, so that token i on is exactly what the new weights generate from that prefix
        (a prompt of prompt + tokens[:i] to a fresh model gives the same logits). It may raise
        to cut the generation.
        """
        cache = KVCache(self.config.num_hidden_layers)
        tokens, logprobs = [], []
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        step_input = input_ids
        for i in range(max_new_tokens):
            switched = next_weights(i) if next_weights is not None and i > 0 else None
            if switched is not None:
                weights, cache = switched, KVCache(self.config.num_hidden_layers)
                step_input = torch.cat([input_ids, torch.stack(tokens, dim=1)], dim=1)
            logits = self.forward(step_input, cache=cache, weights=weights)[:, -1, :]
            logp = torch.log_softmax(logits, dim=-1)
            if temperature == 0:
                next_token = logits.argmax(dim=-1)
            else:
                scaled = logits / temperature
                if top_k:
                    kth = scaled.topk(min(top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
                    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
                next_token = torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator).squeeze(1)
            if stop_token is not None:
                next_token = torch.where(done, torch.full_like(next_token, stop_token), next_token)
            tokens.append(next_token)
            logprobs.append(logp.gather(1, next_token[:, None]).squeeze(1))
            if stop_token is not None:
                done |= next_token == stop_token
                if bool(done.all()):
                    break
            step_input = next_token[:, None]
        if not tokens:
            empty = input_ids.new_empty(input_ids.shape[0], 0)
            return empty, empty.float()
        return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1)


class ByteTokenizer:
    """Bytes as tokens (ids 0-255) plus BOS, EOS and PAD: what the small demo and test models use.

    Trainer, reference server and rollout workers share it, so a prompt means the same ids
    everywhere. Models using it need vocab_size >= 259.
    """

    BOS, EOS, PAD = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        return ([self.BOS] if bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Text of the byte ids up to the first EOS; BOS/PAD are skipped."""
        out = bytearray()
        for i in ids.tolist() if isinstance(ids, torch.Tensor) else ids:
            if i == self.EOS:
                break
            if 0 <= i < 256:
                out.append(i)
        return out.decode("utf-8", errors="replace")


class _SkipInitializers(torch.overrides.TorchFunctionMode):
    """torch.nn.init's fills return their tensor untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


def skeleton(config: ModelConfig) -> CausalLM:
    """The architecture of `config` on the meta device: every name and shape, no data. Its layers'
    initializers are skipped: on meta there is nothing to fill, and torch runs them there through
    its Python reference kernels, whose first call imports torch._dynamo (~1-2 s of CPU in every
    process that builds one: each agent, server and sampler)."""
    with torch.device("meta"), _SkipInitializers():
        return CausalLM(config)


def num_parameters(config: ModelConfig) -> int:
    return sum(t.numel() for t in skeleton(config).state_dict().values())


def build_model(config: ModelConfig, *, seed: int = 0, device: str | torch.device = "cpu") -> CausalLM:
    """An fp32 model initialised deterministically from `seed`."""
    model = CausalLM(config).to(device)
    model.reset_parameters(torch.Generator(device=device).manual_seed(seed))
    return model


def save_pretrained(
    directory: str | os.PathLike,
    config: ModelConfig,
    state_dict: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype | None = torch.bfloat16,
) -> list[Path]:
    """Writes an HF-style directory: `config.json` and safetensors (floats cast to `dtype`)."""
    from weightsync.checkpoint_io import write_safetensors

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: (t.detach().to(dtype) if dtype is not None and t.is_floating_point() else t.detach()).contiguous()
        for name, t in state_dict.items()
    }
    files = write_safetensors(tensors, directory)
    tmp = directory / f".{CONFIG_NAME}.tmp"
    tmp.write_text(json.dumps(config.to_hf(), indent=2, sort_keys=True))
    os.replace(tmp, directory / CONFIG_NAME)
    return files


def load_config(directory: str | os.PathLike) -> ModelConfig:
    path = Path(directory) / CONFIG_NAME
    try:
        return ModelConfig.from_hf(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"cannot read a model config from {path}: {e}") from e


def load_pretrained(
    directory: str | os.PathLike, *, dtype: torch.dtype | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and weights of an HF-style directory, checked against the architecture.

    Raises ValueError naming missing, unexpected or mis-shaped tensors.
    """
    from weightsync.checkpoint_io import open_checkpoint

    config = load_config(directory)
    checkpoint = open_checkpoint(directory)
    expected = {name: tuple(t.shape) for name, t in CausalLM(config).to("meta").state_dict().items()}
    missing = sorted(set(expected) - set(checkpoint))
    unexpected = sorted(set(checkpoint) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{directory}: weights do not fit the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    weights = {}
    for name, shape in expected.items():
        tensor = checkpoint[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{directory}: {name} has shape {tuple(tensor.shape)}, the config needs {shape}")
        weights[name] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
    return config, weights


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position: logits (b, t, v), targets (b, t) -> (b, t), in fp32."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
