"""The sglang engine (agents/engines/sglang.py). Contract tests run it against
harness/sglang_contract_server.py, a contract server that reproduces SGLang's weight-update routes
and failure behaviour (not SGLang: it cannot be installed on a CPU machine); the generic engine
contract also runs over it in tests/agents/engines/test_engines.py. `test_real_sglang_gpu` runs the same swaps
against a real `python -m sglang.launch_server` where CUDA and sglang are importable.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from harness.sglang_contract_server import SGLangContractServer
from weightsync.agents.engines import open_engine
from weightsync.agents.engines.base import Engine
from weightsync.agents.engines.sglang import SGLangError
from weightsync.agents.parity_figures import compare
from weightsync.errors import ConfigError, LayoutError, WeightsyncError
from weightsync.models import ModelConfig, build_model, load_pretrained, save_pretrained
from weightsync.models.probe import draw_prompts, run_probe, to_probe

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
SHARD_BYTES = 8_000  # several files for SMALL (~40 kB of bf16)


def make_weights(version: int) -> dict[str, torch.Tensor]:
    model = build_model(ModelConfig(**SMALL), seed=version)
    return {name: t.to(torch.bfloat16) for name, t in model.state_dict().items()}


def assert_same_tensors(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for name, want in expected.items():
        assert actual[name].dtype == want.dtype and torch.equal(actual[name], want), name


def post(url: str, body: dict, timeout_s: float = 120) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        return json.loads(reply.read())


def generate(server: SGLangContractServer, **params) -> dict:
    return post(server.url + "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, **params}})


@pytest.fixture
def template(tmp_path) -> Path:
    """The HF directory the server starts on (its --model-path)."""
    directory = tmp_path / "template"
    save_pretrained(directory, ModelConfig(**SMALL), make_weights(0))
    (directory / "tokenizer_config.json").write_text("{}")
    return directory


@pytest.fixture
def server(template):
    server = SGLangContractServer(template)
    yield server
    server.close()


def open_sglang(server, tmp_path, template, **options):
    return open_engine(
        {
            "type": "sglang",
            "url": server.url,
            "root": str(tmp_path / "snapshots"),
            "template_dir": str(template),
            "shard_bytes": SHARD_BYTES,
            "retry_backoff_s": 0.0,
            **options,
        }
    )


@pytest.fixture
def engine(server, tmp_path, template):
    engine = open_sglang(server, tmp_path, template)
    yield engine
    engine.close()


# ------------------------------------------------------------------ contract tests


def test_contract_swaps_of_a_run_of_versions_are_bit_exact_in_the_server(engine, server):
    assert isinstance(engine, Engine) and engine.zero_copy is False
    assert engine.served_version() is None
    for version in range(1, 6):
        weights = make_weights(version)
        report = engine.swap(version, weights, digest=f"digest-{version}")
        assert report.version == version and 0 <= report.pause_s <= report.total_s
        assert engine.served_version() == version and engine.wait_unused(version, 0)
        assert server.weight_version == str(version)
        assert_same_tensors(server.weights, weights)
        assert generate(server)["meta_info"]["weight_version"] == str(version)
        snapshot = engine.current_dir()
        assert server.model_path == str(snapshot) and snapshot.name == f"v{version:012d}"
        assert (snapshot / "tokenizer_config.json").exists() and (snapshot / "config.json").exists()
        assert len(list(snapshot.glob("model-*-of-*.safetensors"))) > 1
    reloads = [body for _, route, body in server.calls if route == "/update_weights_from_disk"]
    assert reloads[-1] == {
        "model_path": str(engine.current_dir()),
        "flush_cache": True,
        "weight_version": "5",
        "abort_all_requests": False,
    }
    assert server.cache_flushes == 5
    assert not [c for c in server.calls if c[1] in ("/pause_generation", "/continue_generation")], (
        "drain wait: SGLang's update lock drains, no pause"
    )


def test_contract_unchanged_files_are_hard_linked_not_copied(server, tmp_path, template):
    engine = open_sglang(server, tmp_path, template, keep_snapshots=2)
    try:
        w1 = make_weights(1)
        engine.swap(1, w1, digest="digest-1")
        v1 = engine.current_dir()
        index = json.loads((v1 / "model.safetensors.index.json").read_text())["weight_map"]
        changed_name = "model.layers.1.mlp.down_proj.weight"
        w2 = {name: t.clone() for name, t in w1.items()}
        w2[changed_name][0, 0] += 1
        engine.swap(2, w2, digest="digest-2")
        v2 = engine.current_dir()
        assert_same_tensors(server.weights, w2)
        files = sorted(p.name for p in v1.glob("model-*.safetensors"))
        assert files == sorted(p.name for p in v2.glob("model-*.safetensors")), "the file plan is fixed"
        for file in files:
            a, b = (v1 / file).stat(), (v2 / file).stat()
            if file == index[changed_name]:
                assert a.st_ino != b.st_ino and b.st_nlink == 1, "a changed file is written anew"
            else:
                assert a.st_ino == b.st_ino and b.st_nlink == 2, f"{file} is unchanged: a hard link"
        assert (v1 / index[changed_name]).read_bytes() != (v2 / index[changed_name]).read_bytes()
        engine.close()
        # A new engine on the same root links against the snapshot `current` names.
        engine = open_sglang(server, tmp_path, template, keep_snapshots=2)
        engine.swap(3, w2, digest="digest-3")
        v3 = engine.current_dir()
        assert all((v3 / f).stat().st_ino == (v2 / f).stat().st_ino for f in files)
        assert_same_tensors(load_pretrained(v3)[1], w2)
        assert engine.snapshots() == [2, 3]
    finally:
        engine.close()


def test_contract_failed_reload_rolls_back_and_raises_previous_kept_until_next_success(engine, server):
    w1 = make_weights(1)
    engine.swap(1, w1, digest="digest-1")
    server.fail_next_loads = ["safetensors header is corrupt"]
    with pytest.raises(SGLangError, match=r"reload of version 2 failed.*still serves weight_version 1.*corrupt"):
        engine.swap(2, make_weights(2), digest="digest-2")
    # The server re-read v1 from disk: it had to be there.
    assert server.weight_version == "1" and server.model_path == str(engine.current_dir())
    assert_same_tensors(server.weights, w1)
    assert engine.served_version() == 1 and engine.snapshots() == [1]
    assert engine.current_dir().name == "v000000000001"
    w3 = make_weights(3)
    engine.swap(3, w3, digest="digest-3")
    assert engine.snapshots() == [3], "the previous snapshot goes once the next swap succeeded"
    assert_same_tensors(server.weights, w3)


def test_contract_a_load_the_server_refuses_by_shape_rolls_back_to_its_model_path(engine, server, template):
    bad = make_weights(1)
    bad["model.norm.weight"] = torch.ones(31, dtype=torch.bfloat16)  # the first version fixes no layout here
    with pytest.raises(SGLangError, match="Failed to update weights.*model.norm.weight"):
        engine.swap(1, bad, digest="digest-1")
    assert engine.served_version() is None and engine.snapshots() == [] and engine.current_dir() is None
    assert server.model_path == str(template) and server.weight_version == "default"
    assert_same_tensors(server.weights, make_weights(0))
    engine.swap(1, make_weights(1), digest="digest-1")  # the layout was not fixed by the failure
    assert server.weight_version == "1"
    with pytest.raises(LayoutError, match="model.norm.weight has shape"):
        engine.swap(2, bad, digest="digest-2")


def test_contract_a_lost_reply_is_settled_by_the_weight_version(server, tmp_path, template):
    engine = open_sglang(server, tmp_path, template, reload_retries=0)
    try:
        engine.swap(1, make_weights(1), digest="digest-1")
        server.lose_next_replies = 1  # loaded, but the reply never comes
        w2 = make_weights(2)
        engine.swap(2, w2, digest="digest-2")
        assert engine.served_version() == 2 and server.weight_version == "2"
        assert_same_tensors(server.weights, w2)
        server.lose_next_replies, server.fail_next_loads = 1, ["cannot read"]  # failed, and no reply
        with pytest.raises(SGLangError, match="still serves weight_version 2.*no reply"):
            engine.swap(3, make_weights(3), digest="digest-3")
        assert engine.served_version() == 2 and engine.snapshots() == [2]
    finally:
        engine.close()


def test_contract_a_lost_reply_is_retried(server, tmp_path, template):
    engine = open_sglang(server, tmp_path, template, reload_retries=1)
    try:
        server.lose_next_replies = 1
        engine.swap(1, make_weights(1), digest="digest-1")
        assert len([c for c in server.calls if c[1] == "/update_weights_from_disk"]) == 2
        assert server.weight_version == "1"
    finally:
        engine.close()


def test_contract_an_unknown_server_version_is_restored_to_the_previous_snapshot(engine, server):
    w1 = make_weights(1)
    engine.swap(1, w1, digest="digest-1")
    server.weight_version = "someone-else"  # the server's state is no longer the one the engine left
    server.fail_next_loads = ["disk full"]
    with pytest.raises(SGLangError, match="restored weight_version 1"):
        engine.swap(2, make_weights(2), digest="digest-2")
    assert server.weight_version == "1" and engine.served_version() == 1
    assert_same_tensors(server.weights, w1)


def test_contract_an_unknown_server_version_after_a_restart_is_reported_not_guessed(server, tmp_path, template):
    engine = open_sglang(server, tmp_path, template)
    engine.swap(1, make_weights(1), digest="digest-1")
    engine.close()
    engine = open_sglang(server, tmp_path, template)  # served_version() None: v1 may not be what the server has
    try:
        server.weight_version = "someone-else"
        server.fail_next_loads = ["disk full"]
        with pytest.raises(SGLangError, match="reports weight_version 'someone-else'.*no snapshot to restore"):
            engine.swap(2, make_weights(2), digest="digest-2")
        assert engine.served_version() is None and server.weight_version == "someone-else"
    finally:
        engine.close()


def test_contract_requests_in_flight_finish_on_their_version_drain_wait(engine, server):
    engine.swap(1, make_weights(1), digest="digest-1")
    held: list[dict] = []
    request = threading.Thread(target=lambda: held.append(generate(server, hold=True)))
    request.start()
    assert server.holding.wait(60)
    swap = threading.Thread(target=engine.swap, args=(2, make_weights(2)), kwargs={"digest": "digest-2"})
    swap.start()
    assert server.writer_waiting.wait(60), "the reload waits for the request in flight"
    assert swap.is_alive() and server.weight_version == "1"
    server.release()
    request.join(60)
    swap.join(60)
    assert held[0]["meta_info"]["weight_versions_used"] == ["1"]
    assert held[0]["meta_info"]["finish_reason"]["type"] == "length"
    assert engine.served_version() == 2
    assert generate(server)["meta_info"]["weight_versions_used"] == ["2"]


def test_contract_drain_abort_pauses_aborts_and_continues(server, tmp_path, template):
    engine = open_sglang(server, tmp_path, template, drain="abort")
    try:
        engine.swap(1, make_weights(1), digest="digest-1")
        held: list[dict] = []
        request = threading.Thread(target=lambda: held.append(generate(server, hold=True)))
        request.start()
        assert server.holding.wait(60)
        engine.swap(2, make_weights(2), digest="digest-2")  # returns without the request finishing
        request.join(60)
        assert held[0]["meta_info"]["finish_reason"]["type"] == "abort"
        assert held[0]["meta_info"]["weight_versions_used"] == ["1"]
        routes = [route for _, route, _ in server.calls if route != "/generate"]
        assert routes[-4:] == [
            "/pause_generation",
            "/update_weights_from_disk",
            "/get_weight_version",
            "/continue_generation",
        ]
        assert [b for _, r, b in server.calls if r == "/pause_generation"][-1] == {"mode": "abort"}
        server.fail_next_loads = ["bad file"]
        with pytest.raises(SGLangError, match="still serves weight_version 2"):
            engine.swap(3, make_weights(3), digest="digest-3")
        assert server.calls[-1][1] == "/continue_generation", "a failed swap continues generation too"
        assert generate(server)["meta_info"]["weight_versions_used"] == ["2"]
    finally:
        engine.close()


def test_contract_a_failed_continue_is_loud(server, tmp_path, template):
    engine = open_sglang(server, tmp_path, template, drain="abort")
    try:
        server.missing_routes = {"/continue_generation"}
        with pytest.raises(SGLangError, match="continue after version 1 failed, the server stays paused"):
            engine.swap(1, make_weights(1), digest="digest-1")
    finally:
        engine.close()


def test_contract_open_removes_leftovers_of_an_interrupted_swap(server, tmp_path, template):
    engine = open_sglang(server, tmp_path, template)
    engine.swap(1, make_weights(1), digest="digest-1")
    engine.close()
    root = tmp_path / "snapshots"
    (root / ".tmp-v000000000002-abc").mkdir()
    (root / ".tmp-v000000000002-abc" / "model-00001-of-00005.safetensors").write_bytes(b"partial")
    (root / ".trash-v000000000000-1234").mkdir()
    os.symlink("v000000000002", root / ".current.tmp-xyz")
    engine = open_sglang(server, tmp_path, template)
    try:
        assert sorted(p.name for p in root.iterdir()) == [".lock", "current", "v000000000001"]
        assert engine.served_version() is None, "unknown until a swap succeeds in this process"
        inode = (root / "v000000000001" / "config.json").stat().st_ino
        engine.swap(1, make_weights(1), digest="digest-1")  # the agent re-applies its last version
        assert (root / "v000000000001" / "config.json").stat().st_ino == inode, "the snapshot is reused"
        assert engine.served_version() == 1 and server.weight_version == "1"
        with pytest.raises(WeightsyncError, match="must not be reused"):
            engine.swap(1, make_weights(5), digest="digest-5")
    finally:
        engine.close()


def test_contract_requests_during_a_run_of_swaps_never_mix_versions(engine, server):
    engine.swap(1, make_weights(1), digest="digest-1")
    stop = threading.Event()
    replies, problems = [], []

    def client() -> None:
        while not stop.is_set():
            try:
                replies.append(generate(server, max_new_tokens=4)["meta_info"])
            except Exception as e:  # reported below; a client thread must not die silently
                problems.append(repr(e))

    clients = [threading.Thread(target=client) for _ in range(3)]
    for c in clients:
        c.start()
    try:
        for version in range(2, 7):
            engine.swap(version, make_weights(version), digest=f"digest-{version}")
    finally:
        stop.set()
        for c in clients:
            c.join(60)
    assert not problems and replies
    for meta in replies:
        assert len(meta["weight_versions_used"]) == 1, meta
        assert meta["weight_version"] == meta["weight_versions_used"][0], meta
    assert generate(server)["meta_info"]["weight_version"] == "6"


def test_contract_the_parity_probe_reads_sglangs_input_logprobs(engine, server):
    """The engine answers a parity probe with what the server computes on the version it serves;
    the trainer's record of the same bf16 weights in float32 (what the contract server computes
    in) is the same to ~1e-6. SGLang says nothing of its dtype and gives no top-k here."""
    weights = make_weights(3)
    engine.swap(3, weights, digest="d3")
    prompts = list(itertools.islice(draw_prompts(SMALL["vocab_size"], length=9), 2))
    answer = engine.prompt_logprobs(prompts, top_k=8)
    assert answer.version == 3 and answer.experts is None and answer.compute_dtype is None and answer.top_ids is None
    record = run_probe(ModelConfig(**SMALL), prompts, weights.__getitem__, dtypes=[torch.float32])[torch.float32]
    figures = compare(to_probe(prompts, {"float32": record}), "float32", answer.logprobs)
    assert figures.tokens == 16 and figures.max_abs_dlogprob <= 1e-6 and figures.gap_kl is None


def test_contract_flush_cache_is_refused_while_requests_are_pending(server):
    """What the contract server keeps of SGLang, checked against itself."""
    thread = threading.Thread(target=generate, args=(server,), kwargs={"hold": True})
    thread.start()
    assert server.holding.wait(60)
    with pytest.raises(urllib.error.HTTPError) as refused:
        post(server.url + "/flush_cache", {})
    assert refused.value.code == 400
    server.release()
    thread.join(60)
    post_ok = urllib.request.urlopen(urllib.request.Request(server.url + "/flush_cache", method="POST"), timeout=60)
    assert post_ok.status == 200


def test_contract_missing_routes_are_refused_clearly(server, tmp_path, template):
    server.missing_routes = {"/get_weight_version", "/update_weights_from_disk"}
    with pytest.raises(SGLangError, match="lacks GET /get_weight_version, POST /update_weights_from_disk"):
        open_sglang(server, tmp_path, template)
    assert not (tmp_path / "snapshots").exists()
    server.missing_routes = {"/pause_generation"}
    open_sglang(server, tmp_path, template).close()  # drain "wait" does not need it
    with pytest.raises(SGLangError, match="lacks POST /pause_generation"):
        open_sglang(server, tmp_path, template, drain="abort")
    url = server.url
    server.close()
    with pytest.raises(SGLangError, match="no SGLang server answers"):
        open_engine({"type": "sglang", "url": url, "root": str(tmp_path / "s2"), "template_dir": str(template)})


def test_config_is_validated(tmp_path, template):
    base = {"type": "sglang", "url": "http://127.0.0.1:1", "root": str(tmp_path), "template_dir": str(template)}
    with pytest.raises(ValueError, match="drain must be one of.*in_place"):
        open_engine({**base, "drain": "in_place"})
    with pytest.raises(ValueError, match="url must be"):
        open_engine({**base, "url": "127.0.0.1:30000"})
    with pytest.raises(
        ConfigError, match=r"unknown key \[agent.engine\] 'reload_url'; did you mean 'reload_retries'\?"
    ):
        open_engine({**base, "reload_url": "x"})
    with pytest.raises(ValueError, match="template_dir"):
        open_engine({"type": "sglang", "url": "http://127.0.0.1:1", "root": str(tmp_path)})
    with pytest.raises(ValueError, match="shard_bytes"):
        open_engine({**base, "shard_bytes": 0})


def test_one_engine_per_root(engine, server, tmp_path, template):
    with pytest.raises(WeightsyncError, match="another engine"):
        open_sglang(server, tmp_path, template)


# ------------------------------------------------------------------ a real SGLang server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None,
    reason="needs CUDA and sglang (pip install sglang); the contract tests cover the CPU side",
)
def test_real_sglang_gpu(tmp_path):
    config = ModelConfig(
        model_type="qwen3",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )
    template = tmp_path / "template"
    save_pretrained(template, config, build_model(config, seed=0).state_dict())
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "sglang.log", "w")  # noqa: SIM115 - closed in finally
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(template),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--skip-tokenizer-init",
            "--dtype",
            "bfloat16",
            "--mem-fraction-static",
            "0.2",
            "--disable-cuda-graph",
            "--context-length",
            "256",
            "--weight-version",
            "0",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    engine = None
    try:
        deadline = time.monotonic() + 900
        while True:  # the server answers once the model is loaded
            assert server.poll() is None, (tmp_path / "sglang.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "sglang did not come up in 900 s"
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/get_model_info", timeout=5) as reply:
                    if reply.status == 200:
                        break
            time.sleep(1)
        engine = open_engine(
            {
                "type": "sglang",
                "url": url,
                "root": str(tmp_path / "snapshots"),
                "template_dir": str(template),
                "shard_bytes": 1 << 20,
            }
        )
        for version in (1, 2, 3):
            weights = {n: t.to(torch.bfloat16) for n, t in build_model(config, seed=version).state_dict().items()}
            engine.swap(version, weights, digest=f"digest-{version}")
            assert engine.weight_version() == str(version)
            for name in ("model.embed_tokens.weight", "lm_head.weight"):  # not fused by SGLang
                got = post(url + "/get_weights_by_name", {"name": name, "truncate_size": 4})
                assert torch.equal(torch.tensor(got, dtype=torch.float32), weights[name][:4].float()), name
            out = post(
                url + "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
            )
            assert out["meta_info"]["weight_version"] == str(version)
        # The failure behaviour the contract server copies: a failed load answers 400 success=false,
        # reloads the previous model_path and keeps the weight_version.
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(url + "/update_weights_from_disk", {"model_path": str(tmp_path / "missing"), "weight_version": "9"})
        assert refused.value.code == 400 and json.loads(refused.value.read())["success"] is False
        assert engine.weight_version() == "3"
        got = post(url + "/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 4})
        assert torch.equal(torch.tensor(got, dtype=torch.float32), weights["lm_head.weight"][:4].float())
    finally:
        if engine is not None:
            engine.close()
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
