"""A new user's first run, from the README and docs only (issue 42): each message or exit code that
stood between them and a served model, as the failing case it was.

- `ls --store /nonexistent` said "no models" and exited 0;
- a mistyped --model read as a model with no versions;
- `status --agent localhost` dialed port 443, and a deadline came back as a bare DEADLINE_EXCEEDED;
- `train --set train.steps=-1` said "train.steps and train.log_every must be >= 1" (neither which
  nor the value) from every rank, and exited 1 where the README promises 2;
- an agent could not start from the store alone, and a [train.model] table pasted into
  [agent.engine] model failed on init_seed with a TypeError's words.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightsync.app.cli import build_parser, main
from weightsync.app.cli.agent import agent_config
from weightsync.errors import ConfigError
from weightsync.listen import AGENT_PORT, agent_target
from weightsync.models import ModelConfig, build_model, save_pretrained

REPO = Path(__file__).resolve().parents[2]
TINY = ModelConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _store_with(tmp_path: Path, model: str, *, config_json: bool = True) -> str:
    """A store holding one version of `model` (with the model's config.json, or bare weights)."""
    directory = tmp_path / "hf"
    save_pretrained(directory, TINY, build_model(TINY, seed=0).state_dict())
    store = str(tmp_path / "store")
    source = directory if config_json else directory / "model.safetensors"
    assert main(["publish", "--store", store, "--model", model, str(source)]) == 0
    return store


def test_ls_of_a_store_that_does_not_exist_exits_2_naming_it(tmp_path, capsys):
    code, out, err = _run(capsys, "ls", "--store", str(tmp_path / "nonexistent"))
    assert code == 2 and out == "", (code, out)
    assert err.count("\n") == 1 and f"{tmp_path / 'nonexistent'} is not a directory" in err, err
    (tmp_path / "empty").mkdir()  # a store nothing was published to yet: empty, and that is no error
    code, out, _ = _run(capsys, "ls", "--store", str(tmp_path / "empty"))
    assert code == 0 and "no models in" in out


@pytest.mark.parametrize("command", ["ls", "pull", "verify", "gc"])
def test_a_mistyped_model_lists_the_models_the_store_holds(tmp_path, capsys, command):
    store = _store_with(tmp_path, "sft-tiny")
    capsys.readouterr()
    extra = {"pull": ["--out", str(tmp_path / "out")], "gc": ["--keep", "1"]}.get(command, [])
    code, out, err = _run(capsys, command, "--store", store, "--model", "sft-tyny", *extra)
    assert code == 2 and out == "", err
    assert "has no versions of 'sft-tyny'; did you mean 'sft-tiny'? it holds sft-tiny" in err, err
    assert not (tmp_path / "out").exists()


def test_status_of_a_host_without_a_port_dials_the_agent_port_not_443(capsys):
    assert agent_target("localhost") == f"localhost:{AGENT_PORT}"
    assert agent_target("[::1]") == f"[::1]:{AGENT_PORT}" and agent_target("::1") == f"[::1]:{AGENT_PORT}"
    assert agent_target("10.0.0.2:7171") == "10.0.0.2:7171"
    code, _, err = _run(capsys, "status", "--agent", "localhost", "--timeout-s", "5")
    # Whatever listens on 7070 on this shared machine (nothing, or another engineer's agent), never 443.
    assert ":443" not in err and (code == 0 or f"localhost:{AGENT_PORT}" in err), err


def test_a_status_past_its_deadline_says_what_that_can_mean():
    with socket.socket() as silent:  # accepts connections, never answers: not a weightsync agent
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(Exception, match="DEADLINE_EXCEEDED") as raised:
            from weightsync.transport.rpc import AgentClient

            client = AgentClient(address)
            try:
                client.status(timeout_s=1)
            finally:
                client.close()
    message = str(raised.value)
    assert "no answer within 1 s" in message and "not a weightsync agent" in message
    assert "--timeout-s" in message


def test_a_trainer_setting_to_fix_exits_2_in_one_line_naming_the_setting_and_value(tmp_path, capsys):
    config = REPO / "trainer" / "configs" / "sft_tiny.toml"
    code, out, err = _run(capsys, "train", "--config", str(config), "--nproc", "2", "--set", "train.steps=-1")
    assert code == 2 and out == "", err
    assert err.count("\n") == 1 and err.endswith("[train] steps must be >= 1, got -1\n"), err
    code, _, err = _run(capsys, "train", "--config", str(config), "--set", "train.stepz=3")
    assert code == 2 and "unknown key [train] 'stepz'; did you mean 'steps'?" in err, err


def test_a_train_model_table_pasted_into_the_engine_names_init_seed_as_the_trainers(tmp_path, capsys):
    toml = tmp_path / "agent.toml"
    toml.write_text(
        '[agent]\nmodel = "m"\ncache_dir = "c"\n\n[agent.engine]\ntype = "reference"\n'
        "model = { model_type = 'qwen3', vocab_size = 259, hidden_size = 64, intermediate_size = 192, "
        "num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, init_seed = 0 }\n"
    )
    code, out, err = _run(capsys, "agent", "--config", str(toml))
    assert code == 2 and out == "", err
    assert "unknown key [agent.engine.model] 'init_seed': init_seed is the trainer's setting ([train.model]" in err


def test_an_agent_starts_from_the_store_alone(tmp_path):
    store = _store_with(tmp_path, "policy")
    args = build_parser().parse_args(["agent", "--model", "policy", "--store", store, "--cache-dir", "c"])
    config = agent_config(args)
    assert config.engine == {"type": "reference", "model": TINY}  # its stop token: the byte tokenizer's


@pytest.mark.parametrize(
    ("model", "config_json", "message"),
    [
        ("polcy", True, "has no versions of 'polcy'; it holds policy"),
        ("policy", False, "policy v1 in file://.* was published without a config.json"),
    ],
)
def test_an_agent_from_a_store_that_cannot_tell_the_architecture_says_why(tmp_path, model, config_json, message):
    store = _store_with(tmp_path, "policy", config_json=config_json)
    args = build_parser().parse_args(["agent", "--model", model, "--store", store, "--cache-dir", "c"])
    with pytest.raises(ConfigError, match=message):
        agent_config(args)


def test_pull_of_bare_weights_still_says_where_a_config_comes_from(tmp_path, capsys):
    """Versions published without model files (bare safetensors, older publishers) pull as before."""
    store = str(tmp_path / "store")
    save_file({"w": torch.ones(4)}, tmp_path / "w.safetensors")
    assert main(["publish", "--store", store, "--model", "m", str(tmp_path / "w.safetensors")]) == 0
    capsys.readouterr()
    code, _, err = _run(capsys, "pull", "--store", store, "--model", "m", "--out", str(tmp_path / "out"))
    assert code == 0 and "no config.json was published with v1" in err


def test_the_expert_mismatch_names_the_positions_it_is_a_fraction_of():
    """The status line said "expert mismatch 0.0156 over 124 tokens" of a fraction over 128 positions
    (4 prompts of 32 tokens: 124 log-probs, 128 routed positions)."""
    from weightsync.app.cli.agent import parity_line
    from weightsync.transport.v1 import sync_pb2

    report = dict(
        version=3, engine="reference", compute_dtype="bfloat16", dlogprob_p50=0.0, dlogprob_p90=0.001,
        max_abs_dlogprob=0.00467, tokens=124, action="ok",
    )  # fmt: skip
    line = parity_line(sync_pb2.ParityReport(**report, expert_mismatch=2 / 128, expert_positions=128))
    assert "max 0.00467 over 124 tokens, expert mismatch 0.0156 over 128 positions," in line, line
    older = parity_line(sync_pb2.ParityReport(**report, expert_mismatch=2 / 128))  # an agent that reports no count
    assert "over 124 tokens, expert mismatch 0.0156," in older, older
    assert "expert" not in parity_line(sync_pb2.ParityReport(**report))  # a dense model
