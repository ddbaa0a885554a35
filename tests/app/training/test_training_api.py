"""The training server against the unmodified, pinned `tinker` SDK: every implemented call,
futures under load, out-of-order chunks, and bad input (each refused with the SDK's error
category and a clear message, the model unchanged).

One server (one rank, gloo) on a tiny random model for the module; each test makes its own
training clients. Reference numbers come from the plain model (`weightsync.models`) on the
same weights, computed here in the test.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types

from harness.tiny_model import write_tiny_model
from harness.training_server import API_KEY, TrainingServer
from weightsync.models import CausalLM, load_pretrained, token_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TINKER_VERSION = "0.38.0"


def test_sdk_is_the_pinned_version():
    assert tinker.__version__ == TINKER_VERSION


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    state = tmp_path_factory.mktemp("server") / "state"
    with TrainingServer(
        state,
        extra_args=(
            "--gap-timeout-s",
            "15",
            "--long-poll-s",
            "1",
            "--fwdbwd-max-chunk-len",
            "2",
            "--max-body-mib",
            "1",
            "--model",
            model_dir,
        ),
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def service(server, monkeypatch_module):
    client = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    yield client
    client.close("success").result(timeout=60)  # else its heartbeat outlives the server, warning


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        yield mp


def reference_model(model_dir) -> CausalLM:
    config, weights = load_pretrained(model_dir, dtype=torch.float32)
    model = CausalLM(config)
    model.load_state_dict(weights)
    return model


def make_datum(tokens, weights=None, **inputs):
    inputs.setdefault("target_tokens", tokens[1:])
    if weights is not None:
        inputs["weights"] = weights
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


SEQS = [[3, 17, 42, 99, 7, 8, 250], [5, 6, 7, 8, 9], [100, 200, 300, 400, 12, 13, 14, 15, 16]]


def sft_batch():
    return [make_datum(s, [1.0] * (len(s) - 1)) for s in SEQS]


def local_logprobs(model, seqs):
    out = []
    for s in seqs:
        ids = torch.tensor([s[:-1]])
        out.append(token_logprobs(model(ids), torch.tensor([s[1:]]))[0])
    return out


def forward_logprobs(client, seqs):
    result = client.forward([make_datum(s, [0.0] * (len(s) - 1)) for s in seqs], "cross_entropy").result()
    return [torch.tensor(o["logprobs"].data) for o in result.loss_fn_outputs]


# ----------------------------------------------------------------------------- training


def test_forward_backward_cross_entropy_and_optim_step_match_plain_pytorch(service, model_dir):
    client = service.create_lora_training_client(base_model=model_dir, rank=0).result()
    assert client.get_info().model_data.model_name == model_dir
    reference = reference_model(model_dir)
    expected = local_logprobs(reference, SEQS)
    # Two calls: gradients accumulate until optim_step.
    first = client.forward_backward(sft_batch(), "cross_entropy")
    second = client.forward_backward(sft_batch()[:2], "cross_entropy")
    adam = types.AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1)
    step = client.optim_step(adam)
    out = first.result()
    for got, want in zip(out.loss_fn_outputs, expected, strict=True):
        torch.testing.assert_close(torch.tensor(got["logprobs"].data), want, rtol=0, atol=1e-5)
    assert out.metrics["loss:sum"] == pytest.approx(-sum(float(e.detach().sum()) for e in expected), rel=1e-5)
    second.result(), step.result()

    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1)
    loss = -sum(lp.sum() for lp in local_logprobs(reference, SEQS)) - sum(
        lp.sum() for lp in local_logprobs(reference, SEQS[:2])
    )
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        want = local_logprobs(reference, SEQS)
    for got, w in zip(forward_logprobs(client, SEQS), want, strict=True):
        torch.testing.assert_close(got, w, rtol=0, atol=1e-4)


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo"])
def test_policy_losses_follow_their_public_definitions(service, model_dir, loss_fn):
    client = service.create_lora_training_client(base_model=model_dir, rank=0).result()
    current = local_logprobs(reference_model(model_dir), SEQS)
    rng = np.random.default_rng(0)
    data, expected = [], 0.0
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1} if loss_fn != "importance_sampling" else None
    for s, lp in zip(SEQS, current, strict=True):
        sampler = lp.detach() + torch.tensor(rng.normal(0, 0.3, lp.shape[0]), dtype=torch.float32)
        adv = torch.tensor(rng.normal(0, 1, lp.shape[0]), dtype=torch.float32)
        data.append(make_datum(s, logprobs=sampler.tolist(), advantages=adv.tolist()))
        ratio = torch.exp(lp.detach() - sampler)
        if loss_fn == "importance_sampling":
            expected += float(-(ratio * adv).sum())
        elif loss_fn == "ppo":
            expected += float(-torch.minimum(ratio * adv, ratio.clamp(0.9, 1.1) * adv).sum())
        else:
            expected += float(-(ratio.clamp(0.9, 1.1) * lp.detach() * adv).sum())
    out = client.forward_backward(data, loss_fn, loss_fn_config=config).result()
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert client.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm"] > 0


def test_forward_backward_custom_equals_the_builtin_loss_it_mirrors(service, model_dir):
    """The SDK runs a custom loss as a forward pass plus a weighted backward; a custom
    cross-entropy must leave the model where the built-in one does."""
    builtin = service.create_lora_training_client(base_model=model_dir, rank=0).result()
    custom = service.create_lora_training_client(base_model=model_dir, rank=0).result()

    def neg_log_likelihood(data, logprobs_list):
        loss = sum(
            -(lp * torch.tensor(d.loss_fn_inputs["weights"].data)).sum()
            for d, lp in zip(data, logprobs_list, strict=True)
        )
        return loss, {"custom_metric": 1.0}

    adam = types.AdamParams(learning_rate=1e-2)
    out = custom.forward_backward_custom(sft_batch(), neg_log_likelihood).result()
    assert out.metrics["custom_metric"] == 1.0
    custom.optim_step(adam).result()
    builtin_out = builtin.forward_backward(sft_batch(), "cross_entropy").result()
    builtin.optim_step(adam).result()
    assert out.metrics["loss:sum"] == pytest.approx(builtin_out.metrics["loss:sum"], rel=1e-5)
    for a, b in zip(forward_logprobs(custom, SEQS), forward_logprobs(builtin, SEQS), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_futures_under_load_and_chunks_sent_out_of_order(service, model_dir):
    """The server tells the SDK to send at most 2 datums per request, so a 9-datum call goes out
    as 5 chunks in parallel (the first one last); 12 calls are in flight before any result is
    read. Every result is the right one, in order."""
    client = service.create_lora_training_client(base_model=model_dir, rank=0).result()
    seqs = [SEQS[i % 3][: 4 + i % 5] for i in range(9)]
    want = local_logprobs(reference_model(model_dir), seqs)
    futures = [client.forward([make_datum(s, [0.0] * (len(s) - 1)) for s in seqs], "cross_entropy") for _ in range(12)]
    for future in futures:
        outputs = future.result().loss_fn_outputs
        assert len(outputs) == len(seqs)
        for got, w in zip(outputs, want, strict=True):
            torch.testing.assert_close(torch.tensor(got["logprobs"].data), w, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- raw protocol


def post(server, route, body, *, content_type="application/json", key=API_KEY, accept=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": content_type, "X-API-Key": key}
    if accept:
        headers["Accept"] = accept
    request = urllib.request.Request(server.url + route, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers.get("Content-Type"), response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), e.read()


def wait_result(server, request_id):
    while True:
        status, kind, body = post(server, "/api/v1/retrieve_future", {"request_id": request_id})
        assert status == 200, body
        if kind == "application/json" and json.loads(body).get("type") == "try_again":
            continue
        return kind, body


def fwdbwd_proto(model_id, seq_id, loss_fn="cross_entropy", forward_only=True):
    from tinker.proto.request_conv import forward_backward_request_to_proto

    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=sft_batch(), loss_fn=loss_fn),
        model_id=model_id,
        seq_id=seq_id,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def raw_model(server, service, model_dir):
    client = service.create_lora_training_client(base_model=model_dir, rank=0).result()
    return client, client.model_id


def loaded_models(server) -> list[str]:
    request = urllib.request.Request(server.url + "/api/v1/healthz", headers={"X-API-Key": API_KEY})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["loaded_models"]


def wait_unloaded(server, model_id: str) -> None:
    deadline = time.monotonic() + 120  # the unload runs after the requests queued before it
    while model_id in loaded_models(server):
        assert time.monotonic() < deadline, f"{model_id} still loaded 120 s after its session finished"
        time.sleep(0.2)


def test_a_client_closed_by_its_with_block_finishes_its_session(server, model_dir):
    """`with tinker.ServiceClient() as service:` (and `service.close(status)`) finishes the session
    on the server: leaving the block raises nothing, the session's heartbeat gets 410 (on which the
    SDK stops beating), its models refuse further requests and are unloaded, and its saved
    weights still load."""
    with tinker.ServiceClient(base_url=server.url, api_key=API_KEY) as service:
        client = service.create_lora_training_client(base_model=model_dir, rank=0).result()
        client.forward_backward(sft_batch(), "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        saved = client.save_state("closed-session").result().path
        expected = forward_logprobs(client, SEQS)
        assert client.model_id in loaded_models(server)
    session = client.model_id.split(":", 1)[0]
    wait_unloaded(server, client.model_id)
    status, _, body = post(server, "/api/v1/session_heartbeat", {"session_id": session})
    assert status == 410 and b"finished (success)" in body, body
    status, _, body = post(
        server,
        "/api/v1/optim_step",
        {"model_id": client.model_id, "seq_id": 99, "adam_params": {"learning_rate": 1e-3}},
    )
    assert status == 410, body
    status, _, body = post(
        server, "/api/v1/create_model", {"session_id": session, "model_seq_id": 7, "base_model": model_dir}
    )
    assert status == 410, body
    status, _, body = post(server, "/api/v1/load_weights", {"session_id": session, "model_seq_id": 8, "path": saved})
    assert status == 410, body
    # A second finish is no error and keeps the first reason.
    status, _, body = post(server, f"/api/v1/sessions/{session}/finish", {"reason": {"type": "errored"}})
    assert status == 200, body
    status, _, body = post(server, "/api/v1/session_heartbeat", {"session_id": session})
    assert b"finished (success)" in body, body
    status, _, body = post(server, f"/api/v1/sessions/{session}/finish", {"reason": {"type": "done"}})
    assert status == 400 and b"finish reason" in body, body

    fresh = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    try:
        restored = fresh.create_training_client_from_state(saved).result()
        for got, want in zip(forward_logprobs(restored, SEQS), expected, strict=True):
            assert torch.equal(got, want)
    finally:
        fresh.close("success").result(timeout=60)
    wait_unloaded(server, restored.model_id)


def test_a_session_whose_client_went_silent_expires_and_its_model_is_unloaded(tmp_path, model_dir):
    """A client that dies without closing its session stops beating: after --session-timeout-s
    without a heartbeat, a request or a job of its own running, the session is finished (expired)
    and its model unloaded, and a late heartbeat gets 410. Raw HTTP, so that no SDK heartbeat
    keeps the session alive. The model's creation is a job of the session: the silence counts
    from its end, so the model exists before it expires, however slow the machine."""
    with TrainingServer(tmp_path / "state", extra_args=("--session-timeout-s", "2", "--long-poll-s", "1")) as srv:
        status, _, body = post(srv, "/api/v1/create_session", {"tags": [], "user_metadata": None, "sdk_version": "x"})
        assert status == 200, body
        session = json.loads(body)["session_id"]
        status, _, body = post(
            srv, "/api/v1/create_model", {"session_id": session, "model_seq_id": 0, "base_model": model_dir}
        )
        assert status == 200, body
        model_id = json.loads(body)["model_id"]
        deadline = time.monotonic() + 120
        while f"model {model_id} unloaded" not in srv.log_path.read_text(errors="replace"):
            assert time.monotonic() < deadline, "the silent session's model was never unloaded"
            time.sleep(0.2)
        assert model_id not in loaded_models(srv)
        status, _, body = post(srv, "/api/v1/session_heartbeat", {"session_id": session})
        assert status == 410 and b"(expired)" in body, body
        log = srv.log_path.read_text(errors="replace")
        assert f"session {session} expired" in log and f"model {model_id} unloaded" in log, log[-3000:]


def test_requests_run_in_seq_id_order_whatever_order_they_arrive_in(server, service, model_dir):
    _, model_id = raw_model(server, service, model_dir)
    # seq 2 (optim_step) arrives before seq 1 (forward_backward): run first, it would see no gradient.
    status, _, body = post(
        server, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}}
    )
    assert status == 200, body
    optim_id = json.loads(body)["request_id"]
    status, _, body = post(
        server,
        "/api/v1/forward_backward",
        fwdbwd_proto(model_id, 1, forward_only=False),
        content_type="application/x-protobuf",
    )
    assert status == 200, body
    _, result = wait_result(server, optim_id)
    assert json.loads(result)["metrics"]["grad_norm"] > 0


def test_a_seq_id_gap_fails_as_a_user_error_and_changes_nothing(server, service, model_dir):
    client, model_id = raw_model(server, service, model_dir)
    before = forward_logprobs(client, SEQS)  # seq 1 and 2 (two chunks of at most 2 datums)
    status, _, body = post(
        server,
        "/api/v1/forward_backward",
        fwdbwd_proto(model_id, 5, forward_only=False),
        content_type="application/x-protobuf",
    )
    assert status == 200
    _, result = wait_result(server, json.loads(body)["request_id"])  # the server waits 15 s for seq 3
    doc = json.loads(result)
    assert doc["category"] == "user" and "seq_id gap" in doc["error"] and "for seq_id 3" in doc["error"]
    status, _, body = post(
        server, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
    )
    assert status == 400 and b"already used" in body  # seq 1 was a forward_backward: not a retry
    # The SDK's next calls are seq 3 and 4, which the gap left free. The same calls batch the
    # datums as `before` did: a CPU's kernels may round differently per batch shape (AMD EPYC's
    # do), so only a like-for-like forward can show that nothing changed.
    after = forward_logprobs(client, SEQS)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)


def test_a_retried_request_gets_the_first_ones_future_and_runs_once(server, service, model_dir):
    """The SDK resends a request whose reply it lost (reset or timed-out connection) with the same
    seq_id; that must not fail the run, nor apply a step twice."""

    def train_and_read(retry: bool) -> list[torch.Tensor]:
        _, model_id = raw_model(server, service, model_dir)
        requests = [
            ("/api/v1/forward_backward", fwdbwd_proto(model_id, 1, forward_only=False), "application/x-protobuf"),
            (
                "/api/v1/optim_step",
                json.dumps({"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-2}}).encode(),
                "application/json",
            ),
        ]
        for route, body, content_type in requests:
            ids = []
            for _ in range(2 if retry else 1):
                status, _, reply = post(server, route, body, content_type=content_type)
                assert status == 200, reply
                ids.append(json.loads(reply)["request_id"])
            assert len(set(ids)) == 1, ids
            kind, result = wait_result(server, ids[0])
            if kind == "application/json":
                assert "error" not in json.loads(result), result
        status, _, reply = post(
            server,
            "/api/v1/forward_backward",
            fwdbwd_proto(model_id, 3),
            content_type="application/x-protobuf",
            accept="application/x-protobuf",
        )
        assert status == 200, reply
        _, result = wait_result(server, json.loads(reply)["request_id"])
        return [torch.tensor(o["logprobs"].data) for o in decode_fwdbwd(result).loss_fn_outputs]

    for once, retried in zip(train_and_read(retry=False), train_and_read(retry=True), strict=True):
        assert torch.equal(once, retried)  # one forward_backward and one optim_step, not two


def test_bad_inputs_fail_with_the_user_category_and_leave_the_model_unchanged(service, model_dir):
    client = service.create_lora_training_client(base_model=model_dir, rank=0).result()
    before = forward_logprobs(client, SEQS)
    cases = [
        ("dro", [make_datum(SEQS[0], [1.0] * 6)], "not supported"),
        ("cross_entropy", [make_datum(SEQS[0], [1.0] * 5)], "has shape [5]; it must be [6]"),
        ("cross_entropy", [make_datum(SEQS[0], [1.0] * 6, target_tokens=[1, 2, 3, 4, 5, 100000])], "vocabulary"),
        ("ppo", [make_datum(SEQS[0], [1.0] * 6)], "missing ['logprobs', 'advantages']"),
    ]
    for loss_fn, data, message in cases:
        with pytest.raises(tinker.RequestFailedError) as info:
            client.forward_backward(data, loss_fn).result()
        assert info.value.category == types.RequestErrorCategory.User
        assert message in str(info.value)
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # nothing was accumulated
    for a, b in zip(forward_logprobs(client, SEQS), before, strict=True):
        assert torch.equal(a, b)


def test_an_unknown_loss_name_and_a_garbage_body_are_user_errors(server, service, model_dir):
    _, model_id = raw_model(server, service, model_dir)
    status, _, body = post(
        server,
        "/api/v1/forward_backward",
        fwdbwd_proto(model_id, 1, loss_fn="no_such_loss"),
        content_type="application/x-protobuf",
    )
    _, result = wait_result(server, json.loads(body)["request_id"])
    doc = json.loads(result)
    assert doc["category"] == "user" and "unknown loss function 'no_such_loss'" in doc["error"]
    status, _, body = post(
        server, "/api/v1/forward_backward", b"\xff\x00garbage", content_type="application/x-protobuf"
    )
    assert status == 400 and json.loads(body)["category"] == "user"


def test_an_oversized_request_is_refused_with_413(server, service, model_dir):
    client = service.create_lora_training_client(base_model=model_dir, rank=0).result()
    before = forward_logprobs(client, SEQS)  # seq_ids 1 and 2
    tokens = [7] * 150_001  # 150k int32 tokens + int64 targets + float32 weights: over the 1 MiB limit
    with pytest.raises(tinker.APIStatusError) as info:
        client.forward_backward([make_datum(tokens, [1.0] * 150_000)], "cross_entropy").result()
    assert info.value.status_code == 413 and "over this server's limit" in str(info.value)
    # The refused body was never read, so its seq_id (3) is a hole only the caller can fill.
    _, _, body = post(
        server, "/api/v1/forward_backward", fwdbwd_proto(client.model_id, 3), content_type="application/x-protobuf"
    )
    _, result = wait_result(server, json.loads(body)["request_id"])
    assert len(decode_fwdbwd(result).loss_fn_outputs) == len(SEQS)
    # Then the SDK goes on at seq 4 and 5, batching the datums as `before` did (a CPU's kernels
    # may round differently per batch shape, as AMD EPYC's do: compare like with like).
    after = forward_logprobs(client, SEQS)
    for a, b in zip(after, before, strict=True):
        assert torch.equal(a, b)


def decode_fwdbwd(payload):
    from tinker.proto.response_conv import deserialize_forward_backward_output

    return deserialize_forward_backward_output(payload)


def test_a_bad_api_key_is_refused_with_401(server):
    with pytest.raises(tinker.AuthenticationError) as info:
        tinker.ServiceClient(base_url=server.url, api_key="tml-wrong-key").create_lora_training_client(
            base_model="x", rank=0
        ).result()
    assert "API key" in str(info.value)


def test_routes_left_out_answer_404_naming_the_feature(server):
    status, _, body = post(server, "/api/v1/save_weights_external", {"model_id": "m", "seq_id": 1})
    assert status == 404
    assert "save_weights_external" in json.loads(body)["error"]


# ----------------------------------------------------------------------------- durability


def train_steps(client, steps):
    for _ in range(steps):
        client.forward_backward(sft_batch(), "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def test_save_state_and_resume_with_optimizer_is_bit_identical(service, model_dir):
    client = service.create_lora_training_client(base_model=model_dir, rank=0).result()
    train_steps(client, 2)
    path = client.save_state("after-2").result().path
    assert path == f"tinker://{client.model_id}/weights/after-2"
    train_steps(client, 1)
    want = forward_logprobs(client, SEQS)

    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    train_steps(resumed, 1)
    for a, b in zip(forward_logprobs(resumed, SEQS), want, strict=True):
        assert torch.equal(a, b)
    # Weights only: the optimizer starts fresh, so the same step lands elsewhere.
    weights_only = service.create_training_client_from_state(path).result()
    train_steps(weights_only, 1)
    assert not all(torch.equal(a, b) for a, b in zip(forward_logprobs(weights_only, SEQS), want, strict=True))
    # load_state on an existing client goes back to the saved point.
    resumed.load_state_with_optimizer(path).result()
    train_steps(resumed, 1)
    for a, b in zip(forward_logprobs(resumed, SEQS), want, strict=True):
        assert torch.equal(a, b)
    checkpoints = service.create_rest_client().list_checkpoints(client.model_id).result().checkpoints
    assert [c.tinker_path for c in checkpoints] == [path]


def test_load_state_of_a_missing_checkpoint_is_a_clear_error(service, model_dir):
    with pytest.raises(Exception, match="no saved state"):
        service.create_training_client_from_state("tinker://nope:train:0/weights/missing").result()


def test_a_killed_server_restarted_resumes_from_the_last_saved_state_bit_identically(
    tmp_path, model_dir, monkeypatch_module
):
    state = tmp_path / "state"
    first = TrainingServer(state).start()
    try:
        with tinker.ServiceClient(base_url=first.url, api_key=API_KEY) as service:
            client = service.create_lora_training_client(base_model=model_dir, rank=0).result()
            train_steps(client, 2)
            path = client.save_state("mid-run").result().path
            train_steps(client, 2)
            want = forward_logprobs(client, SEQS)
    finally:
        first.stop(kill=True)  # SIGKILL: no clean shutdown (the client's session closed first)
    with TrainingServer(state) as second, tinker.ServiceClient(base_url=second.url, api_key=API_KEY) as service:
        resumed = service.create_training_client_from_state_with_optimizer(path).result()
        train_steps(resumed, 2)
        for a, b in zip(forward_logprobs(resumed, SEQS), want, strict=True):
            assert torch.equal(a, b)
