"""The reference inference server over real HTTP on 127.0.0.1: generation for text and id prompts
of mixed lengths, the version on every response, a hammer test per swap policy (clients generating
while versions swap) proving every token comes from a swapped-in version as that version generates
it, the swap policies on a generation held at a token step (drain: one version; in_flight: both,
with token ranges, the later tokens exactly the new version's from that prefix; abort: run again),
request validation, endpoints and configurations, and the default stop token (the model's own EOS)."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
import torch

from weightsync.agents.engines import open_engine
from weightsync.agents.engines.reference_server import ReferenceServer, ReferenceServerConfig
from weightsync.agents.engines.swap_policy import SwapPolicy
from weightsync.errors import LayoutError
from weightsync.models import ByteTokenizer, CausalLM, ModelConfig, build_model, save_pretrained

# Byte-tokenizer vocabulary; a wide init so greedy choices have clear margins and differ per version.
BYTE_MODEL = dict(
    vocab_size=259,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.3,
)
TOKENIZER = ByteTokenizer()


def make_weights(version: int) -> dict[str, torch.Tensor]:
    model = build_model(ModelConfig(**BYTE_MODEL), seed=version)
    return {name: t.to(torch.bfloat16) for name, t in model.state_dict().items()}


def post(url: str, body: dict | bytes, path: str = "/v1/generate") -> tuple[int, dict, dict]:
    """(status, headers, JSON answer) of a POST."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, dict(reply.headers), json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def get(url: str, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url + path, timeout=60) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture
def server():
    with ReferenceServer(ReferenceServerConfig(model=BYTE_MODEL)) as server:
        yield server


def test_no_weights_yet_means_503_and_not_ready(server):
    status, headers, answer = post(server.url, {"prompts": ["hi"]})
    assert status == 503 and "no weights yet" in answer["error"] and headers["Retry-After"] == "1"
    assert json.loads(get(server.url, "/health")[1]) == {"status": "ok", "ready": False, "weight_version": None}
    assert json.loads(get(server.url, "/v1/version")[1])["weight_version"] is None


def test_generates_text_and_id_prompts_of_mixed_lengths(server):
    weights = make_weights(1)
    server.swap(1, weights, digest="digest-1")
    reference = build_model(ModelConfig(**BYTE_MODEL))  # the model library, in-process, same weights

    def expected(rows: list[list[int]]) -> torch.Tensor:
        return reference.generate(
            torch.tensor(rows), max_new_tokens=6, temperature=0, stop_token=TOKENIZER.EOS, weights=weights
        )[0]

    texts = ["hello", "a", "", "world", "a longer prompt"]  # "hello" and "world": one batch of two
    status, headers, answer = post(server.url, {"prompts": texts, "max_new_tokens": 6})
    assert status == 200 and headers["X-Weight-Version"] == "1"
    assert answer["weight_version"] == 1 and answer["weight_digest"] == "digest-1"
    completions = answer["completions"]
    assert len(completions) == len(texts)
    pair = expected([TOKENIZER.encode("hello"), TOKENIZER.encode("world")])
    for i, text in enumerate(texts):
        want = (
            pair[0 if text == "hello" else 1] if text in ("hello", "world") else expected([TOKENIZER.encode(text)])[0]
        )
        got = completions[i]
        assert got["token_ids"] == want.tolist()[: len(got["token_ids"])], text
        assert len(got["token_ids"]) == len(got["logprobs"]) <= 6
        assert all(lp <= 0 for lp in got["logprobs"])
        assert got["text"] == TOKENIZER.decode(got["token_ids"])
        assert got["finish_reason"] == ("stop" if TOKENIZER.EOS in got["token_ids"] else "length")

    ids = [[256, 1, 2, 3], [256], [256, 9, 8, 7], [200, 100]]
    status, headers, answer = post(server.url, {"prompt_ids": ids, "max_new_tokens": 6, "stop": None})
    assert status == 200 and answer["weight_version"] == 1
    got = [c["token_ids"] for c in answer["completions"]]
    same_length = expected([ids[0], ids[2]]).tolist()
    assert got == [same_length[0], expected([ids[1]])[0].tolist(), same_length[1], expected([ids[3]])[0].tolist()]


