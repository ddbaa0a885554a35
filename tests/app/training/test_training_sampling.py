"""save_weights_for_sampler and sampling clients through the unmodified `tinker` SDK: the
training server publishes through the weightsync publisher (a full version, then deltas), an
agent verifies and swaps each version into a reference engine, and sampling runs on what the
agent serves, tagged with its version.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types

from harness.tiny_model import write_tiny_model
from harness.training_server import API_KEY, TrainingServer
from weightsync.models import CausalLM, load_pretrained, token_logprobs
from weightsync.reader import Reader
from weightsync.stores import open_store
from weightsync.versions import read_manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = [3, 17, 42, 99, 7, 8]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        state = tmp_path_factory.mktemp("server") / "state"
        with TrainingServer(state, extra_args=("--long-poll-s", "1")) as srv:
            yield srv


@pytest.fixture(scope="module")
def service(server):
    client = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    yield client
    client.close("success").result(timeout=60)  # else its heartbeat outlives the server, warning


def train_step(client, lr=1e-2):
    tokens = [3, 17, 42, 99, 7, 8, 250, 11]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 7},
    )
    client.forward_backward([datum], "cross_entropy")
    client.optim_step(types.AdamParams(learning_rate=lr)).result()


def fp32_logprobs(weights, config, tokens):
    model = CausalLM(config)
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    with torch.no_grad():
        return token_logprobs(model(torch.tensor([tokens[:-1]])), torch.tensor([tokens[1:]]))[0]


def store_of(server):
    return open_store(f"file://{Path(server.state_dir).resolve() / 'store'}")


def test_sampler_weights_publish_a_base_then_deltas_bit_exact_to_the_trainer(server, service, model_dir, tmp_path):
    client = service.create_lora_training_client(base_model=model_dir, rank=0).result()
    train_step(client)
    first = client.save_weights_for_sampler("a").result().path
    train_step(client)
    second = client.save_weights_for_sampler("b").result().path
    assert second == f"tinker://{client.model_id}/sampler_weights/b"
    store_model = "tinker-" + client.model_id.replace(":", "-")
    store = store_of(server)
    assert read_manifest(store, store_model, 1).kind == "full"
    assert read_manifest(store, store_model, 2).kind == "delta"

    # The trainer's own fp32 weights at the second save, from a DCP save_state right after it.
    state_path = client.save_state("now").result().path
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run_dir = Path(server.state_dir) / "runs" / client.model_id / "weights" / "now"
    dcp_to_torch_save(run_dir, tmp_path / "state.pt")
    trainer = torch.load(tmp_path / "state.pt", weights_only=True)["model"]
    published = Reader(store, model=store_model).read(2).state_dict()
    assert set(published) == set(trainer)
    for name, tensor in trainer.items():
        assert torch.equal(published[name], tensor.to(torch.bfloat16)), name
    assert state_path.endswith("/weights/now")

    # Sampling from the second version runs on exactly those weights (prompt logprobs).
    sampler = service.create_sampling_client(model_path=second).result()
    result = sampler.sample(
        types.ModelInput.from_ints(PROMPT),
        num_samples=3,
        sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=1),
        include_prompt_logprobs=True,
    ).result()
    assert len(result.sequences) == 3 and all(1 <= len(s.tokens) <= 4 for s in result.sequences)
    assert all(len(s.logprobs) == len(s.tokens) for s in result.sequences)
    config, _ = load_pretrained(model_dir)
    want = fp32_logprobs(published, config, PROMPT)
    assert result.prompt_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(result.prompt_logprobs[1:]), want, rtol=0, atol=1e-5)
    del first


def test_save_weights_and_get_sampling_client_stop_tokens_stop_strings_and_versions(server, service, model_dir):
    client = service.create_lora_training_client(base_model=model_dir, rank=0).result()
    train_step(client)
    sampler = client.save_weights_and_get_sampling_client().result()
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    full = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, greedy).result().sequences[0]
    assert full.stop_reason == "length" and len(full.tokens) == 6
    # Stop on the third greedy token: the sequence ends with it.
    stop_token = full.tokens[2]
    first_at = full.tokens.index(stop_token)
    stopped = (
        sampler.sample(
            types.ModelInput.from_ints(PROMPT),
            1,
            types.SamplingParams(max_tokens=6, temperature=0.0, stop=[stop_token]),
        )
        .result()
        .sequences[0]
    )
    assert stopped.stop_reason == "stop" and stopped.tokens == full.tokens[: first_at + 1]
    # A stop string: the decoded text of that token.
    tokenizer = client.get_tokenizer()
    text = tokenizer.decode(full.tokens[first_at : first_at + 1])
    if text.strip():
        by_string = (
            sampler.sample(
                types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[text])
            )
            .result()
            .sequences[0]
        )
        assert by_string.stop_reason == "stop" and len(by_string.tokens) <= first_at + 1


def test_each_sampling_response_names_the_weight_version_that_produced_it(server, service, model_dir):
    client = service.create_lora_training_client(base_model=model_dir, rank=0).result()
    train_step(client)
    client.save_weights_for_sampler("x").result()
    train_step(client)
    path = client.save_weights_for_sampler("y").result().path
    session = service.create_sampling_client(model_path=path).result()._sampling_session_id
    body = {
        "sampling_session_id": session,
        "seq_id": 0,
        "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": 3, "temperature": 1.0},
    }
    request_id = _post(server, "/api/v1/asample", body)[1]["request_id"]
    while True:
        headers, _ = _post(server, "/api/v1/retrieve_future", {"request_id": request_id}, raw=True)
        if headers.get("Content-Type") == "application/x-protobuf":
            break
    assert headers["X-Weight-Version"] == "2"
    info = json.loads(
        urllib.request.urlopen(
            urllib.request.Request(f"{server.url}/api/v1/samplers/{session}", headers={"X-API-Key": API_KEY})
        ).read()
    )
    assert info["weight_version"] == 2 and info["model_path"] == path


def test_a_sampling_client_keeps_sampling_its_own_version_after_newer_saves(server, service, model_dir):
    client = service.create_lora_training_client(base_model=model_dir, rank=0).result()
    train_step(client)
    old_path = client.save_weights_for_sampler("old").result().path
    train_step(client)
    client.save_weights_for_sampler("new").result()
    store_model = "tinker-" + client.model_id.replace(":", "-")
    old = Reader(store_of(server), model=store_model).read(1).state_dict()
    sampler = service.create_sampling_client(model_path=old_path).result()
    result = sampler.sample(
        types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2), include_prompt_logprobs=True
    ).result()
    config, _ = load_pretrained(model_dir)
    torch.testing.assert_close(
        torch.tensor(result.prompt_logprobs[1:]), fp32_logprobs(old, config, PROMPT), rtol=0, atol=1e-5
    )
    info = json.loads(
        urllib.request.urlopen(
            urllib.request.Request(
                f"{server.url}/api/v1/samplers/{sampler._sampling_session_id}", headers={"X-API-Key": API_KEY}
            )
        ).read()
    )
    assert info["weight_version"] == 1


def test_sampling_the_base_model_uses_its_own_weights(service, model_dir):
    sampler = service.create_sampling_client(base_model=model_dir).result()
    result = sampler.sample(
        types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2), include_prompt_logprobs=True
    ).result()
    config, weights = load_pretrained(model_dir)
    torch.testing.assert_close(
        torch.tensor(result.prompt_logprobs[1:]), fp32_logprobs(weights, config, PROMPT), rtol=0, atol=1e-5
    )


def test_concurrent_first_samples_on_a_fresh_server_all_succeed(model_dir, tmp_path):
    """The cookbook's RL recipe opens a server's sampling with a whole batch of concurrent
    requests. The sampler's generator (and its tokenizer: a first `import transformers`) is built
    once, not raced by every request: a race made the first requests fail with ImportError (the
    SDK retried them, so only the server's log showed it)."""
    with (
        TrainingServer(tmp_path / "state", extra_args=("--long-poll-s", "1")) as srv,
        tinker.ServiceClient(base_url=srv.url, api_key=API_KEY) as service,
    ):
        sampler = service.create_sampling_client(base_model=model_dir).result()
        futures = [
            sampler.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=3, seed=i))
            for i in range(16)
        ]
        results = [future.result() for future in futures]
    assert all(len(result.sequences) == 2 for result in results)
    log = srv.log_path.read_text(errors="replace")
    assert "failed" not in log and "Traceback" not in log, log[-3000:]


def test_bad_sampling_requests_are_user_errors(service, model_dir):
    sampler = service.create_sampling_client(base_model=model_dir).result()
    with pytest.raises(tinker.BadRequestError, match="token ids"):
        sampler.sample(types.ModelInput.from_ints([10**6]), 1, types.SamplingParams(max_tokens=2)).result()
    with pytest.raises(Exception, match="not sampler weights"):
        service.create_sampling_client(model_path="tinker://x:train:0/weights/state").result()


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
