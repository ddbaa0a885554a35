"""The `weightsync` command: publish → ls → pull → verify → gc on real files, in-process and as a
real subprocess, with --json output and clear one-line errors."""

from __future__ import annotations

import json
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
    assert err.startswith("weightsync: error:") and "[2]" in err


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
    "argv, message",
    [
        (["pull", "--store", "nowhere", "--model", "m", "--out", "o"], "has no versions"),
        (["pull", "--store", "STORE", "--model", "m", "--version", "9", "--out", "o"], "version 9 is not in"),
        (["publish", "--store", "STORE", "--model", "../evil", "CKPT"], "invalid model name"),
        (["publish", "--store", "STORE", "--model", "m", "missing.safetensors"], "does not exist"),
        (["ls", "--store", "ftp://host/x"], "unsupported store URI"),
    ],
)
def test_errors_are_one_clear_line(tmp_path, capsys, argv, message):
    _, _, c1, _ = _checkpoints(tmp_path)
    assert _run(capsys, "publish", "--store", str(tmp_path / "store"), "--model", "m", str(c1))[0] == 0
    argv = [str(tmp_path / "store") if a == "STORE" else str(c1) if a == "CKPT" else a for a in argv]
    code, _, err = _run(capsys, *argv)
    assert code == 1
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


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["publish", "--model", "m"])
    assert exit_info.value.code == 2


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