def test_sampling_is_seeded_and_stop_tokens_end_completions(server):
    server.swap(1, make_weights(1), digest="digest-1")
    sample = {"prompt_ids": [[256, 5, 6]], "max_new_tokens": 12, "temperature": 1.0, "top_k": 50, "stop": None}
    runs = [post(server.url, {**sample, "seed": seed})[2]["completions"][0]["token_ids"] for seed in (1, 1, 2, 3)]
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs}) > 1
    greedy = post(server.url, {"prompt_ids": [[256, 5, 6]], "max_new_tokens": 12, "stop": None})[2]
    tokens = greedy["completions"][0]["token_ids"]
    stop = tokens[2]
    stopped = post(server.url, {"prompt_ids": [[256, 5, 6]], "max_new_tokens": 12, "stop": stop})[2]
    assert stopped["completions"][0]["token_ids"] == tokens[: tokens.index(stop) + 1]
    assert stopped["completions"][0]["finish_reason"] == "stop"


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(SwapPolicy))
def test_hammer_every_token_comes_from_a_swapped_in_version(server, policy):
    """Clients generate without pause while the agent swaps versions and, as it would with double
    buffering, overwrites each replaced version's tensors once wait_unused says they are free.
    drain and abort: every response comes from exactly one version, as that version alone
    generates it. in_flight: every token range comes from the version it names, as that version
    generates it from the prefix before it (so no token ever saw overwritten memory)."""
    versions = range(1, 13)
    weights = {v: make_weights(v) for v in versions}
    requests = [
        {"prompt_ids": [[256, 1, 2], [256, 3, 4, 5, 6], [256, 3, 4]], "max_new_tokens": 8},
        {"prompts": ["swap", "under load"], "max_new_tokens": 10},
        {"prompt_ids": [[7] * 9], "max_new_tokens": 12, "stop": None},
    ]
    expected = {}  # (version, request) -> completions, precomputed through the same server
    for v in versions:
        server.swap(v, weights[v], digest=f"digest-{v}")
        for r, body in enumerate(requests):
            status, _, answer = post(server.url, body)
            assert status == 200 and answer["weight_version"] == v
            expected[v, r] = answer["completions"]
    for r in range(len(requests)):
        assert len({json.dumps(expected[v, r]) for v in versions}) >= len(versions) // 2, "versions must differ"

    server.swap(1, weights[1], digest="digest-1")
    responses: dict[int, list[tuple[str, int, dict]]] = {r: [] for r in range(len(requests))}
    answered = {v: 0 for v in versions}  # responses per version, to swap only after a few
    progress = threading.Condition()
    stop = threading.Event()

    def client(r: int) -> None:
        while not stop.is_set():
            status, headers, answer = post(server.url, requests[r])
            responses[r].append((headers.get("X-Weight-Version"), status, answer))
            if status != 200:
                return
            with progress:
                answered[answer["weight_version"]] += 1
                progress.notify_all()

    clients = [threading.Thread(target=client, args=(r,)) for r in range(len(requests))]
    for c in clients:
        c.start()
    try:
        for v in versions:
            with progress:
                assert progress.wait_for(lambda v=v: answered[v] >= 3, timeout=60), f"version {v} got no answers"
            if v == versions[-1]:
                break
            server.swap(v + 1, weights[v + 1], digest=f"digest-{v + 1}", policy=policy)
            assert server.wait_unused(v, 60)
            for t in weights[v].values():  # the agent reuses that memory for a later version
                t.fill_(float("nan"))
    finally:
        stop.set()
        for c in clients:
            c.join()

    for r, answers in responses.items():
        assert answers
        previous = 0
        for header, status, answer in answers:
            assert status == 200, answer
            v = answer["weight_version"]
            assert header == str(v) and answer["weight_digest"] == f"digest-{v}"
            if policy is SwapPolicy.IN_FLIGHT:
                check_ranges(answer, requests[r], {v: expected[v, r] for v in versions})
            else:
                assert answer["weight_versions"] == [v] and all(
                    c["versions"] == [{"version": v, "start": 0, "stop": len(c["token_ids"])}]
                    for c in answer["completions"]
                )
                assert answer["completions"] == expected[v, r], f"request {r} at version {v}: mixed or stale weights"
            assert v >= previous, "a client saw versions go backwards"
            previous = v
    assert {a["weight_version"] for answers in responses.values() for _, _, a in answers} == set(versions)


