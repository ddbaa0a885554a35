"""Training profiles: the shipped ones load and resolve by name (newest version) or name@version,
an unknown one is refused listing the known ones, and a server started from a profile (through
`weightsync serve-training`, 2 ranks under torchrun for demo-lm) trains the profile's model when
a client names the profile as its base model.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from weightsync.app.training.errors import NotFound
from weightsync.app.training.profiles import load_profiles, parse_profile, resolve_profile
from weightsync.app.training.sampling import SamplerHub
from weightsync.app.training.serve import add_arguments, to_argv
from weightsync.app.training.service import ServiceConfig


def test_the_shipped_profiles_load_and_resolve():
    profiles = load_profiles()
    assert {"demo-lm@1", "qwen3-0.6b@1"} <= set(profiles)
    qwen = resolve_profile("qwen3-0.6b")
    assert qwen.architecture["hidden_size"] == 1024 and qwen.architecture["num_hidden_layers"] == 28
    assert qwen.cpu_offload and qwen.activation_checkpointing and qwen.mixed_precision == "bf16"
    assert resolve_profile("demo-lm@1").ranks == 2
    assert resolve_profile("qwen3-0.6b", model_dir="/models/qwen3").model_dir == "/models/qwen3"
    with pytest.raises(NotFound, match="known: \\['demo-lm@1'"):
        resolve_profile("no-such-profile")
    with pytest.raises(NotFound):
        resolve_profile("demo-lm@99")


def test_to_argv_round_trips_the_server_options():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = [
        "--state-dir",
        "/tmp/x",
        "--port",
        "0",
        "--profile",
        "demo-lm",
        "--cpu-offload",
        "--model",
        "a",
        "--model",
        "b",
        "--sampler-engine",
        "vllm",
        "--vllm-url",
        "http://127.0.0.1:8001",
    ]
    args = parser.parse_args(argv)
    assert vars(parser.parse_args(to_argv(args))) == vars(args)


def test_a_profile_may_put_the_sampler_on_vllm_and_vllm_needs_a_url(tmp_path):
    doc = {
        "name": "on-vllm",
        "version": 1,
        "model": {"model_dir": "/models/m"},
        "sampler": {"engine": "vllm", "url": "http://127.0.0.1:8001"},
    }
    profile = parse_profile(doc, where="test")
    assert profile.sampler_engine == "vllm" and profile.sampler_url == "http://127.0.0.1:8001"
    assert parse_profile({**doc, "sampler": {}}, where="test").sampler_engine == "reference"
    with pytest.raises(ValueError, match="engine must be one of"):
        parse_profile({**doc, "sampler": {"engine": "sglang"}}, where="test")
    with pytest.raises(ValueError, match="needs vllm_url"):
        ServiceConfig(state_dir=str(tmp_path), sampler_engine="vllm")
    with pytest.raises(ValueError, match="the reference engine serves merged weights"):
        ServiceConfig(state_dir=str(tmp_path), sampler_weights="adapter")
    with pytest.raises(ValueError, match="--vllm-url"):
        SamplerHub(store_uri=f"file://{tmp_path}", cache_root=tmp_path, engine="vllm")


def test_a_profile_sets_tensor_and_expert_parallelism_that_divides_its_ranks():
    doc = {"name": "wide", "version": 1, "model": {"model_dir": "/models/m"}, "parallel": {"ranks": 4, "tp": 2}}
    assert (parse_profile(doc, where="test").tp, parse_profile(doc, where="test").ep) == (2, 1)
    moe = {**doc, "parallel": {"ranks": 4, "ep": 4}}
    assert parse_profile(moe, where="test").ep == 4
    with pytest.raises(ValueError, match=r"\[parallel\] tp must be >= 1 and divide ranks \(4\), got 3"):
        parse_profile({**doc, "parallel": {"ranks": 4, "tp": 3}}, where="test")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_server_from_the_demo_profile_trains_the_profile_model_on_two_ranks(tmp_path):
    tinker = pytest.importorskip("tinker")
    from tinker import types

    env = {**os.environ, "TINKER_TELEMETRY": "0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "weightsync.app.cli",
                "serve-training",
                "--state-dir",
                str(tmp_path / "state"),
                "--port",
                "0",
                "--api-key",
                "tml-profile",
                "--profile",
                "demo-lm",
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            start_new_session=True,
        )
    try:
        ready: list[dict] = []
        seen = threading.Event()

        def read_ready() -> None:
            for line in proc.stdout:
                if line.startswith(b'{"event": "ready"'):
                    ready.append(json.loads(line))
                    seen.set()
                    return

        threading.Thread(target=read_ready, daemon=True).start()
        assert seen.wait(300), (tmp_path / "server.log").read_text()[-3000:]
        assert ready[0]["world_size"] == 2 and ready[0]["profile"] == "demo-lm@1"
        with tinker.ServiceClient(base_url=ready[0]["url"], api_key="tml-profile") as service:
            client = service.create_lora_training_client(base_model="demo-lm", rank=0).result()
            tokens = [256, 49, 43, 50, 61, 51, 257]
            datum = types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 6},
            )
            losses = []
            for _ in range(3):
                out = client.forward_backward([datum, datum, datum], "cross_entropy")
                client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
                losses.append(out.result().metrics["loss:sum"])
            assert losses[-1] < losses[0]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)


def _profile_dir(tmp_path, text: str):
    directory = tmp_path / "profiles"
    directory.mkdir(parents=True)
    (directory / "mine.toml").write_text(text)
    return directory


GOOD = """name = "mine"
version = 1
[model]
model_dir = "/models/m"
[parallel]
ranks = 1
"""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (GOOD.replace("ranks = 1", "rank = 2"), r"unknown key \[parallel\] 'rank'; did you mean 'ranks'\?"),
        (GOOD + "[sampler]\nengin = 'vllm'\n", r"unknown key \[sampler\] 'engin'; did you mean 'engine'\?"),
        (GOOD.replace("ranks = 1", 'ranks = "2"'), r"\[parallel\] ranks must be an integer, got '2'"),
        (GOOD.replace("version = 1\n", ""), r"version is missing"),
        (
            GOOD.replace('model_dir = "/models/m"', "architecture = { hidden_sise = 8 }"),
            r"unknown key \[model\] architecture 'hidden_sise'; did you mean 'hidden_size'\?",
        ),
        (GOOD.replace("ranks = 1", 'mixed_precision = "fp8"'), r"mixed_precision must be one of"),
    ],
)
def test_a_typo_in_a_profile_is_an_error_naming_the_key(tmp_path, text, message):
    """A profile was mapped by hand: `rank = 2` under [parallel] was silently ignored (1 rank ran)."""
    from weightsync.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_profiles(_profile_dir(tmp_path, text))


def test_serve_training_with_a_mistyped_profile_exits_2_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    pytest.importorskip("tinker")
    from weightsync.app.cli import main
    from weightsync.app.training import profiles

    def serve(profile: str) -> tuple[int, str]:
        code = main(["serve-training", "--state-dir", str(tmp_path / "state"), "--profile", profile, "--api-key", "k"])
        return code, capsys.readouterr().err

    monkeypatch.setattr(profiles, "PROFILE_DIR", _profile_dir(tmp_path / "typo", GOOD.replace("ranks = 1", "rank = 2")))
    code, err = serve("mine")
    assert code == 2 and err.count("\n") == 1 and "'rank'; did you mean 'ranks'?" in err, err
    monkeypatch.setattr(profiles, "PROFILE_DIR", _profile_dir(tmp_path / "good", GOOD))
    code, err = serve("nope")
    assert code == 2 and "--profile nope: no training profile 'nope'; known: ['mine@1']" in err, err
    assert not (tmp_path / "state").exists()
