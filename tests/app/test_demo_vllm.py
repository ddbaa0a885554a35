"""`weightsync demo --engine vllm`, short: the FSDP2 trainer, 1 region x 2 agents each beside its
own real vLLM server (started by the demo), rollout workers sampling through vLLM's
/v1/completions. Every agent must end on the last version bit for bit, and every rollout must
carry the version vLLM reported before and after it was sampled."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from harness.vllm import require_vllm, vllm_python
from weightsync.app.demo import DemoConfig, run_demo

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.vllm]

require_vllm()


@pytest.fixture
def server_tmp(monkeypatch):
    """Where the demo makes its servers' temporary directories (vLLM's sockets), to see them gone
    at the end. Not in tmp_path: a socket's path must stay under 108 bytes."""
    directory = Path(tempfile.mkdtemp(prefix="ws-demo-"))
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.timeout(1800)
def test_the_demo_runs_on_vllm_engines_and_every_agent_ends_bit_exact(tmp_path, capsys, server_tmp):
    lines: list[str] = []
    config = DemoConfig(
        out_dir=str(tmp_path / "demo"),
        engine="vllm",
        regions=1,
        agents_per_region=2,
        warmup_steps=60,
        rl_steps=2,
        group_size=4,
        groups_per_step=2,
        timeout_s=1700,
        vllm_python=vllm_python(),
    )
    summary = run_demo(config, echo=lambda line: lines.append(line))

    last = summary["last_version"]
    assert last >= 62 and summary["all_bit_exact"]
    assert {a["version"] for a in summary["agents"].values()} == {last}
    assert all(a["engine_url"].startswith("http://127.0.0.1:") for a in summary["agents"].values())
    assert summary["rollout_groups"]["claimed"] > 0, "the trainer trained on rollouts sampled by vLLM"
    versions = [row["version"] for row in summary["rewards"]]
    assert versions and all(1 <= v <= last for v in versions)
    assert any("; vllm engines," in line for line in lines)
    # Every agent held its vLLM (bf16, as its workers report) to the trainer's bf16 record of the
    # published weights: kernels apart, the same numbers, and no breach under the defaults. The
    # figures' distribution is printed: docs/agents.md ("Parity probe") records it.
    parity = summary["parity"]
    assert parity["probes"] >= 2 and parity["compute_dtypes"] == ["bfloat16"], parity
    assert all(p is not None for p in summary["versions"][-1]["parity"].values()), "the last version was probed"
    with capsys.disabled():
        print(json.dumps({"vllm_demo_parity": parity["figures"], "probes": parity["probes"]}))
    assert parity["breaches"] == 0, parity["breached"]
    assert list(server_tmp.iterdir()) == []
    assert summary["headline"].endswith(f"parity probe: 0 breaches in {parity['probes']} probes")
