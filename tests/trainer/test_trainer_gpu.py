"""The FSDP2 trainer on CUDA/NCCL (skipped without CUDA): bf16 mixed precision with sharded
publishing, without and with CPU offload; versions pull back equal to the gathered bf16 state."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from weightsync.reader import Reader
from weightsync.stores import LocalStore
from weightsync.versions import list_versions, read_manifest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SCENARIOS = Path(__file__).with_name("trainer_scenarios.py")


def test_bf16_publishing_with_and_without_offload_on_cuda(tmp_path):
    nproc = min(2, torch.cuda.device_count())  # NCCL needs one device per rank
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(SCENARIOS),
            "gpu",
            str(tmp_path),
        ],
        cwd=SCENARIOS.parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = torch.load(tmp_path / "gpu.pt", weights_only=False)
    for offload, run in results.items():
        losses = [m["loss"] for m in run["history"]]
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
        store = LocalStore(tmp_path / f"store-{int(offload)}")
        latest = list_versions(store, "tiny")[-1]
        step = read_manifest(store, "tiny", latest).step
        state = Reader(store, model="tiny").read(latest).state_dict()
        want = run["published_states"][step]
        assert sorted(state) == sorted(want)
        assert all(torch.equal(state[k], want[k]) for k in want)
    assert [m["loss"] for m in results[True]["history"]] == pytest.approx(
        [m["loss"] for m in results[False]["history"]], rel=1e-3
    )
