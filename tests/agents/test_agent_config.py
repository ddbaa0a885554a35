"""The agent's config loader: every file in tests/hostile/config/ is refused by
`weightsync agent --config FILE` (a real subprocess) with exit code 2, one error line that names
the key its expected.json gives and says how to fix it, and no traceback. Each case is one edit
away from valid.toml, which loads, so no case can pass by failing for some other reason.
"""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from weightsync.agents.config import load_agent_config
from weightsync.errors import ConfigError, WeightsyncError
from weightsync.transport.rpc import TlsConfig

CORPUS = Path(__file__).parents[1] / "hostile" / "config"
EXPECTED = json.loads((CORPUS / "expected.json").read_text())
VALID = CORPUS / "valid.toml"


def test_corpus_is_complete():
    files = {p.name for p in CORPUS.glob("*.toml")} - {VALID.name}
    assert files == set(EXPECTED)
    assert len(files) >= 20


def test_valid_config_loads():
    config = load_agent_config(VALID)
    assert config.cache_dir == "/var/lib/weightsync/agent" and config.poll_interval_s == 5.0
    assert config.engine == {"type": "reference", "model_dir": "/var/lib/weightsync/model"}
    assert config.tls == TlsConfig(cert="/etc/weightsync/tls/agent.pem", key="/etc/weightsync/tls/agent.key")
    assert config.peers == ("10.0.0.2:7070",) and config.require_signatures


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_case_is_one_edit_from_the_valid_config(name):
    """A case that differs from valid.toml in one place fails for that place, not another."""
    diff = [
        line
        for line in difflib.unified_diff(
            VALID.read_text().splitlines(), (CORPUS / name).read_text().splitlines(), lineterm="", n=0
        )
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert 1 <= len(diff) <= 4, diff


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_loader_names_the_key(name):
    spec = EXPECTED[name]
    with pytest.raises(ConfigError) as info:
        load_agent_config(CORPUS / name)
    assert isinstance(info.value, (WeightsyncError, ValueError))
    assert spec["key"] in str(info.value) and spec["match"] in str(info.value)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_cli_exits_2_with_one_line_naming_the_key(name, tmp_path):
    spec = EXPECTED[name]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "WEIGHTSYNC_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "weightsync.app.cli", "agent", "--config", str(CORPUS / name)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weightsync: error: "), proc.stderr
    assert spec["key"] in lines[0] and spec["match"] in lines[0]


def test_overrides_are_checked_like_the_file():
    with pytest.raises(ConfigError, match="poll_interval_s must be a number"):
        load_agent_config(VALID, poll_interval_s="5")
    config = load_agent_config(VALID, cache_dir="/elsewhere", peers=("a:1", "b:2"))
    assert config.cache_dir == "/elsewhere" and config.peers == ("a:1", "b:2")


def test_no_file_needs_model_and_cache_dir_from_overrides():
    with pytest.raises(ConfigError, match="cache_dir is missing"):
        load_agent_config(None, model="m")
    # The default engine is the reference server, which needs an architecture: refused at load, not at start.
    with pytest.raises(ConfigError, match=r"\[agent.engine\] give exactly one of model .* and model_dir"):
        load_agent_config(None, model="m", cache_dir="/c")
    engine = {"type": "reference", "model_dir": "/m"}
    assert load_agent_config(None, model="m", cache_dir="/c", engine=engine).engine == engine


def test_a_file_without_an_agent_table_is_refused(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text("# nothing here\n")
    with pytest.raises(ConfigError, match=r"no \[agent\] table"):
        load_agent_config(path)