def check_ranges(answer: dict, body: dict, alone: dict[int, list[dict]]) -> None:
    """Each completion's version ranges cover its tokens in order, from ascending versions, none
    older than the response's `weight_version` (a later batch of the request may start on a
    newer one); the first range is what its version alone generates (`alone[version]`), each
    later one what its version generates from the prompt and the tokens before it (recomputed
    in-process on the same bf16 weights)."""
    prompts = body.get("prompt_ids") or [TOKENIZER.encode(t) for t in body["prompts"]]
    model = build_model(ModelConfig(**BYTE_MODEL))
    for i, (prompt, completion) in enumerate(zip(prompts, answer["completions"], strict=True)):
        tokens, ranges = completion["token_ids"], completion["versions"]
        assert ranges[0]["start"] == 0 and ranges[-1]["stop"] == len(tokens)
        assert all(
            a["stop"] == b["start"] and a["version"] < b["version"] for a, b in zip(ranges, ranges[1:], strict=False)
        )
        assert ranges[0]["version"] >= answer["weight_version"]
        assert {r["version"] for r in ranges} <= set(answer["weight_versions"])
        first = ranges[0]
        assert tokens[: first["stop"]] == alone[first["version"]][i]["token_ids"][: first["stop"]]
        for r in ranges[1:]:
            prefix = torch.tensor([list(prompt) + tokens[: r["start"]]])
            again = model.generate(
                prefix,
                max_new_tokens=r["stop"] - r["start"],
                temperature=0,
                stop_token=body.get("stop", TOKENIZER.EOS),
                weights=make_weights(r["version"]),
            )[0]
            assert again[0].tolist() == tokens[r["start"] : r["stop"]], f"tokens {r} are not v{r['version']}'s"
        assert all(lp == lp for lp in completion["logprobs"]), "a NaN logprob: a token saw overwritten weights"


class GatedServer(ReferenceServer):
    """The reference server with its first request held at token steps `at_steps` (each until the
    test lets it go), so that a test can swap while a generation is surely in flight (no timing
    involved)."""

    def __init__(self, config: ReferenceServerConfig, *, at_steps: tuple[int, ...]) -> None:
        super().__init__(config)
        self.reached = {step: threading.Event() for step in at_steps}
        self.go = {step: threading.Event() for step in at_steps}

    def _running(self, record):
        running = super()._running(record)
        between_steps = running.between_steps

        def gated(step: int):
            if step in self.reached and not self.reached[step].is_set():
                self.reached[step].set()
                assert self.go[step].wait(60)
            return between_steps(step)

        running.between_steps = gated
        return running


def generate_across_a_swap(policy: SwapPolicy, *, at_step: int = 10, new_tokens: int = 48) -> dict:
    """A greedy generation on v1 that a swap to v2 under `policy` meets at token `at_step`."""
    body = {"prompt_ids": [[256, 5, 6, 7]], "max_new_tokens": new_tokens, "stop": None}
    with GatedServer(ReferenceServerConfig(model=BYTE_MODEL), at_steps=(at_step,)) as server:
        server.swap(1, make_weights(1), digest="digest-1")
        answers = []
        client = threading.Thread(target=lambda: answers.append(post(server.url, body)))
        client.start()
        assert server.reached[at_step].wait(60)
        server.swap(2, make_weights(2), digest="digest-2", policy=policy)
        server.go[at_step].set()
        client.join(60)
        status, headers, answer = answers[0]
        assert status == 200, answer
        assert server.wait_unused(1, 60), "the request no longer holds v1"
    return answer


