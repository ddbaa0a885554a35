"""vllm_sampling: Tinker sample requests run on a vLLM server that a weightsync agent keeps in sync.

The training server attaches an agent with a `VllmEngine` to a vLLM server the user runs (the
same base model, weightsync's worker extension, the dev routes and `--enable-scale-out`; see
docs/training-api.md). One vLLM server serves one training run's versions: the agent swaps each
version the run publishes into it with the drain policy, so a request that is running at a swap
finishes on the old version and every response comes from exactly one version.

A sample request becomes one `POST /inference/v1/generate` (token ids in, token ids out):

    SDK SamplingParams / request      vLLM sampling_params
    num_samples                       n (at most the server's --max-num-seqs)
    max_tokens                        max_tokens (capped to the model's context)
    temperature, top_k, top_p, seed   the same (temperature 0: greedy)
    stop token ids (default EOS)      stop_token_ids, ignore_eos (only the given ids stop)
    stop strings                      applied here with the base model's tokenizer: vLLM runs
                                      without one (--skip-tokenizer-init), so the tokens after
                                      the first match are dropped, as if generation had stopped
    (sampled-token logprobs)          logprobs 0: the sampled token's logprob
    prompt logprobs                   prompt_logprobs 0

Each choice reports `weight_versions`, spans [start, end) of the version labels the agent set
with /update_weight_version; the response's version is that label, the same for every choice
and span (a response spanning versions, which the drain policy rules out, is refused rather than
mislabelled).

Logprobs are vLLM's `--logprobs-mode` (default raw_logprobs: the model's distribution before
temperature; the reference engine reports them after temperature, so both agree at temperature 1).

Not here: the agent (weightsync.agents), the reference engine's generation (sampling.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from weightsync.app.training.errors import TrainingError, UserInputError
from weightsync.app.training.sampling import stop_string_at
from weightsync.app.training.wire import SampledSequence
from weightsync.transport.json_http import HttpClient, HttpError

GENERATE_ROUTE = "/inference/v1/generate"
SAMPLE_REPLY_BYTES = 256 * 1024 * 1024
"""A sample reply's cap: n sequences with per-token (and prompt) log-probs run to tens of MiB."""


class VllmSamplingError(TrainingError):
    """vLLM failed or answered something that cannot be reported truthfully (server-side: retry)."""


class VllmSampler:
    """Sends one request per sample call to the vLLM server at `url`."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        api_key = api_key or os.environ.get("VLLM_API_KEY")  # as the VllmEngine does
        self._client = HttpClient(self.url, api_key=api_key, timeout_s=timeout_s, max_reply_bytes=SAMPLE_REPLY_BYTES)

    def sample(
        self,
        prompt: Sequence[int],
        *,
        num_samples: int,
        params: Any,
        prompt_logprobs: bool,
        context: int,
        tokenizer: Any | None,
        model: str | None = None,
    ) -> tuple[int, list[SampledSequence], np.ndarray | None]:
        """(the weight version that produced it, sequences, prompt logprobs or None). `params` is
        sampling.SamplingParams; `context` the model's max_position_embeddings; `model` the LoRA
        adapter to sample with (None: the served model)."""
        if params.stop_strings and tokenizer is None:
            raise UserInputError("stop strings need the model's tokenizer, which the base model directory lacks")
        prompt = [int(t) for t in prompt]
        sampling_params: dict[str, Any] = {
            "n": num_samples,
            "max_tokens": max(1, min(params.max_tokens, context - len(prompt))),
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "stop_token_ids": list(params.stop_tokens),
            "ignore_eos": True,
            "logprobs": 0,
        }
        if params.seed is not None:
            sampling_params["seed"] = params.seed
        if prompt_logprobs:
            sampling_params["prompt_logprobs"] = 0
        body: dict[str, Any] = {"token_ids": prompt, "sampling_params": sampling_params, "stream": False}
        if model is not None:
            body["model"] = model
        reply = self._post(body)
        choices = sorted(reply.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != num_samples:
            raise VllmSamplingError(f"vLLM at {self.url} answered {len(choices)} choices for n={num_samples}")
        version = _one_version(choices, self.url)
        sequences = [_sequence(choice, params, tokenizer) for choice in choices]
        prompt_lp = _prompt_logprobs(reply, prompt) if prompt_logprobs else None
        return version, sequences, prompt_lp

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return self._client.post_json(GENERATE_ROUTE, body)
        except HttpError as e:
            if e.status in (400, 422):  # vLLM refused the request itself (n above --max-num-seqs, ...)
                raise UserInputError(f"vLLM refused the sample request: {e.detail}") from None
            raise VllmSamplingError(str(e)) from None


def _one_version(choices: list[dict[str, Any]], url: str) -> int:
    """The one weight version every token of every choice came from."""
    labels = set()
    for choice in choices:
        spans = choice.get("weight_versions")
        if spans is None:
            raise VllmSamplingError(
                f"vLLM at {url} reports no weight_versions: it needs vLLM >= 0.32 and an "
                "agent that labels versions (/update_weight_version)"
            )
        labels.update(span.get("version") for span in spans)
    if len(labels) != 1:
        # The agent swaps with the drain policy, under which this cannot happen: someone else
        # swapped weights into this server mid-request. Refuse rather than tag it wrongly.
        raise VllmSamplingError(
            f"the response spans weight versions {sorted(map(str, labels))}; the vLLM server "
            f"at {url} must be swapped only by this training server's agent"
        )
    label = labels.pop()
    try:
        return int(label)
    except (TypeError, ValueError):
        raise VllmSamplingError(
            f"vLLM at {url} serves weights labelled {label!r}, not a version this training server's agent swapped in"
        ) from None


def _sequence(choice: dict[str, Any], params: Any, tokenizer: Any | None) -> SampledSequence:
    tokens = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(tokens) or any(int(c["token_id"]) != t for c, t in zip(content, tokens, strict=True)):
        raise VllmSamplingError("vLLM's logprobs do not match its sampled tokens")
    logprobs = [float(c["logprob"]) for c in content]
    # finish_reason "stop" with a stop token: the token is part of the output (as on the reference engine).
    stopped = choice.get("finish_reason") == "stop" and bool(tokens) and tokens[-1] in params.stop_tokens
    if params.stop_strings:
        for end in range(1, len(tokens) + 1):
            if stop_string_at(tokenizer, tokens[:end], params.stop_strings):
                tokens, logprobs, stopped = tokens[:end], logprobs[:end], True
                break
    return SampledSequence(np.asarray(tokens, dtype=np.int64), np.asarray(logprobs, dtype=np.float32), stopped)


def _prompt_logprobs(reply: dict[str, Any], prompt: list[int]) -> np.ndarray:
    """log p(prompt[i] | prompt[:i]) per position; NaN for the first (nothing precedes it)."""
    entries = reply.get("prompt_logprobs")
    if not isinstance(entries, list) or len(entries) != len(prompt):
        raise VllmSamplingError(
            f"vLLM returned {len(entries) if isinstance(entries, list) else 'no'} prompt "
            f"logprobs for a {len(prompt)}-token prompt"
        )
    out = np.full(len(prompt), np.nan, dtype=np.float32)
    for i, entry in enumerate(entries[1:], start=1):
        candidate = (entry or {}).get(str(prompt[i])) or (entry or {}).get(prompt[i])
        if candidate is None:
            raise VllmSamplingError(f"vLLM's prompt logprobs lack prompt token {i}")
        out[i] = float(candidate["logprob"])
    return out
