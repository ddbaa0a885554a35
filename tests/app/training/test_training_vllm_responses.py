"""How the training server reads vLLM's /inference/v1/generate answers (documents shaped like the
real vLLM 0.32's, which tests/app/training/test_training_vllm_sampling.py drives): a response is tagged with its
one weight version or refused, stop strings cut the tokens where the reference engine would stop,
prompt logprobs are picked by token id.
"""

from __future__ import annotations

import numpy as np
import pytest

from weightsync.app.training.sampling import SamplingParams
from weightsync.app.training.vllm_sampling import VllmSamplingError, _one_version, _prompt_logprobs, _sequence


class Letters:
    """A tokenizer whose token i is the letter chr(ord('a') + i)."""

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def params(stop_tokens=(), stop_strings=()):
    return SamplingParams(
        max_tokens=8,
        temperature=1.0,
        top_k=-1,
        top_p=1.0,
        seed=None,
        stop_tokens=stop_tokens,
        stop_strings=stop_strings,
    )


def choice(tokens, versions, finish_reason="length"):
    return {
        "index": 0,
        "token_ids": tokens,
        "finish_reason": finish_reason,
        "weight_versions": versions,
        "logprobs": {"content": [{"token_id": t, "logprob": -0.5 - t} for t in tokens]},
    }


def test_a_response_names_its_one_version_or_is_refused():
    span = {"version": "3", "start": 0, "end": 4}
    assert _one_version([choice([1, 2, 3, 4], [span]), choice([5, 6], [{**span, "end": 2}])], "u") == 3
    mixed = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 4}]
    with pytest.raises(VllmSamplingError, match=r"spans weight versions \['3', '4'\]"):
        _one_version([choice([1, 2, 3, 4], mixed)], "u")
    with pytest.raises(VllmSamplingError, match=r"spans weight versions"):
        _one_version([choice([1], [span]), choice([1], [{**span, "version": "5"}])], "u")
    with pytest.raises(VllmSamplingError, match="labelled 'default'"):
        _one_version([choice([1], [{**span, "version": "default"}])], "u")
    with pytest.raises(VllmSamplingError, match="no weight_versions"):
        _one_version([choice([1], None)], "u")


def test_stop_tokens_and_stop_strings_end_sequences_as_on_the_reference_engine():
    stopped = _sequence(choice([1, 2, 3], [], finish_reason="stop"), params(stop_tokens=(3,)), None)
    assert stopped.stopped and stopped.tokens.tolist() == [1, 2, 3]
    assert not _sequence(choice([1, 2, 3], []), params(stop_tokens=(3,)), None).stopped  # length
    # "cd" appears once token 3 ('d') is out: the tokens after it are dropped with their logprobs.
    cut = _sequence(choice([0, 2, 3, 4, 5], []), params(stop_strings=("cd",)), Letters())
    assert cut.stopped and cut.tokens.tolist() == [0, 2, 3]
    np.testing.assert_array_equal(cut.logprobs, np.array([-0.5, -2.5, -3.5], dtype=np.float32))
    assert not _sequence(choice([0, 1], []), params(stop_strings=("cd",)), Letters()).stopped
    bad = choice([1, 2], [])
    bad["logprobs"]["content"][1]["token_id"] = 7
    with pytest.raises(VllmSamplingError, match="do not match"):
        _sequence(bad, params(), None)


def test_prompt_logprobs_are_those_of_the_prompt_tokens():
    reply = {
        "prompt_logprobs": [
            None,
            {"5": {"logprob": -1.0, "rank": 3}, "9": {"logprob": -0.1, "rank": 1}},
            {"6": {"logprob": -2.0, "rank": 8}},
        ]
    }
    got = _prompt_logprobs(reply, [4, 5, 6])
    assert np.isnan(got[0]) and got[1:].tolist() == [-1.0, -2.0]
    with pytest.raises(VllmSamplingError, match="for a 2-token prompt"):
        _prompt_logprobs(reply, [4, 5])
