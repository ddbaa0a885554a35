"""The demo, shortened: every version the follower rebuilds equals the trainer's bf16 weights."""

from __future__ import annotations

import json

from weightsync.demo import DemoConfig, run_demo
from weightsync.store import LocalStore
from weightsync.versions import list_versions


def test_demo_versions_are_bit_exact_and_rebase_on_schedule(tmp_path):
    config = DemoConfig(
        store=f"file://{tmp_path}/store", steps=5, warmup_steps=2, dim=64, layers=2, seq_len=16, batch=4,
        rebase_every=2, out=str(tmp_path / "summary.json"),
    )
    lines = []
    summary = run_demo(config, echo=lines.append)

    assert summary["all_bit_exact"]
    kinds = [row["kind"] for row in summary["versions"]]
    assert kinds == ["full", "delta", "delta", "full", "delta"]
    assert [row["version"] for row in summary["versions"]] == [1, 2, 3, 4, 5]
    assert all(row["stored_bytes"] < row["raw_bytes"] for row in summary["versions"] if row["kind"] == "delta")
    assert list_versions(LocalStore(tmp_path / "store"), config.model) == [1, 2, 3, 4, 5]
    assert json.loads((tmp_path / "summary.json").read_text())["all_bit_exact"] is True
    assert any("bit-exact" in line for line in lines)
