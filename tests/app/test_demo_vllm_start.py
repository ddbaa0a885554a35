"""`weightsync demo --engine vllm` when a vLLM server cannot start: the demo fails with the
server's own last words instead of waiting for it (it used to wait out --timeout-s, its agents
blocked on a server that had died), and leaves neither processes nor temporary files behind.
No vLLM needed: the "vLLM interpreter" is a script that dies the way a server does."""

from __future__ import annotations

import tempfile

import pytest

from weightsync.app.demo import DemoConfig, run_demo


def test_a_vllm_server_that_dies_at_start_fails_the_demo_with_its_log(tmp_path, monkeypatch):
    dying = tmp_path / "python"
    dying.write_text("#!/bin/sh\necho 'ValueError: no such flag --enforce-eager' >&2\nexit 3\n")
    dying.chmod(0o755)
    server_tmp = tmp_path / "tmp"
    server_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(server_tmp))  # where the servers' own directories go
    config = DemoConfig(out_dir=str(tmp_path / "demo"), engine="vllm", vllm_python=str(dying), timeout_s=600)

    with pytest.raises(RuntimeError, match=r"(?s)exited with 3.*no such flag --enforce-eager"):
        run_demo(config, echo=lambda line: None)
    assert list(server_tmp.iterdir()) == []
    logs = sorted(p.name for p in (tmp_path / "demo" / "logs").iterdir())
    assert logs and all(name.endswith("-vllm.log") for name in logs), logs  # no agent was started