@pytest.mark.parametrize("policy", list(SwapPolicy))
def test_a_replaced_version_is_free_one_token_step_after_the_swap_unless_draining(policy):
    """What bounds memory without a third buffer: under in_flight and abort the request leaves v1
    at its next token step, so the agent may rebuild v1's buffer while the request still runs;
    under drain v1 stays in use until the request ends."""
    body = {"prompt_ids": [[256, 5, 6, 7]], "max_new_tokens": 48, "stop": None}
    with GatedServer(ReferenceServerConfig(model=BYTE_MODEL), at_steps=(10, 20)) as server:
        server.swap(1, make_weights(1), digest="digest-1")
        client = threading.Thread(target=post, args=(server.url, body))
        client.start()
        assert server.reached[10].wait(60)
        server.swap(2, make_weights(2), digest="digest-2", policy=policy)
        server.go[10].set()
        assert server.reached[20].wait(60)  # the request is running, held at its token step 20
        assert server.wait_unused(1, 0) == (policy is not SwapPolicy.DRAIN)
        assert server.requests_in_flight() == 1
        server.go[20].set()
        client.join(60)
        assert server.wait_unused(1, 60)


def alone(version: int, prompt: list[int], new_tokens: int) -> list[int]:
    """What a fresh server on `version` alone generates (greedy) from `prompt`."""
    with ReferenceServer(ReferenceServerConfig(model=BYTE_MODEL)) as fresh:
        fresh.swap(version, make_weights(version), digest=f"digest-{version}")
        status, _, answer = post(fresh.url, {"prompt_ids": [prompt], "max_new_tokens": new_tokens, "stop": None})
        assert status == 200
        return answer["completions"][0]["token_ids"]


def test_in_flight_a_long_generation_spans_a_swap_and_says_which_version_made_which_tokens():
    answer = generate_across_a_swap(SwapPolicy.IN_FLIGHT, at_step=10, new_tokens=48)
    completion = answer["completions"][0]
    assert answer["weight_version"] == 1 and answer["weight_versions"] == [1, 2] and answer["restarts"] == 0
    assert completion["versions"] == [{"version": 1, "start": 0, "stop": 10}, {"version": 2, "start": 10, "stop": 48}]
    tokens = completion["token_ids"]
    assert tokens[:10] == alone(1, [256, 5, 6, 7], 48)[:10]
    # The tokens after the switch are what v2 generates from the prompt and the first 10 tokens.
    assert tokens[10:] == alone(2, [256, 5, 6, 7] + tokens[:10], 38)
    assert tokens[10:] != alone(1, [256, 5, 6, 7], 48)[10:], "the versions must differ for the test to mean much"


def test_drain_a_generation_that_a_swap_meets_stays_on_its_version():
    answer = generate_across_a_swap(SwapPolicy.DRAIN)
    assert answer["weight_version"] == 1 and answer["weight_versions"] == [1]
    assert answer["completions"][0]["versions"] == [{"version": 1, "start": 0, "stop": 48}]
    assert answer["completions"][0]["token_ids"] == alone(1, [256, 5, 6, 7], 48)


def test_abort_a_generation_that_a_swap_meets_runs_again_on_the_new_version():
    answer = generate_across_a_swap(SwapPolicy.ABORT)
    assert answer["weight_version"] == 2 and answer["weight_versions"] == [2] and answer["restarts"] == 1
    assert answer["completions"][0]["versions"] == [{"version": 2, "start": 0, "stop": 48}]
    assert answer["completions"][0]["token_ids"] == alone(2, [256, 5, 6, 7], 48)


def test_swap_refuses_a_policy_that_is_not_a_swap_policy(server):
    """Strings are parsed once, where a setting is read (SwapPolicy.parse); swap takes the enum."""
    for policy in ("eventually", "drain"):
        with pytest.raises(TypeError, match="swap policy must be a SwapPolicy"):
            server.swap(1, make_weights(1), digest="digest-1", policy=policy)
    assert server.served_version() is None
    with pytest.raises(
        ValueError, match=r"swap policy must be one of \['drain', 'in_flight', 'abort'\], got 'eventually'"
    ):
        SwapPolicy.parse("eventually")
    assert SwapPolicy.parse("in_flight") is SwapPolicy.IN_FLIGHT


