"""The `weightsync` command: publish → ls → pull → verify → gc on real files, in-process and as a
real subprocess, with --json output and clear one-line errors."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.bits import assert_bit_equal
from weightsync.agents.engines import engine_types
from weightsync.agents.engines.swap_policy import SwapPolicy
from weightsync.app.cli import main
from weightsync.app.demo.run import DEMO_ENGINES
from weightsync.checkpoint_io import INDEX_NAME, open_checkpoint, write_safetensors
from weightsync.format.layout import manifest_key


def _checkpoints(tmp_path: Path) -> tuple[dict, dict, Path, Path]:
    g = torch.Generator().manual_seed(0)
    first = {
        "model.embed.weight": torch.randn(300, 64, generator=g),
        "model.norm.weight": torch.ones(64),
        "model.head.weight": torch.randn(64, 300, generator=g).to(torch.float16),
        "model.steps": torch.arange(7, dtype=torch.int64),
    }
    second = dict(first)
    mask = torch.rand(300, 64, generator=g) < 0.03
    second["model.embed.weight"] = first["model.embed.weight"] + mask * 1e-2
    save_file(first, tmp_path / "c1.safetensors")
    save_file(second, tmp_path / "c2.safetensors")
    return first, second, tmp_path / "c1.safetensors", tmp_path / "c2.safetensors"


def _bf16(sd: dict) -> dict:
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_publish_ls_pull_verify_roundtrip(tmp_path, capsys):
    first, second, c1, c2 = _checkpoints(tmp_path)
    store = f"file://{tmp_path}/store"
    code, out, _ = _run(capsys, "publish", "--store", store, "--model", "org/m", "--step", "1", str(c1), "--json")
    assert code == 0 and json.loads(out)["kind"] == "full"
    code, out, _ = _run(capsys, "publish", "--store", store, "--model", "org/m", "--step", "2", str(c2), "--json")
    published = json.loads(out)
    assert code == 0 and (published["version"], published["kind"], published["parent"]) == (2, "delta", 1)
    assert published["ratio"] > 5

    code, out, _ = _run(capsys, "ls", "--store", store, "--model", "org/m", "--json")
    listing = json.loads(out)
    assert [(v["version"], v["kind"], v["step"]) for v in listing["versions"]] == [(1, "full", 1), (2, "delta", 2)]
    code, out, _ = _run(capsys, "ls", "--store", store, "--json")
    assert json.loads(out)["models"] == ["org/m"]

    for version, expected in ((1, first), (2, second)):
        out_dir = tmp_path / f"pulled{version}"
        code, out, _ = _run(
            capsys,
            "pull",
            "--store",
            store,
            "--model",
            "org/m",
            "--version",
            str(version),
            "--out",
            str(out_dir),
            "--json",
        )
        assert code == 0 and json.loads(out)["version"] == version
        assert_bit_equal(load_file(out_dir / "model.safetensors"), _bf16(expected))

    code, out, _ = _run(capsys, "verify", "--store", store, "--model", "org/m", "--all", "--json")
    assert code == 0 and json.loads(out)["ok"] is True


def test_keep_dtypes_and_hf_directory_with_index(tmp_path, capsys):
    first, _, _, _ = _checkpoints(tmp_path)
    hf_dir = tmp_path / "hf"
    files = write_safetensors(first, hf_dir, max_shard_bytes=40_000)
    assert files[-1].name == INDEX_NAME and len(files) > 2
    store = str(tmp_path / "store")
    code, _, _ = _run(capsys, "publish", "--store", store, "--model", "m", "--keep-dtypes", str(hf_dir))
    assert code == 0
    code, _, _ = _run(capsys, "pull", "--store", store, "--model", "m", "--out", str(tmp_path / "out"))
    assert code == 0
    assert_bit_equal(dict(open_checkpoint(tmp_path / "out")), first)


def test_verify_names_the_corrupt_version_and_fails(tmp_path, capsys):
    _, _, c1, c2 = _checkpoints(tmp_path)
    store = tmp_path / "store"
    for c in (c1, c2):
        assert _run(capsys, "publish", "--store", str(store), "--model", "m", str(c))[0] == 0
    manifest = json.loads((store / "models/m/versions/000000000002.json").read_text())
    key = next(c["key"] for t in manifest["tensors"] for c in t["chunks"] if "key" in c)
    path = store / "models/m" / key
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))

    code, out, err = _run(capsys, "verify", "--store", str(store), "--model", "m", "--all")
    assert code == 1
    assert "v1: ok" in out and "v2: FAILED" in out and "IntegrityError" in out
    last = err.splitlines()[-1]  # after the reader's warning about the object it fetched again
    assert last.startswith("weightsync: error:") and "[2]" in last


def test_gc_dry_run_then_real(tmp_path, capsys):
    _, _, c1, c2 = _checkpoints(tmp_path)
    store = str(tmp_path / "store")
    for c in (c1, c2, c1):  # v3 (same bytes as v1) is a delta on v2
        assert _run(capsys, "publish", "--store", store, "--model", "m", "--chunk-mib", "0.01", str(c))[0] == 0
    code, out, _ = _run(
        capsys, "gc", "--store", store, "--model", "m", "--keep", "1", "--grace-s", "0", "--dry-run", "--json"
    )
    plan = json.loads(out)
    assert code == 0 and plan["dry_run"] and plan["keep_versions"] == [1, 2, 3] and plan["delete_versions"] == []

    # Make the newest version a base so that older ones can go.
    assert _run(capsys, "publish", "--store", store, "--model", "m", "--keep-dtypes", str(c2))[0] == 0
    code, out, _ = _run(capsys, "gc", "--store", store, "--model", "m", "--keep", "1", "--grace-s", "0", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["delete_versions"] == [1, 2, 3] and plan["keep_versions"] == [4]
    code, out, _ = _run(capsys, "ls", "--store", store, "--model", "m", "--json")
    assert [v["version"] for v in json.loads(out)["versions"]] == [4]
    assert _run(capsys, "verify", "--store", store, "--model", "m", "--all")[0] == 0


@pytest.mark.parametrize(
    "argv, message, exit_code",
    [  # 2: a setting to fix (usage, config); 1: the command ran and failed
        (["pull", "--store", "nowhere", "--model", "m", "--out", "o"], "is not a directory, so it holds no store", 2),
        (
            ["pull", "--store", "STORE", "--model", "mx", "--out", "o"],
            "has no versions of 'mx'; did you mean 'm'? it holds m",
            2,
        ),
        (["pull", "--store", "STORE", "--model", "m", "--version", "9", "--out", "o"], "version 9 is not in", 1),
        (["publish", "--store", "STORE", "--model", "../evil", "CKPT"], "--model: invalid model name", 2),
        (["publish", "--store", "STORE", "--model", "m", "missing.safetensors"], "does not exist", 1),
        (["ls", "--store", "ftp://host/x"], "unsupported store URI", 2),
        (["ls", "--store", "s3:/bucket/x"], "did you mean s3://bucket/x?", 2),
    ],
)
def test_errors_are_one_clear_line(tmp_path, capsys, argv, message, exit_code):
    _, _, c1, _ = _checkpoints(tmp_path)
    assert _run(capsys, "publish", "--store", str(tmp_path / "store"), "--model", "m", str(c1))[0] == 0
    argv = [str(tmp_path / "store") if a == "STORE" else str(c1) if a == "CKPT" else a for a in argv]
    code, _, err = _run(capsys, *argv)
    assert code == exit_code
    assert err.count("\n") == 1 and err.startswith("weightsync: error:") and message in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["publish", "pull", "ls", "verify", "gc", "demo"])
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert "--json" in capsys.readouterr().out


@pytest.mark.slow
def test_real_subprocess_and_help_does_not_import_torch(tmp_path):
    _, second, _, c2 = _checkpoints(tmp_path)
    script = "import sys, weightsync.app.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", script]).returncode == 0
    store = str(tmp_path / "store")
    done = subprocess.run(
        [sys.executable, "-m", "weightsync.app.cli", "publish", "--store", store, "--model", "m", str(c2), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(done.stdout)["version"] == 1
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "weightsync.app.cli",
            "pull",
            "--store",
            store,
            "--model",
            "m",
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert_bit_equal(load_file(tmp_path / "out" / "model.safetensors"), _bf16(second))


def test_publish_for_older_readers(tmp_path, capsys):
    """--manifest-format 1 --highest-codec sparse: a delta every reader reads (no packs, no ctx)."""
    _, second, c1, c2 = _checkpoints(tmp_path)
    store = f"file://{tmp_path}/store"
    old = ("--manifest-format", "1", "--highest-codec", "sparse")
    for checkpoint in (c1, c2):
        code, _, err = _run(capsys, "publish", "--store", store, "--model", "m", *old, str(checkpoint), "--json")
        assert code == 0, err
    manifest = json.loads((tmp_path / "store" / manifest_key("m", 2)).read_bytes())
    assert manifest["kind"] == "delta" and manifest["format"] == 1
    assert {c["codec"] for t in manifest["tensors"] for c in t["chunks"]} <= {"xor", "sparse", "same"}
    code, _, err = _run(capsys, "publish", "--store", store, "--model", "m", "--manifest-format", "4", str(c2))
    assert code == 1 and "manifest_format must be one of [1, 2, 3]" in err


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["publish", "--model", "m"])
    assert exit_info.value.code == 2


# ------------------------------------------------------------------------ what publish says


def test_publish_and_ls_report_one_ratio_in_sizes_that_show(tmp_path, capsys):
    _, _, c1, c2 = _checkpoints(tmp_path)
    store = f"file://{tmp_path}/store"
    assert _run(capsys, "publish", "--store", store, "--model", "m", str(c1))[0] == 0
    code, out, _ = _run(capsys, "publish", "--store", store, "--model", "m", str(c2), "--json")
    published = json.loads(out)
    code, out, _ = _run(capsys, "ls", "--store", store, "--model", "m", "--json")
    listed = json.loads(out)["versions"][1]
    assert published["ratio"] == listed["ratio"]  # was 72.9x from publish and 78.0x from ls on one version
    assert listed["ratio"] == listed["raw_bytes"] / (listed["stored_bytes"] + listed["manifest_bytes"])
    code, out, _ = _run(capsys, "ls", "--store", store, "--model", "m")
    delta_line = out.splitlines()[2]
    assert " kB" in delta_line and "0.0 MB" not in delta_line, out  # a delta of some kB, not "0.0 MB"
    assert f"{listed['ratio']:.1f}x" in delta_line


def test_publish_says_why_a_version_is_full_naming_what_changed(tmp_path, capsys):
    first, _, c1, _ = _checkpoints(tmp_path)
    store = f"file://{tmp_path}/store"
    code, out, _ = _run(capsys, "publish", "--store", store, "--model", "m", str(c1))
    assert code == 0 and "(full: no parent)" in out
    changed = dict(first)
    changed["model.head.weight"] = torch.zeros(64, 301, dtype=torch.float16)
    changed["model.extra.bias"] = torch.zeros(3)
    del changed["model.norm.weight"]
    save_file(changed, tmp_path / "c3.safetensors")
    code, out, _ = _run(capsys, "publish", "--store", store, "--model", "m", str(tmp_path / "c3.safetensors"), "--json")
    reason = json.loads(out)["full_reason"]
    assert code == 0 and json.loads(out)["kind"] == "full"
    assert "1 unexpected: model.extra.bias" in reason and "1 missing: model.norm.weight" in reason
    assert "model.head.weight has shape (64, 301), the last version needs (64, 300)" in reason


def test_publish_announces_the_dtype_cast_and_keep_dtypes_silences_it(tmp_path, capsys):
    _, _, c1, _ = _checkpoints(tmp_path)  # float32 x2 and float16 x1 floating tensors
    code, _, err = _run(capsys, "publish", "--store", str(tmp_path / "s1"), "--model", "m", str(c1))
    assert code == 0
    assert "casting 1 float16 tensor, 2 float32 tensors to bfloat16" in err and "--keep-dtypes" in err
    code, _, err = _run(capsys, "publish", "--store", str(tmp_path / "s2"), "--model", "m", "--keep-dtypes", str(c1))
    assert code == 0 and "casting" not in err


def test_a_step_that_repeats_or_goes_back_is_warned_about_naming_the_last_step(tmp_path, capsys):
    _, _, c1, c2 = _checkpoints(tmp_path)
    store = str(tmp_path / "store")
    assert _run(capsys, "publish", "--store", store, "--model", "m", "--step", "5", str(c1))[0] == 0
    code, _, err = _run(capsys, "publish", "--store", store, "--model", "m", "--step", "3", str(c2))
    assert code == 0 and "warning: --step 3 goes back from the last published step 5 (v1)" in err
    code, _, err = _run(capsys, "publish", "--store", store, "--model", "m", "--step", "3", str(c1))
    assert code == 0 and "warning: --step 3 repeats the last published step 3 (v2)" in err
    code, _, err = _run(capsys, "publish", "--store", store, "--model", "m", "--step", "4", str(c2))
    assert code == 0 and "warning" not in err


def test_publish_signing_key_makes_versions_that_require_signatures_accepts(tmp_path, capsys):
    from weightsync.stores import open_store
    from weightsync.transport.signing import Verifier
    from weightsync.versions import read_manifest, read_signature

    _, _, c1, _ = _checkpoints(tmp_path)
    assert _run(capsys, "keygen", "--out", str(tmp_path / "key"))[0] == 0
    store = str(tmp_path / "store")
    code, out, _ = _run(
        capsys, "publish", "--store", store, "--model", "m", "--signing-key", str(tmp_path / "key.pem"), str(c1)
    )
    assert code == 0 and "signed by key" in out
    manifest_bytes = read_manifest(open_store(store), "m", 1).to_bytes()
    signature = read_signature(open_store(store), "m", 1, manifest_bytes)
    assert Verifier.from_pem([tmp_path / "key.pub"]).verify(manifest_bytes, signature)


@pytest.mark.parametrize("case", ["missing directory", "existing key"])
def test_keygen_refuses_a_missing_directory_or_an_existing_key_in_a_sentence(tmp_path, capsys, case):
    out = tmp_path / "nowhere" / "key" if case == "missing directory" else tmp_path / "key"
    if case == "existing key":
        (tmp_path / "key.pem").write_text("precious")
    code, _, err = _run(capsys, "keygen", "--out", str(out))
    assert code == 2 and err.count("\n") == 1 and "Errno" not in err
    want = "does not exist (create it first)" if case == "missing directory" else "already exists, and a key is never"
    assert want in err
    assert case == "missing directory" or (tmp_path / "key.pem").read_text() == "precious"
    assert not (tmp_path / "key.pub").exists()


# ------------------------------------------------------------------------------ pull --out


def test_pull_writes_a_directory_that_transformers_loads_as_it_is(tmp_path, capsys):
    """The published HF directory's config and tokenizer come back with the weights; the pulled
    directory loads in transformers with the published weights, bit for bit."""
    transformers = pytest.importorskip("transformers")
    from harness.tiny_model import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "model")
    store = str(tmp_path / "store")
    code, out, _ = _run(capsys, "publish", "--store", store, "--model", "m", str(model_dir), "--json")
    assert code == 0 and {"config.json", "tokenizer.json"} <= set(json.loads(out)["model_files"])
    assert _run(capsys, "pull", "--store", store, "--model", "m", "--out", str(tmp_path / "pulled"))[0] == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pulled", torch_dtype=torch.bfloat16)
    want = open_checkpoint(model_dir)
    got = loaded.state_dict()
    for name in want:
        assert torch.equal(got[name], want[name].to(torch.bfloat16)), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "pulled")
    assert tokenizer("2 + 3")["input_ids"]


def test_pull_template_supplies_the_config_and_a_foreign_file_is_never_replaced(tmp_path, capsys):
    from harness.tiny_model import write_tiny_model

    _, _, c1, c2 = _checkpoints(tmp_path)
    template = write_tiny_model(tmp_path / "template")
    store = str(tmp_path / "store")
    assert _run(capsys, "publish", "--store", store, "--model", "m", str(c1))[0] == 0
    out = tmp_path / "out"
    code, _, err = _run(capsys, "pull", "--store", store, "--model", "m", "--out", str(out))
    assert code == 0 and "no config.json was published" in err  # a bare safetensors publish
    code, _, _ = _run(capsys, "pull", "--store", store, "--model", "m", "--out", str(out), "--template", str(template))
    assert code == 0 and (out / "config.json").read_bytes() == (template / "config.json").read_bytes()

    mine = tmp_path / "mine"
    mine.mkdir()
    save_file({"precious": torch.ones(3)}, mine / "model.safetensors")
    before = (mine / "model.safetensors").read_bytes()
    code, _, err = _run(capsys, "pull", "--store", store, "--model", "m", "--out", str(mine))
    assert code == 2 and "model.safetensors, which weightsync did not write" in err
    assert (mine / "model.safetensors").read_bytes() == before
    (out / "config.json").write_text("{}")  # the user's edit: not replaced by a pull with a template
    code, _, err = _run(
        capsys, "pull", "--store", store, "--model", "m", "--out", str(out), "--template", str(template)
    )
    assert code == 2 and "already holds config.json with other contents" in err
    assert (out / "config.json").read_text() == "{}"


@pytest.mark.slow
def test_log_format_json_makes_every_agent_log_line_a_json_object(tmp_path):
    import signal

    from harness.tiny_model import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "model")
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightsync.app.cli", "agent", "--model", "m", "--model-dir", str(model_dir),
         "--store", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "cache"), "--name", "a1", "--region", "eu",
         "--log-format", "json", "-v"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert json.loads(proc.stdout.readline())["event"] == "ready"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines, "the agent logged nothing at -v"
    for line in lines:
        record = json.loads(line)  # every line, warnings from libraries included
        assert {"ts", "level", "logger", "message"} <= set(record), record
    assert any(json.loads(line).get("agent") == "a1" and json.loads(line).get("region") == "eu" for line in lines)


def test_demo_help_states_the_defaults_the_code_uses(capsys):
    """`demo --help` said --warmup-steps defaults to 40 while the code used 60."""
    import dataclasses
    import re

    from weightsync.app.demo import DemoConfig

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    defaults = {f.name: getattr(DemoConfig(), f.name) for f in dataclasses.fields(DemoConfig)}
    stated = re.findall(r"--([a-z-]+) [A-Z_]+ (?:(?!--).)*?\(default ([^;)]+)", text)
    checked = 0
    for flag, value in stated:
        name = flag.replace("-", "_")
        if name in defaults and not value.startswith("$") and "://" not in value:
            assert value.strip() == str(defaults[name]), (flag, value, defaults[name])
            checked += 1
    assert checked >= 8, stated


class _Stream:
    def __init__(self, tty: bool) -> None:
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


def test_the_demo_progress_is_one_line_rewritten_on_a_terminal_and_changes_only_elsewhere():
    from weightsync.app.demo.run import ProgressLine

    for tty in (True, False):
        stream = _Stream(tty)
        progress = ProgressLine(stream)
        for line in ("step 1", "step 1", "step 2", "step 2", "step 3"):
            progress(line)
        progress.done()
        if tty:
            assert stream.text == "\r\033[Kstep 1\r\033[Kstep 2\r\033[Kstep 3\n"
        else:
            assert stream.text == "step 1\nstep 2\nstep 3\n"


def test_serve_training_without_the_training_extra_refuses_to_start_naming_it(tmp_path):
    """It used to start, print ready, then answer every forward_backward with HTTP 500 'No module
    named tinker' while the SDK retried for minutes."""
    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'tinker':\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from weightsync.app.cli import main\n"
        f"sys.exit(main(['serve-training', '--port', '0', '--api-key', 'tml-x', '--state-dir', {str(tmp_path)!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "pip install 'weightsync[training]'" in done.stderr and "ready" not in done.stdout