BAD_REQUESTS = [
    (b"{not json", "not valid JSON"),
    (b'["a list"]', "must be a JSON object"),
    (b'{"prompts": ["a"], "max_new_tokens": NaN}', "NaN is not a JSON number"),
    ({"max_new_tokens": 4}, "exactly one of prompts"),
    ({"prompts": ["a"], "prompt_ids": [[1]]}, "exactly one of prompts"),
    ({"prompts": "a"}, "prompts must be a non-empty list"),
    ({"prompts": []}, "prompts must be a non-empty list"),
    ({"prompts": [3]}, "prompts[0] must be a string"),
    ({"prompt_ids": [[1, "2"]]}, "prompt_ids[0][1] must be an integer"),
    ({"prompt_ids": [[1, True]]}, "prompt_ids[0][1] must be an integer"),
    ({"prompt_ids": [[]]}, "prompt_ids[0] must be a non-empty list"),
    ({"prompt_ids": [[1, 259]]}, "prompt_ids[0][1] must be in 0..258"),
    ({"prompt_ids": [[-1]]}, "must be in 0..258"),
    ({"prompt_ids": [[1]] * 65}, "prompt_ids has 65 entries; the limit is 64"),
    ({"prompts": ["a"], "max_new_tokens": 5000}, "max_new_tokens must be in 1..1024"),
    ({"prompts": ["a"], "max_new_tokens": 0}, "max_new_tokens must be in 1..1024"),
    ({"prompts": ["a"], "max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
    ({"prompts": ["a" * 5000]}, "prompt 0 has 5001 tokens; the limit is 4096"),
    ({"prompts": ["a" * 2000], "max_new_tokens": 100}, "exceeds the model's max_position_embeddings (2048)"),
    ({"prompts": ["a"], "temperature": -1}, "temperature must be 0 (greedy) or a number in [0.01, 100]"),
    ({"prompts": ["a"], "temperature": 1e-9}, "temperature must be 0 (greedy)"),
    ({"prompts": ["a"], "temperature": "hot"}, "temperature must be 0 (greedy)"),
    ({"prompts": ["a"], "top_k": -3}, "top_k must be in 0..259"),
    ({"prompts": ["a"], "seed": "x"}, "seed must be an integer"),
    ({"prompts": ["a"], "stop": 999}, "stop must be in 0..258"),
    ({"prompts": ["a"], "max_tokens": 3}, "unknown fields ['max_tokens']"),
]


def test_bad_requests_get_400_with_a_clear_message(server):
    server.swap(1, make_weights(1), digest="digest-1")
    for body, message in BAD_REQUESTS:
        status, _, answer = post(server.url, body)
        assert status == 400 and message in answer["error"], (body, answer)
    assert post(server.url, b"x" * (2 << 20))[0] == 413  # read and dropped: the client sees the 413
    for headers, status in [
        ({"Content-Length": str(100 << 20)}, 413),  # refused without reading the body
        ({"Content-Length": str(2 << 20), "Expect": "100-continue"}, 413),
        ({"Transfer-Encoding": "chunked"}, 411),
    ]:
        connection = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=30)
        connection.putrequest("POST", "/v1/generate")
        for key, value in headers.items():
            connection.putheader(key, value)
        connection.endheaders()
        reply = connection.getresponse()
        assert reply.status == status and "error" in json.loads(reply.read())
        connection.close()
    assert post(server.url, {"prompts": ["a"]}, path="/v1/nothing")[0] == 404
    assert get(server.url, "/v1/generate")[0] == 405
    status, _, answer = post(server.url, {"prompts": ["still alive"], "max_new_tokens": 2})
    assert status == 200 and answer["weight_version"] == 1
    metrics = get(server.url, "/metrics")[1].decode()
    assert f'weightsync_engine_requests_total{{outcome="bad_request"}} {len(BAD_REQUESTS) + 3}.0' in metrics


def test_text_prompts_need_the_byte_vocabulary():
    with ReferenceServer(ReferenceServerConfig(model={**BYTE_MODEL, "vocab_size": 64})) as server:
        server.swap(
            1, {n: t.to(torch.bfloat16) for n, t in build_model(server.model_config).state_dict().items()}, digest="d"
        )
        status, _, answer = post(server.url, {"prompts": ["a"]})
        assert status == 400 and "send prompt_ids" in answer["error"]
        status, _, answer = post(server.url, {"prompt_ids": [[1, 2]], "max_new_tokens": 3})
        assert status == 200 and answer["completions"][0]["text"] is None


def test_served_tensors_are_the_swapped_tensors_and_layout_is_checked(server):
    weights = make_weights(1)
    server.swap(1, weights, digest="digest-1")
    served = server.served()
    assert served.version == 1 and served.digest == "digest-1"
    assert all(served.weights[n] is t and torch.equal(served.weights[n], t) for n, t in weights.items())
    fp32 = {n: t.float() for n, t in make_weights(2).items()}
    with pytest.raises(LayoutError, match="compute_dtype float32 to convert"):
        server.swap(2, fp32, digest="digest-2")
    assert server.served().version == 1 and server.served_version() == 1


def test_float32_compute_converts_before_the_flip():
    with ReferenceServer(ReferenceServerConfig(model=BYTE_MODEL, compute_dtype="float32")) as server:
        assert not server.zero_copy
        weights = make_weights(1)
        server.swap(1, weights, digest="digest-1")
        served = server.served().weights
        assert all(served[n].dtype == torch.float32 and torch.equal(served[n], t.float()) for n, t in weights.items())
        assert server.wait_unused(1, 0), "no reference to the agent's tensors is kept"
        status, _, answer = post(server.url, {"prompts": ["abc"], "max_new_tokens": 4})
        assert status == 200 and answer["weight_version"] == 1 and len(answer["completions"][0]["token_ids"]) <= 4


def test_version_and_metrics_endpoints(server):
    server.swap(7, make_weights(1), digest="digest-7")
    post(server.url, {"prompts": ["m"], "max_new_tokens": 3, "stop": None})
    info = json.loads(get(server.url, "/v1/version")[1])
    assert info["weight_version"] == 7 and info["weight_digest"] == "digest-7"
    assert info["last_swap_pause_s"] > 0 and info["swapped_at"] > 0 and info["compute_dtype"] == "bfloat16"
    assert json.loads(get(server.url, "/health")[1]) == {"status": "ok", "ready": True, "weight_version": 7}
    status, metrics = get(server.url, "/metrics")
    text = metrics.decode()
    assert status == 200
    for line in (
        "weightsync_engine_weight_version 7.0",
        'weightsync_engine_requests_total{outcome="ok"} 1.0',
        "weightsync_engine_swap_pause_seconds_count 1.0",
        "weightsync_engine_generated_tokens_total 3.0",
        "weightsync_engine_prompt_tokens_total 2.0",
        'weightsync_engine_swaps_total{outcome="ok"} 1.0',
    ):
        assert line in text, line


def test_busy_slots_answer_503():
    config = ReferenceServerConfig(model=BYTE_MODEL, max_concurrent_requests=1, queue_timeout_s=0.01)
    with ReferenceServer(config) as server:
        server.swap(1, make_weights(1), digest="d")
        replica = server._replicas.get()  # what a long generation does: hold the only slot
        try:
            status, _, answer = post(server.url, {"prompts": ["a"]})
            assert status == 503 and "slots stayed busy" in answer["error"]
        finally:
            server._replicas.put(replica)
        assert post(server.url, {"prompts": ["a"], "max_new_tokens": 1})[0] == 200


def test_config_is_validated():
    for kwargs, message in [
        ({}, "exactly one of model"),
        ({"model": BYTE_MODEL, "model_dir": "x"}, "exactly one"),
        ({"model": {"hidden": 3}}, "field names of weightsync.models.ModelConfig"),
        ({"model": BYTE_MODEL, "compute_dtype": "fp8"}, "compute_dtype must be one of"),
        ({"model": BYTE_MODEL, "port": 70000}, "port must be"),
        ({"model": BYTE_MODEL, "max_batch_size": 0}, "max_batch_size must be a positive int"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            ReferenceServerConfig(**kwargs)


def test_model_dir_is_served_as_version_0(tmp_path):
    config = ModelConfig(**BYTE_MODEL)
    state = build_model(config, seed=4).state_dict()
    save_pretrained(tmp_path / "model", config, state)
    engine = open_engine({"type": "reference", "model_dir": str(tmp_path / "model")})
    try:
        served = engine.served()
        assert engine.served_version() == 0 and served.digest is None
        assert all(torch.equal(served.weights[n], t.to(torch.bfloat16)) for n, t in state.items())
        status, headers, answer = post(engine.url, {"prompts": ["x"], "max_new_tokens": 2})
        assert status == 200 and headers["X-Weight-Version"] == "0" and answer["weight_digest"] is None
    finally:
        engine.close()


def test_replica_rope_matches_the_model():
    from weightsync.agents.engines.reference import _replica

    config = ModelConfig(**{**BYTE_MODEL, "rope_theta": 500000.0, "head_dim": 16})
    assert torch.equal(_replica(config).inv_freq, CausalLM(config).inv_freq)


@pytest.mark.slow
def test_serve_entry_point(tmp_path):
    config = ModelConfig(**BYTE_MODEL)
    save_pretrained(tmp_path / "model", config, build_model(config).state_dict())
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weightsync.agents.engines.reference_server",
            "--model-dir",
            str(tmp_path / "model"),
            "--port",
            "0",
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        started = json.loads(proc.stdout.readline())
        assert started["weight_version"] == 0
        assert json.loads(get(started["url"], "/health")[1])["ready"] is True
        proc.terminate()
        assert proc.wait(timeout=300) == 0  # a deadline for a loaded machine, not a timing check
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def _always_says(tmp_path, token: int, vocab: int, **files: dict) -> str:
    """A model directory whose greedy choice is always `token`, with extra JSON files (or keys
    added to config.json) as given."""
    config = ModelConfig(**{**BYTE_MODEL, "vocab_size": vocab})
    state = build_model(config, seed=1).state_dict()
    for name, tensor in state.items():  # the residual stream is the embedding, the same for every token
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    state["model.embed_tokens.weight"].fill_(1.0)
    state["lm_head.weight"] = torch.zeros_like(state["lm_head.weight"])
    state["lm_head.weight"][token] = 1.0  # the one logit above 0
    directory = tmp_path / f"model-{token}-{vocab}-{len(files)}"
    save_pretrained(directory, config, state)
    for name, doc in files.items():
        path = directory / f"{name}.json"
        merged = {**(json.loads(path.read_text()) if path.exists() else {}), **doc}
        path.write_text(json.dumps(merged))
    return str(directory)


def _greedy(model_dir: str, **options) -> dict:
    with ReferenceServer(ReferenceServerConfig(model_dir=model_dir, **options)) as server:
        status, _, answer = post(server.url, {"prompt_ids": [[1, 2, 3]], "max_new_tokens": 6})
        assert status == 200, answer
        return {**answer["completions"][0], "default_stop": getattr(server, "default_stop", "none before")}


def test_the_default_stop_is_the_models_own_eos_not_the_byte_tokenizers(tmp_path):
    """Token 257 is the byte tokenizer's EOS; it cut the generations of every other model with a
    vocabulary above 257 unless each request sent "stop": null."""
    other = _greedy(_always_says(tmp_path, 257, vocab=300))
    assert other["token_ids"] == [257] * 6 and other["finish_reason"] == "length"
    assert other["default_stop"] is None
    # The model's own eos_token_id: generation_config.json first (the first of a list), then config.json.
    named = _greedy(_always_says(tmp_path, 257, vocab=300, config={"eos_token_id": 5}))
    assert named["default_stop"] == 5 and named["token_ids"] == [257] * 6
    stops = _greedy(
        _always_says(tmp_path, 257, vocab=300, config={"eos_token_id": 5}, generation_config={"eos_token_id": [257, 5]})
    )
    assert stops["default_stop"] == 257 and stops["token_ids"] == [257] and stops["finish_reason"] == "stop"
    # The byte tokenizer's vocabulary (the demo's models) keeps its EOS; the engine option wins over all.
    byte = _greedy(_always_says(tmp_path, 257, vocab=259))
    assert byte["default_stop"] == 257 and byte["token_ids"] == [257] and byte["finish_reason"] == "stop"
    assert _greedy(_always_says(tmp_path, 257, vocab=259), eos_token_id=3)["token_ids"] == [257] * 6