@pytest.mark.slow
def test_log_format_json_reaches_the_trainer_processes(tmp_path):
    config = Path(__file__).parents[2] / "trainer" / "configs" / "sft_tiny.toml"
    done = subprocess.run(
        [sys.executable, "-m", "weightsync.app.cli", "train", "--config", str(config), "--set", "train.steps=6",
         "--log-format", "json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]
    assert any(r["logger"].startswith("weightsync.trainer") and r["rank"] == 0 for r in records), records[:5]


def test_agent_help_lists_every_engine_type_and_swap_policy(capsys):
    """The choices come from the engine registry and the SwapPolicy enum, not a list of their own."""
    with pytest.raises(SystemExit) as exit_info:
        main(["agent", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the choices over lines
    assert len(engine_types()) >= 4 and "{" + ",".join(engine_types()) + "}" in out
    assert "{" + ",".join(SwapPolicy.names()) + "}" in out
    assert set(DEMO_ENGINES) <= set(engine_types()), "the demo starts registered engines only"


def test_agent_engine_without_its_required_setting_is_a_config_error(tmp_path, capsys):
    """`--engine vllm` without a URL: one line naming the setting, exit 2, before anything starts."""
    code, out, err = _run(capsys, "agent", "--engine", "vllm", "--model", "m", "--cache-dir", str(tmp_path / "c"))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("weightsync: error:"), err
    assert "[agent.engine] url is missing" in err and "vllm" in err
    assert not (tmp_path / "c").exists(), "nothing was started"


def test_building_the_parser_does_not_import_torch():
    """`--help` (the parser with the registry's choices) stays instant: no torch, no engine module."""
    script = (
        "import sys\nfrom weightsync.app.cli import build_parser\nbuild_parser()\n"
        "heavy = [m for m in ('torch', 'numpy', 'weightsync.agents.engines.base') if m in sys.modules]\n"
        "sys.exit(str(heavy) if heavy else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_a_delta_on_a_machine_without_the_kernels_says_it_compiles_them(tmp_path):
    """`publish` of a delta on a cold numba cache compiled for a minute in silence; now it says so
    first, and only when it must (a full version needs no kernel, a warm cache none either)."""
    _, _, c1, c2 = _checkpoints(tmp_path)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    note = "compiling the codec kernels, once per machine"

    def publish(checkpoint) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "weightsync.app.cli", "publish", "--store", str(tmp_path / "store"), "--model", "m",
             str(checkpoint)],
            env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stderr

    assert note not in publish(c1)  # full: no kernel
    assert note in publish(c2)  # the first delta here, on an empty cache
    for i in range(3):  # later deltas also decode their parent from the store: a kernel or two more
        last = publish(c1 if i % 2 == 0 else c2)
    assert note not in last  # once every kernel a delta uses is cached, nothing is said


# ------------------------------------------------------------------------ agent: errors, not tracebacks

AGENT_TOML = """
[agent]
model = "m"
cache_dir = "{cache}"
poll_interval_s = 5.0

[agent.engine]
type = "reference"
model = {{vocab_size = 64, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 1, num_attention_heads = 2, num_key_value_heads = 1}}
"""


def _agent_toml(tmp_path: Path) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(AGENT_TOML.format(cache=tmp_path / "cache"))
    return path


@pytest.mark.parametrize(
    "flag, setting", [("--listen", "listen"), ("--health-listen", "health_listen"), ("--metrics-port", "metrics_port")]
)
def test_an_agent_port_in_use_is_one_line_naming_the_setting(tmp_path, capfd, flag, setting):
    """It was a traceback and a C-level `add_port.cc` line (listen), or `[Errno 98] Address already
    in use` with no port named (metrics)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        value = str(port) if flag == "--metrics-port" else f"127.0.0.1:{port}"
        code = main(["agent", "--config", str(_agent_toml(tmp_path)), flag, value])
    out, err = capfd.readouterr()  # the file descriptors: gRPC's C core writes there, not to sys.stderr
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("weightsync: error:"), err
    assert f"cannot listen on 127.0.0.1:{port} ({setting}): the port is taken" in err
    assert f"set {setting} ({flag})" in err
    assert "Traceback" not in err and "add_port" not in err
    assert not (tmp_path / "cache").exists(), "the agent stopped before it started anything"


def test_an_agent_without_an_engine_names_the_flags_to_give(tmp_path, capsys):
    code, out, err = _run(capsys, "agent", "--model", "m", "--cache-dir", str(tmp_path / "c"))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("weightsync: error: weightsync agent needs an engine"), err
    assert "--model-dir" in err and "--engine" in err and "--engine-url" in err and "--config" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--engine", "vllm", "--engine-url", "http://127.0.0.1:8000"],
            "--engine vllm contradicts [agent.engine] type",
        ),
        (["--engine-url", "http://127.0.0.1:8000"], "--engine-url: the reference engine has no url option"),
        (["--engine-root", "/tmp/x"], "its flags are ['--engine-port', '--model-dir']"),
    ],
)
def test_an_engine_flag_that_cannot_apply_over_the_config_is_refused_with_the_reason(tmp_path, capsys, flags, message):
    code, out, err = _run(capsys, "agent", "--config", str(_agent_toml(tmp_path)), *flags)
    assert code == 2 and out == "", err
    assert err.count("\n") == 1 and message in err, err


def test_flags_given_with_config_are_applied(tmp_path):
    """`--engine-port 18777` beside --config was silently ignored; every flag now lands in the config."""
    from weightsync.app.cli import build_parser
    from weightsync.app.cli.agent import agent_config

    argv = ["agent", "--config", str(_agent_toml(tmp_path)), "--engine-port", "18777", "--poll-interval-s", "0.7"]
    config = agent_config(build_parser().parse_args(argv + ["--metrics-port", "9500", "--metrics-host", "0.0.0.0"]))
    assert config.engine["port"] == 18777 and config.engine["model"]["vocab_size"] == 64  # the file's options stay
    assert (config.poll_interval_s, config.metrics_port, config.metrics_host) == (0.7, 9500, "0.0.0.0")
    config = agent_config(
        build_parser().parse_args(
            ["agent", "--model", "m", "--cache-dir", "c", "--engine", "vllm", "--engine-url", "http://127.0.0.1:8000"]
        )
    )
    assert config.engine == {"type": "vllm", "url": "http://127.0.0.1:8000"}


def test_the_agent_runs_with_the_engine_port_given_beside_its_config(tmp_path):
    """What the user saw: the ready line's engine_url on another port than --engine-port."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weightsync.app.cli",
            "agent",
            "--config",
            str(_agent_toml(tmp_path)),
            "--engine-port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready = json.loads(agent.stdout.readline())
        assert ready["event"] == "ready" and ready["engine_url"] == f"http://127.0.0.1:{port}", ready
    finally:
        agent.send_signal(signal.SIGTERM)
        # Reads both pipes to the end while it waits: an agent blocked writing to a full pipe
        # would never stop. Stopping waits for a kernel compile under way: minutes under load.
        agent.communicate(timeout=600)


def _threads_taking(pid: int, sig: int) -> list[int]:
    """The threads of `pid` that do not block `sig` (its status file's SigBlk mask)."""
    taking = []
    for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        blocked = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
        if not blocked & (1 << (sig - 1)):
            taking.append(tid)
    return taking


def test_an_agent_stops_on_a_sigterm_that_one_of_its_other_threads_takes(tmp_path):
    """The kernel may hand a process's SIGTERM to any of its threads. Python runs the handler in
    the main thread only, which an untimed wait never woke: two agents in CI runs hung on SIGTERM
    until pytest's timeout. Here the signal goes to a thread that is not the main one (tgkill)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "tgkill"):
        pytest.skip("no tgkill in this C library")
    agent = subprocess.Popen(
        [sys.executable, "-m", "weightsync.app.cli", "agent", "--config", str(_agent_toml(tmp_path))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert json.loads(agent.stdout.readline())["event"] == "ready"
        # the oldest: one that lives as long as the agent (the kernels' warm-up thread may end any time)
        others = [tid for tid in _threads_taking(agent.pid, signal.SIGTERM) if tid != agent.pid]
        assert others, "the agent runs threads beside its main one that take SIGTERM"
        assert libc.tgkill(agent.pid, others[0], signal.SIGTERM) == 0, os.strerror(ctypes.get_errno())
        _, err = agent.communicate(timeout=600)  # its shutdown is bounded at 120 s, kernels compiling or not
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate()
    assert agent.returncode == 0, err[-3000:]


def test_status_of_an_agent_from_before_engine_states_takes_its_word(capsys):
    """A new CLI against an agent from before this release (no engine_state, no verification in its
    reply): --verify compares the digests it sends, as the older CLI did, and does not call its
    engine not serving."""
    import concurrent.futures as cf

    import grpc

    from weightsync.transport.rpc import agent_service_handler
    from weightsync.transport.v1 import sync_pb2

    def refuse(request, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this test")

    def old_status(request, context) -> sync_pb2.StatusReply:  # what an older agent answered
        digest = "ab" * 16
        return sync_pb2.StatusReply(
            agent="old", model="m", current_version=4, current_digest=digest, target_version=4, engine="vllm",
            served_digest=digest if request.verify else "",
        )  # fmt: skip

    server = grpc.server(cf.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((agent_service_handler(refuse, refuse, old_status),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        code, out, err = _run(capsys, "status", "--agent", f"127.0.0.1:{port}", "--verify")
        assert code == 0, out + err
        assert (
            "engine vllm: serving v4" in out
            and "verified the bytes the agent serves (an older agent): bit-exact" in out
        )
    finally:
        server.stop(0)
